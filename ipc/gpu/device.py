"""What a worker needs from the GPU: how many CUDA devices this process sees, the check a KIND_GPU
instance makes before it loads, device memory and copies through cuda-python's driver bindings
(``cuda.bindings.driver``; ``cuda.cuda`` in cuda-python before 12.6), and ``DeviceTensor``, a
tensor already in device memory that a backend binds without a copy through the host.

``Cuda`` works in the device's *primary* context, which the CUDA runtime (and so onnxruntime and
TensorRT) uses too, so pointers pass freely between them. The bindings return ``(CUresult,
value...)``; an error becomes a ``CudaError`` that names it (``cuGetErrorName``).

Nothing here touches CUDA, or imports cuda-python, at import. A worker initialises CUDA itself,
after the process that started it forked: a CUDA context does not survive ``fork()``, so the
scheduler (and any process that forks workers) calls only ``visible_gpus``, which counts GPUs
from what needs no CUDA (NVML, else /proc/driver/nvidia/gpus). Without cuda-python,
``device_count`` answers from the same, so a KIND_GPU load fails with the reason, never a crash.
"""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmserve.ipc.errors import BackendLoadError

CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100
CU_STREAM_NON_BLOCKING = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_SIZE = 64            # sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle)

NOT_INSTALLED = ("cuda-python is not installed (pip install 'shmserve[gpu]', or 'shmserve[gpu-cu12]' "
                 "for an NVIDIA driver older than CUDA 13)")
PROC_GPUS = "/proc/driver/nvidia/gpus"      # one entry per GPU the driver has; no CUDA needed


class CudaError(RuntimeError):
    pass


_driver_module: Any = None
_driver_lock = threading.Lock()


def _driver() -> Any:
    """cuda-python's driver bindings, imported on first use (never at import: see above)."""
    global _driver_module
    with _driver_lock:
        if _driver_module is None:
            try:
                from cuda.bindings import driver
            except ImportError as e:
                try:     # cuda-python before 12.6
                    from cuda import cuda as driver
                except ImportError:
                    raise CudaError(f"{NOT_INSTALLED}: {e}") from None
            _driver_module = driver
        return _driver_module


def _error_name(drv: Any, err: Any) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if int(res) == CUDA_SUCCESS and name:
            return name.decode()
    except Exception:       # an error code these bindings do not know
        pass
    return getattr(err, "name", None) or f"CUDA error {int(err)}"


def _call(drv: Any, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` of the bindings: the value after the CUresult (None if there is none), or a
    CudaError naming the error."""
    err, *values = fn(*args)
    if int(err) != CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_error_name(drv, err)}")
    return values[0] if values else None


def _init(drv: Any) -> Any:
    """cuInit(0): its CUresult; CudaError if the bindings cannot reach the driver at all."""
    try:
        (err,) = drv.cuInit(0)
    except Exception as e:      # cuda-python raises when libcuda.so.1 cannot be loaded
        raise CudaError(f"no NVIDIA driver ({e})") from None
    return err


def device_count() -> tuple[int, str]:
    """(CUDA devices this process can use, why there are none). Never raises. Honours
    CUDA_VISIBLE_DEVICES, as every CUDA library in the process does."""
    try:
        drv = _driver()
    except CudaError as e:
        return _count_without_cuda(str(e))
    try:
        err = _init(drv)
    except CudaError as e:
        return 0, str(e)
    if int(err) == CUDA_ERROR_NO_DEVICE:
        return 0, "the NVIDIA driver finds no CUDA device (CUDA_VISIBLE_DEVICES may hide them)"
    if int(err) != CUDA_SUCCESS:
        return 0, f"the CUDA driver failed to initialise ({_error_name(drv, err)})"
    try:
        n = int(_call(drv, "cuDeviceGetCount", drv.cuDeviceGetCount))
    except CudaError as e:
        return 0, str(e)
    return n, "" if n else "the NVIDIA driver reports no CUDA device"


def driver_device_count() -> tuple[int, str]:
    """Like ``device_count``, but counting only what this process can reach through cuda-python
    (CUDA IPC handles need the driver API): GPUs without the bindings count as none, and the
    reason says both. Never raises."""
    try:
        _driver()
    except CudaError as e:
        n, why = _count_without_cuda(str(e))
        if n:
            return 0, f"this machine has {n} GPU{'' if n == 1 else 's'}, but {e}"
        return 0, why
    return device_count()


def _count_without_cuda(no_bindings: str) -> tuple[int, str]:
    """Without cuda-python: the GPUs ``visible_gpus`` counts, or why there are none."""
    n, visible, seen_by = _driver_gpus()
    if seen_by is None:
        return 0, f"no NVIDIA driver (no NVML, no {PROC_GPUS}); {no_bindings}"
    if visible == 0:
        hidden = " (CUDA_VISIBLE_DEVICES hides them)" if n else ""
        return 0, f"{seen_by} shows {n} NVIDIA GPU{'' if n == 1 else 's'}{hidden}; {no_bindings}"
    return visible, ""


def visible_gpus() -> int:
    """How many GPUs a CUDA library in a process would use, counted without initialising CUDA
    (and so safe in a process that forks: the scheduler places KIND_AUTO instances with it)."""
    return _driver_gpus()[1]


def _driver_gpus() -> tuple[int, int, str | None]:
    """(GPUs the NVIDIA driver has, how many CUDA_VISIBLE_DEVICES leaves, who counted them:
    NVML through nvidia-ml-py, else /proc/driver/nvidia/gpus, None without a driver)."""
    n, seen_by = _nvml_count(), "NVML"
    if n is None:
        n, seen_by = _proc_count(), PROC_GPUS
    if n is None:
        return 0, 0, None
    return n, _visible(n, os.environ.get("CUDA_VISIBLE_DEVICES")), seen_by


def _nvml_count() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _proc_count() -> int | None:
    try:
        return len(os.listdir(PROC_GPUS))
    except OSError:
        return None


def _visible(n: int, spec: str | None) -> int:
    """How many of ``n`` GPUs CUDA_VISIBLE_DEVICES leaves, read as CUDA reads it: indices or
    UUIDs (GPU-..., MIG-...), up to the first entry that names no device."""
    if spec is None:
        return n
    count, seen = 0, set()
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit() and int(entry) < n and int(entry) not in seen:
            seen.add(int(entry))
        elif not entry.startswith(("GPU-", "MIG-")):   # a UUID is taken as present
            break
        count += 1
    return count


def require_device(device_id: int, who: str) -> None:
    """The load error of a KIND_GPU instance placed on a GPU this machine does not have."""
    n, why = device_count()
    if n == 0:
        raise BackendLoadError(f"{who} is KIND_GPU (GPU {device_id}), but this machine has no GPU "
                               f"that CUDA can use: {why}")
    if not 0 <= device_id < n:
        raise BackendLoadError(f"{who} is placed on GPU {device_id}, but this machine has {n} "
                               f"GPU{'s' if n > 1 else ''} (0 to {n - 1})")


class Cuda:
    """The driver API on one device, in its primary context. A context is current per thread:
    a thread other than the one that made this object calls ``use()`` first. Pointers and
    streams are plain ints (what onnxruntime's and TensorRT's bindings take)."""

    def __init__(self, device_id: int):
        drv = self.driver = _driver()
        err = _init(drv)
        if int(err) != CUDA_SUCCESS:
            raise CudaError(f"cuInit failed: {_error_name(drv, err)}")
        self.device = _call(drv, f"cuDeviceGet({device_id})", drv.cuDeviceGet, device_id)
        self.ctx = _call(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain, self.device)
        self.device_id = device_id
        self.use()

    def use(self) -> None:
        _call(self.driver, "cuCtxSetCurrent", self.driver.cuCtxSetCurrent, self.ctx)

    def name(self) -> str:
        raw = _call(self.driver, "cuDeviceGetName", self.driver.cuDeviceGetName, 256, self.device)
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()

    def alloc(self, nbytes: int) -> int:
        # cuMemAlloc refuses 0 bytes (CUDA_ERROR_INVALID_VALUE)
        return int(_call(self.driver, f"cuMemAlloc({nbytes} bytes)", self.driver.cuMemAlloc,
                         max(1, nbytes)))

    def free(self, ptr: int) -> None:
        _call(self.driver, "cuMemFree", self.driver.cuMemFree, ptr)

    def stream(self) -> int:
        return int(_call(self.driver, "cuStreamCreate", self.driver.cuStreamCreate,
                         CU_STREAM_NON_BLOCKING))

    def destroy_stream(self, stream: int) -> None:
        _call(self.driver, "cuStreamDestroy", self.driver.cuStreamDestroy, stream)

    def synchronize(self, stream: int) -> None:
        _call(self.driver, "cuStreamSynchronize", self.driver.cuStreamSynchronize, stream)

    def htod(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            _call(self.driver, "cuMemcpyHtoD", self.driver.cuMemcpyHtoDAsync, dst, src, nbytes, stream)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            _call(self.driver, "cuMemcpyDtoH", self.driver.cuMemcpyDtoHAsync, dst, src, nbytes, stream)

    def dtod(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            _call(self.driver, "cuMemcpyDtoD", self.driver.cuMemcpyDtoDAsync, dst, src, nbytes, stream)

    def open_ipc_handle(self, raw: bytes) -> int:
        """Map a device allocation another process exported (``cuIpcGetMemHandle``, or the
        runtime's ``cudaIpcGetMemHandle``: the same 64 bytes) into this context; returns its base
        address. Opening a handle this context has open already returns the same address and
        counts one more reference: each open needs its ``close_ipc_handle``."""
        if len(raw) != IPC_HANDLE_SIZE:
            raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_SIZE} bytes, got {len(raw)}")
        drv = self.driver
        handle = drv.CUipcMemHandle()
        get_ptr = getattr(handle, "getPtr", None)
        if get_ptr is not None:     # every version: write the bytes where the struct is
            ctypes.memmove(int(get_ptr()), raw, IPC_HANDLE_SIZE)
        else:
            handle.reserved = raw
        self.use()
        return int(_call(drv, "cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle, handle,
                         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))

    def export_ipc_handle(self, ptr: int) -> bytes:
        """The 64-byte CUDA IPC handle of the allocation at ``ptr`` (its base: what
        ``alloc`` returned), which another process opens with ``open_ipc_handle``. CUDA refuses
        a handle in the process that exported it: that process uses the pointer itself."""
        self.use()
        handle = _call(self.driver, "cuIpcGetMemHandle", self.driver.cuIpcGetMemHandle, ptr)
        get_ptr = getattr(handle, "getPtr", None)
        if get_ptr is not None:
            return ctypes.string_at(int(get_ptr()), IPC_HANDLE_SIZE)
        return bytes(handle.reserved)

    def close_ipc_handle(self, ptr: int) -> None:
        self.use()
        _call(self.driver, "cuIpcCloseMemHandle", self.driver.cuIpcCloseMemHandle, ptr)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation ``ptr`` points into."""
        self.use()
        err, base, size = self.driver.cuMemGetAddressRange(ptr)
        if int(err) != CUDA_SUCCESS:
            raise CudaError(f"cuMemGetAddressRange failed: {_error_name(self.driver, err)}")
        return int(base), int(size)

    def to_host(self, t: DeviceTensor) -> np.ndarray:
        """A device tensor's bytes in a new numpy array (synchronous)."""
        out = np.empty(t.shape, dtype=t.dtype)
        self.use()
        if out.nbytes:
            _call(self.driver, "cuMemcpyDtoH", self.driver.cuMemcpyDtoH, out.ctypes.data, t.ptr,
                  out.nbytes)
        return out


_devices: dict[int, Cuda] = {}
_devices_lock = threading.Lock()


def cuda(device_id: int) -> Cuda:
    """One ``Cuda`` per device and process."""
    with _devices_lock:
        c = _devices.get(device_id)
        if c is None:
            c = _devices[device_id] = Cuda(device_id)
        return c


@dataclass(slots=True)
class DeviceTensor:
    """A dense, row-major tensor in device memory: an input that is already on a GPU (a client's
    CUDA shared-memory region), or a python model's GPU tensor. ``owner`` keeps the memory alive
    (an IPC mapping, a DLPack capsule, the producing object). ``device_type`` is "cuda"; tests
    of the binding code use "cpu" with a host pointer."""
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device_id: int = 0
    device_type: str = "cuda"
    owner: object = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def rows(self, start: int, stop: int) -> DeviceTensor:
        """Rows [start, stop) of the first dimension: one request's part of a batch output,
        the same memory (kept alive by the same owner)."""
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * np.dtype(self.dtype).itemsize
        return DeviceTensor(self.ptr + start * row, (stop - start, *self.shape[1:]), self.dtype,
                            self.device_id, self.device_type, self.owner)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2 if self.device_type == "cuda" else 1), self.device_id

    def __dlpack__(self, stream=None, **_):
        from shmserve.ipc.gpu import dlpack
        return dlpack.capsule(self)
