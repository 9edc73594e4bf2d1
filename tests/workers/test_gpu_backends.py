"""The GPU paths on a real GPU (all marked gpu: skipped with the reason where nvidia-ml-py finds
none): the CUDA driver wrapper (ipc/gpu/device.py on cuda-python's driver bindings), onnxruntime's
CUDA provider with I/O binding (device inputs bound where they are), a TensorRT engine built
here and run by the tensorrt backend, and pb_utils GPU tensors through DLPack.
bench/gpu_check.sh runs them."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gpu_models import MLP_ONNX, build_engine

from shmserve.ipc import model_config
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest
from shmserve.workers.python_backend import pb_utils as pb

pytestmark = pytest.mark.gpu

MLP_DIR = os.path.dirname(os.path.dirname(MLP_ONNX))       # configs/models/mlp_onnx


def _spec(name, kind, device_id=0):
    cfg = model_config.normalize(model_config.read_config(MLP_DIR, "mlp_onnx"), "mlp_onnx")
    return InstanceSpec(name, 1, MLP_DIR, model_config.config_to_json(cfg), f"{name}_0", kind,
                        device_id, "onnxruntime")


def _on_device(cuda: gpu.Cuda, arr: np.ndarray) -> DeviceTensor:
    arr = np.ascontiguousarray(arr)
    ptr = cuda.alloc(arr.nbytes)
    cuda.htod(ptr, arr.ctypes.data, arr.nbytes)
    cuda.synchronize(0)

    class Owner:            # frees the memory with the tensor
        def __del__(self):
            cuda.free(ptr)
    return DeviceTensor(ptr, arr.shape, arr.dtype, cuda.device_id, "cuda", Owner())


def _reference(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort
    s = ort.InferenceSession(MLP_ONNX, providers=["CPUExecutionProvider"])
    return s.run(None, {"INPUT0": x})[0]


def test_cuda_driver_round_trip():
    n, why = gpu.device_count()
    assert n >= 1, why
    cuda = gpu.cuda(0)              # cuda-python's driver bindings (shmserve[gpu])
    assert cuda.name() and "\0" not in cuda.name()
    with pytest.raises(gpu.CudaError, match=rf"^cuDeviceGet\({n}\) failed: CUDA_ERROR_INVALID_DEVICE$"):
        gpu.Cuda(n)
    x = np.arange(1 << 20, dtype=np.float32)
    a = _on_device(cuda, x)
    b = cuda.alloc(x.nbytes)
    stream = cuda.stream()
    cuda.dtod(b, a.ptr, x.nbytes, stream)
    out = np.empty_like(x)
    cuda.dtoh(out.ctypes.data, b, x.nbytes, stream)
    cuda.synchronize(stream)
    cuda.destroy_stream(stream)
    cuda.free(b)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(cuda.to_host(a), x)


def test_onnxruntime_cuda_instance_on_its_gpu():
    from shmserve.workers.backends.onnx import OnnxBackend
    backend = OnnxBackend(_spec("mlp_onnx", "GPU", 0))
    assert backend.session.get_providers()[0] == "CUDAExecutionProvider"
    assert backend.io_binding
    options = backend.session.get_provider_options()["CUDAExecutionProvider"]
    assert options["device_id"] == "0"
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((n, 256), dtype=np.float32) for n in (1, 5, 2)]
    resps = backend.execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, []) for x in xs])
    for x, r in zip(xs, resps):
        assert not r.error, r.error
        np.testing.assert_allclose(r.outputs[0][2], _reference(x), rtol=1e-3, atol=1e-3)
    # an input already on the device is bound where it is, alone or gathered with host parts
    cuda = gpu.cuda(0)
    dx = _on_device(cuda, xs[1])
    (r,) = backend.execute([WorkRequest({"INPUT0": dx}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(r.outputs[0][2], _reference(xs[1]), rtol=1e-3, atol=1e-3)
    mixed = backend.execute([WorkRequest({"INPUT0": dx}, {"INPUT0": "FP32"}, []),
                             WorkRequest({"INPUT0": xs[2]}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(mixed[1].outputs[0][2], _reference(xs[2]), rtol=1e-3, atol=1e-3)


def test_onnxruntime_instance_on_a_gpu_that_is_not_there():
    from shmserve.workers.backends.onnx import OnnxBackend
    n, _ = gpu.device_count()
    with pytest.raises(BackendLoadError, match=f"placed on GPU {n}, but this machine has {n} GPU"):
        OnnxBackend(_spec("mlp_onnx", "GPU", n))


def test_tensorrt_engine_built_here_runs(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT's Python package (shmserve[gpu])")
    from shmserve.workers.backends.tensorrt import TensorRTBackend
    os.makedirs(tmp_path / "mlp_trt" / "1")
    build_engine(MLP_ONNX, str(tmp_path / "mlp_trt" / "1" / "model.plan"), "INPUT0",
                 (1, 256), (8, 256), (16, 256))
    cfg = {"name": "mlp_trt", "platform": "tensorrt_plan", "backend": "tensorrt",
           "default_model_filename": "model.plan", "max_batch_size": 16,
           "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [256]}],
           "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [256]}]}
    spec = InstanceSpec("mlp_trt", 1, str(tmp_path / "mlp_trt"), json.dumps(cfg), "mlp_trt_0",
                        "GPU", 0, "tensorrt")
    backend = TensorRTBackend(spec)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((n, 256), dtype=np.float32) for n in (1, 7, 3)]
    resps = backend.execute([WorkRequest({"INPUT0": x}, {"INPUT0": "FP32"}, []) for x in xs])
    for x, r in zip(xs, resps):
        assert not r.error, r.error
        assert r.outputs[0][:2] == ("OUTPUT0", "FP32")
        np.testing.assert_allclose(r.outputs[0][2], _reference(x), rtol=1e-3, atol=1e-3)
    # past the profile: the request's error, naming the bounds
    (r,) = backend.execute([WorkRequest({"INPUT0": np.zeros((17, 256), np.float32)},
                                        {"INPUT0": "FP32"}, [])])
    assert "max [16, 256]" in r.error
    # a device input bound where it is
    dx = _on_device(gpu.cuda(0), xs[1])
    (r,) = backend.execute([WorkRequest({"INPUT0": dx}, {"INPUT0": "FP32"}, [])])
    np.testing.assert_allclose(r.outputs[0][2], _reference(xs[1]), rtol=1e-3, atol=1e-3)
    backend.finalize()
    # max_batch_size past the profile: a load error
    cfg["max_batch_size"] = 32
    spec.config_json = json.dumps(cfg)
    with pytest.raises(BackendLoadError, match="take at most 16"):
        TensorRTBackend(spec)


def test_pb_utils_gpu_tensors_through_dlpack():
    cuda = gpu.cuda(0)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    dx = _on_device(cuda, x)
    t = pb.Tensor.from_dlpack("g", dx)
    assert not t.is_cpu() and t.shape() == [3, 4] and t.__dlpack_device__() == (2, 0)
    with pytest.raises(pb.TritonModelException, match="stored in GPU"):
        t.as_numpy()
    np.testing.assert_array_equal(t._host(), x)
    again = pb.Tensor.from_dlpack("h", t.to_dlpack())
    np.testing.assert_array_equal(again._host(), x)
