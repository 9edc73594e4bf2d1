"""--http-header-forward-pattern / --grpc-header-forward-pattern against a real server: headers
and metadata whose names match reach a python model as string parameters (infer, generate,
the gRPC stream), a reserved one is refused naming it, and without a pattern nothing is
forwarded."""
import json
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server
from tritonclient.utils import InferenceServerException

ECHO = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "PARAMS", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""
CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "PARAMS", np.array([r.parameters()], dtype=object))]) for r in requests]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("forward") / "models")
    write_model(r, "echo", ECHO, CODE)
    return r


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, "--http-header-forward-pattern", "^x-",
               "--grpc-header-forward-pattern", "(?-i)^tenant")
    yield s
    s.stop()


def params_of(result) -> dict:
    return json.loads(result.as_numpy("PARAMS")[0])


def echo_input(mod):
    x = mod.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    return x


def test_matching_http_headers_become_parameters(server):
    c = httpclient.InferenceServerClient(server.url)
    res = c.infer("echo", [echo_input(httpclient)], parameters={"mine": 1},
                  headers={"X-Tenant": "acme", "x-trace": "t1", "Other": "no"})
    assert params_of(res) == {"mine": 1, "X-Tenant": "acme", "x-trace": "t1"}


def test_generate_forwards_them_too(server):
    r = requests.post(f"{server.base}/v2/models/echo/generate", json={"INPUT0": [1.0]},
                      headers={"X-Tenant": "acme"}, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["PARAMS"])["X-Tenant"] == "acme"


def test_matching_grpc_metadata_becomes_parameters_on_calls_and_streams(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    # the gRPC pattern matches with case: metadata keys are lower case on the wire
    res = c.infer("echo", [echo_input(grpcclient)], headers={"tenant": "acme", "x-trace": "t"})
    assert params_of(res) == {"tenant": "acme"}
    answers: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)),
                   headers={"tenant-id": "7"})
    c.async_stream_infer("echo", [echo_input(grpcclient)])
    result, error = answers.get(timeout=30)
    c.stop_stream()
    assert error is None and params_of(result) == {"tenant-id": "7"}
    # quotes, a backslash and a trailing space (RFC 9113 frowns on it; gRPC sends it and
    # Triton takes it): passed on as it came
    value = 'This is a "quoted" string with a backslash\\ '
    res = c.infer("echo", [echo_input(grpcclient)], headers={"tenant": value})
    assert params_of(res) == {"tenant": value}


def test_reserved_names_are_refused_and_the_server_serves_on(repo):
    s = Server(repo, "--http-header-forward-pattern", ".*", "--grpc-header-forward-pattern",
               "^(priority|tenant)$")
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        r = requests.post(f"{s.base}/v2/models/echo/infer", headers={"priority": "5"},
                          json=body, timeout=30)
        assert r.status_code == 400
        assert r.json() == {"error": "Header 'priority' is reserved for Triton usage and "
                                     "cannot be forwarded."}
        g = grpcclient.InferenceServerClient(s.grpc_url)
        with pytest.raises(InferenceServerException) as e:
            g.infer("echo", [echo_input(grpcclient)], headers={"tenant": "a", "priority": "1"})
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "Header 'priority' is reserved for Triton usage" in e.value.message()
        assert params_of(g.infer("echo", [echo_input(grpcclient)],
                                 headers={"tenant": "a"})) == {"tenant": "a"}
        r = requests.post(f"{s.base}/v2/models/echo/infer", headers={"X-Ok": "1"},
                          json=body, timeout=30)
        assert r.status_code == 200
    finally:
        s.stop()


def test_without_a_pattern_nothing_is_forwarded(repo):
    s = Server(repo)
    try:
        c = httpclient.InferenceServerClient(s.url)
        res = c.infer("echo", [echo_input(httpclient)], headers={"X-Tenant": "acme"})
        assert params_of(res) == {}
    finally:
        s.stop()
