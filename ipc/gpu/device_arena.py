"""``DeviceArena``: a worker's output slots in GPU memory, for tensors that go to another worker
without a trip through host memory (an ensemble's intermediate tensor, when the model left it on
a GPU and the next step binds device memory).

Per GPU, device memory from ``gpu.Cuda.alloc`` in chunks, each exported once as a CUDA IPC
handle (``cuIpcGetMemHandle``); a slot is a byte range of a chunk, named by
``CudaRef(handle, device, offset, nbytes)``, which the consumer opens (ipc/gpu/cuda_ipc.py, cached
per handle) and reads where it is. The scheduler gives a slot back (``ReleaseOutputs.device``)
when the request that made it ends, as it does host slots.

Bounded per GPU (``--cuda-memory-pool-byte-size``, 64 MiB by default, 0 turns it off): ``keep``
returns None when a tensor does not fit, and the worker copies it to host memory instead, so a
full arena never fails a request. Chunks are allocated on first need and kept until the worker
stops: other processes may hold their handles open, and freeing memory under them is what CUDA
IPC forbids; the scheduler tells them to close the handles of a worker that has ended.

Only the owner allocates and frees. A model's own threads may answer (response senders) while
the loop reads inputs, so the tables are behind a lock.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu import dlpack
from shmserve.ipc.gpu.device import CudaError, DeviceTensor
from shmserve.ipc.messages.common import CudaRef

log = logging.getLogger("shmserve.worker")

DEFAULT_POOL_BYTES = 64 << 20   # per GPU, as Triton's --cuda-memory-pool-byte-size
CHUNK_BYTES = 16 << 20          # one allocation; a larger tensor gets a chunk of its size
ALIGN = 256                     # what cudaMalloc gives: kernels, onnxruntime and TensorRT bind it


def _aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) & ~(ALIGN - 1))


@dataclass(eq=False)
class _Chunk:
    cuda: gpu.Cuda
    ptr: int
    size: int
    handle: bytes
    holes: list[list[int]] = field(default_factory=list)    # sorted [offset, length], merged

    def __post_init__(self) -> None:
        self.holes = [[0, self.size]]

    def take(self, n: int) -> int | None:
        """First fit of ``n`` (aligned) bytes; the offset, or None."""
        for i, hole in enumerate(self.holes):
            if hole[1] >= n:
                off = hole[0]
                if hole[1] == n:
                    del self.holes[i]
                else:
                    hole[0] += n
                    hole[1] -= n
                return off
        return None

    def give(self, off: int, n: int) -> None:
        holes = self.holes
        i = 0
        while i < len(holes) and holes[i][0] < off:
            i += 1
        holes.insert(i, [off, n])
        if i + 1 < len(holes) and off + n == holes[i + 1][0]:
            holes[i][1] += holes[i + 1][1]
            del holes[i + 1]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == off:
            holes[i - 1][1] += holes[i][1]
            del holes[i]


class DeviceArena:
    def __init__(self, pool_bytes: dict[int, int] | None = None,
                 default_bytes: int = DEFAULT_POOL_BYTES, chunk_bytes: int = CHUNK_BYTES):
        self.pool_bytes = dict(pool_bytes or {})
        self.default_bytes = default_bytes
        self.chunk_bytes = chunk_bytes
        self.chunks: dict[int, list[_Chunk]] = {}           # device -> its chunks
        self.by_handle: dict[tuple[bytes, int], _Chunk] = {}
        self.live: dict[CudaRef, tuple[_Chunk, int]] = {}    # slot -> (chunk, aligned bytes)
        self.lock = threading.Lock()
        self.warned: set[int] = set()       # devices whose allocation failed (said once)

    def limit(self, device_id: int) -> int:
        return self.pool_bytes.get(device_id, self.default_bytes)

    @property
    def slots_in_use(self) -> int:
        return len(self.live)

    @property
    def bytes_allocated(self) -> int:
        return sum(c.size for cs in self.chunks.values() for c in cs)

    def keep(self, t: DeviceTensor) -> CudaRef | None:
        """Copy ``t`` (device to device, synchronised: the consumer is another process) into a
        new slot on its GPU. None when it cannot stay on the device: not CUDA memory, empty, or
        no room within the pool (the caller copies it to the host)."""
        if t.device_type != "cuda" or t.nbytes == 0:
            return None
        n = _aligned(t.nbytes)
        with self.lock:
            found = self._slot(t.device_id, n)
            if found is None:
                return None
            chunk, off = found
            ref = CudaRef(chunk.handle, t.device_id, off, t.nbytes)
            self.live[ref] = (chunk, n)
        try:
            chunk.cuda.use()
            chunk.cuda.dtod(chunk.ptr + off, t.ptr, t.nbytes)
            chunk.cuda.synchronize(0)
        except CudaError:
            self.free(ref)
            raise
        return ref

    def _slot(self, device_id: int, n: int) -> tuple[_Chunk, int] | None:
        chunks = self.chunks.setdefault(device_id, [])
        for chunk in chunks:
            off = chunk.take(n)
            if off is not None:
                return chunk, off
        room = self.limit(device_id) - sum(c.size for c in chunks)
        if n > room:
            return None
        new = self._new_chunk(device_id, max(n, min(self.chunk_bytes, room)))
        if new is None:
            return None
        chunks.append(new)
        self.by_handle[(new.handle, device_id)] = new
        off = new.take(n)
        assert off == 0
        return new, off

    def _new_chunk(self, device_id: int, size: int) -> _Chunk | None:
        """A new exported allocation, or None when the GPU has no memory for it (the output
        goes through the host, as it would without the arena)."""
        try:
            c = gpu.cuda(device_id)
            c.use()
            ptr = c.alloc(size)
        except CudaError as e:
            if device_id not in self.warned:
                self.warned.add(device_id)
                log.warning("device arena on GPU %d: cannot allocate %d bytes (%s); outputs go "
                            "through host memory", device_id, size, e)
            return None
        try:
            handle = c.export_ipc_handle(ptr)
        except CudaError as e:
            c.free(ptr)
            if device_id not in self.warned:
                self.warned.add(device_id)
                log.warning("device arena on GPU %d: cannot export device memory (%s); outputs "
                            "go through host memory", device_id, e)
            return None
        return _Chunk(c, ptr, size, handle)

    def free(self, ref: CudaRef) -> None:
        """Give a slot back; a reference that names no live slot of ours (freed already, or
        another process's memory) is ignored."""
        with self.lock:
            found = self.live.pop(ref, None)
            if found is not None:
                chunk, n = found
                chunk.give(ref.offset, n)

    def local(self, ref: CudaRef) -> tuple[gpu.Cuda, int] | None:
        """A reference into our own chunks: the device and the address (a process cannot open
        the IPC handles it exported); None for another process's memory."""
        with self.lock:
            chunk = self.by_handle.get((ref.handle, ref.device_id))
        if chunk is None:
            return None
        if ref.offset < 0 or ref.offset + ref.nbytes > chunk.size:
            raise CudaError(f"range [{ref.offset}, {ref.offset + ref.nbytes}) is outside the "
                            f"device arena chunk of {chunk.size} bytes")
        chunk.cuda.use()
        return chunk.cuda, chunk.ptr + ref.offset

    def close(self) -> None:
        with self.lock:
            chunks = [c for cs in self.chunks.values() for c in cs]
            self.chunks.clear()
            self.by_handle.clear()
            self.live.clear()
        for chunk in chunks:
            try:
                chunk.cuda.use()
                chunk.cuda.free(chunk.ptr)
            except CudaError as e:
                log.warning("freeing the device arena on GPU %d failed: %s",
                            chunk.cuda.device_id, e)


def to_host(t: DeviceTensor) -> np.ndarray:
    """A tensor a backend left in device memory, copied to a new host array (an output that
    goes to host memory after all). "cpu" tensors are host pointers (onnxruntime's I/O
    binding on a CPU session, in tests)."""
    if t.device_type == "cpu":
        return np.array(dlpack.host_array(t))
    return gpu.cuda(t.device_id).to_host(t)
