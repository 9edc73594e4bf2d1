"""The error texts and status codes that Triton's own QA tests assert (qa/L0_http, L0_grpc,
L0_input_validation, L0_lifecycle), asked of shmserve the same way: raw HTTP, tritonclient HTTP
and tritonclient gRPC. Where Triton answers 500 for a client's bad input, shmserve answers 400
(the project's rule) with Triton's words."""
import gzip
import json
import os
import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import IDENTITY, write_model
from serverproc import REPO_ROOT, Server
from tritonclient.utils import InferenceServerException

MAX_INPUT = 1 << 20         # --http-max-input-size: small, so the size tests stay quick
RAW = {"Inference-Header-Content-Length": "0"}
TRAVERSAL = ["../etc", "a/../b", "../../etc/passwd", "model/..", "..", "/etc/passwd",
             "model/subdir", "model/", " ..", ".. "]


def _fp32_inputs(names: str) -> str:
    return ", ".join(f'{{ name: "{n}", data_type: TYPE_FP32, dims: [ -1 ] }}' for n in names)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("triton_texts"))
    for name in ("identity_fp32", "identity_bytes", "simple", "simple_identity"):
        shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", name),
                        os.path.join(repo, name))
    out = 'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]'
    write_model(repo, "three_required", f'''
        backend: "python"
        input [ {_fp32_inputs(["INPUT0", "INPUT1", "INPUT2"])} ]
        {out}''', IDENTITY)
    write_model(repo, "three_and_optional", f'''
        backend: "python"
        input [ {_fp32_inputs(["INPUT0", "INPUT1", "INPUT2"])},
                {{ name: "INPUT3", data_type: TYPE_FP32, dims: [ -1 ], optional: true }} ]
        {out}''', IDENTITY)
    write_model(repo, "two_variable_dims", '''
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP16, dims: [ -1, -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP16, dims: [ -1, -1 ] } ]''', IDENTITY)
    write_model(repo, "strings16", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ 16 ] },
                { name: "INPUT1", data_type: TYPE_STRING, dims: [ 16 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ 16 ] } ]''', IDENTITY)
    write_model(repo, "identity_int64", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_INT64, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT64, dims: [ -1 ] } ]''', IDENTITY)
    return repo


@pytest.fixture(scope="module")
def server(repo):
    srv = Server(repo, "--model-control-mode", "explicit", "--load-model", "*",
                 "--http-max-input-size", str(MAX_INPUT), "--model-upload-max-bytes", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(server.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _infer_url(server, model: str) -> str:
    return f"{server.base}/v2/models/{model}/infer"


def _post(server, model: str, **kw) -> requests.Response:
    return requests.post(_infer_url(server, model), timeout=60, **kw)


def _error(r: requests.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    message = r.json()["error"]
    for w in words:
        assert w in message, message
    return message


def _raises(call, status: str, *words: str) -> str:
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == status, e.value
    for w in words:
        assert w in e.value.message(), e.value.message()
    return e.value.message()


def _live(server) -> None:
    assert requests.get(f"{server.base}/v2/health/live", timeout=10).status_code == 200


# ---- qa/L0_http/http_test.py --------------------------------------------------------------------
def test_raw_binary_requests_that_cannot_be_deduced(server):
    _error(_post(server, "identity_bytes", data=b"427", headers=RAW), 400,
           "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]")
    _error(_post(server, "two_variable_dims", data=np.ones([2, 2], np.float16).tobytes(),
                 headers=RAW), 400,
           "The shape of the raw input 'INPUT0' can not be deduced because there are more than "
           "one variable-sized dimension")
    _error(_post(server, "three_required", data=np.arange(24, dtype=np.float32).tobytes(),
                 headers=RAW), 400,
           "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in "
           "'three_required' model configuration")
    # qa/L0_http/http_request_many_chunks.py sends its raw body to 'simple'
    _error(_post(server, "simple", data=b"A" * 64, headers=RAW), 400,
           "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
           "'simple' model configuration")


def test_buffer_size_overflow(server):
    def doc(first: int) -> dict:
        return {"inputs": [{"name": "INPUT0", "shape": [first, 2 ** 60 + 2], "datatype": "FP32",
                            "data": [1.0]}]}
    _error(_post(server, "identity_fp32", json=doc(2 ** 4)), 400,
           "causes total element count to exceed maximum size of")
    _error(_post(server, "identity_fp32", json=doc(2 ** 2)), 400,
           "byte size overflow for input 'INPUT0'")


def test_negative_dimension_is_a_500_with_tritons_words(server):
    """Triton answers 500 (its JSON reader fails), which its own L0_http test expects."""
    doc = {"inputs": [{"name": "INPUT0", "shape": [2, -5], "datatype": "FP32", "data": [1.0]}]}
    _error(_post(server, "identity_fp32", json=doc), 500,
           "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
           "unsigned-integer", "input 'INPUT0'")


@pytest.mark.parametrize("model, datatype, value", [
    ("simple_identity", "BYTES", '"hello"'), ("identity_int64", "INT64", "123")])
def test_json_data_nesting_depth_limit(server, model, datatype, value):
    def post(depth: int) -> requests.Response:
        data = "[" * depth + value + "]" * depth
        body = f'{{"inputs": [{{"name": "INPUT0", "datatype": "{datatype}", "shape": [1, 1], ' \
               f'"data": {data}}}]}}'
        return _post(server, model, data=body, headers={"Content-Type": "application/json"})
    for depth in (120, 100):
        _error(post(depth), 400, "JSON nesting depth exceeds maximum allowed limit (100)")
    for depth in (50, 99):
        assert post(depth).status_code == 200
    _live(server)


def test_duplicate_output_names(server, http, grpc):
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 8],
                       "data": x.tolist()}],
           "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]}
    _error(_post(server, "identity_fp32", json=doc), 400,
           "output 'OUTPUT0' already exists in request")
    ones = np.ones((1, 16), dtype=np.int32)
    for client, status in ((http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
        mod = httpclient if client is http else grpcclient
        inputs = [mod.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(ones)
        outputs = [mod.InferRequestedOutput("OUTPUT0") for _ in range(2)]
        _raises(lambda: client.infer("simple", inputs, outputs=outputs), status,
                "output 'OUTPUT0' already exists in request")
    _live(server)


def test_duplicate_input_names(server, http, grpc):
    x = np.ones((1, 4), dtype=np.float32)
    for client, mod, status in ((http, httpclient, "400"),
                                (grpc, grpcclient, "StatusCode.INVALID_ARGUMENT")):
        inputs = [mod.InferInput("INPUT0", [1, 4], "FP32") for _ in range(2)]
        for i in inputs:
            i.set_data_from_numpy(x)
        _raises(lambda: client.infer("identity_fp32", inputs), status,
                "input 'INPUT0' already exists in request")


def test_repository_index_ready_must_be_a_boolean(server):
    depth = 250000
    body = '{"ready":' + "[" * depth + "true" + "]" * depth + "}"
    assert len(body) < MAX_INPUT
    for data in (body, '{"ready": "yes"}', '{"ready": 1}'):
        r = requests.post(f"{server.base}/v2/repository/index", data=data,
                          headers={"Content-Type": "application/json"}, timeout=60)
        _error(r, 400, "Invalid value for 'ready': expected a boolean")
    _live(server)


def test_inference_header_content_length_errors(server):
    def post(value: str) -> requests.Response:
        return _post(server, "identity_fp32", json={"inputs": []},
                     headers={"Inference-Header-Content-Length": value})
    _error(post("99999999999"), 400, "inference header size should be in range (0, ")
    _error(post("1000"), 400, "inference header size should be in range (0, 14), got: 1000")
    _error(post("ten"), 400, "Unable to parse Inference-Header-Content-Length, got: ten")
    r = _post(server, "identity_fp32", data=gzip.compress(b" " * (1 << 20)),
              headers={"Content-Type": "application/json", "Content-Encoding": "gzip",
                       "Inference-Header-Content-Length": "9999999"})
    _error(r, 400, "inference header size should be in range")
    _live(server)


# ---- qa/L0_http/http_input_size_limit_test.py ---------------------------------------------------
def _json_of_size(size: int) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1], "data": [""]}]}
    pad = size - len(json.dumps(doc))
    doc["inputs"][0]["data"] = ["A" * pad]
    body = json.dumps(doc).encode()
    assert len(body) == size
    return body


def test_json_body_size_limit_at_the_byte(server):
    words = ("request JSON size of ", " bytes exceeds the maximum allowed input size of ",
             "Use --http-max-input-size to increase the limit.")
    r = _post(server, "identity_bytes", data=_json_of_size(MAX_INPUT + 1))
    _error(r, 400, f"request JSON size of {MAX_INPUT + 1} bytes", f"of {MAX_INPUT} bytes", *words)
    assert _post(server, "identity_bytes", data=_json_of_size(MAX_INPUT)).status_code == 200


def _padded_gzip(size: int) -> bytes:
    doc = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 100],
                                  "data": [1.0] * 100}]}, indent=4)
    return gzip.compress((doc[:-1] + " " * (size - len(doc)) + doc[-1]).encode())


def test_compressed_body_size_limit(server):
    gz = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    r = _post(server, "identity_fp32", data=_padded_gzip(MAX_INPUT + (64 << 10)), headers=gz)
    _error(r, 400, "exceeds the maximum allowed value", "--http-max-input-size")
    r = _post(server, "identity_fp32", data=_padded_gzip(MAX_INPUT - (64 << 10)), headers=gz)
    assert r.status_code == 200 and "outputs" in r.json()


def test_control_body_past_the_limit(server):
    """Triton reads it and answers 400; shmserve refuses it by its Content-Length (a 413, the
    README's rule) with Triton's words."""
    body = json.dumps({"parameters": {"config": "{}", "x": "A" * MAX_INPUT}})
    r = requests.post(f"{server.base}/v2/repository/models/identity_fp32/load", data=body,
                      timeout=60)
    _error(r, 413, "request JSON size", " exceeds the maximum allowed input size",
           "--http-max-input-size")
    assert server.model_ready("identity_fp32")


# ---- qa/L0_input_validation/input_validation_test.py --------------------------------------------
def _fp32s(mod, names):
    inputs = [mod.InferInput(n, [1], "FP32") for n in names]
    for i in inputs:
        i.set_data_from_numpy(np.arange(1, dtype=np.float32))
    return inputs


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_missing_required_inputs(proto, http, grpc):
    client, mod = (http, httpclient) if proto == "http" else (grpc, grpcclient)
    status = "400" if proto == "http" else "StatusCode.INVALID_ARGUMENT"
    _raises(lambda: client.infer("three_required", []), status,
            "expected 3 inputs but got 0 inputs for model 'three_required'. Got input(s) [], but "
            "missing required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide all "
            "required input(s).")
    _raises(lambda: client.infer("three_and_optional", []), status,
            "expected number of inputs between 3 and 4 but got 0 inputs for model "
            "'three_and_optional'. Got input(s) [], but missing required input(s) "
            "['INPUT0','INPUT1','INPUT2']. Please provide all required input(s).")
    _raises(lambda: client.infer("three_required", _fp32s(mod, ["INPUT0"])), status,
            "expected 3 inputs but got 1 inputs for model 'three_required'. Got input(s) "
            "['INPUT0'], but missing required input(s) ['INPUT1','INPUT2']. Please provide all "
            "required input(s).")
    _raises(lambda: client.infer("three_and_optional", _fp32s(mod, ["INPUT0", "INPUT3"])),
            status,
            "expected number of inputs between 3 and 4 but got 2 inputs for model "
            "'three_and_optional'. Got input(s) ['INPUT0','INPUT3'], but missing required "
            "input(s) ['INPUT1','INPUT2']. Please provide all required input(s).")


def test_input_byte_size_mismatch(grpc):
    x = np.arange(10, dtype=np.float32)[None]
    inp = grpcclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    inp.set_shape((1, 8))
    _raises(lambda: grpc.infer("identity_fp32", [inp]), "StatusCode.INVALID_ARGUMENT",
            "input byte size mismatch for input 'INPUT0' for model 'identity_fp32'. "
            "Expected 32, got 40")


def test_string_element_counts(grpc):
    def strings(n: int):
        arr = np.array([str(i) for i in range(n)], dtype=object).reshape(1, n)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = grpcclient.InferInput(name, [1, n], "BYTES")
            inp.set_data_from_numpy(arr)
            inp.set_shape((1, 16))
            inputs.append(inp)
        return inputs
    _raises(lambda: grpc.infer("strings16", strings(14)), "StatusCode.INVALID_ARGUMENT",
            "expected 16 string elements for inference input 'INPUT0' for model 'strings16', "
            "got 14")
    _raises(lambda: grpc.infer("strings16", strings(18)), "StatusCode.INVALID_ARGUMENT",
            "unexpected number of string elements 17 for inference input 'INPUT0' for model "
            "'strings16', expecting 16")


def test_model_names_a_load_refuses(server, grpc, http):
    for name in TRAVERSAL:
        _raises(lambda: grpc.load_model(name), "StatusCode.INVALID_ARGUMENT",
                "model name must not contain path traversal characters")
    for name in ["", " ", "   ", "\t", "\n", "\r", "\f", "\v", " \t \n "]:
        _raises(lambda: grpc.load_model(name), "StatusCode.INVALID_ARGUMENT",
                "Model name cannot be empty. Please enter a valid name to deploy.")
    _raises(lambda: http.load_model(" .."), "400",
            "model name must not contain path traversal characters")
    for name in ["model123", "model.version1", "...", "..my_model", "model..1", "model....1"]:
        message = _raises(lambda: grpc.load_model(name), "StatusCode.INTERNAL",
                          "failed to poll from model repository")
        assert "path traversal" not in message
    for name in TRAVERSAL:      # an unload does not check the name
        try:
            grpc.unload_model(name)
        except InferenceServerException as e:
            assert "path traversal" not in e.message()
    assert server.model_ready("identity_fp32")


# ---- qa/L0_lifecycle/lifecycle_test.py ----------------------------------------------------------
def test_load_failures_and_unknown_models(server, repo, http, grpc):
    for client, status in ((http, "500"), (grpc, "StatusCode.INTERNAL")):
        _raises(lambda: client.load_model("unknown_model"), status,
                "failed to load 'unknown_model', failed to poll from model repository")
    # a model whose version directory lost its model file (test_model_control_fail)
    os.makedirs(os.path.join(repo, "no_model_file", "1"))
    with open(os.path.join(repo, "no_model_file", "config.pbtxt"), "w") as f:
        f.write('backend: "python"\nmax_batch_size: 1\n'
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
    for client, status in ((http, "400"), (http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
        _raises(lambda: client.load_model("no_model_file"), status,
                "load failed for model 'no_model_file'")
    for client, status in ((http, "404"), (grpc, "StatusCode.NOT_FOUND")):
        _raises(lambda: client.infer("no_model_file", _fp32s(
                    httpclient if client is http else grpcclient, ["INPUT0"])), status,
                "Request for unknown model: 'no_model_file' has no available versions")
        _raises(lambda: client.get_model_metadata("nope"), status,
                "Request for unknown model: 'nope' is not found")
        _raises(lambda: client.get_model_metadata("simple", "7"), status,
                "Request for unknown model: 'simple' version 7 is not found")


def test_load_and_unload_refused_outside_explicit_mode(repo):
    srv = Server(os.path.join(REPO_ROOT, "configs", "models"))
    try:
        with httpclient.InferenceServerClient(srv.url) as http, \
                grpcclient.InferenceServerClient(srv.grpc_url) as grpc:
            for client, status in ((http, "503"), (grpc, "StatusCode.UNAVAILABLE")):
                for call in (client.load_model, client.unload_model):
                    _raises(lambda: call("simple"), status,
                            "explicit model load / unload is not allowed if polling is enabled",
                            "the model control mode is 'none'")
    finally:
        srv.stop()
