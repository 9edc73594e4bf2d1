"""KIND_AUTO instances follow the GPUs the machine has, counted as the scheduler must count them:
without initialising CUDA (NVML here, a fake one in the server's processes: tests/e2e/fake_nvml),
narrowed by CUDA_VISIBLE_DEVICES. On a CPU-only onnxruntime, an onnxruntime model that KIND_AUTO
puts on a GPU fails to load with the reason (never a silent CPU fall-back), a python model stays
KIND_CPU and serves, and the frontend reports the GPUs' gauges."""
import os
import shutil

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import REPO_ROOT, Server, wait_for

from shmserve.ipc.gpu import device as gpu

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(gpu.device_count()[0] > 0,
                                reason="a real GPU is present: the fake NVML would misstate it")

ADD_ONE = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]) for r in requests]
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kind_auto"))
    write_model(root, "onnx_auto", '''
        backend: "onnxruntime"
        max_batch_size: 64
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
        instance_group [ { kind: KIND_AUTO } ]
    ''', None)
    shutil.copy(os.path.join(REPO_ROOT, "configs", "models", "mlp_onnx", "1", "model.onnx"),
                os.path.join(root, "onnx_auto", "1"))
    write_model(root, "python_auto", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]
        instance_group [ { kind: KIND_AUTO } ]
    ''', ADD_ONE)
    return root


def _start(repo, monkeypatch, gpus: int, visible: str | None) -> Server:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (os.path.join(HERE, "fake_nvml"), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("FAKE_NVML_GPUS", str(gpus))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    s = Server(repo, wait_ready=False)
    try:
        wait_for(lambda: all(e.get("state") not in ("LOADING", None) for e in _index(s).values()),
                 90, "both models to finish loading")
    except BaseException:
        s.stop()
        raise
    return s


def _metrics_url(server) -> str:
    return f"http://127.0.0.1:{server.metrics_port}/metrics"


def _index(server) -> dict:
    r = requests.post(f"{server.base}/v2/repository/index", timeout=10)
    return {e["name"]: e for e in r.json()}


# placed: the instances KIND_AUTO makes, one per visible GPU; they load at once, and the reason
# names whichever failed first
@pytest.mark.parametrize("gpus, visible, placed", [
    (2, None, ["'onnx_auto_0_0' is KIND_GPU (GPU 0)", "'onnx_auto_0_1' is KIND_GPU (GPU 1)"]),
    (4, "3", ["'onnx_auto_0_0' is KIND_GPU (GPU 0)"])])
def test_kind_auto_follows_the_gpus_nvml_shows(repo, monkeypatch, gpus, visible, placed):
    s = _start(repo, monkeypatch, gpus, visible)
    try:
        entry = _index(s)["onnx_auto"]
        assert entry["state"] == "UNAVAILABLE", entry
        assert any(f"instance {p}" in entry["reason"] for p in placed), entry
        assert "no CUDA execution provider" in entry["reason"], entry
        c = httpclient.InferenceServerClient(s.url)
        assert c.get_model_config("python_auto")["instance_group"][0]["kind"] == "KIND_CPU"
        i = httpclient.InferInput("IN", [2], "FP32")
        i.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
        np.testing.assert_array_equal(c.infer("python_auto", [i]).as_numpy("OUT"), [2, 3])
        metrics = requests.get(_metrics_url(s), timeout=10).text
        assert metrics.count('nv_gpu_memory_total_bytes{gpu_uuid="GPU-fake-') == gpus, metrics
    finally:
        s.stop()


@pytest.mark.parametrize("gpus, visible", [(0, None), (2, "")])
def test_no_visible_gpu_keeps_kind_auto_on_cpu(repo, monkeypatch, gpus, visible):
    s = _start(repo, monkeypatch, gpus, visible)
    try:
        index = _index(s)
        assert index["onnx_auto"]["state"] == "READY", index
        c = httpclient.InferenceServerClient(s.url)
        assert c.get_model_config("onnx_auto")["instance_group"][0]["kind"] == "KIND_CPU"
        metrics = requests.get(_metrics_url(s), timeout=10).text    # NVML shows them all
        assert metrics.count('nv_gpu_memory_total_bytes{gpu_uuid="GPU-fake-') == gpus, metrics
    finally:
        s.stop()
