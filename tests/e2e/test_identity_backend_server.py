"""Models of Triton's identity backend served end to end: the example repository's
custom_identity_int32 over HTTP and gRPC, a QA-style model with an optional input and several
instances, and configs the backend refuses (their load fails with its words; the rest serve)."""
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for

QA_IDENTITY = """
    name: "qa_identity"
    backend: "identity"
    max_batch_size: 8
    dynamic_batching { max_queue_delay_microseconds: 500 }
    instance_group [ { count: 2, kind: KIND_CPU } ]
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] },
            { name: "INPUT1", data_type: TYPE_STRING, dims: [ -1 ], optional: true } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] },
             { name: "OUTPUT1", data_type: TYPE_STRING, dims: [ -1 ] } ]
    parameters { key: "execute_delay_ms" value { string_value: "1" } }
"""
BAD_PAIRS = """
    backend: "identity"
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 2 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_INT64, dims: [ 2 ] } ]
"""
EXAMPLE_PARAMETERS = {"param0": "an example string parameter", "param1": 42, "param2": False,
                      "param3": 123.123}


@pytest.fixture(scope="module")
def server(tmp_path_factory, example_repo):
    repo = str(tmp_path_factory.mktemp("identity"))
    write_model(repo, "qa_identity", QA_IDENTITY, None)
    write_model(repo, "bad_identity", BAD_PAIRS, None)
    srv = Server([example_repo, repo], "--strict-readiness", "false")
    try:
        wait_for(lambda: srv.model_ready("qa_identity"), 60, "qa_identity to load")
        yield srv
    finally:
        assert srv.stop() == 0


def test_custom_identity_int32_answers_its_input_over_http_and_grpc(server):
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    h = httpclient.InferenceServerClient(server.url)
    i = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    i.set_data_from_numpy(data)
    res = h.infer("custom_identity_int32", [i], outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), data)
    assert res.get_response()["parameters"] == EXAMPLE_PARAMETERS

    g = grpcclient.InferenceServerClient(server.grpc_url)
    gi = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    gi.set_data_from_numpy(data)
    gres = g.infer("custom_identity_int32", [gi])
    np.testing.assert_array_equal(gres.as_numpy("OUTPUT0"), data)
    params = gres.get_response().parameters
    assert params["param0"].string_param == "an example string parameter"
    assert params["param1"].int64_param == 42 and params["param2"].bool_param is False
    assert params["param3"].double_param == pytest.approx(123.123)
    meta = h.get_model_metadata("custom_identity_int32")
    assert meta["platform"] == "identity"
    assert h.get_model_config("custom_identity_int32")["backend"] == "identity"


def test_input_bytes_are_counted_in_the_backends_metric(server):
    h = httpclient.InferenceServerClient(server.url)
    i = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    i.set_data_from_numpy(np.zeros((1, 16), np.int32))
    for _ in range(3):
        h.infer("custom_identity_int32", [i])

    def counted():
        text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text
        line = [x for x in text.splitlines() if x.startswith(
            'input_byte_size_counter{model="custom_identity_int32",version="1"}')]
        return line and float(line[0].split()[-1]) >= 3 * 64
    wait_for(counted, 30, "the input byte counter to reach 3 x 64 bytes")


def test_an_absent_optional_input_comes_back_as_zeros(server):
    h = httpclient.InferenceServerClient(server.url)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    i = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    i.set_data_from_numpy(x)
    res = h.infer("qa_identity", [i])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), x)
    assert res.as_numpy("OUTPUT1").tolist() == [[b""], [b""]]
    s = httpclient.InferInput("INPUT1", [2, 2], "BYTES")
    s.set_data_from_numpy(np.array([[b"a", b"bc"], [b"", b"d"]], dtype=object))
    res = h.infer("qa_identity", [i, s], outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert res.as_numpy("OUTPUT1").tolist() == [[b"a", b"bc"], [b"", b"d"]]
    assert res.as_numpy("OUTPUT0") is None


def test_concurrent_requests_batch_over_both_instances(server):
    g = grpcclient.InferenceServerClient(server.grpc_url)
    x = np.ones((1, 4), np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    results = []
    for _ in range(24):
        g.async_infer("qa_identity", [inp], lambda result, error: results.append((result, error)))
    wait_for(lambda: len(results) == 24, 30, "24 answers")
    assert all(e is None and np.array_equal(r.as_numpy("OUTPUT0"), x) for r, e in results)
    stats = g.get_inference_statistics("qa_identity", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 24


def test_a_config_the_backend_refuses_fails_its_load_and_the_rest_serve(server):
    idx = {e["name"]: e for e in
           requests.post(f"{server.base}/v2/repository/index", timeout=10).json()}
    assert idx["bad_identity"]["state"] == "UNAVAILABLE"
    assert "expected input and output datatype to match, got TYPE_INT32 and TYPE_INT64" in \
        idx["bad_identity"]["reason"]
    assert server.model_ready("custom_identity_int32") and server.model_ready("qa_identity")
