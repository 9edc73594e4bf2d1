"""The example pipeline in configs/models: ensemble_mlp (mlp_preprocess -> mlp_onnx ->
mlp_postprocess) answers what the client gets by calling the three models in turn itself, over
HTTP (binary and JSON, and the curl line of docs/models.md) and gRPC."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import REPO_ROOT, Server

MODELS = os.path.join(REPO_ROOT, "configs", "models")


@pytest.fixture(scope="module")
def srv(example_repo):
    s = Server(example_repo)
    yield s
    assert s.stop() == 0


def _images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 256), dtype=np.uint8)


def _infer(client, module, model: str, name: str, x: np.ndarray, datatype: str,
           outputs: list[str]) -> list[np.ndarray]:
    i = module.InferInput(name, list(x.shape), datatype)
    i.set_data_from_numpy(x)
    r = client.infer(model, [i], outputs=[module.InferRequestedOutput(o) for o in outputs])
    return [r.as_numpy(o) for o in outputs]


def _by_hand(client, module, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The client runs the pipeline itself: three requests, each answer sent back as the next
    one's input."""
    (pixels,) = _infer(client, module, "mlp_preprocess", "IMAGE", images, "UINT8", ["PIXELS"])
    (logits,) = _infer(client, module, "mlp_onnx", "INPUT0", pixels, "FP32", ["OUTPUT0"])
    probs, cls = _infer(client, module, "mlp_postprocess", "LOGITS", logits, "FP32",
                        ["PROBS", "CLASS"])
    # and each step does what its config's comment says
    np.testing.assert_allclose(pixels, images.astype(np.float32) / 255, rtol=1e-6)
    e = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(probs, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(cls, probs.argmax(axis=1).reshape(-1, 1))
    assert probs.dtype == np.float32 and cls.dtype == np.int32
    return probs, cls


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_equals_the_three_models_in_turn(srv, protocol, batch):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(srv.url if protocol == "http" else srv.grpc_url)
    for seed in range(3):
        images = _images(batch, seed)
        probs, cls = _by_hand(client, module, images)
        got_probs, got_cls = _infer(client, module, "ensemble_mlp", "IMAGE", images, "UINT8",
                                    ["PROBS", "CLASS"])
        assert got_probs.shape == (batch, 256) and got_cls.shape == (batch, 1)
        assert got_probs.dtype == np.float32 and got_cls.dtype == np.int32
        np.testing.assert_array_equal(got_probs, probs)      # the same computation, bit for bit
        np.testing.assert_array_equal(got_cls, cls)
        # one output asked for: the ensemble returns it alone
        (only,) = _infer(client, module, "ensemble_mlp", "IMAGE", images, "UINT8", ["CLASS"])
        np.testing.assert_array_equal(only, cls)
    client.close()


def test_ensemble_is_ready_from_an_empty_version_folder(srv):
    # git keeps the empty version folder through a placeholder file; the scanner takes it
    assert os.listdir(os.path.join(MODELS, "ensemble_mlp", "1")) == [".gitkeep"]
    index = {e["name"]: e for e in
             requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
    for m in ("ensemble_mlp", "mlp_preprocess", "mlp_onnx", "mlp_postprocess"):
        assert index[m]["state"] == "READY" and index[m]["version"] == "1", index[m]
    c = httpclient.InferenceServerClient(srv.url)
    meta = c.get_model_metadata("ensemble_mlp")
    assert meta["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == \
        [("IMAGE", "UINT8", [-1, 256])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == \
        [("CLASS", "INT32", [-1, 1]), ("PROBS", "FP32", [-1, 256])]


def test_readme_tritonclient_example(srv):
    # docs/models.md's example, with the server's address
    client = httpclient.InferenceServerClient(srv.url)
    image = np.arange(256, dtype=np.uint8).reshape(1, 256)     # a batch of one 256-byte "image"
    inputs = [httpclient.InferInput("IMAGE", image.shape, "UINT8")]
    inputs[0].set_data_from_numpy(image)
    result = client.infer("ensemble_mlp", inputs)
    cls, probs = result.as_numpy("CLASS"), result.as_numpy("PROBS")
    assert cls.tolist() == [[64]] and probs.shape == (1, 256)      # what docs/models.md prints
    assert cls[0, 0] == probs[0].argmax() and abs(float(probs.sum()) - 1) < 1e-5
    np.testing.assert_array_equal(cls, _by_hand(client, httpclient, image)[1])


CURL = """curl -s -X POST localhost:8000/v2/models/ensemble_mlp/infer -d '{
  "inputs": [{"name": "IMAGE", "shape": [1, 256], "datatype": "UINT8", "data": ['"$(seq -s, 0 255)"']}],
  "outputs": [{"name": "CLASS"}]}'"""


def test_readme_curl_example(srv):
    c = httpclient.InferenceServerClient(srv.url)
    cls = _by_hand(c, httpclient, np.arange(256, dtype=np.uint8).reshape(1, 256))[1]
    assert cls.tolist() == [[64]]                                   # what docs/models.md prints
    expected = {"model_name": "ensemble_mlp", "model_version": "1", "outputs": [
        {"name": "CLASS", "datatype": "INT32", "shape": [1, 1], "data": [64]}]}
    # the same body through requests (JSON in, JSON out)
    body = {"inputs": [{"name": "IMAGE", "shape": [1, 256], "datatype": "UINT8",
                        "data": list(range(256))}], "outputs": [{"name": "CLASS"}]}
    r = requests.post(f"{srv.base}/v2/models/ensemble_mlp/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == expected
    if shutil.which("curl") is None or shutil.which("seq") is None:
        pytest.skip("no curl or seq here: the docs' line itself is not run")
    out = subprocess.run(["bash", "-c", CURL.replace("localhost:8000", srv.url)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == expected
