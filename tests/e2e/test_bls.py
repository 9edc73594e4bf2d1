"""BLS (issue 16): a python model's own requests to other models, through the scheduler like any
request: exec(), async_exec(), exec(decoupled=True), errors as response.has_error(), timeouts,
and a model that calls itself refused instead of deadlocking."""
import os
import shutil
import textwrap
import threading

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import REPO_ROOT, Server, model_sleeping, wait_for

CALLER = textwrap.dedent('''
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.name = args["model_name"]

        def execute(self, requests):
            out = []
            for r in requests:
                p = json.loads(r.parameters())
                x = pb_utils.get_input_tensor_by_name(r, "IN")
                target = p.get("target", "adder")
                if target == "self":
                    target = self.name
                bls = pb_utils.InferenceRequest(
                    model_name=target, requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x.as_numpy())],
                    timeout=int(p.get("timeout_us", 0)),
                    parameters={"delay_ms": int(p.get("delay_ms", 0))})
                if p.get("depth", 0) > 0 and target == self.name:
                    bls = pb_utils.InferenceRequest(model_name=target, requested_output_names=["OUT"],
                        inputs=[pb_utils.Tensor("IN", x.as_numpy())], parameters={"depth": 0})
                resp = bls.exec()
                if resp.has_error():
                    text = np.array([resp.error().message().encode()], dtype=np.object_)
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("ERR", text),
                        pb_utils.Tensor("OUT", np.zeros(1, np.int32))]))
                    continue
                y = pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y * 10),
                    pb_utils.Tensor("ERR", np.array([b""], dtype=np.object_))]))
            return out
''')

ADDER = textwrap.dedent('''
    import json, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                time.sleep(json.loads(r.parameters()).get("delay_ms", 0) / 1000.0)
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
            return out
''')

ASYNC_CALLER = textwrap.dedent('''
    import asyncio
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        async def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                calls = [pb_utils.InferenceRequest(model_name="adder", requested_output_names=["OUT"],
                         inputs=[pb_utils.Tensor("IN", x + i)]).async_exec() for i in range(3)]
                answers = await asyncio.gather(*calls)
                total = sum(pb_utils.get_output_tensor_by_name(a, "OUT").as_numpy() for a in answers)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", total.astype(np.int32))]))
            return out
''')

STREAM_CALLER = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                bls = pb_utils.InferenceRequest(model_name="repeat_int32",
                    requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x), pb_utils.Tensor("DELAY", np.zeros(len(x), np.uint32)),
                            pb_utils.Tensor("WAIT", np.zeros(1, np.uint32))])
                got, empty = [], 0
                for resp in bls.exec(decoupled=True):
                    if resp.has_error():
                        raise pb_utils.TritonModelException(resp.error().message())
                    if resp.output_tensors():
                        got.append(int(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0]))
                    else:
                        empty += 1
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array(got + [-empty], np.int32))]))
            return out
''')

# decoupled: sends IN[0] every 20 ms from execute() until its request is cancelled (then an
# error with code CANCELLED, as Triton's response_sender_until_cancelled), at most 200 times
UNTIL_CANCELLED = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        r = requests[0]
        x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[:1]
        sender = r.get_response_sender()
        for _ in range(200):
            if r.is_cancelled():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "request has been cancelled", pb_utils.TritonError.CANCELLED)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            time.sleep(0.02)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
# sums the stream of until_cancelled and cancels it once the sum reaches 10: OUT is
# [sum, responses, cancelled]
CANCELLER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            stream = pb_utils.InferenceRequest(
                model_name="until_cancelled", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec(decoupled=True)
            total, n, cancelled = 0, 0, 0
            for resp in stream:
                if resp.has_error():
                    cancelled = int(resp.error().code() == pb_utils.TritonError.CANCELLED)
                    break
                if not resp.output_tensors():
                    break
                total += int(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0])
                n += 1
                if total >= 10:
                    stream.cancel()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([total, n, cancelled], np.int32))]))
        return out
"""
IO = '''
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ -1 ] } ]
'''
CALLER_IO = '''
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ -1 ] },
             { name: "ERR", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("bls"))
    shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", "repeat_int32"),
                    os.path.join(repo, "repeat_int32"))
    write_model(repo, "adder", 'backend: "python"\nmax_batch_size: 0\n' + IO, ADDER)
    write_model(repo, "caller", 'backend: "python"\nmax_batch_size: 0\n' + CALLER_IO, CALLER)
    write_model(repo, "async_caller", 'backend: "python"\nmax_batch_size: 0\n' + IO, ASYNC_CALLER)
    write_model(repo, "stream_caller", 'backend: "python"\nmax_batch_size: 0\n' + IO,
                STREAM_CALLER)
    write_model(repo, "until_cancelled", 'backend: "python"\nmax_batch_size: 0\n'
                'model_transaction_policy { decoupled: true }\n' + IO, UNTIL_CANCELLED)
    write_model(repo, "canceller", 'backend: "python"\nmax_batch_size: 0\n' + IO, CANCELLER)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _call(srv, model, values, **params):
    c = httpclient.InferenceServerClient(srv.url)
    i = httpclient.InferInput("IN", [len(values)], "INT32")
    i.set_data_from_numpy(np.array(values, dtype=np.int32))
    return c.infer(model, [i], parameters=params or None)


def _err(result) -> str:
    return result.as_numpy("ERR")[0].decode()


def test_exec_runs_another_model_through_the_scheduler(srv):
    r = _call(srv, "caller", [1, 2, 3])
    assert _err(r) == ""
    assert r.as_numpy("OUT").tolist() == [20, 30, 40]
    stats = requests.get(f"{srv.base}/v2/models/adder/stats", timeout=10).json()
    assert stats["model_stats"][0]["inference_count"] >= 1     # counted like any request


def test_async_exec_gathers(srv):
    assert _call(srv, "async_caller", [1, 1]).as_numpy("OUT").tolist() == [9, 9]


def test_exec_decoupled_iterates_the_responses(srv):
    # the FINAL flag alone arrives as a last, empty response (counted as -1 here)
    assert _call(srv, "stream_caller", [5, 6, 7]).as_numpy("OUT").tolist() == [5, 6, 7, -1]


def test_errors_come_back_as_responses(srv):
    assert "Request for unknown model: 'nothing' is not found" in \
        _err(_call(srv, "caller", [1], target="nothing"))
    # the same checks as a client's request: repeat_int32 needs DELAY and WAIT too
    assert "expected 3 inputs but got 1 inputs for model 'repeat_int32'" in \
        _err(_call(srv, "caller", [1], target="repeat_int32"))


def test_a_model_calling_itself_is_refused_not_deadlocked(srv):
    text = _err(_call(srv, "caller", [1], target="self"))
    assert "BLS request for model 'caller' refused" in text and "deadlock" in text
    assert _call(srv, "caller", [4]).as_numpy("OUT").tolist() == [50]     # still serving


def test_outside_a_server_exec_is_an_error():
    from shmserve.workers.python_backend import pb_utils
    with pytest.raises(pb_utils.TritonModelException, match="BLS requests can only be made"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[]).exec()


def test_a_bls_timeout_ends_the_request_while_it_waits(srv):
    """timeout (µs) counts while the request is queued, as a client's: with 'adder' busy on a
    slow request, a BLS request with a short timeout gets Triton's 'Request timeout expired'."""
    slow = threading.Thread(target=lambda: _call(srv, "adder", [1], delay_ms=1500))
    slow.start()
    try:
        wait_for(lambda: model_sleeping(srv, "adder"), 20, "adder to run the slow request")
        text = _err(_call(srv, "caller", [1], timeout_us=100_000))
        assert "Request timeout expired" in text
    finally:
        slow.join(30)


def test_a_decoupled_bls_stream_is_cancelled_by_its_iterator(srv):
    """Triton's ResponseIterator.cancel(): the model answering sees is_cancelled() and ends
    its stream with CANCELLED; the caller stops early (well before 200 responses)."""
    total, n, cancelled = _call(srv, "canceller", [2]).as_numpy("OUT").tolist()
    assert cancelled == 1 and total >= 10 and n < 200
