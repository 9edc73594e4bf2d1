"""ModelStreamInfer errors with and without the ``triton_grpc_error: true`` header, against a
real server: by default a failed answer is a message and the stream stays open; with the header
it ends the stream with its gRPC status, after the answers before it. A request refused before
it runs (an unknown model) stays a message either way, as in Triton."""
import queue
import textwrap

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from repo_builder import write_model
from serverproc import Server
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

PICKY = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                if x[0] == -1:
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "minus one is refused", pb_utils.TritonError.INVALID_ARG)))
                    continue
                if x[0] == -2:
                    raise RuntimeError("minus two breaks the model")
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')

ERROR_MODE = {"triton_grpc_error": "true"}
WAIT_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("stream_errors"))
    write_model(repo, "picky", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    ''', PICKY)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _inputs(value: int):
    inp = grpcclient.InferInput("INPUT0", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], dtype=np.int32))
    return [inp]


class _Stream:
    """A tritonclient stream whose callbacks land in a queue."""

    def __init__(self, server, headers=None):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)),
                                 headers=headers)

    def send(self, value: int, model: str = "picky", request_id: str = ""):
        self.client.async_stream_infer(model, _inputs(value), request_id=request_id)

    def next(self):
        return self.got.get(timeout=WAIT_S)

    def value(self) -> int:
        result, error = self.next()
        assert error is None, error
        return int(result.as_numpy("OUTPUT0")[0])

    def close(self):
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def test_without_the_header_an_error_is_a_message_and_the_stream_stays_open(server):
    s = _Stream(server)
    try:
        s.send(7)
        assert s.value() == 7
        s.send(-1, request_id="bad")
        result, error = s.next()
        assert result is None and "minus one is refused" in error.message()
        s.send(-2)
        result, error = s.next()
        assert result is None and "minus two breaks the model" in error.message()
        s.send(8)                               # still open
        assert s.value() == 8
    finally:
        s.close()


def test_with_the_header_a_failed_answer_ends_the_stream_with_its_status(server):
    s = _Stream(server, ERROR_MODE)
    try:
        s.send(7)
        assert s.value() == 7
        s.send(-1)
        result, error = s.next()
        assert result is None
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        assert "minus one is refused" in error.message()
        with pytest.raises(InferenceServerException, match="no longer in valid state"):
            s.send(8)                           # the stream is closed
    finally:
        s.close()


def test_with_the_header_a_model_exception_ends_the_stream_as_internal(server):
    s = _Stream(server, ERROR_MODE)
    try:
        s.send(-2)
        result, error = s.next()
        assert result is None and error.status() == "StatusCode.INTERNAL"
        assert "minus two breaks the model" in error.message()
    finally:
        s.close()


def test_with_the_header_a_refused_request_stays_a_message(server):
    """Triton ends the stream only for an answer that failed; a request refused when it is
    enqueued (here an unknown model) is answered with error_message, and the stream goes on."""
    s = _Stream(server, ERROR_MODE)
    try:
        s.send(1, model="no_such_model")
        result, error = s.next()
        assert result is None and "no_such_model" in error.message()
        s.send(9)
        assert s.value() == 9
    finally:
        s.close()


@pytest.mark.parametrize("metadata", [(), (("triton_grpc_error", "true"),)], ids=["default", "header"])
def test_a_refused_request_is_answered_with_its_id_only(server, metadata):
    """As Triton 2.51 answers it: error_message, and an infer_response that holds only the id
    (no model name, no triton_final_response); a failed execution holds more (above)."""
    bad = service_pb2.ModelInferRequest(model_name="no_such_model", id="r1")
    bad.inputs.add(name="INPUT0", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    with grpc.insecure_channel(server.grpc_url) as ch:
        responses = list(service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(
            iter([bad]), metadata=metadata, timeout=WAIT_S))
    assert len(responses) == 1
    assert responses[0].error_message == "Request for unknown model: 'no_such_model' is not found"
    assert responses[0].infer_response == service_pb2.ModelInferResponse(id="r1")


def test_raw_stream_answers_before_the_error_then_the_status(server):
    """In order: the answers to the requests before the failed one, then the status; what
    the client sent after it is not answered."""
    def request(value: int, rid: str):
        r = service_pb2.ModelInferRequest(model_name="picky", id=rid)
        t = r.inputs.add(name="INPUT0", datatype="INT32", shape=[1])
        t.contents.int_contents.append(value)
        return r

    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        call = stub.ModelStreamInfer(
            iter([request(1, "a"), request(2, "b"), request(-1, "c"), request(3, "d")]),
            metadata=(("triton_grpc_error", "true"),), timeout=WAIT_S)
        ids = []
        with pytest.raises(grpc.RpcError) as e:
            for response in call:
                assert not response.error_message
                ids.append(response.infer_response.id)
        assert ids == ["a", "b"]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "minus one is refused" in e.value.details()


@pytest.mark.parametrize("value", ["True", "1", "false"])
def test_only_the_value_true_turns_the_mode_on(server, value):
    """Triton compares the header's value with "true" exactly."""
    s = _Stream(server, {"triton_grpc_error": value})
    try:
        s.send(-1)
        result, error = s.next()
        assert result is None and "minus one is refused" in error.message()
        s.send(4)
        assert s.value() == 4
    finally:
        s.close()
