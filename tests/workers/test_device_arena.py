"""A worker's device arena (ipc/gpu/device_arena.py) and the worker around it, on CPU against
fake_cuda (device memory is host memory; ShmIpcDriver's is POSIX shared memory, as across
processes): an output the request lets stay on the device and the model left there is copied
device to device into a slot, answered as a CudaRef to an exported chunk and given back by
ReleaseOutputs.device; any other device output, a full arena, or one turned off goes through the
host; the worker reads its own slots by address (CUDA refuses to open a handle in the process
that exported it); every slot is free again after many requests; stopping frees the chunks.
The scheduler's side: tests/engine/test_ensemble_device.py; a real server:
tests/e2e/test_ensemble_gpu_handoff.py."""
from __future__ import annotations

import ctypes
import json
import os
import tempfile
import threading
import types

import fake_cuda
import numpy as np
import pytest
from bare_worker import BareWorker

from shmserve.ipc.exec_record import ExecutionRecord
from shmserve.ipc.gpu import cuda_ipc
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.gpu.device_arena import ALIGN, DeviceArena, to_host
from shmserve.ipc.messages import encode
from shmserve.ipc.messages.common import CudaRef, InferPayload, OutputSpec, Tensor
from shmserve.ipc.messages.to_worker import ExecuteBatch, ReleaseOutputs, RequestRoute
from shmserve.ipc.shm import ShmMapCache
from shmserve.workers.answers import Answers
from shmserve.workers.backends.base import WorkResponse
from shmserve.workers.leases.chain import Chains
from shmserve.workers.worker import Worker

CONFIG = {"name": "m", "max_batch_size": 0,
          "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
          "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}]}


@pytest.fixture
def drv(monkeypatch):
    return fake_cuda.install(monkeypatch, devices=2)


class DeviceMemory:
    """A model's own device allocation (what torch or cupy would hold), freed with it."""

    def __init__(self, arr: np.ndarray, device_id: int = 0):
        self.cuda = gpu.cuda(device_id)
        self.cuda.use()
        self.ptr = self.cuda.alloc(max(1, arr.nbytes))
        self.cuda.htod(self.ptr, np.ascontiguousarray(arr).ctypes.data, arr.nbytes)

    def __del__(self):
        try:
            self.cuda.use()
            self.cuda.free(self.ptr)
        except Exception:
            pass


def on_device(arr: np.ndarray, device_id: int = 0) -> DeviceTensor:
    memory = DeviceMemory(arr, device_id)
    return DeviceTensor(memory.ptr, arr.shape, arr.dtype, device_id, "cuda", memory)


def read(ptr: int, dtype, count: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(ptr, count * np.dtype(dtype).itemsize), dtype)


# ---- the arena -------------------------------------------------------------------------------------
def test_a_kept_tensor_is_copied_into_a_slot_of_an_exported_chunk(drv):
    arena = DeviceArena()
    x = np.arange(10, dtype=np.float32)
    ref = arena.keep(on_device(x, 1))
    chunk = arena.chunks[1][0]
    assert ref == CudaRef(chunk.handle, 1, 0, 40) and drv.exported[chunk.handle][0] == chunk.ptr
    assert read(chunk.ptr, np.float32, 10).tolist() == x.tolist()
    assert drv.copies[-1] == "dtod" and "cuStreamSynchronize" in drv.calls
    second = arena.keep(on_device(x + 1, 1))
    assert second.offset == ALIGN and second.handle == ref.handle     # aligned, same chunk
    assert arena.slots_in_use == 2 and len(drv.allocations) == 1      # the model's own went
    arena.free(ref)
    arena.free(ref)                                     # twice, or not ours: ignored
    arena.free(CudaRef(b"x" * 64, 1, 0, 40))
    assert arena.slots_in_use == 1
    assert arena.keep(on_device(x, 1)).offset == 0      # the hole is used again
    arena.close()
    assert drv.allocations == {} and arena.bytes_allocated == 0


def test_the_pool_bounds_each_gpu_and_a_full_one_says_none(drv):
    arena = DeviceArena({0: 4 * ALIGN}, chunk_bytes=2 * ALIGN)
    one = np.zeros(ALIGN // 4, np.float32)              # one aligned slot each
    refs = [arena.keep(on_device(one)) for _ in range(4)]
    assert all(refs) and len(arena.chunks[0]) == 2 and arena.bytes_allocated == 4 * ALIGN
    assert arena.keep(on_device(one)) is None           # full: the caller copies to the host
    arena.free(refs[2])
    assert arena.keep(on_device(one)) == refs[2]
    big = np.zeros(8 * ALIGN // 4, np.float32)
    assert arena.keep(on_device(big, 1)) is not None    # GPU 1 has the default pool
    assert arena.chunks[1][0].size == 8 * ALIGN         # larger than a chunk: one of its own
    arena.close()


def test_a_tensor_larger_than_a_chunk_gets_a_chunk_of_its_own(drv):
    arena = DeviceArena(chunk_bytes=ALIGN)
    ref = arena.keep(on_device(np.zeros(1000, np.float32)))
    assert ref.nbytes == 4000 and arena.chunks[0][0].size == 4096
    arena.close()


def test_a_pool_of_zero_never_touches_cuda_and_nor_do_host_tensors(drv):
    arena = DeviceArena({0: 0})
    x = np.zeros(4, np.float32)
    t = on_device(x)
    drv.calls.clear()
    assert arena.keep(t) is None and drv.calls == []
    assert arena.keep(DeviceTensor(x.ctypes.data, x.shape, x.dtype, 0, "cpu", x)) is None
    assert arena.keep(on_device(np.zeros((0, 4), np.float32), 1)) is None     # nothing to keep


def test_no_device_memory_means_none_said_once(drv, caplog):
    arena = DeviceArena()
    t = on_device(np.zeros(4, np.float32))
    drv.fail["cuMemAlloc"] = fake_cuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert arena.keep(t) is None and arena.keep(t) is None
    assert [r.message for r in caplog.records].count(
        "device arena on GPU 0: cannot allocate 16777216 bytes (cuMemAlloc(16777216 bytes) "
        "failed: CUDA_ERROR_OUT_OF_MEMORY); outputs go through host memory") == 1


def test_local_references_resolve_to_addresses_and_others_do_not(drv):
    arena = DeviceArena()
    ref = arena.keep(on_device(np.arange(4, dtype=np.float32)))
    c, ptr = arena.local(CudaRef(ref.handle, 0, 256, 16))
    assert c is gpu.cuda(0) and ptr == arena.chunks[0][0].ptr + 256
    assert arena.local(CudaRef(ref.handle, 1, 0, 16)) is None       # not on that GPU
    assert arena.local(CudaRef(b"y" * 64, 0, 0, 16)) is None
    with pytest.raises(gpu.CudaError, match="outside the device arena chunk"):
        arena.local(CudaRef(ref.handle, 0, arena.chunks[0][0].size, 16))
    arena.close()


def test_to_host_reads_device_and_host_pointer_tensors(drv):
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert to_host(on_device(x)).tolist() == x.tolist()
    got = to_host(DeviceTensor(x.ctypes.data, x.shape, x.dtype, 0, "cpu", x))
    assert got.tolist() == x.tolist() and got.ctypes.data != x.ctypes.data
    assert to_host(on_device(x).rows(1, 2)).tolist() == [[3, 4, 5]]


# ---- the worker --------------------------------------------------------------------------------------
class GpuDoubler:
    """A backend whose model computes on the GPU: OUT = 2 * IN, left in device memory where the
    request allows it (as a python model's from_dlpack tensor, onnxruntime's bound output or
    TensorRT's buffer), else copied out."""

    def __init__(self, device_inputs: bool = False, datatype: str = "FP32"):
        self.device_inputs, self.datatype, self.seen = device_inputs, datatype, []

    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs["IN"]
            self.seen.append(x)
            host = to_host(x) if isinstance(x, DeviceTensor) else x
            y = (host * 2).astype(np.float64 if self.datatype == "FP64" else np.float32)
            out.append(WorkResponse([("OUT", self.datatype, on_device(y)
                                      if "OUT" in r.device_outputs else y)]))
        return out


def execution_record() -> ExecutionRecord:
    """What the worker writes while it executes (ipc/exec_record.py), in a file already
    removed: nobody reads it here."""
    with tempfile.TemporaryDirectory() as d:
        return ExecutionRecord(os.path.join(d, "exec"))


def make_worker(backend, pool=None, config=CONFIG) -> tuple[Worker, list]:
    w = BareWorker()
    w.chains, w.bls = Chains(w), None   # no ensemble runs worker to worker, no BLS
    w.args = types.SimpleNamespace(spawn_id=1)
    w.spec = types.SimpleNamespace(model_name="m", version=1)
    w.backend, w.device_inputs = backend, backend.device_inputs
    w.device_arena = DeviceArena(pool)
    w.maps, w.cuda_handles, w.arena = ShmMapCache(), cuda_ipc.CudaHandles(w.device_arena.local), None
    w.answers = Answers("m", 1, "unix://test", w.arena, w.maps, w.device_arena, w.cuda_handles)
    w.use_config(json.dumps(config))
    w.sequence, w.senders, w.streams = None, False, {}
    w.running, w.running_chain, w.cancelled = None, [], set()
    w.out_lock = threading.Lock()
    w.record = execution_record()
    answers: list = []
    w.answer = lambda fid, msg: answers.append(msg)
    w.tell = lambda msg, payloads=(): None
    return w, answers


def run(w: Worker, answers: list, x, device: bool = True):
    inputs = [x if isinstance(x, Tensor) else Tensor("IN", "FP32", list(x.shape), x.tobytes())]
    w.execute(ExecuteBatch(1, [RequestRoute(7, 0)]),
              [encode(InferPayload("r", inputs, [OutputSpec("OUT", device=device)]))])
    return answers.pop()


def test_an_output_left_on_the_gpu_is_answered_as_a_cuda_ref_and_given_back(drv):
    w, answers = make_worker(GpuDoubler())
    x = np.arange(4, dtype=np.float32)
    drv.copies.clear()
    res = run(w, answers, x)
    (out,) = res.outputs
    assert res.error == "" and (out.name, out.shape, out.data, out.shm) == ("OUT", [4], None, None)
    chunk = w.device_arena.chunks[0][0]
    assert out.cuda == CudaRef(chunk.handle, 0, 0, 16) and res.worker == "unix://test"
    assert read(chunk.ptr, np.float32, 4).tolist() == (x * 2).tolist()
    assert "dtoh" not in drv.copies                     # it never went through the host
    assert w.device_arena.slots_in_use == 1
    w.release_outputs(ReleaseOutputs([], [out.cuda]))
    assert w.device_arena.slots_in_use == 0


def test_outputs_the_request_does_not_let_stay_go_through_the_host(drv):
    w, answers = make_worker(GpuDoubler())
    x = np.arange(4, dtype=np.float32)
    res = run(w, answers, x, device=False)
    assert res.outputs[0].cuda is None and res.worker == ""
    assert np.frombuffer(res.outputs[0].data, np.float32).tolist() == (x * 2).tolist()
    # a backend that hands back a device tensor it was not allowed to: copied out all the same
    w.backend.execute = lambda reqs: [WorkResponse([("OUT", "FP32", on_device(x))])]
    res = run(w, answers, x, device=False)
    assert res.outputs[0].cuda is None and np.frombuffer(res.outputs[0].data, np.float32).tolist() == x.tolist()
    assert w.device_arena.bytes_allocated == 0


def test_a_full_arena_falls_back_to_the_host_and_never_fails_the_request(drv):
    w, answers = make_worker(GpuDoubler(), pool={0: ALIGN})
    x = np.arange(4, dtype=np.float32)
    first = run(w, answers, x)
    assert first.outputs[0].cuda is not None
    second = run(w, answers, x + 1)                    # the one slot is taken
    assert second.error == "" and second.outputs[0].cuda is None and second.worker == ""
    assert np.frombuffer(second.outputs[0].data, np.float32).tolist() == ((x + 1) * 2).tolist()
    w.release_outputs(ReleaseOutputs([], [first.outputs[0].cuda]))
    assert run(w, answers, x).outputs[0].cuda == first.outputs[0].cuda


def test_an_output_that_breaks_the_config_is_checked_on_the_host(drv):
    w, answers = make_worker(GpuDoubler(datatype="FP64"))
    res = run(w, answers, np.arange(4, dtype=np.float32))
    assert res.error == ("unexpected datatype FP64 for inference output 'OUT' of model 'm', "
                         "expecting FP32")
    assert w.device_arena.slots_in_use == 0


def test_every_slot_is_free_after_many_requests(drv):
    w, answers = make_worker(GpuDoubler(), pool={0: 4 * ALIGN})
    held = []
    for i in range(50):
        res = run(w, answers, np.full(4, i, np.float32))
        held.append(res.outputs[0].cuda)
        if len(held) == 3:              # the scheduler gives them back as requests end
            w.release_outputs(ReleaseOutputs([], held))
            held = []
    assert all(r is not None for r in held)
    w.release_outputs(ReleaseOutputs([], held))
    assert w.device_arena.slots_in_use == 0 and w.device_arena.bytes_allocated == 4 * ALIGN
    assert [h[1] for h in w.device_arena.chunks[0][0].holes] == [4 * ALIGN]


def test_the_next_step_on_the_same_worker_reads_its_slot_by_address(monkeypatch):
    """CUDA refuses cuIpcOpenMemHandle in the process that exported the handle (ShmIpcDriver
    too); the worker resolves its own references itself."""
    drv = fake_cuda.install(monkeypatch, driver_class=fake_cuda.ShmIpcDriver)
    backend = GpuDoubler(device_inputs=True)
    w, answers = make_worker(backend)
    try:
        x = np.arange(4, dtype=np.float32)
        mid = run(w, answers, x).outputs[0]
        own = gpu.cuda(0)
        with pytest.raises(gpu.CudaError, match="CUDA_ERROR_INVALID_CONTEXT"):
            own.open_ipc_handle(mid.cuda.handle)
        res = run(w, answers, Tensor("IN", "FP32", mid.shape, None, None, mid.cuda))
        seen = backend.seen[-1]
        assert type(seen) is DeviceTensor and seen.ptr == w.device_arena.chunks[0][0].ptr
        assert to_host(seen).tolist() == (x * 2).tolist() and res.error == ""
        assert w.cuda_handles.open == {} and drv.ipc_open == {}
        del seen, backend.seen[:]
    finally:
        w.device_arena.close()
    assert drv.segments == {}           # every fake device allocation unlinked


def test_stopping_the_worker_frees_the_chunks(drv):
    w, answers = make_worker(GpuDoubler())
    run(w, answers, np.arange(4, dtype=np.float32))
    assert len(drv.allocations) == 1
    w.device_arena.close()
    assert drv.allocations == {}
