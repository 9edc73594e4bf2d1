"""A worker and clients' CUDA shared-memory regions, on CPU against fake_cuda (a client's region is
an allocation of "another process", exported with its IPC handle): an input in a region reaches
the backend as a host copy (python backend, onnxruntime on the CPU, BYTES) or, for a backend that
binds device memory, as a DeviceTensor where it is; an output is copied into the region and
answered without bytes; a handle is opened once and closed when the frontend says no region uses
it (ForgetSegments), or at exit. The same through a real server: tests/e2e/test_cuda_shm_cpu.py."""
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
from serverproc import REPO_ROOT

from shmserve.ipc import dtypes
from shmserve.ipc.exec_record import ExecutionRecord
from shmserve.ipc.gpu import cuda_ipc
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages import encode
from shmserve.ipc.messages.common import CudaRef, ErrorCode, InferPayload, OutputSpec, Tensor
from shmserve.ipc.messages.to_scheduler import ForgetSegments
from shmserve.ipc.messages.to_worker import ExecuteBatch, RequestRoute
from shmserve.ipc.shm import ShmMapCache
from shmserve.workers.answers import Answers
from shmserve.workers.backends.base import WorkResponse
from shmserve.workers.leases.chain import Chains
from shmserve.workers.tensors import OutputTooLarge
from shmserve.workers.worker import Worker

CONFIG = {"name": "m", "max_batch_size": 0,
          "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
          "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}]}


@pytest.fixture
def drv(monkeypatch):
    return fake_cuda.install(monkeypatch, devices=2)


class Doubler:
    """A backend: OUT = 2 * IN, remembering what it was given."""

    def __init__(self, device_inputs: bool, datatype: str = "FP32"):
        self.device_inputs = device_inputs
        self.datatype = datatype
        self.seen: list = []

    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs["IN"]
            self.seen.append(x)
            if isinstance(x, DeviceTensor):
                x = gpu.cuda(x.device_id).to_host(x)
            if self.datatype == "BYTES":
                out.append(WorkResponse([("OUT", "BYTES", x)]))
            else:
                out.append(WorkResponse([("OUT", "FP32", x * 2)]))
        return out


def execution_record() -> ExecutionRecord:
    """What the worker writes while it executes (ipc/exec_record.py), in a file already
    removed: nobody reads it here."""
    with tempfile.TemporaryDirectory() as d:
        return ExecutionRecord(os.path.join(d, "exec"))


def make_worker(backend, config=CONFIG) -> tuple[Worker, list]:
    """A Worker with what execute() and forget() use; its answers are collected."""
    w = BareWorker()
    w.chains, w.bls = Chains(w), None   # no ensemble runs worker to worker, no BLS
    w.args = types.SimpleNamespace(spawn_id=1)
    w.spec = types.SimpleNamespace(model_name="m", version=1)
    w.backend, w.device_inputs = backend, backend.device_inputs
    w.maps, w.cuda_handles, w.arena = ShmMapCache(), cuda_ipc.CudaHandles(), None
    w.answers = Answers("m", 1, "unix://test", w.arena, w.maps, None, w.cuda_handles)
    w.use_config(json.dumps(config))
    w.sequence, w.senders, w.streams = None, False, {}
    w.running, w.running_chain, w.cancelled = None, [], set()
    w.out_lock = threading.Lock()
    w.record = execution_record()
    answers: list = []
    w.answer = lambda fid, msg: answers.append(msg)
    w.tell = lambda msg, payloads=(): None
    return w, answers


def run(w: Worker, answers: list, inputs: list[Tensor], outputs: list[OutputSpec]):
    w.execute(ExecuteBatch(1, [RequestRoute(7, 0)]), [encode(InferPayload("r", inputs, outputs))])
    return answers.pop()


def host_bytes(base: int, nbytes: int) -> bytes:
    return ctypes.string_at(base, nbytes)


def fill(base: int, arr: np.ndarray, offset: int = 0) -> None:
    ctypes.memmove(base + offset, arr.ctypes.data, arr.nbytes)


def test_python_backend_gets_a_host_copy_and_the_output_lands_in_the_region(drv):
    x = np.arange(4, dtype=np.float32)
    h_in, in_base = drv.export(64)
    h_out, out_base = drv.export(64)
    fill(in_base, x, offset=16)
    backend = Doubler(device_inputs=False)
    w, answers = make_worker(backend)
    res = run(w, answers, [Tensor("IN", "FP32", [4], cuda=CudaRef(h_in, 1, 16, 16))],
              [OutputSpec("OUT", cuda=CudaRef(h_out, 0, 32, 32))])
    assert res.error == ""
    seen = backend.seen[0]
    assert type(seen) is np.ndarray and seen.tolist() == x.tolist()
    out = res.outputs[0]
    assert (out.name, out.shape, out.data, out.shm) == ("OUT", [4], None, None)
    assert out.cuda == CudaRef(h_out, 0, 32, 16) and res.worker == ""    # no slot to give back
    assert np.frombuffer(host_bytes(out_base + 32, 16), np.float32).tolist() == (x * 2).tolist()
    # both handles open, once each, and kept for the next request
    assert sorted(drv.ipc_open.values()) == [1, 1] and drv.calls.count("cuIpcOpenMemHandle") == 2
    run(w, answers, [Tensor("IN", "FP32", [4], cuda=CudaRef(h_in, 1, 16, 16))],
        [OutputSpec("OUT", cuda=CudaRef(h_out, 0, 0, 16))])
    assert drv.calls.count("cuIpcOpenMemHandle") == 2
    # the frontend says no region uses h_in any more: closed; the rest at exit
    w.forget(ForgetSegments([], [h_in]))
    assert list(drv.ipc_open) == [out_base]
    w.cuda_handles.close()
    assert drv.ipc_open == {}


def test_a_backend_that_binds_device_memory_gets_a_device_tensor_where_it_is(drv):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    h_in, in_base = drv.export(256)
    fill(in_base, x, offset=64)
    backend = Doubler(device_inputs=True)
    config = dict(CONFIG, input=[{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1],
                                  "reshape": {"shape": [3, 2]}}],
                  output=[{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1, -1]}])
    w, answers = make_worker(backend, config)
    res = run(w, answers, [Tensor("IN", "FP32", [6], cuda=CudaRef(h_in, 0, 64, 24))],
              [OutputSpec("OUT")])
    assert res.error == ""
    t = backend.seen[0]
    assert type(t) is DeviceTensor and t.ptr == in_base + 64 and t.device_id == 0
    assert t.shape == (3, 2) and t.dtype == np.float32 and t.device_type == "cuda"   # reshaped
    assert np.frombuffer(res.outputs[0].data, np.float32).tolist() == (x.ravel() * 2).tolist()
    assert "cuMemcpyDtoH" in drv.calls and "htod" not in drv.copies


def test_bytes_inputs_and_outputs(drv):
    words = np.array([b"alpha", b"", b"gamma"], dtype=object)
    raw = dtypes.serialize_bytes(words).tobytes()
    h_in, in_base = drv.export(len(raw), raw)
    h_out, out_base = drv.export(64)
    backend = Doubler(device_inputs=True, datatype="BYTES")     # BYTES always come to the host
    w, answers = make_worker(backend, dict(CONFIG, input=[], output=[]))
    res = run(w, answers, [Tensor("IN", "BYTES", [3], cuda=CudaRef(h_in, 0, 0, len(raw)))],
              [OutputSpec("OUT", cuda=CudaRef(h_out, 0, 0, 64))])
    assert res.error == "" and backend.seen[0].tolist() == words.tolist()
    assert res.outputs[0].cuda.nbytes == len(raw) and host_bytes(out_base, len(raw)) == raw


def test_an_output_too_large_for_the_region(drv):
    h_in, in_base = drv.export(16)
    h_out, _ = drv.export(64)
    w, answers = make_worker(Doubler(device_inputs=False))
    res = run(w, answers, [Tensor("IN", "FP32", [4], cuda=CudaRef(h_in, 0, 0, 16))],
              [OutputSpec("OUT", cuda=CudaRef(h_out, 0, 0, 8))])
    assert res.code == ErrorCode.INVALID_ARG
    assert res.error == ("shared memory size specified with the request for output 'OUT' (8 bytes) "
                         "should be at least 16 bytes to hold the results")


def test_a_handle_that_does_not_open_fails_the_request_not_the_worker(drv):
    w, answers = make_worker(Doubler(device_inputs=False))
    res = run(w, answers, [Tensor("IN", "FP32", [4], cuda=CudaRef(b"\1" * 64, 0, 0, 16))],
              [OutputSpec("OUT")])
    assert res.code == ErrorCode.INVALID_ARG
    assert res.error.startswith("invalid request tensors: cannot open the CUDA IPC handle of a "
                                "CUDA shared memory region on GPU 0: cuIpcOpenMemHandle failed: "
                                "CUDA_ERROR_INVALID_VALUE")
    assert w.cuda_handles.open == {}


def test_without_cuda_python_the_request_says_so(monkeypatch):
    fake_cuda.uninstall(monkeypatch)
    w, answers = make_worker(Doubler(device_inputs=False))
    res = run(w, answers, [Tensor("IN", "FP32", [4], cuda=CudaRef(b"\1" * 64, 0, 0, 16))],
              [OutputSpec("OUT")])
    assert res.code == ErrorCode.INVALID_ARG and "cuda-python is not installed" in res.error


def test_a_device_tensor_output_is_copied_device_to_device(drv):
    h_out, out_base = drv.export(32)
    x = np.arange(4, dtype=np.float32)
    handles = cuda_ipc.CudaHandles()
    c = gpu.cuda(0)
    src = c.alloc(16)                       # a backend's own device memory
    c.htod(src, x.ctypes.data, 16)
    t = cuda_ipc.write_output("OUT", "FP32", DeviceTensor(src, (4,), np.dtype(np.float32)),
                              CudaRef(h_out, 0, 8, 24), handles, OutputTooLarge)
    assert t.cuda == CudaRef(h_out, 0, 8, 16) and t.shape == [4]
    assert np.frombuffer(host_bytes(out_base + 8, 16), np.float32).tolist() == x.tolist()
    assert drv.copies[-1] == "dtod"
    handles.close()
    assert drv.ipc_open == {}


def test_forget_closes_a_handle_on_every_device_and_ignores_unknown_ones(drv):
    h, base = drv.export(16)
    handles = cuda_ipc.CudaHandles()
    handles.pointer(CudaRef(h, 0, 0, 16))
    handles.pointer(CudaRef(h, 1, 0, 16))         # the same region reached from GPU 1's context
    assert drv.ipc_open == {base: 2}
    handles.forget([b"\0" * 64])
    assert drv.ipc_open == {base: 2}
    handles.forget([h])
    assert drv.ipc_open == {} and handles.open == {}


def test_which_backends_take_device_inputs():
    """onnxruntime on a GPU and TensorRT bind a DeviceTensor where it is; onnxruntime on the CPU
    (even through I/O binding) and the python backend get host copies."""
    from shmserve.ipc import model_config
    from shmserve.ipc.spawn_args import InstanceSpec
    from shmserve.workers.backends.onnx import OnnxBackend
    from shmserve.workers.backends.tensorrt import TensorRTBackend
    from shmserve.workers.python_backend.backend import PythonBackend
    models = os.path.join(REPO_ROOT, "configs", "models")
    cfg = model_config.normalize(model_config.read_config(os.path.join(models, "mlp_onnx"),
                                                          "mlp_onnx"), "mlp_onnx")
    spec = InstanceSpec("mlp_onnx", 1, os.path.join(models, "mlp_onnx"),
                        model_config.config_to_json(cfg), "mlp_onnx_0", "CPU", 0, "onnxruntime")
    for io_binding in (False, True):
        assert OnnxBackend(spec, io_binding=io_binding).device_inputs is False
    assert TensorRTBackend.device_inputs is True
    assert getattr(PythonBackend, "device_inputs", False) is False


def test_onnxruntime_copies_a_device_input_at_an_unaligned_offset():
    """A client's CUDA region at an offset that is not 256-byte aligned is copied (device to
    device on a GPU; here, a CPU session through I/O binding, host to host) into a buffer of the
    backend's own, never bound where it is."""
    from shmserve.ipc import model_config
    from shmserve.ipc.spawn_args import InstanceSpec
    from shmserve.workers.backends.base import WorkRequest
    from shmserve.workers.backends.onnx import OnnxBackend
    models = os.path.join(REPO_ROOT, "configs", "models")
    cfg = model_config.normalize(model_config.read_config(os.path.join(models, "mlp_onnx"),
                                                          "mlp_onnx"), "mlp_onnx")
    spec = InstanceSpec("mlp_onnx", 1, os.path.join(models, "mlp_onnx"),
                        model_config.config_to_json(cfg), "mlp_onnx_0", "CPU", 0, "onnxruntime")
    x = np.random.default_rng(4).standard_normal((2, 256), dtype=np.float32)
    raw = np.zeros(x.nbytes + 512, np.uint8)
    start = (-raw.ctypes.data) % 256 + 16           # aligned + 16: not bindable as it is
    held = raw[start:start + x.nbytes].view(np.float32).reshape(x.shape)
    held[...] = x
    t = DeviceTensor(held.ctypes.data, x.shape, np.dtype(np.float32), 0, "cuda", held)
    (got,) = OnnxBackend(spec, io_binding=True).execute([WorkRequest({"INPUT0": t}, {"INPUT0": "FP32"}, [])])
    (want,) = OnnxBackend(spec).execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(got.outputs[0][2], want.outputs[0][2], rtol=1e-6)
