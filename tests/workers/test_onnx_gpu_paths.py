"""The onnxruntime backend's GPU path, as far as a machine without a GPU can take it: the load
errors of a KIND_GPU instance (no CUDA provider, no GPU, a provider that did not start: never a
silent CPU fallback), and the I/O-binding execution path (run on a CPU session, with host
arrays and with pointer-bound tensors). The real CUDA session: test_gpu_backends.py (gpu)."""
from __future__ import annotations

import ctypes
import json
import os

import fake_cuda
import numpy as np
import onnxruntime as ort
import pytest
from serverproc import REPO_ROOT

from shmserve.ipc import model_config
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest
from shmserve.workers.backends.onnx import OnnxBackend

MODELS = os.path.join(REPO_ROOT, "configs", "models")
HAS_CUDA_PROVIDER = "CUDAExecutionProvider" in ort.get_available_providers()


def _spec(name: str, kind: str = "CPU", device_id: int = 0) -> InstanceSpec:
    cfg = model_config.read_config(os.path.join(MODELS, name), name)
    cfg = model_config.normalize(cfg, name)
    return InstanceSpec(name, 1, os.path.join(MODELS, name), model_config.config_to_json(cfg),
                        f"{name}_0_0", kind, device_id, "onnxruntime")


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has the CUDA provider")
def test_kind_gpu_without_the_cuda_provider_fails_with_the_reason():
    with pytest.raises(BackendLoadError) as e:
        OnnxBackend(_spec("mlp_onnx", "GPU"))
    text = str(e.value)
    assert "instance 'mlp_onnx_0_0' is KIND_GPU" in text
    assert "no CUDA execution provider" in text and "CPUExecutionProvider" in text
    if gpu.device_count()[0] == 0:
        assert "this machine has no GPU that CUDA can use" in text


def test_kind_gpu_on_a_machine_without_a_gpu(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "device_count", lambda: (0, "no NVIDIA driver (test)"))
    with pytest.raises(BackendLoadError, match=r"is KIND_GPU \(GPU 0\), but this machine has no "
                                               r"GPU that CUDA can use: no NVIDIA driver \(test\)"):
        OnnxBackend(_spec("mlp_onnx", "GPU"))
    monkeypatch.setattr(gpu, "device_count", lambda: (2, ""))
    with pytest.raises(BackendLoadError, match=r"placed on GPU 5, but this machine has 2 GPUs \(0 to 1\)"):
        OnnxBackend(_spec("mlp_onnx", "GPU", device_id=5))


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has the CUDA provider")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_a_cuda_provider_that_does_not_start_is_not_a_silent_cpu_fallback(monkeypatch):
    # what onnxruntime-gpu does when CUDA or cuDNN libraries are missing: it warns and runs the
    # session on CPU; a CPU-only onnxruntime given the CUDA provider does the same
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "device_count", lambda: (1, ""))
    with pytest.raises(BackendLoadError, match="could not start its CUDA execution provider on GPU 0"):
        OnnxBackend(_spec("mlp_onnx", "GPU"))


def _outputs(resp) -> dict:
    assert not resp.error, resp.error
    return {n: a for n, _, a in resp.outputs}


def test_io_binding_gives_what_session_run_gives():
    plain = OnnxBackend(_spec("mlp_onnx"))
    bound = OnnxBackend(_spec("mlp_onnx"), io_binding=True)
    assert not plain.io_binding and bound.io_binding
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, 256), dtype=np.float32) for n in (1, 4, 2)]
    for x in xs:
        x.flags.writeable = False           # as the worker's inputs are (shared memory)
    reqs = [WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, []) for x in xs]
    for a, b in zip(plain.execute(reqs), bound.execute(reqs)):
        np.testing.assert_allclose(_outputs(a)["OUTPUT0"], _outputs(b)["OUTPUT0"], rtol=1e-6)


def test_io_binding_binds_pointer_tensors_where_they_are():
    """A DeviceTensor ("cpu" here: a host pointer) is bound by address, alone or gathered with
    host parts into one batch."""
    bound = OnnxBackend(_spec("mlp_onnx"), io_binding=True)
    plain = OnnxBackend(_spec("mlp_onnx"))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 256), dtype=np.float32)
    y = rng.standard_normal((2, 256), dtype=np.float32)
    dx = DeviceTensor(x.ctypes.data, x.shape, x.dtype, 0, "cpu", x)
    want = plain.execute([WorkRequest({"INPUT0": np.concatenate([x, y])}, {"INPUT0": "FP32"}, [])])
    want = _outputs(want[0])["OUTPUT0"]
    (alone,) = bound.execute([WorkRequest({"INPUT0": dx}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(_outputs(alone)["OUTPUT0"], want[:3], rtol=1e-6)
    mixed = bound.execute([WorkRequest({"INPUT0": dx}, {"INPUT0": "FP32"}, []),
                           WorkRequest({"INPUT0": y}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(_outputs(mixed[0])["OUTPUT0"], want[:3], rtol=1e-6)
    np.testing.assert_allclose(_outputs(mixed[1])["OUTPUT0"], want[3:], rtol=1e-6)


def test_outputs_the_next_step_reads_on_the_device_stay_where_onnxruntime_put_them():
    """device_outputs: bound on the session's device (here the CPU session's, so "cpu"
    pointer tensors; on a GPU, CUDA memory the worker copies into its device arena), owned by
    onnxruntime's OrtValue, split per request of a batch; the other requests' outputs and
    outputs without I/O binding come back as host arrays."""
    from shmserve.ipc.gpu.device_arena import to_host
    bound = OnnxBackend(_spec("mlp_onnx"), io_binding=True)
    plain = OnnxBackend(_spec("mlp_onnx"))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256), dtype=np.float32)
    y = rng.standard_normal((2, 256), dtype=np.float32)
    want = _outputs(plain.execute([WorkRequest({"INPUT0": np.concatenate([x, y])},
                                               {"INPUT0": "FP32"}, [])])[0])["OUTPUT0"]
    on_device = frozenset({"OUTPUT0"})
    (alone,) = bound.execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, [],
                                          device_outputs=on_device)])
    t = _outputs(alone)["OUTPUT0"]
    assert isinstance(t, DeviceTensor) and t.device_type == "cpu" and t.shape == (3, 256)
    assert isinstance(t.owner, ort.OrtValue)
    np.testing.assert_allclose(to_host(t), want[:3], rtol=1e-6)
    both = bound.execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, [], device_outputs=on_device),
                          WorkRequest({"INPUT0": y}, {"INPUT0": "FP32"}, [])])
    parts = [_outputs(r)["OUTPUT0"] for r in both]
    assert [p.shape for p in parts] == [(3, 256), (2, 256)]
    np.testing.assert_allclose(to_host(parts[0]), want[:3], rtol=1e-6)
    np.testing.assert_allclose(to_host(parts[1]), want[3:], rtol=1e-6)   # the worker copies it
    (host,) = plain.execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, [],
                                         device_outputs=on_device)])
    assert isinstance(_outputs(host)["OUTPUT0"], np.ndarray)


def test_string_models_run_without_io_binding():
    # onnxruntime: "Only binding non-string Tensors is currently supported"
    bound = OnnxBackend(_spec("simple_string"), io_binding=True)
    assert not bound.io_binding
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"1"] * 16], dtype=object)
    (resp,) = bound.execute([WorkRequest({"INPUT0": a, "INPUT1": b},
                                         {"INPUT0": "BYTES", "INPUT1": "BYTES"}, [])])
    out = _outputs(resp)
    assert [int(v) for v in out["OUTPUT0"].ravel()] == [i + 1 for i in range(16)]
    assert [int(v) for v in out["OUTPUT1"].ravel()] == [i - 1 for i in range(16)]


def test_gather_on_the_host_keeps_order_and_refuses_mismatched_parts():
    from shmserve.workers.backends.onnx import _gather
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.arange(6, 9, dtype=np.int32).reshape(1, 3)
    da = DeviceTensor(a.ctypes.data, a.shape, a.dtype, 0, "cpu", a)
    out = _gather([da, b], ("cpu", 0))
    got = np.frombuffer((ctypes.c_char * out.nbytes).from_address(out.ptr), np.int32).reshape(out.shape)
    np.testing.assert_array_equal(got, np.arange(9, dtype=np.int32).reshape(3, 3))
    with pytest.raises(ValueError):
        _gather([a, np.zeros((1, 4), np.int32)], ("cpu", 0))


def test_instances_are_placed_on_their_gpus():
    """kind and gpus reach each instance's InstanceSpec (engine/lifecycle.instances_of)."""
    from shmserve.engine.lifecycle.loading import instances_of
    cfg = model_config.read_config(os.path.join(MODELS, "mlp_onnx"), "mlp_onnx")
    del cfg.instance_group[:]
    group = cfg.instance_group.add()
    group.kind, group.count = group.KIND_GPU, 2
    group.gpus.extend([1, 3])
    cfg = model_config.normalize(cfg, "mlp_onnx")
    assert [(i.name, i.kind, i.device_id) for i in instances_of(cfg)] == \
        [("mlp_onnx_0_0", "GPU", 1), ("mlp_onnx_0_1", "GPU", 1), ("mlp_onnx_0_2", "GPU", 3),
         ("mlp_onnx_0_3", "GPU", 3)]      # names of their own, the index running over the gpus


def test_tensorrt_models_default_to_kind_gpu():
    from tritonclient.grpc import model_config_pb2 as mc
    cfg = mc.ModelConfig(backend="tensorrt", max_batch_size=1)
    cfg.input.add(name="X", data_type=mc.TYPE_FP32, dims=[2])
    cfg.output.add(name="Y", data_type=mc.TYPE_FP32, dims=[2])
    cfg = model_config.normalize(cfg, "trt")
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan"
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU


def test_device_count_without_a_driver_is_zero_with_a_reason(monkeypatch):
    # cuda-python installed, libcuda.so.1 not: the bindings raise at the first call
    fake_cuda.install(monkeypatch, no_library=True)
    assert gpu.device_count() == (0, "no NVIDIA driver (Failed to dlopen libcuda.so.1)")


def test_gather_on_the_device_copies_each_part_to_its_offset(monkeypatch):
    """_gather for a CUDA instance, through ipc/gpu/device.py on (fake) cuda-python bindings."""
    from shmserve.workers.backends.onnx import _gather
    driver = fake_cuda.install(monkeypatch)
    cuda = gpu.cuda(0)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(6, 9, dtype=np.float32).reshape(1, 3)
    ptr = cuda.alloc(a.nbytes)
    cuda.htod(ptr, a.ctypes.data, a.nbytes)
    da = DeviceTensor(ptr, a.shape, a.dtype, 0, "cuda")
    driver.copies.clear()
    out = _gather([b, da, b], ("cuda", 0))
    assert driver.copies == ["htod", "dtod", "htod"] and out.device_type == "cuda"
    np.testing.assert_array_equal(cuda.to_host(out), np.concatenate([b, a, b]))
    held = len(driver.allocations)
    del out
    assert len(driver.allocations) == held - 1      # the gathered buffer went with its tensor
    cuda.free(ptr)
    assert driver.allocations == {}


def test_config_json_of_a_kind_gpu_instance_is_valid():
    spec = _spec("mlp_onnx", "GPU", 1)
    assert json.loads(spec.config_json)["name"] == "mlp_onnx" and spec.device_id == 1
