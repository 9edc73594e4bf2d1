"""Serving on a GPU, end to end (all marked gpu): an onnxruntime model on KIND_GPU and a TensorRT
engine built here from mlp_onnx, through HTTP with binary tensors and gRPC, one request and many
at once (dynamic batching), checked against onnxruntime on the CPU; and the GPU gauges for the
GPU the models run on. bench/gpu_check.sh runs them."""
import concurrent.futures

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from gpu_models import MLP_ONNX, add_mlp_models
from serverproc import Server, wait_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    pytest.importorskip("tensorrt", reason="TensorRT's Python package (shmserve[gpu])")
    repo = str(tmp_path_factory.mktemp("gpu_models"))
    add_mlp_models(repo)
    srv = Server(repo, wait_ready=False, timeout=180)
    try:
        wait_for(lambda: srv.model_ready("mlp_gpu") and srv.model_ready("mlp_trt"), 180,
                 f"the GPU models to load:\n{_index(srv)}")
    except BaseException:
        print(srv.log_text())
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0


def _index(srv):
    try:
        return requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()
    except requests.RequestException as e:
        return str(e)


def _reference(x):
    import onnxruntime as ort
    return ort.InferenceSession(MLP_ONNX, providers=["CPUExecutionProvider"]).run(None, {"INPUT0": x})[0]


@pytest.mark.parametrize("model", ["mlp_gpu", "mlp_trt"])
def test_http_binary_one_and_many(gpu_server, model):
    c = httpclient.InferenceServerClient(gpu_server.url, concurrency=16)
    rng = np.random.default_rng(5)

    def infer(x):
        i = httpclient.InferInput("INPUT0", x.shape, "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        o = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        return c.infer(model, [i], outputs=[o]).as_numpy("OUTPUT0")
    x = rng.standard_normal((3, 256), dtype=np.float32)
    np.testing.assert_allclose(infer(x), _reference(x), rtol=1e-3, atol=1e-3)
    xs = [rng.standard_normal((1 + i % 4, 256), dtype=np.float32) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(infer, xs, timeout=120))
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y, _reference(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("model", ["mlp_gpu", "mlp_trt"])
def test_grpc(gpu_server, model):
    c = grpcclient.InferenceServerClient(gpu_server.grpc_url)
    x = np.random.default_rng(6).standard_normal((2, 256), dtype=np.float32)
    i = grpcclient.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    y = c.infer(model, [i], client_timeout=60).as_numpy("OUTPUT0")
    np.testing.assert_allclose(y, _reference(x), rtol=1e-3, atol=1e-3)


def test_gpu_gauges_while_serving(gpu_server):
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(f"http://127.0.0.1:{gpu_server.metrics_port}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                 "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"):
        assert name in fams and fams[name].samples, name
        assert all(s.labels["gpu_uuid"].startswith("GPU-") for s in fams[name].samples)
    assert "# TYPE nv_energy_consumption counter" in text
    used = [s.value for s in fams["nv_gpu_memory_used_bytes"].samples]
    assert max(used) > 0            # the models' workers hold GPU memory
