"""Models of Triton's repeat and square backends (its QA repositories' repeat_int32 and
square_int32) streamed over gRPC with tritonclient, and one the repeat backend refuses."""
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from repo_builder import write_model
from serverproc import Server, wait_for

REPEAT = """
    backend: "repeat"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] },
            { name: "DELAY", data_type: TYPE_UINT32, dims: [ -1 ] },
            { name: "WAIT", data_type: TYPE_UINT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] },
             { name: "IDX", data_type: TYPE_UINT32, dims: [ 1 ] } ]
"""
SQUARE = """
    backend: "square"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
NOT_DECOUPLED = SQUARE.replace("model_transaction_policy { decoupled: true }", "")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("streams"))
    write_model(repo, "repeat_int32", REPEAT, None)
    write_model(repo, "square_int32", SQUARE, None)
    write_model(repo, "square_plain", NOT_DECOUPLED, None)
    srv = Server(repo, "--strict-readiness", "false")
    try:
        wait_for(lambda: srv.model_ready("repeat_int32") and srv.model_ready("square_int32"),
                 60, "the two stream models to load")
        yield srv
    finally:
        assert srv.stop() == 0


def _input(name, arr, dtype):
    i = grpcclient.InferInput(name, list(arr.shape), dtype)
    i.set_data_from_numpy(arr)
    return i


def _stream(server, model, inputs, request_id="1", final_error=False):
    """The responses of one streamed request, up to its FINAL flag (or its error, which ends a
    request that fails as a whole: tritonclient hands it over without the flag)."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    c.async_stream_infer(model, inputs, request_id=request_id,
                         enable_empty_final_response=True)
    out = []
    while True:
        result, error = got.get(timeout=30)
        if error is not None:
            out.append(error)
            if final_error:
                break
            continue
        final = result.get_response().parameters["triton_final_response"].bool_param
        if final and not result.get_response().outputs:
            break
        out.append(result)
    c.stop_stream()
    return out


def test_repeat_streams_its_input_element_by_element(server):
    values = np.array([7, -1, 3], np.int32)
    got = _stream(server, "repeat_int32", [
        _input("IN", values, "INT32"), _input("DELAY", np.array([1, 2, 1], np.uint32), "UINT32"),
        _input("WAIT", np.array([10], np.uint32), "UINT32")])
    assert [(r.as_numpy("OUT").tolist(), r.as_numpy("IDX").tolist()) for r in got] == \
        [([7], [0]), ([-1], [1]), ([3], [2])]


def test_repeat_with_in_and_delay_of_different_lengths_is_one_error(server):
    got = _stream(server, "repeat_int32", [
        _input("IN", np.array([1, 2], np.int32), "INT32"),
        _input("DELAY", np.array([1], np.uint32), "UINT32"),
        _input("WAIT", np.array([0], np.uint32), "UINT32")], final_error=True)
    assert len(got) == 1 and "expected IN and DELAY shape to match, got [2] and [1]" in str(got[0])


def test_square_sends_in_responses(server):
    got = _stream(server, "square_int32", [_input("IN", np.array([4], np.int32), "INT32")])
    assert [r.as_numpy("OUT").tolist() for r in got] == [[4]] * 4


def test_a_model_that_is_not_decoupled_answers_with_its_first_response(server):
    """As Triton (its gRPC state-cleanup test streams to a repeat model that is not
    decoupled): the first response is the answer, the later ones are dropped."""
    wait_for(lambda: server.model_ready("square_plain"), 60, "square_plain to load")
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        got = c.infer("square_plain", [_input("IN", np.array([3], np.int32), "INT32")])
        assert got.as_numpy("OUT").tolist() == [3]
        answers: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("square_plain", [_input("IN", np.array([4], np.int32), "INT32")],
                             request_id="7")
        result, error = answers.get(timeout=30)
        assert error is None and result.as_numpy("OUT").tolist() == [4]
        c.stop_stream()             # waits for the call to end: nothing else came
        assert answers.empty()
    finally:
        c.close()
    assert server.model_ready("square_int32")


def test_unload_lets_a_running_stream_finish(tmp_path):
    """Triton's rule for a model unloaded while a request runs: the request finishes first. A
    repeat model's responses come from a thread after execute() returned; the unload waits for
    them (finalize joins the threads) and only then is the model gone."""
    write_model(str(tmp_path), "repeat_int32", REPEAT, None)
    srv = Server(str(tmp_path), "--model-control-mode", "explicit", "--load-model",
                 "repeat_int32")
    try:
        got: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(srv.grpc_url)
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer("repeat_int32", [
            _input("IN", np.array([1, 2, 3], np.int32), "INT32"),
            _input("DELAY", np.array([0, 300, 300], np.uint32), "UINT32"),
            _input("WAIT", np.array([0], np.uint32), "UINT32")], enable_empty_final_response=True)
        first, error = got.get(timeout=30)
        assert error is None and first.as_numpy("OUT").tolist() == [1]
        grpcclient.InferenceServerClient(srv.grpc_url).unload_model("repeat_int32")
        rest = [got.get(timeout=30) for _ in range(3)]
        assert all(e is None for _, e in rest)
        assert [r.as_numpy("OUT").tolist() for r, _ in rest[:2]] == [[2], [3]]
        assert rest[2][0].get_response().parameters["triton_final_response"].bool_param
        c.stop_stream()
        wait_for(lambda: not srv.model_ready("repeat_int32"), 30, "the model to unload")
    finally:
        assert srv.stop() == 0
