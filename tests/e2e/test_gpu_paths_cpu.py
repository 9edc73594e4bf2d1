"""The GPU paths' failures a machine without a GPU shows, through a real server: a TensorRT model
without TensorRT and an onnxruntime model placed on a GPU that is not there are UNAVAILABLE with
their reasons in the repository index (the other models serve); a python model's DLPack round
trip works on CPU, and one that hands the server a GPU tensor gets a clear error. Their GPU
counterparts: tests/e2e/test_gpu_serving.py (gpu)."""
import os
import shutil

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import REPO_ROOT, Server, wait_for
from tritonclient.utils import InferenceServerException

from shmserve.ipc.gpu import device as gpu

DLPACK_ROUND_TRIP = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "IN")
            through = pb_utils.Tensor.from_dlpack("tmp", t.to_dlpack())
            doubled = pb_utils.Tensor("d", through.as_numpy() * 2)
            result = pb_utils.Tensor.from_dlpack("OUT", doubled)
            assert result.is_cpu() and np.from_dlpack(result).shape == tuple(t.shape())
            out.append(pb_utils.InferenceResponse([result]))
        return out
'''

HANDS_BACK_A_GPU_TENSOR = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class CudaTensor:       # what torch or cupy would give: a tensor whose device is CUDA:0
    def __init__(self, arr):
        self.arr = arr
    def __dlpack_device__(self):
        return (2, 0)
    def __dlpack__(self, stream=None):
        raise AssertionError("no GPU: the server must refuse before importing")

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
            "OUT", CudaTensor(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()))])
            for r in requests]
'''

IO = '''
    input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
'''


def _tensorrt_installed() -> bool:
    try:
        import tensorrt  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("gpu_paths"))
    write_model(repo, "dlpack_round_trip", 'backend: "python"\nmax_batch_size: 4\n' + IO, DLPACK_ROUND_TRIP)
    write_model(repo, "hands_back_gpu_tensor", 'backend: "python"\nmax_batch_size: 0\n' + IO,
                HANDS_BACK_A_GPU_TENSOR)
    # a plan file TensorRT would refuse anyway: without TensorRT the load fails before reading it
    write_model(repo, "trt_plan", '''
        platform: "tensorrt_plan"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
    ''', None)
    with open(os.path.join(repo, "trt_plan", "1", "model.plan"), "wb") as f:
        f.write(b"not an engine")
    write_model(repo, "onnx_on_gpu3", '''
        backend: "onnxruntime"
        max_batch_size: 64
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
        instance_group [ { kind: KIND_GPU, gpus: [ 3 ] } ]
    ''', None)
    shutil.copy(os.path.join(REPO_ROOT, "configs", "models", "mlp_onnx", "1", "model.onnx"),
                os.path.join(repo, "onnx_on_gpu3", "1"))
    s = Server(repo, wait_ready=False)
    try:
        wait_for(lambda: all(e.get("state") not in ("LOADING", None) for e in _index(s).values()),
                 90, "every model to finish loading")
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def _index(server) -> dict:
    r = requests.post(f"{server.base}/v2/repository/index", timeout=10)
    return {e["name"]: e for e in r.json()}


@pytest.mark.skipif(_tensorrt_installed(), reason="TensorRT is installed here")
def test_tensorrt_model_without_tensorrt_is_unavailable_with_the_reason(srv):
    entry = _index(srv)["trt_plan"]
    assert entry["state"] == "UNAVAILABLE"
    assert "TensorRT is not installed" in entry["reason"], entry


@pytest.mark.skipif(gpu.device_count()[0] > 3, reason="this machine has a GPU 3")
def test_onnx_instance_on_a_missing_gpu_is_unavailable_with_the_reason(srv):
    entry = _index(srv)["onnx_on_gpu3"]
    assert entry["state"] == "UNAVAILABLE"
    assert "GPU 3" in entry["reason"] and "KIND_GPU" in entry["reason"] or \
        "placed on GPU 3" in entry["reason"], entry
    # the model's readiness says so too, and the other models serve
    r = requests.get(f"{srv.base}/v2/models/onnx_on_gpu3/ready", timeout=10)
    assert r.status_code == 400
    assert _index(srv)["dlpack_round_trip"]["state"] == "READY"


def test_dlpack_round_trip_on_cpu(srv):
    c = httpclient.InferenceServerClient(srv.url)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    i = httpclient.InferInput("IN", x.shape, "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    np.testing.assert_array_equal(c.infer("dlpack_round_trip", [i]).as_numpy("OUT"), x * 2)


@pytest.mark.skipif(gpu.device_count()[0] > 0, reason="a GPU is present")
def test_a_gpu_tensor_without_a_gpu_is_a_clear_error(srv):
    c = httpclient.InferenceServerClient(srv.url)
    x = np.ones(4, dtype=np.float32)
    i = httpclient.InferInput("IN", x.shape, "FP32")
    i.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as e:
        c.infer("hands_back_gpu_tensor", [i])
    assert "tensor 'OUT' is in GPU memory (DLPack device CUDA:0), but this machine has no GPU " \
           "that CUDA can use" in str(e.value)
