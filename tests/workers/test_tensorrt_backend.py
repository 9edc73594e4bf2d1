"""workers/backends/tensorrt.py without a GPU: the load errors, and everything the backend does
around TensorRT (shapes, profiles, batching, copies, bindings, auto-complete) against the fakes
in fake_tensorrt.py, and ipc/gpu/device.py's own CUDA calls against fake_cuda.py (cuda-python's driver
bindings with host memory). The real engine on a real GPU: tests/workers/test_gpu_backends.py
(gpu)."""
from __future__ import annotations

import json
import os
import sys

import fake_cuda
import numpy as np
import pytest
from fake_tensorrt import ENGINES, EngineSpec, install, plan_bytes

from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends import tensorrt as tensorrt_backend
from shmserve.workers.backends.base import WorkRequest, load_backend


def _addsub(inputs):
    a, b = inputs["INPUT0"], inputs["INPUT1"]
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


ENGINES["addsub"] = EngineSpec(
    inputs={"INPUT0": ("INT32", [-1, 16]), "INPUT1": ("INT32", [-1, 16])},
    outputs={"OUTPUT0": ("INT32", [-1, 16]), "OUTPUT1": ("INT32", [-1, 16])},
    profiles=[{"INPUT0": ((1, 16), (4, 16), (8, 16)), "INPUT1": ((1, 16), (4, 16), (8, 16))}],
    compute=_addsub)
# two profiles: small batches and large ones, a variable second dimension
ENGINES["scale2"] = EngineSpec(
    inputs={"X": ("FLOAT", [-1, -1])},
    outputs={"Y": ("FLOAT", [-1, -1])},
    profiles=[{"X": ((1, 1), (2, 4), (4, 8))}, {"X": ((5, 1), (8, 4), (16, 8))}],
    compute=lambda i: {"Y": i["X"] * 2})
ENGINES["fixed"] = EngineSpec(
    inputs={"X": ("HALF", [2, 3])}, outputs={"Y": ("HALF", [2, 3])},
    profiles=[], compute=lambda i: {"Y": i["X"] + np.float16(1)})
ENGINES["shape_tensor"] = EngineSpec(
    inputs={"S": ("INT32", [2])}, outputs={"Y": ("FLOAT", [-1])},
    profiles=[], compute=lambda i: {"Y": np.zeros(3, np.float32)}, shape_tensors=["S"])

ADDSUB_CONFIG = {
    "name": "addsub", "backend": "tensorrt", "platform": "tensorrt_plan",
    "default_model_filename": "model.plan", "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
              {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
               {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
}


def _spec(tmp_path, engine, config, kind="GPU", auto_complete=False, plan=None) -> InstanceSpec:
    os.makedirs(tmp_path / "m" / "1", exist_ok=True)
    (tmp_path / "m" / "1" / "model.plan").write_bytes(plan if plan is not None else plan_bytes(engine))
    return InstanceSpec("m", 1, str(tmp_path / "m"), json.dumps(config), "m_0", kind, 0,
                        "tensorrt", auto_complete)


@pytest.fixture
def trt(monkeypatch):
    return install(monkeypatch)


@pytest.fixture(autouse=True)
def cuda_driver(monkeypatch):
    return fake_cuda.install(monkeypatch)


def _load(tmp_path, trt, engine="addsub", config=None, **kw):
    """The backend on (fake) GPU 0 through ipc/gpu/device.py, and the fake driver under it."""
    backend = tensorrt_backend.TensorRTBackend(_spec(tmp_path, engine, config or ADDSUB_CONFIG, **kw),
                                               trt=trt)
    return backend, fake_cuda.current()


def _req(**inputs) -> WorkRequest:
    return WorkRequest(inputs, {n: "INT32" for n in inputs}, [])


def test_without_tensorrt_the_load_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)     # import tensorrt raises ImportError
    with pytest.raises(BackendLoadError, match="TensorRT is not installed"):
        load_backend(_spec(tmp_path, "addsub", ADDSUB_CONFIG))


def test_kind_cpu_is_refused(tmp_path, trt):
    with pytest.raises(BackendLoadError, match="runs only on GPUs"):
        _load(tmp_path, trt, kind="CPU")


def test_kind_gpu_without_a_gpu_is_a_clear_load_error(tmp_path, trt, monkeypatch):
    fake_cuda.install(monkeypatch, no_library=True)
    with pytest.raises(BackendLoadError, match=r"has no GPU that CUDA can use: no NVIDIA driver "
                                               r"\(Failed to dlopen libcuda.so.1\)"):
        tensorrt_backend.TensorRTBackend(_spec(tmp_path, "addsub", ADDSUB_CONFIG), trt=trt)
    fake_cuda.install(monkeypatch, devices=0)
    with pytest.raises(BackendLoadError, match="has no GPU that CUDA can use: the NVIDIA driver finds no CUDA device"):
        tensorrt_backend.TensorRTBackend(_spec(tmp_path, "addsub", ADDSUB_CONFIG), trt=trt)
    fake_cuda.install(monkeypatch, devices=1)
    spec = _spec(tmp_path, "addsub", ADDSUB_CONFIG)
    spec.device_id = 3
    with pytest.raises(BackendLoadError, match="placed on GPU 3, but this machine has 1 GPU"):
        tensorrt_backend.TensorRTBackend(spec, trt=trt)


def test_without_cuda_python_the_load_says_so(tmp_path, trt, monkeypatch):
    """A GPU the driver shows (here /proc/driver/nvidia/gpus), but no cuda-python."""
    fake_cuda.uninstall(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    os.makedirs(tmp_path / "gpus" / "0000:01:00.0")
    monkeypatch.setattr(gpu, "PROC_GPUS", str(tmp_path / "gpus"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.device_count() == (1, "")
    with pytest.raises(gpu.CudaError, match=r"cuda-python is not installed \(pip install 'shmserve\[gpu\]'"):
        tensorrt_backend.TensorRTBackend(_spec(tmp_path, "addsub", ADDSUB_CONFIG), trt=trt)


def test_cuda_errors_are_named(tmp_path, trt, cuda_driver):
    cuda_driver.fail["cuMemAlloc"] = cuda_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    backend, _ = _load(tmp_path, trt)
    (resp,) = backend.execute([_req(INPUT0=np.ones((1, 16), np.int32), INPUT1=np.ones((1, 16), np.int32))])
    assert "cuMemAlloc(256 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY" in resp.error


def test_a_plan_tensorrt_cannot_read_fails_with_its_words(tmp_path, trt):
    with pytest.raises(BackendLoadError, match="could not deserialize .*magic tag mismatch"):
        _load(tmp_path, trt, plan=b"not an engine")


def test_one_request_and_requested_outputs(tmp_path, trt):
    backend, cuda = _load(tmp_path, trt)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.ones((2, 16), np.int32)
    (resp,) = backend.execute([_req(INPUT0=a, INPUT1=b)])
    assert not resp.error
    out = {n: (d, arr) for n, d, arr in resp.outputs}
    np.testing.assert_array_equal(out["OUTPUT0"][1], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"][1], a - b)
    assert out["OUTPUT0"][0] == "INT32"
    only = _req(INPUT0=a, INPUT1=b)
    only.requested_outputs = ["OUTPUT1"]
    (resp,) = backend.execute([only])
    assert [n for n, _, _ in resp.outputs] == ["OUTPUT1"]


def test_a_batch_is_copied_in_by_parts_and_split_back(tmp_path, trt):
    backend, cuda = _load(tmp_path, trt)
    rng = np.random.default_rng(0)
    reqs, expect = [], []
    for rows in (1, 3, 2):
        a = rng.integers(-100, 100, (rows, 16), dtype=np.int32)
        b = rng.integers(-100, 100, (rows, 16), dtype=np.int32)
        reqs.append(_req(INPUT0=a, INPUT1=b))
        expect.append((a + b, a - b))
    cuda.copies.clear()
    resps = backend.execute(reqs)
    ctx = backend.context
    assert ctx.runs == 1 and ctx.shapes["INPUT0"] == (6, 16)
    # each request's part straight to its offset: 3 host-to-device copies per input, no gather
    assert cuda.copies.count("htod") == 6 and cuda.copies.count("dtoh") == 2
    for resp, (s, d) in zip(resps, expect):
        out = {n: arr for n, _, arr in resp.outputs}
        np.testing.assert_array_equal(out["OUTPUT0"], s)
        np.testing.assert_array_equal(out["OUTPUT1"], d)


def test_buffers_grow_and_are_freed_at_finalize(tmp_path, trt):
    backend, cuda = _load(tmp_path, trt)
    one = np.ones((1, 16), np.int32)
    backend.execute([_req(INPUT0=one, INPUT1=one)])
    small = dict(backend.buffers)
    eight = np.ones((8, 16), np.int32)
    (resp,) = backend.execute([_req(INPUT0=eight, INPUT1=eight)])
    assert not resp.error
    assert backend.buffers["INPUT0"][1] >= eight.nbytes > small["INPUT0"][1]
    assert len(cuda.allocations) == 4           # the smaller buffers went back
    backend.finalize()
    assert cuda.allocations == {} and cuda.streams == 0


def test_a_shape_outside_the_profile_is_the_requests_error(tmp_path, trt):
    backend, _ = _load(tmp_path, trt, config={**ADDSUB_CONFIG, "max_batch_size": 8})
    nine = np.ones((9, 16), np.int32)
    (resp,) = backend.execute([_req(INPUT0=nine, INPUT1=nine)])
    assert resp.code == ErrorCode.INVALID_ARG
    assert "input 'INPUT0' has shape [9, 16]" in resp.error and "max [8, 16]" in resp.error


def test_the_batch_shape_picks_the_profile(tmp_path, trt):
    config = {"name": "scale2", "max_batch_size": 16, "default_model_filename": "model.plan",
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}
    backend, _ = _load(tmp_path, trt, engine="scale2", config=config)
    ctx = backend.context
    for rows, profile in ((2, 0), (12, 1), (12, 1), (3, 0)):
        x = np.full((rows, 5), rows, np.float32)
        (resp,) = backend.execute([WorkRequest({"X": x}, {"X": "FP32"}, [])])
        assert not resp.error, resp.error
        np.testing.assert_array_equal(resp.outputs[0][2], x * 2)
        assert backend.profile == ctx.profile == profile
    assert ctx.profile_switches == 3        # the load's, to 1, back to 0
    wide = np.ones((2, 9), np.float32)
    (resp,) = backend.execute([WorkRequest({"X": wide}, {"X": "FP32"}, [])])
    assert "profile 0: min [1, 1], max [4, 8]; profile 1: min [5, 1], max [16, 8]" in resp.error


def test_requests_whose_shapes_differ_run_apart(tmp_path, trt):
    config = {"name": "scale2", "max_batch_size": 16, "default_model_filename": "model.plan",
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}
    backend, _ = _load(tmp_path, trt, engine="scale2", config=config)
    xs = [np.full((1, 3), 1, np.float32), np.full((2, 5), 2, np.float32), np.full((1, 3), 3, np.float32)]
    resps = backend.execute([WorkRequest({"X": x}, {"X": "FP32"}, []) for x in xs])
    assert backend.context.runs == 2
    for x, resp in zip(xs, resps):
        np.testing.assert_array_equal(resp.outputs[0][2], x * 2)


def test_without_batching_each_request_runs_alone(tmp_path, trt):
    config = {"name": "fixed", "max_batch_size": 0, "default_model_filename": "model.plan",
              "input": [{"name": "X", "data_type": "TYPE_FP16", "dims": [2, 3]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP16", "dims": [2, 3]}]}
    backend, _ = _load(tmp_path, trt, engine="fixed", config=config)
    xs = [np.full((2, 3), i, np.float16) for i in range(3)]
    resps = backend.execute([WorkRequest({"X": x}, {"X": "FP16"}, []) for x in xs])
    assert backend.context.runs == 3
    for x, resp in zip(xs, resps):
        assert resp.outputs[0][1] == "FP16"
        np.testing.assert_array_equal(resp.outputs[0][2], x + np.float16(1))


def _aligned(values: np.ndarray, offset: int = 0) -> np.ndarray:
    """A copy of ``values`` at an address 256-byte aligned plus ``offset`` (cudaMalloc aligns
    to 256 bytes; TensorRT takes tensor addresses aligned so)."""
    raw = np.zeros(values.nbytes + 512 + offset, np.uint8)
    start = (-raw.ctypes.data) % 256 + offset
    out = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def test_device_inputs_are_bound_where_they_are(tmp_path, trt):
    backend, cuda = _load(tmp_path, trt)
    a = _aligned(np.arange(16, dtype=np.int32).reshape(1, 16))
    b = np.full((1, 16), 5, np.int32)
    da = DeviceTensor(a.ctypes.data, a.shape, a.dtype, 0, "cuda", a)
    cuda.adopt(a.ctypes.data, a.nbytes)
    cuda.copies.clear()
    (resp,) = backend.execute([_req(INPUT0=da, INPUT1=b)])
    assert backend.context.addresses["INPUT0"] == a.ctypes.data      # no copy at all
    assert cuda.copies.count("htod") == 1 and "dtod" not in cuda.copies
    np.testing.assert_array_equal(resp.outputs[0][2], a + b)
    # in a batch of several, a device part is copied device to device into the batch buffer
    cuda.copies.clear()
    resps = backend.execute([_req(INPUT0=da, INPUT1=b), _req(INPUT0=a + 1, INPUT1=b)])
    assert cuda.copies.count("dtod") == 1
    np.testing.assert_array_equal(resps[1].outputs[0][2], a + 1 + b)
    np.testing.assert_array_equal(resps[0].outputs[1][2], a - b)


def test_outputs_the_next_step_reads_on_the_device_stay_in_the_binding_buffers(tmp_path, trt):
    """device_outputs (an ensemble's next step binds device memory): no copy to the host; each
    request gets its rows of the output buffer, which the worker copies into its device arena
    before the next execution reuses it. Outputs no request may take on the device are copied
    out as before."""
    backend, cuda = _load(tmp_path, trt)
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    b = np.ones((3, 16), np.int32)
    reqs = [_req(INPUT0=a[:1], INPUT1=b[:1]), _req(INPUT0=a[1:], INPUT1=b[1:])]
    for r in reqs:
        r.device_outputs = frozenset({"OUTPUT0"})
    cuda.copies.clear()
    resps = backend.execute(reqs)
    assert cuda.copies.count("dtoh") == 1                   # OUTPUT1 only
    buffer = backend.buffers["OUTPUT0"][0]
    for resp, rows, start in zip(resps, (a[:1], a[1:]), (0, 1)):
        out = {n: arr for n, _, arr in resp.outputs}
        t = out["OUTPUT0"]
        assert isinstance(t, DeviceTensor) and t.device_type == "cuda" and t.owner is backend
        assert t.ptr == buffer + start * 16 * 4 and t.shape == rows.shape
        np.testing.assert_array_equal(gpu.cuda(0).to_host(t), rows + 1)
        np.testing.assert_array_equal(out["OUTPUT1"], rows - 1)


def test_an_unaligned_device_input_is_copied_not_bound(tmp_path, trt):
    """A client's CUDA region at an offset: TensorRT takes 256-byte aligned addresses only."""
    backend, cuda = _load(tmp_path, trt)
    a = _aligned(np.arange(16, dtype=np.int32).reshape(1, 16), offset=64)
    b = np.full((1, 16), 5, np.int32)
    cuda.adopt(a.ctypes.data, a.nbytes)
    cuda.copies.clear()
    (resp,) = backend.execute([_req(INPUT0=DeviceTensor(a.ctypes.data, a.shape, a.dtype, 0), INPUT1=b)])
    assert backend.context.addresses["INPUT0"] != a.ctypes.data
    assert cuda.copies.count("dtod") == 1
    np.testing.assert_array_equal(resp.outputs[0][2], a + b)


@pytest.mark.parametrize("change, match", [
    (lambda c: c["input"][0].update(name="NOPE"), "configuration has input 'NOPE', which the TensorRT engine does not have"),
    (lambda c: c["output"][1].update(data_type="TYPE_FP32"), "output 'OUTPUT1': the configuration says TYPE_FP32 but the TensorRT engine has INT32"),
    (lambda c: c["input"][0].update(dims=[4, 4]), r"do not match the engine's shape \[-1, 16\]"),
    (lambda c: c.update(max_batch_size=32), "max_batch_size 32, but the TensorRT engine's optimisation profiles take at most 8"),
])
def test_a_config_that_does_not_fit_the_engine_fails_to_load(tmp_path, trt, change, match):
    config = json.loads(json.dumps(ADDSUB_CONFIG))
    change(config)
    with pytest.raises(BackendLoadError, match=match):
        _load(tmp_path, trt, config=config)


def test_shape_tensor_inputs_are_refused(tmp_path, trt):
    config = {"name": "s", "max_batch_size": 0, "default_model_filename": "model.plan",
              "input": [{"name": "S", "data_type": "TYPE_INT32", "dims": [2]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}
    with pytest.raises(BackendLoadError, match="shape tensor"):
        _load(tmp_path, trt, engine="shape_tensor", config=config)


def test_auto_complete_fills_the_config_from_the_engine(tmp_path, trt):
    spec = _spec(tmp_path, "addsub", {"name": "m", "backend": "tensorrt",
                                      "default_model_filename": "model.plan"}, auto_complete=True)
    tensorrt_backend.TensorRTBackend(spec, trt=trt)
    cfg = json.loads(spec.config_json)
    assert cfg["max_batch_size"] == 8
    assert cfg["input"] == [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}]
    assert [o["name"] for o in cfg["output"]] == ["OUTPUT0", "OUTPUT1"]
