"""The HTTP/REST endpoints against the real server, through tritonclient.http and plain requests."""
import json

import ml_dtypes
import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url)
    yield c
    c.close()


def test_health_and_server_metadata(server, client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "shmserve-test"
    assert "binary_tensor_data" in meta["extensions"]
    assert "model_configuration" in meta["extensions"]


def test_model_metadata_has_batch_dim_and_platform(client):
    meta = client.get_model_metadata("simple")
    assert meta["name"] == "simple" and meta["versions"] == ["1"]
    assert meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
                              {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]}]
    onnx = client.get_model_metadata("mlp_onnx", "1")
    assert onnx["platform"] == "onnxruntime_onnx"
    assert onnx["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 256]}]
    nob = client.get_model_metadata("nobatch_fp32")
    assert nob["inputs"][0]["shape"] == [2, -1]


def test_model_config_rendered_like_triton(server):
    r = requests.get(f"{server.base}/v2/models/mlp_onnx/config", timeout=10)
    assert r.status_code == 200
    cfg = r.json()
    assert cfg["name"] == "mlp_onnx" and cfg["max_batch_size"] == 64
    assert cfg["input"][0]["dims"] == [256] and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["backend"] == "onnxruntime" and cfg["platform"] == "onnxruntime_onnx"
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert cfg["instance_group"][0]["name"] == "mlp_onnx_0"
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU"
    assert cfg["instance_group"][0]["count"] == 2
    assert cfg["model_transaction_policy"] == {"decoupled": False}
    assert cfg["default_model_filename"] == "model.onnx"
    assert cfg["optimization"]["input_pinned_memory"] == {"enable": True}
    reshaped = requests.get(f"{server.base}/v2/models/reshaped/versions/1/config", timeout=10).json()
    assert reshaped["input"][0]["reshape"] == {"shape": [2, 2]}


def test_model_ready_endpoints(server, client):
    assert client.is_model_ready("simple")
    assert client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "7")
    r = requests.get(f"{server.base}/v2/models/simple/versions/7/ready", timeout=10)
    assert r.status_code == 400 and r.json() == {"error": "Model version not ready"}
    r = requests.get(f"{server.base}/v2/models/no_such_model/ready", timeout=10)
    assert r.status_code == 404


def _simple_inputs(binary: bool):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", a.shape, "INT32"),
              httpclient.InferInput("INPUT1", b.shape, "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return a, b, inputs


@pytest.mark.parametrize("binary", [False, True])
def test_simple_infer_json_and_binary(client, binary):
    a, b, inputs = _simple_inputs(binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    res = client.infer("simple", inputs, outputs=outputs, request_id="req-42")
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    resp = res.get_response()
    assert resp["id"] == "req-42"
    assert resp["model_name"] == "simple" and resp["model_version"] == "1"


def test_requested_output_subset(client):
    a, b, inputs = _simple_inputs(True)
    res = client.infer("simple", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    names = [o["name"] for o in res.get_response()["outputs"]]
    assert names == ["OUTPUT1"]
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    assert res.as_numpy("OUTPUT0") is None


def test_all_outputs_json_when_none_requested(server):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [[1] * 16]}]}
    r = requests.post(f"{server.base}/v2/models/simple/infer", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    out = r.json()["outputs"]
    assert [o["name"] for o in out] == ["OUTPUT0", "OUTPUT1"]
    assert out[0]["data"] == [i + 1 for i in range(16)]
    assert "id" not in r.json()


def _sample(wire: str, n: int):
    rng = np.random.default_rng(7)
    if wire == "BYTES":
        return np.array([f"élément {i}".encode() for i in range(n - 1)] + [b""], dtype=object)
    if wire == "BOOL":
        return rng.integers(0, 2, n).astype(bool)
    if wire == "BF16":
        return rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    dt = np.dtype({"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}.get(wire, wire.lower()))
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


ALL_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES"]


# FP16/BF16 cannot travel as JSON: that refusal has tests of its own below
ROUND_TRIPS = [(w, b) for w in ALL_TYPES for b in (True, False) if b or w not in ("FP16", "BF16")]


@pytest.mark.parametrize("wire, binary", ROUND_TRIPS)
def test_every_datatype_round_trips(client, wire, binary):
    data = _sample(wire, 10).reshape(2, 5)
    inp = httpclient.InferInput("INPUT0", data.shape, wire)
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary or wire == "BF16")
    res = client.infer(f"id_{wire.lower()}", [inp], outputs=[out])
    got = res.as_numpy("OUTPUT0")
    assert res.get_response()["outputs"][0]["datatype"] == wire
    assert list(got.shape) == [2, 5]
    if wire == "BYTES":
        # tritonclient hands JSON strings back as str, binary BYTES as bytes
        expected = [x if binary else x.decode() for x in data.reshape(-1)]
        assert list(got.reshape(-1)) == expected
    else:
        np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("wire", ["FP16", "BF16"])
def test_fp16_bf16_json_input_refused(server, wire):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": wire, "data": [1.0, 2.0]}]}
    r = requests.post(f"{server.base}/v2/models/id_{wire.lower()}/infer", json=body, timeout=30)
    assert r.status_code == 400
    assert "binary data format" in r.json()["error"]


def test_fp16_json_output_refused(client):
    data = np.ones((1, 3), dtype=np.float16)
    inp = httpclient.InferInput("INPUT0", data.shape, "FP16")
    inp.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException, match="binary_data"):
        client.infer("id_fp16", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])


def test_raw_binary_body(server):
    data = np.arange(12, dtype=np.float32)
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=data.tobytes(),
                      headers={"Inference-Header-Content-Length": "0"}, timeout=30)
    assert r.status_code == 200, r.text
    hlen = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:hlen])
    assert header["outputs"][0]["shape"] == [1, 12]
    np.testing.assert_array_equal(np.frombuffer(r.content[hlen:], dtype=np.float32), data)


def test_mlp_onnx_matches_onnxruntime(client, example_repo):
    import onnxruntime as ort
    x = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    got = client.infer("mlp_onnx", [inp]).as_numpy("OUTPUT0")
    sess = ort.InferenceSession(f"{example_repo}/mlp_onnx/1/model.onnx", providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, sess.run(None, {"INPUT0": x})[0], rtol=1e-5, atol=1e-5)


def test_reshape_applies_inside_the_model(client):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer("reshaped", [inp])
    assert res.as_numpy("SEEN_SHAPE").tolist() == [[2, 2, 2], [2, 2, 2]]
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), x)


def test_optional_input_may_be_omitted(client):
    a = np.array([1, 2, 3], dtype=np.int32)
    ia = httpclient.InferInput("A", [3], "INT32")
    ia.set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("optional_in", [ia]).as_numpy("SUM"), a)
    ib = httpclient.InferInput("B", [3], "INT32")
    ib.set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("optional_in", [ia, ib]).as_numpy("SUM"), 2 * a)


def test_gzip_request_body(server):
    import gzip
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32",
                                   "data": [1.5, 2.5, 3.5]}]}).encode()
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=gzip.compress(body),
                      headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [1.5, 2.5, 3.5]
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=body,
                      headers={"Content-Encoding": "br"}, timeout=30)
    assert r.status_code == 501 and r.headers["Accept-Encoding"] == "gzip, deflate"


def test_version_policy_specific(client):
    meta = client.get_model_metadata("versioned")
    assert meta["versions"] == ["1", "3"]
    inp = httpclient.InferInput("INPUT0", [1], "INT32")
    inp.set_data_from_numpy(np.array([0], dtype=np.int32))
    assert client.infer("versioned", [inp]).as_numpy("VERSION")[0] == 3       # highest ready
    assert client.infer("versioned", [inp], model_version="1").as_numpy("VERSION")[0] == 1
    with pytest.raises(InferenceServerException) as e:
        client.infer("versioned", [inp], model_version="2")
    assert e.value.status() == "404"
    assert client.get_model_metadata("versioned", "1")["versions"] == ["1"]
