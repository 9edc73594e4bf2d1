"""A stand-in for cuda-python's driver bindings (``cuda.bindings.driver``), so that ipc/gpu/device.py
runs its own code on a machine without a GPU: ``install(monkeypatch)`` puts it where
``from cuda.bindings import driver`` finds it. "Device" memory is host memory (a device pointer
is a host address), so copies, offsets and bindings are checked byte for byte.

It keeps the bindings' conventions that gpu.py relies on: every call returns a tuple whose first
item is a ``CUresult`` (an int enum), handles (CUdevice, CUcontext, CUstream, CUdeviceptr) are
objects that ``int()`` reads, and pointer or stream arguments may be those objects or plain
ints. And the driver's rules: nothing before ``cuInit`` (CUDA_ERROR_NOT_INITIALIZED), no memory
call without a current context, per thread (CUDA_ERROR_INVALID_CONTEXT), ``cuMemAlloc(0)`` is
CUDA_ERROR_INVALID_VALUE, freeing what was not allocated or using a destroyed stream is an
error. Device pointers must lie inside an allocation or a range given to ``adopt()``, unless
``strict`` is off (for tensors a test model makes itself). ``fail[name] = CUresult...`` makes
a call return that error.

CUDA IPC: ``export(nbytes)`` stands for another process's allocation (a client's CUDA
shared-memory region) and gives its 64-byte handle; its memory is device memory here only while
``cuIpcOpenMemHandle`` has it open (each open counted, each ``cuIpcCloseMemHandle`` takes one
back; ``ipc_open`` shows what is open). ``cuIpcGetMemHandle`` exports an allocation of this
"process", ``cuMemGetAddressRange`` finds the allocation a pointer is in.
"""
from __future__ import annotations

import ctypes
import enum
import os
import struct
import sys
import threading
import types


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class _Handle:
    def __init__(self, value: int = 0):
        self._value = int(value)

    def __int__(self):
        return self._value

    def __repr__(self):
        return f"<{type(self).__name__} {self._value}>"


class CUdevice(_Handle):
    pass


class CUcontext(_Handle):
    pass


class CUstream(_Handle):
    pass


class CUdeviceptr(_Handle):
    pass


IPC_HANDLE_SIZE = 64


class CUipcMemHandle:
    """As the bindings have it: 64 opaque bytes in a C struct, read and written through
    ``reserved`` or at ``getPtr()``."""

    def __init__(self):
        self._buf = ctypes.create_string_buffer(IPC_HANDLE_SIZE)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)

    @property
    def reserved(self) -> bytes:
        return self._buf.raw

    @reserved.setter
    def reserved(self, value: bytes) -> None:
        if len(value) != IPC_HANDLE_SIZE:
            raise ValueError(f"reserved must be {IPC_HANDLE_SIZE} bytes")
        ctypes.memmove(self._buf, value, IPC_HANDLE_SIZE)


def _handle(value, cls) -> int:
    """What the bindings do with a handle argument: None is 0, the handle type or an int."""
    if value is None:
        return 0
    if isinstance(value, (cls, int)) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"Argument is not instance of type (expected {cls.__name__} or int, "
                    f"got {type(value).__name__})")


def _host(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"host pointer: expected an int address, got {type(value).__name__}")


OK = CUresult.CUDA_SUCCESS


class FakeDriver(types.ModuleType):
    def __init__(self, devices: int = 1, names: tuple[str, ...] = (), no_library: bool = False,
                 strict: bool = True):
        super().__init__("cuda.bindings.driver")
        self.CUresult, self.CUstream_flags = CUresult, CUstream_flags
        self.CUdevice, self.CUcontext, self.CUstream, self.CUdeviceptr = CUdevice, CUcontext, CUstream, CUdeviceptr
        self.CUipcMemHandle = CUipcMemHandle
        self.devices, self.no_library, self.strict = devices, no_library, strict
        self.names = names or tuple(f"Fake GPU {i}" for i in range(devices))
        self.fail: dict[str, CUresult] = {}
        self.initialised = False
        self.allocations: dict[int, ctypes.Array] = {}
        self.adopted: list[tuple[int, int]] = []
        self.stream_handles: set[int] = set()
        self.copies: list[str] = []
        self.calls: list[str] = []
        self.retained: dict[int, int] = {}       # device -> primary context retains
        self.exported: dict[bytes, tuple[int, int]] = {}     # IPC handle -> (base, size)
        self.foreign: dict[int, ctypes.Array] = {}  # other processes' allocations (export())
        self.ipc_open: dict[int, int] = {}          # base -> opens not yet closed
        self._next_stream = 0x5000
        self._current = threading.local()

    # -- what tests look at -------------------------------------------------------------------

    @property
    def streams(self) -> int:
        return len(self.stream_handles)

    def adopt(self, ptr: int, nbytes: int) -> None:
        """Let host memory at ``ptr`` stand for device memory (a tensor a test made)."""
        self.adopted.append((int(ptr), int(nbytes)))

    def export(self, nbytes: int, data: bytes = b"") -> tuple[bytes, int]:
        """An allocation of another process (a client's), exported: (its IPC handle, the host
        address its bytes are at, for the test to fill or read)."""
        buf = ctypes.create_string_buffer(data, max(1, nbytes)) if data else \
            ctypes.create_string_buffer(max(1, nbytes))
        base = ctypes.addressof(buf)
        self.foreign[base] = buf
        return self._export(base, nbytes), base

    def _export(self, base: int, nbytes: int) -> bytes:
        handle = b"FAKEIPC\0" + struct.pack("<QQ", base, nbytes) + os.urandom(IPC_HANDLE_SIZE - 24)
        self.exported[handle] = (base, nbytes)
        return handle

    def _ranges(self) -> list[tuple[int, int]]:
        opened = [(b, len(self.foreign[b])) for b in self.ipc_open if b in self.foreign]
        return [(a, len(b)) for a, b in self.allocations.items()] + opened + self.adopted

    # -- the rules ----------------------------------------------------------------------------

    def _enter(self, name: str, context: bool = True) -> CUresult:
        self.calls.append(name)
        if name in self.fail:
            return self.fail[name]
        if name != "cuInit" and name != "cuGetErrorName" and not self.initialised:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        if context and not getattr(self._current, "ctx", 0):
            return CUresult.CUDA_ERROR_INVALID_CONTEXT
        return OK

    def _device_range(self, ptr: int, nbytes: int) -> bool:
        if not self.strict:
            return True
        return any(a <= ptr and ptr + nbytes <= a + n for a, n in self._ranges())

    def _stream_ok(self, stream) -> bool:
        s = _handle(stream, CUstream)
        return s == 0 or s in self.stream_handles

    # -- the driver API, as cuda-python binds it -----------------------------------------------

    def cuGetErrorName(self, error):
        if not isinstance(error, CUresult):         # the bindings take the enum only
            raise TypeError("Argument 'error' has incorrect type (expected CUresult)")
        return OK, error.name.encode()

    def cuInit(self, flags):
        self.calls.append("cuInit")
        if self.no_library:
            raise RuntimeError("Failed to dlopen libcuda.so.1")
        if "cuInit" in self.fail:
            return (self.fail["cuInit"],)
        if self.devices == 0:
            return (CUresult.CUDA_ERROR_NO_DEVICE,)
        self.initialised = True
        return (OK,)

    def cuDeviceGetCount(self):
        err = self._enter("cuDeviceGetCount", context=False)
        return err, (self.devices if err == OK else 0)

    def cuDeviceGet(self, ordinal: int):
        err = self._enter("cuDeviceGet", context=False)
        if err == OK and not 0 <= ordinal < self.devices:
            err = CUresult.CUDA_ERROR_INVALID_DEVICE
        return err, CUdevice(ordinal if err == OK else 0)

    def cuDeviceGetName(self, length: int, dev):
        err = self._enter("cuDeviceGetName", context=False)
        d = _handle(dev, CUdevice)
        if err == OK and not 0 <= d < self.devices:
            err = CUresult.CUDA_ERROR_INVALID_DEVICE
        name = b" " * length        # the bindings hand back the whole buffer they passed
        if err == OK:
            text = self.names[d].encode()[:length - 1] + b"\0"
            name = text + name[len(text):]
        return err, name

    def cuDevicePrimaryCtxRetain(self, dev):
        err = self._enter("cuDevicePrimaryCtxRetain", context=False)
        d = _handle(dev, CUdevice)
        if err == OK and not 0 <= d < self.devices:
            err = CUresult.CUDA_ERROR_INVALID_DEVICE
        if err != OK:
            return err, CUcontext()
        self.retained[d] = self.retained.get(d, 0) + 1
        return OK, CUcontext(0x1000 + d)

    def cuCtxSetCurrent(self, ctx):
        err = self._enter("cuCtxSetCurrent", context=False)
        if err == OK:
            self._current.ctx = _handle(ctx, CUcontext)
        return (err,)

    def cuMemAlloc(self, bytesize: int):
        err = self._enter("cuMemAlloc")
        if err == OK and bytesize == 0:
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err != OK:
            return err, CUdeviceptr()
        buf = ctypes.create_string_buffer(bytesize)
        self.allocations[ctypes.addressof(buf)] = buf
        return OK, CUdeviceptr(ctypes.addressof(buf))

    def cuMemFree(self, dptr):
        err = self._enter("cuMemFree")
        p = _handle(dptr, CUdeviceptr)
        if err == OK and p not in self.allocations:
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err == OK:
            del self.allocations[p]
        return (err,)

    def cuStreamCreate(self, flags: int):
        err = self._enter("cuStreamCreate")
        if err != OK:
            return err, CUstream()
        self._next_stream += 1
        self.stream_handles.add(self._next_stream)
        return OK, CUstream(self._next_stream)

    def cuStreamDestroy(self, stream):
        err = self._enter("cuStreamDestroy")
        s = _handle(stream, CUstream)
        if err == OK and s not in self.stream_handles:
            err = CUresult.CUDA_ERROR_INVALID_HANDLE
        if err == OK:
            self.stream_handles.discard(s)
        return (err,)

    def cuStreamSynchronize(self, stream):
        err = self._enter("cuStreamSynchronize")
        if err == OK and not self._stream_ok(stream):
            err = CUresult.CUDA_ERROR_INVALID_HANDLE
        return (err,)

    def _copy(self, name, kind, dst, src, nbytes, stream=None):
        err = self._enter(name)
        if err == OK and stream is not None and not self._stream_ok(stream):
            err = CUresult.CUDA_ERROR_INVALID_HANDLE
        to_device, from_device = kind.endswith("d"), kind.startswith("d")
        d = _handle(dst, CUdeviceptr) if to_device else _host(dst)
        s = _handle(src, CUdeviceptr) if from_device else _host(src)
        if err == OK and ((to_device and not self._device_range(d, nbytes))
                          or (from_device and not self._device_range(s, nbytes))):
            err = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
        if err == OK:
            self.copies.append(kind)
            if nbytes:
                ctypes.memmove(d, s, nbytes)
        return (err,)

    def cuMemcpyHtoD(self, dstDevice, srcHost, ByteCount):
        return self._copy("cuMemcpyHtoD", "htod", dstDevice, srcHost, ByteCount)

    def cuMemcpyDtoH(self, dstHost, srcDevice, ByteCount):
        return self._copy("cuMemcpyDtoH", "dtoh", dstHost, srcDevice, ByteCount)

    def cuMemcpyDtoD(self, dstDevice, srcDevice, ByteCount):
        return self._copy("cuMemcpyDtoD", "dtod", dstDevice, srcDevice, ByteCount)

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):
        return self._copy("cuMemcpyHtoDAsync", "htod", dstDevice, srcHost, ByteCount, hStream)

    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount, hStream):
        return self._copy("cuMemcpyDtoHAsync", "dtoh", dstHost, srcDevice, ByteCount, hStream)

    def cuMemcpyDtoDAsync(self, dstDevice, srcDevice, ByteCount, hStream):
        return self._copy("cuMemcpyDtoDAsync", "dtod", dstDevice, srcDevice, ByteCount, hStream)


    # -- CUDA IPC -------------------------------------------------------------------------------

    def cuIpcGetMemHandle(self, dptr):
        err = self._enter("cuIpcGetMemHandle")
        p = _handle(dptr, CUdeviceptr)
        h = CUipcMemHandle()
        if err == OK and p not in self.allocations:     # the base of an allocation only
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err == OK:
            h.reserved = self._export(p, len(self.allocations[p]))
        return err, h

    def cuIpcOpenMemHandle(self, handle, Flags):
        err = self._enter("cuIpcOpenMemHandle")
        if not isinstance(handle, CUipcMemHandle):      # the bindings take the struct only
            raise TypeError("Argument 'handle' is not instance of type (expected CUipcMemHandle)")
        found = self.exported.get(handle.reserved)
        if err == OK and found is None:
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err != OK:
            return err, CUdeviceptr()
        base = found[0]
        self.ipc_open[base] = self.ipc_open.get(base, 0) + 1
        return OK, CUdeviceptr(base)

    def cuIpcCloseMemHandle(self, dptr):
        err = self._enter("cuIpcCloseMemHandle")
        p = _handle(dptr, CUdeviceptr)
        if err == OK and not self.ipc_open.get(p):
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err == OK:
            self.ipc_open[p] -= 1
            if not self.ipc_open[p]:
                del self.ipc_open[p]
        return (err,)

    def cuMemGetAddressRange(self, dptr):
        err = self._enter("cuMemGetAddressRange")
        p = _handle(dptr, CUdeviceptr)
        if err == OK:
            for a, n in self._ranges():
                if a <= p < a + max(n, 1):
                    return OK, CUdeviceptr(a), n
            err = CUresult.CUDA_ERROR_NOT_FOUND
        return err, CUdeviceptr(), 0


class ShmIpcDriver(FakeDriver):
    """The fake across processes: a "device allocation" is a POSIX shared-memory segment, and
    its IPC handle names it (``shm_handle``), so a test client, the server's frontend and its
    workers (each with this driver; tests/e2e/fake_cuda_python puts it where
    ``from cuda.bindings import driver`` finds it) reach the same bytes. A client's region is a
    segment the test made; ``cuMemAlloc`` makes one named ``fakecuda_<pid>_...`` (freed: unlinked),
    which ``cuIpcGetMemHandle`` exports. Opening a handle maps the segment, closing the last open
    unmaps it (what /proc/<pid>/maps shows); as CUDA does, a process cannot open a handle it
    exported itself (CUDA_ERROR_INVALID_CONTEXT)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.mapped: dict[int, tuple] = {}      # base -> (mmap, its ctypes view, size, handle)
        self.segments: dict[int, tuple] = {}    # our allocations: base -> (mmap, segment name)
        self._token = os.urandom(4).hex()
        self._allocated = 0

    def _ranges(self) -> list[tuple[int, int]]:
        return super()._ranges() + [(b, m[2]) for b, m in self.mapped.items()]

    def cuMemAlloc(self, bytesize: int):
        err = self._enter("cuMemAlloc")
        if err == OK and bytesize == 0:
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err != OK:
            return err, CUdeviceptr()
        import mmap
        self._allocated += 1
        name = f"fakecuda_{os.getpid()}_{self._token}_{self._allocated}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, bytesize)
            mm = mmap.mmap(fd, bytesize)
        finally:
            os.close(fd)
        view = (ctypes.c_char * bytesize).from_buffer(mm)
        base = ctypes.addressof(view)
        self.allocations[base] = view
        self.segments[base] = (mm, name)
        return OK, CUdeviceptr(base)

    def cuMemFree(self, dptr):
        (err,) = super().cuMemFree(dptr)
        p = _handle(dptr, CUdeviceptr)
        if err == OK and p in self.segments:
            mm, name = self.segments.pop(p)
            os.unlink(f"/dev/shm/{name}")
            try:
                mm.close()
            except BufferError:     # a view of it is still alive: unmapped when collected
                pass
        return (err,)

    def cuIpcGetMemHandle(self, dptr):
        err = self._enter("cuIpcGetMemHandle")
        p = _handle(dptr, CUdeviceptr)
        h = CUipcMemHandle()
        if err == OK and p not in self.segments:     # the base of an allocation only
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        if err == OK:
            h.reserved = shm_handle(self.segments[p][1])
        return err, h

    def cuIpcOpenMemHandle(self, handle, Flags):
        err = self._enter("cuIpcOpenMemHandle")
        if not isinstance(handle, CUipcMemHandle):
            raise TypeError("Argument 'handle' is not instance of type (expected CUipcMemHandle)")
        raw = handle.reserved
        if err != OK:
            return err, CUdeviceptr()
        if any(shm_handle(name) == raw for _, name in self.segments.values()):
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, CUdeviceptr()
        for base, m in self.mapped.items():
            if m[3] == raw:
                self.ipc_open[base] += 1
                return OK, CUdeviceptr(base)
        name = shm_name(raw)
        if name is None:
            return CUresult.CUDA_ERROR_INVALID_VALUE, CUdeviceptr()
        import mmap
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except OSError:
            return CUresult.CUDA_ERROR_INVALID_VALUE, CUdeviceptr()
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        view = (ctypes.c_char * size).from_buffer(mm)
        base = ctypes.addressof(view)
        self.mapped[base] = (mm, view, size, raw)
        self.ipc_open[base] = 1
        return OK, CUdeviceptr(base)

    def cuIpcCloseMemHandle(self, dptr):
        (err,) = super().cuIpcCloseMemHandle(dptr)
        p = _handle(dptr, CUdeviceptr)
        if err == OK and p not in self.ipc_open and p in self.mapped:
            mm, view, _, _ = self.mapped.pop(p)
            del view
            mm.close()
        return (err,)


def shm_handle(segment: str) -> bytes:
    """The IPC handle ShmIpcDriver reads as "the allocation is /dev/shm/<segment>"."""
    raw = b"FAKESHM\0" + segment.encode()
    assert len(raw) <= IPC_HANDLE_SIZE, segment
    return raw.ljust(IPC_HANDLE_SIZE, b"\0")


def shm_name(raw: bytes) -> str | None:
    if not raw.startswith(b"FAKESHM\0"):
        return None
    return raw[8:].rstrip(b"\0").decode(errors="replace") or None


def install(monkeypatch, driver_class: type[FakeDriver] = FakeDriver, **kw) -> FakeDriver:
    """Put a FakeDriver (or ``driver_class``) where ``from cuda.bindings import driver`` finds
    it, and make gpu.py import it afresh (its cached bindings and ``Cuda`` objects are
    dropped)."""
    from shmserve.ipc.gpu import device as gpu
    drv = driver_class(**kw)
    cuda_pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda_pkg.__path__, bindings.__path__ = [], []
    setattr(cuda_pkg, "bindings", bindings)     # noqa: B010 (module attributes)
    setattr(bindings, "driver", drv)            # noqa: B010
    for name, mod in (("cuda", cuda_pkg), ("cuda.bindings", bindings), ("cuda.bindings.driver", drv)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(gpu, "_driver_module", None)
    monkeypatch.setattr(gpu, "_devices", {})
    return drv


def uninstall(monkeypatch) -> None:
    """cuda-python not installed: ``import cuda`` raises ImportError."""
    from shmserve.ipc.gpu import device as gpu
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(gpu, "_driver_module", None)
    monkeypatch.setattr(gpu, "_devices", {})


def current() -> FakeDriver:
    drv = sys.modules.get("cuda.bindings.driver")
    assert isinstance(drv, FakeDriver), "fake_cuda.install() first"
    return drv
