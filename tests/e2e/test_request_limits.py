"""Limits on one request's tensors and messages, with the flags lowered so that small requests
reach them (issue 13): --max-request-tensor-bytes and int64 element counts (HTTP JSON, HTTP
binary, shared memory, gRPC), --http-max-json-elements for JSON inputs and JSON outputs,
--grpc-max-message-size both ways. A large output is delivered whole or refused with the limit
it passed, never cut."""
import socket

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from limit_models import write_limit_models
from serverproc import Server
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

TENSOR_BYTES = 4 << 20
JSON_ELEMENTS = 1000
GRPC_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("limits"))
    write_limit_models(repo)
    s = Server(repo, "--max-request-tensor-bytes", str(TENSOR_BYTES),
               "--http-max-json-elements", str(JSON_ELEMENTS),
               "--grpc-max-message-size", str(GRPC_MESSAGE))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(server.url, network_timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _post(server, model: str, doc: dict) -> requests.Response:
    return requests.post(f"{server.base}/v2/models/{model}/infer", json=doc, timeout=30)


def _refused(server, model: str, doc: dict, *words: str) -> str:
    r = _post(server, model, doc)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    for w in words:
        assert w in message, message
    return message


def _fp32(name: str, x: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


def _http_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def _grpc_error(call) -> InferenceServerException:
    return _http_error(call)


# ---- tensor bytes and element counts ------------------------------------------------------------
def test_tensor_bytes_by_shape_are_refused_before_anything_is_made(server):
    """The shape alone decides: 4 TiB declared with one element of JSON data, a shape whose
    product overflows int64, a dim past 64 bits."""
    doc = {"inputs": [{"name": "INPUT0", "shape": [1 << 40], "datatype": "FP32", "data": [1.0]}]}
    _refused(server, "ident", doc, "input 'INPUT0'", "--max-request-tensor-bytes",
             str(TENSOR_BYTES))
    doc["inputs"][0]["shape"] = [1 << 62, 8]
    _refused(server, "ident", doc, "invalid shape for input 'INPUT0'",
             "causes total element count to exceed maximum size of")
    doc["inputs"][0]["shape"] = [1 << 64]
    _refused(server, "ident", doc, "invalid shape for input 'INPUT0'",
             "contains one or more invalid dimensions")
    # BYTES: each element is at least its 4-byte length prefix
    doc = {"inputs": [{"name": "INPUT0", "shape": [1 << 21], "datatype": "BYTES",
                       "data": ["a"]}]}
    _refused(server, "ident_bytes", doc, "input 'INPUT0'", "--max-request-tensor-bytes")


def test_a_body_that_cannot_fit_the_limits_is_refused_before_it_is_received(server):
    """Its JSON part (--http-max-input-size, 64 MiB) and its tensors (--max-request-tensor-bytes)
    bound an /infer body: a larger Content-Length is a 413 at once, no slot made for it."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
                  % (100 << 20))
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-request-tensor-bytes" in answer


def test_tensor_bytes_add_up_over_the_inputs_http_binary(http):
    half = np.ones(600_000, dtype=np.float32)       # 2.4 MB each: one fits, two do not
    out = http.infer("ident", [_fp32("INPUT0", half)])
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), half)
    e = _http_error(lambda: http.infer("ident", [_fp32("INPUT0", half), _fp32("INPUT1", half)]))
    assert e.status() == "400" and "input 'INPUT1'" in e.message() and \
        "--max-request-tensor-bytes" in e.message()


def test_tensor_bytes_over_shared_memory(server, http):
    region = shm.create_shared_memory_region("limits_in", "/limits_in", 4096)
    try:
        http.register_system_shared_memory("limits_in", "/limits_in", 4096)
        for dtype, model in (("FP32", "ident"), ("BYTES", "ident_bytes")):
            inp = httpclient.InferInput("INPUT0", [1 << 31], dtype)
            inp.set_shared_memory("limits_in", 4096)
            e = _http_error(lambda: http.infer(model, [inp]))
            assert e.status() == "400" and "input 'INPUT0'" in e.message() and \
                "--max-request-tensor-bytes" in e.message(), e.message()
    finally:
        http.unregister_system_shared_memory("limits_in")
        shm.destroy_shared_memory_region(region)


def test_tensor_bytes_and_overflow_over_grpc(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for shape, words in (([1 << 21], "--max-request-tensor-bytes"),
                             ([1 << 62, 4], "causes total element count to exceed"),
                             ([4, (1 << 60) + 2], "byte size overflow for input 'INPUT0'")):
            req = pb.ModelInferRequest(model_name="ident")
            req.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
            req.raw_input_contents.append(b"\0" * 4)
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "input 'INPUT0'" in e.value.details() and words in e.value.details()


# ---- JSON elements ------------------------------------------------------------------------------
def test_json_input_elements(server):
    def doc(*sizes):
        return {"inputs": [{"name": f"INPUT{i}", "shape": [n], "datatype": "FP32",
                            "data": [1.0] * n} for i, n in enumerate(sizes)],
                "parameters": {"binary_data_output": True}}
    assert _post(server, "ident", doc(JSON_ELEMENTS)).status_code == 200
    _refused(server, "ident", doc(JSON_ELEMENTS + 1), "input 'INPUT0'", "--http-max-json-elements",
             "binary")
    _refused(server, "ident", doc(600, 600), "input 'INPUT1'", "--http-max-json-elements")


def test_json_output_past_the_limit_asks_for_binary(http):
    x = np.arange(JSON_ELEMENTS + 500, dtype=np.float32)
    e = _http_error(lambda: http.infer("ident", [_fp32("INPUT0", x)], outputs=[
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]))
    assert e.status() == "400", e.message()
    assert "output 'OUTPUT0'" in e.message() and "--http-max-json-elements" in e.message() and \
        "'binary_data'" in e.message()
    out = http.infer("ident", [_fp32("INPUT0", x)], outputs=[
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x)
    small = np.arange(JSON_ELEMENTS, dtype=np.float32)
    out = http.infer("ident", [_fp32("INPUT0", small)], outputs=[
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), small)


def test_json_output_of_fixed_dims_is_refused_before_the_model_runs(server):
    doc = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "INT32", "data": [1]}]}
    _refused(server, "fixed_out", doc, "output 'OUT'", "2000 elements", "'binary_data'")
    stats = requests.get(f"{server.base}/v2/models/fixed_out/stats", timeout=30).json()
    assert stats["model_stats"][0]["execution_count"] == 0
    doc["outputs"] = [{"name": "OUT", "parameters": {"binary_data": True}}]
    r = _post(server, "fixed_out", doc)
    assert r.status_code == 200


# ---- message size and large outputs -------------------------------------------------------------
def _size_input(n: int, client=httpclient):
    inp = client.InferInput("SIZE", [1], "INT32")
    inp.set_data_from_numpy(np.array([n], dtype=np.int32))
    return inp


def test_a_large_binary_output_arrives_whole_over_http(http):
    n = 24 << 20
    out = http.infer("sized", [_size_input(n)], outputs=[
        httpclient.InferRequestedOutput("OUT", binary_data=True)]).as_numpy("OUT")
    assert out.shape == (n,) and int(out[0]) == int(out[-1]) == n % 251 and \
        int(np.count_nonzero(out != n % 251)) == 0


def test_grpc_messages_past_the_limit_are_resource_exhausted(grpc_client):
    big = np.zeros(GRPC_MESSAGE // 4 + 1024, dtype=np.float32)       # a request past it
    inp = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
    inp.set_data_from_numpy(big)
    e = _grpc_error(lambda: grpc_client.infer("ident", [inp]))
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED", e
    # an answer past it: refused whole, with the limit, never cut
    e = _grpc_error(lambda: grpc_client.infer("sized", [_size_input(2 << 20, grpcclient)]))
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED", e
    assert "--grpc-max-message-size" in e.message() and str(GRPC_MESSAGE) in e.message()
    out = grpc_client.infer("sized", [_size_input(1000, grpcclient)]).as_numpy("OUT")
    assert out.shape == (1000,)


def test_grpc_stream_answer_past_the_limit_is_an_error_on_the_stream(server):
    def req(i: int, n: int) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="sized", id=str(i))
        r.inputs.add(name="SIZE", datatype="INT32", shape=[1])
        r.raw_input_contents.append(np.array([n], dtype=np.int32).tobytes())
        return r
    with grpc.insecure_channel(server.grpc_url) as channel:
        stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([req(0, 10), req(1, 2 << 20), req(2, 20)]), timeout=60)
        answers = list(stream)
    assert [a.infer_response.id for a in answers] == ["0", "1", "2"]
    assert not answers[0].error_message and not answers[2].error_message
    assert "--grpc-max-message-size" in answers[1].error_message
    assert len(answers[2].infer_response.raw_output_contents[0]) == 20



def test_hostile_stream_messages_are_errors_on_the_stream(server):
    """One stream carrying what a hostile client sends: each gets its error on the stream, in
    order, the stream stays open for the good request at the end, and the server serves on."""
    def msg(i: int, model: str = "ident", dtype: str = "FP32", shape=(4,), raw=(b"\0" * 16,),
            version: str = "") -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name=model, model_version=version, id=str(i))
        r.inputs.add(name="INPUT0", datatype=dtype, shape=list(shape))
        r.raw_input_contents.extend(raw)
        return r
    reserved = msg(7)
    reserved.parameters["triton_evil"].string_param = "[" * 100_000
    many = msg(8)
    for k in range(2000):
        many.inputs.add(name=f"X{k}", datatype="FP32", shape=[1])
    hostile = [msg(0, model="no_such_model"), msg(1, version="99999999999999999999999"),
               msg(2, dtype="FP99"), msg(3, shape=(1 << 62, 4)), msg(4, shape=(1 << 21,)),
               msg(5, raw=()), msg(6, raw=(b"\0" * 15,)), reserved, many]
    good = msg(len(hostile))
    with grpc.insecure_channel(server.grpc_url) as channel:
        answers = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([*hostile, good]), timeout=60))
    assert [a.infer_response.id for a in answers] == [str(i) for i in range(len(hostile) + 1)]
    for a in answers[:-1]:
        assert a.error_message, a
    assert not answers[-1].error_message
    assert answers[-1].infer_response.raw_output_contents[0] == b"\0" * 16
    assert requests.get(f"{server.base}/v2/health/ready", timeout=30).status_code == 200
