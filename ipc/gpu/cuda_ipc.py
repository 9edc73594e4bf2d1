"""Clients' CUDA shared-memory regions, as a worker reaches them: a region is a device allocation
the client exported as a CUDA IPC handle (``cudaIpcMemHandle_t``); requests name byte ranges of
it (``CudaRef``). The worker opens each handle once (``cuIpcOpenMemHandle``, in the primary
context of the region's GPU) when a request first uses it, keeps it open for the requests that
follow, and closes it when the frontend says no region uses the handle any more (``ForgetSegments``
after an unregister) or when the worker stops.

Another worker's device arena (ipc/gpu/device_arena.py: an ensemble's intermediate tensor) is
reached the same way; the scheduler sends its handles in ``ForgetSegments`` when that worker ends.

Nothing here touches CUDA before a request names a CUDA region: a worker that never sees one
never initialises CUDA (ipc/gpu/device.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from shmserve.ipc import dtypes
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import CudaError, DeviceTensor
from shmserve.ipc.messages.common import CudaRef, Tensor

log = logging.getLogger("shmserve.worker")


class CudaHandles:
    """The CUDA IPC handles this worker has open: (handle bytes, device) -> (Cuda, base). The
    loop reads inputs, a python model's own threads may write outputs (response senders).

    ``local`` resolves references into this process's own exported memory (its device arena:
    an ensemble whose next step runs on the same instance), which CUDA does not let the
    exporting process open; None for anything else."""

    def __init__(self, local: Callable[[CudaRef], tuple[gpu.Cuda, int] | None] | None = None
                 ) -> None:
        self.open: dict[tuple[bytes, int], tuple[gpu.Cuda, int]] = {}
        self.lock = threading.Lock()
        self.local = local

    def pointer(self, ref: CudaRef) -> tuple[gpu.Cuda, int]:
        """The device (its ``Cuda``, current in this thread) and the address of ``ref``'s first
        byte. Raises CudaError when the handle cannot be opened."""
        if self.local is not None:
            own = self.local(ref)
            if own is not None:
                return own
        key = (ref.handle, ref.device_id)
        with self.lock:
            entry = self.open.get(key)
            if entry is None:
                c = gpu.cuda(ref.device_id)
                try:
                    base = c.open_ipc_handle(ref.handle)
                except CudaError as e:
                    raise CudaError(f"cannot open the CUDA IPC handle of a CUDA shared memory "
                                    f"region on GPU {ref.device_id}: {e}") from None
                entry = self.open[key] = (c, base)
            else:
                entry[0].use()
        return entry[0], entry[1] + ref.offset

    def forget(self, handles: list[bytes]) -> None:
        """Close these handles (on every device): no region uses them any more. A request that
        names one later (sent before the unregister, through another frontend) opens it again."""
        if not self.open or not handles:
            return
        gone = set(handles)
        with self.lock:
            for key in [k for k in self.open if k[0] in gone]:
                self._close(key)

    def close(self) -> None:
        with self.lock:
            for key in list(self.open):
                self._close(key)

    def _close(self, key: tuple[bytes, int]) -> None:
        c, base = self.open.pop(key)
        try:
            c.close_ipc_handle(base)
        except CudaError as e:      # the client's process may have gone: nothing left to do
            log.warning("closing a CUDA IPC handle on GPU %d failed: %s", key[1], e)


def input_tensor(t: Tensor, handles: CudaHandles, device: bool) -> np.ndarray | DeviceTensor:
    """An input in a client's CUDA region: where it is, as a ``DeviceTensor`` (``device``: the
    backend binds device memory, as onnxruntime on a GPU and TensorRT do), else copied to a new
    host array (the python backend, onnxruntime on the CPU, BYTES tensors)."""
    ref = t.cuda
    assert ref is not None
    c, ptr = handles.pointer(ref)
    shape = tuple(t.shape)
    if device and t.datatype != "BYTES":
        dtype = np.dtype(dtypes.WIRE_TO_NUMPY[t.datatype])
        return DeviceTensor(ptr, shape, dtype, ref.device_id, "cuda", handles)
    raw = c.to_host(DeviceTensor(ptr, (ref.nbytes,), np.dtype(np.uint8), ref.device_id))
    if t.datatype == "BYTES":
        return dtypes.deserialize_bytes(raw, dtypes.element_count(t.shape)).reshape(shape)
    return raw.view(dtypes.WIRE_TO_NUMPY[t.datatype]).reshape(shape)


def write_output(name: str, datatype: str, arr, target: CudaRef, handles: CudaHandles,
                 too_large: type[Exception]) -> Tensor:
    """Copy an output into the client's CUDA region (host to device, or device to device for a
    ``DeviceTensor``) and wait for the copy; the Tensor then says how many bytes."""
    if isinstance(arr, DeviceTensor):
        nbytes, shape = arr.nbytes, list(arr.shape)
    else:
        shape = list(arr.shape)
        arr = dtypes.serialize_bytes(arr) if datatype == "BYTES" else np.ascontiguousarray(arr)
        nbytes = arr.nbytes
    if nbytes > target.nbytes:
        raise too_large(f"shared memory size specified with the request for output '{name}' "
                        f"({target.nbytes} bytes) should be at least {nbytes} bytes to hold the "
                        f"results")
    c, ptr = handles.pointer(target)
    if nbytes:
        if isinstance(arr, DeviceTensor):
            c.dtod(ptr, arr.ptr, nbytes)
        else:
            c.htod(ptr, arr.ctypes.data, nbytes)
        c.synchronize(0)        # the client reads the region once it has the answer
    return Tensor(name, datatype, shape, None, None,
                  CudaRef(target.handle, target.device_id, target.offset, nbytes))
