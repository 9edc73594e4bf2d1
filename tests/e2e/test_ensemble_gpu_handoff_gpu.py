"""Ensemble tensors that stay on the GPU, on a real GPU (all marked gpu): a python model's device
tensor, onnxruntime's output bound on the device (KIND_GPU, I/O binding) and handed to a python
model that asks for GPU inputs (ON_GPU says its input was not in host memory), and onnxruntime
to TensorRT (the engine binds the other worker's memory where it is), each checked against
onnxruntime on the CPU. Without a GPU: tests/e2e/test_ensemble_gpu_handoff.py on the fake
cuda-python."""
import concurrent.futures

import numpy as np
import pytest
import tritonclient.http as httpclient
from gpu_models import MLP_ONNX, add_mlp_models
from handoff_models import write_handoff_models
from repo_builder import write_model
from serverproc import Server, wait_for

from shmserve.ipc.gpu import device as gpu

pytestmark = pytest.mark.gpu

MODELS = ("gpu_pipe", "mlp_take", "mlp_chain")


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    pytest.importorskip("tensorrt", reason="TensorRT's Python package (shmserve[gpu])")
    if not gpu.driver_device_count()[0]:
        pytest.skip(f"CUDA IPC needs cuda-python and a GPU: {gpu.driver_device_count()[1]}")
    repo = str(tmp_path_factory.mktemp("gpu_handoff"))
    add_mlp_models(repo)
    write_handoff_models(repo, "[ -1, 256 ]")
    write_model(repo, "mlp_take", '''
        platform: "ensemble"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1, 256 ] } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1, 256 ] },
                 { name: "ON_GPU", data_type: TYPE_BOOL, dims: [ 1 ] } ]
        ensemble_scheduling { step [
          { model_name: "mlp_gpu" model_version: -1
            input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
          { model_name: "gpu_take" model_version: -1
            input_map { key: "MID" value: "mid" }
            output_map [ { key: "OUT" value: "OUT" }, { key: "ON_GPU" value: "ON_GPU" } ] }
        ] }
    ''', None)
    write_model(repo, "mlp_chain", '''
        platform: "ensemble"
        max_batch_size: 64
        input [ { name: "IN", data_type: TYPE_FP32, dims: [ 256 ] } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 256 ] } ]
        ensemble_scheduling { step [
          { model_name: "mlp_gpu" model_version: -1
            input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
          { model_name: "mlp_trt" model_version: -1
            input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }
        ] }
    ''', None)
    srv = Server(repo, wait_ready=False, timeout=180)
    try:
        wait_for(lambda: all(srv.model_ready(m) for m in MODELS), 180, "the GPU models to load")
    except BaseException:
        print(srv.log_text())
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0


def _reference(x):
    import onnxruntime as ort
    return ort.InferenceSession(MLP_ONNX, providers=["CPUExecutionProvider"]).run(
        None, {"INPUT0": x})[0]


def _infer(server, model: str, x: np.ndarray) -> dict:
    c = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        i = httpclient.InferInput("IN", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        res = c.infer(model, [i])
        return {o["name"]: res.as_numpy(o["name"]) for o in res.get_response()["outputs"]}
    finally:
        c.close()


def test_a_python_models_gpu_tensor_reaches_the_next_python_model_on_the_gpu(gpu_server):
    for i in range(10):
        x = np.random.default_rng(i).standard_normal((2, 256), dtype=np.float32)
        out = _infer(gpu_server, "gpu_pipe", x)
        np.testing.assert_allclose(out["OUT"], x * 2 + 1, rtol=1e-6)
        assert out["ON_GPU"].tolist() == [True]


def test_onnxruntime_output_reaches_a_python_model_on_the_gpu(gpu_server):
    x = np.random.default_rng(7).standard_normal((3, 256), dtype=np.float32)
    out = _infer(gpu_server, "mlp_take", x)
    np.testing.assert_allclose(out["OUT"], _reference(x) + 1, rtol=1e-3, atol=1e-3)
    assert out["ON_GPU"].tolist() == [True]


def test_onnxruntime_to_tensorrt_one_and_many(gpu_server):
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((1 + i % 4, 256), dtype=np.float32) for i in range(48)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda x: _infer(gpu_server, "mlp_chain", x)["OUT"], xs,
                             timeout=300))
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y, _reference(_reference(x)), rtol=1e-3, atol=1e-3)
