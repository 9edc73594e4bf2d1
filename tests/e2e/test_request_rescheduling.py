"""Request rescheduling (python backend, sequence_batching { iterative_sequence: true }): a
request released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE runs again, a decoupled one
streaming a response per step, a plain one answering once when it is not rescheduled; without
iterative_sequence the request fails with the reason. No sequence id is needed."""
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server
from tritonclient.utils import InferenceServerException

COUNTDOWN = """
name: "countdown"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
model_transaction_policy { decoupled: true }
"""
# each execution of a request sends how many steps are left; the last ends the stream
COUNTDOWN_CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.left = {}

    def execute(self, requests):
        for r in requests:
            key = id(r)
            if key not in self.left:
                self.left[key] = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            self.left[key] -= 1
            out = pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([self.left[key]], np.int32))])
            sender = r.get_response_sender()
            if self.left[key] <= 0:
                del self.left[key]
                sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(out)
        return None
"""
# reschedules its request, then fails: the failure ends the request (no endless re-runs)
FAILING_CODE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        raise ValueError("failed after rescheduling")
"""
# reschedules every request but returns a response for it, not None: the request fails with
# Triton's words (and is not run again for ever)
WRONG_RETURN_CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            out.append(pb_utils.InferenceResponse([]))
        return out
"""
ADDSUB = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }},
        {{ name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }},
         {{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 4 ] }},
         {{ name: "RUNS", data_type: TYPE_INT32, dims: [ 1 ] }} ]
{extra}
"""
# every request is rescheduled once (None in its place), then answered
ADDSUB_CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}

    def execute(self, requests):
        out = []
        for r in requests:
            n = self.runs[id(r)] = self.runs.get(id(r), 0) + 1
            if n == 1:
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                out.append(None)
                continue
            del self.runs[id(r)]
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b),
                pb_utils.Tensor("RUNS", np.array([n], np.int32))]))
        return out
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("resched") / "models")
    write_model(r, "countdown", COUNTDOWN, COUNTDOWN_CODE)
    write_model(r, "failing", COUNTDOWN.replace('"countdown"', '"failing"'), FAILING_CODE)
    write_model(r, "addsub", ADDSUB.format(name="addsub",
                                           extra="sequence_batching { iterative_sequence: true }"),
                ADDSUB_CODE)
    write_model(r, "not_iterative", ADDSUB.format(name="not_iterative", extra=""), ADDSUB_CODE)
    write_model(r, "wrong_return", ADDSUB.format(
        name="wrong_return", extra="sequence_batching { iterative_sequence: true }"),
        WRONG_RETURN_CODE)
    s = Server(r)
    yield s
    s.stop()


def stream(server, model: str, value: int, answers: int) -> list[tuple]:
    """One request on a gRPC stream (no sequence id: each request is a sequence of its own);
    its first ``answers`` (result, error) pairs."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    x = grpcclient.InferInput("IN", [1], "INT32")
    x.set_data_from_numpy(np.array([value], np.int32))
    c.async_stream_infer(model, [x])
    out = [got.get(timeout=60) for _ in range(answers)]
    c.stop_stream()
    return out


def test_a_decoupled_request_streams_one_response_per_step(server):
    answers = stream(server, "countdown", 3, 3)
    assert [e for _, e in answers] == [None] * 3
    assert [int(r.as_numpy("OUT")[0]) for r, _ in answers] == [2, 1, 0]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_plain_request_is_answered_after_its_rescheduled_run(server, protocol):
    mod = httpclient if protocol == "http" else grpcclient
    c = httpclient.InferenceServerClient(server.url) if protocol == "http" else \
        grpcclient.InferenceServerClient(server.grpc_url)
    a = np.random.default_rng().standard_normal(4).astype(np.float32)
    b = np.random.default_rng().standard_normal(4).astype(np.float32)
    inputs = []
    for name, v in (("INPUT0", a), ("INPUT1", b)):
        i = mod.InferInput(name, [4], "FP32")
        i.set_data_from_numpy(v)
        inputs.append(i)
    res = c.infer("addsub", inputs)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    assert int(res.as_numpy("RUNS")[0]) == 2        # its second execution answered it


def _ones(client_module) -> list:
    """INPUT0 and INPUT1 of the addsub models, four ones each."""
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = client_module.InferInput(name, [4], "FP32")
        i.set_data_from_numpy(np.ones(4, np.float32))
        inputs.append(i)
    return inputs


def test_without_iterative_sequence_a_rescheduled_request_fails(server):
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as e:
        c.infer("not_iterative", _ones(httpclient))
    assert "rescheduled a request, which needs sequence_batching { iterative_sequence: " \
           "true }" in str(e.value)


def test_a_rescheduled_request_with_a_response_returned_for_it_fails(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        c.infer("wrong_return", _ones(grpcclient), client_timeout=60)
    assert "Expected a None object in the execute function return list for reschduled " \
           "request" in str(e.value)


def test_a_request_that_fails_after_rescheduling_ends_with_its_error(server):
    ((result, error),) = stream(server, "failing", 3, 1)
    assert result is None and "failed after rescheduling" in str(error)
    # the worker is free again: another model's request on the server is answered
    ((result, error),) = stream(server, "countdown", 1, 1)
    assert error is None and int(result.as_numpy("OUT")[0]) == 0
