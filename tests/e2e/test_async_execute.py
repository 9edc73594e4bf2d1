"""Python models with ``async def execute`` on the worker's one event loop (workers/python_backend/model_loop.py):
a decoupled model's executions overlap on one instance, a task the model starts outlives the
execute() that started it, and an exception after the answers is logged."""
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from repo_builder import write_model
from serverproc import Server, wait_for

CONFIG = """
    backend: "python"
    max_batch_size: 0
    {decoupled}
    input [ {{ name: "WAIT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
    output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
"""
# waits WAIT seconds, then answers; a negative WAIT raises
DECOUPLED = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for r in requests:
            w = float(pb_utils.get_input_tensor_by_name(r, "WAIT").as_numpy()[0])
            if w < 0:
                raise ValueError("wait_secs cannot be negative")
            await asyncio.sleep(w)
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([w], np.float32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
# answers at once, then sends the FINAL flag from a task that runs after execute() returned
LATER = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([1.0], np.float32))]))

            async def finish(sender=sender):
                await asyncio.sleep(0.2)
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([2.0], np.float32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            asyncio.get_running_loop().create_task(finish())
        return None
"""
# not decoupled: the instance runs one execute() at a time, each to its end
PLAIN = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "WAIT").as_numpy())]) for r in requests]
"""

# answers only once WAIT requests are in it at the same time (or fails after 30 s): a test of
# concurrency that does not depend on how fast the machine is
GATHER = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.inside, self.all_in = 0, None

    async def execute(self, requests):
        if self.all_in is None:
            self.all_in = asyncio.Event()
        for r in requests:
            want = float(pb_utils.get_input_tensor_by_name(r, "WAIT").as_numpy()[0])
            self.inside += 1
            if self.inside >= want:
                self.all_in.set()
            try:
                await asyncio.wait_for(self.all_in.wait(), 30)
                answer = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([want], np.float32))])
            except asyncio.TimeoutError:
                answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"only {self.inside} request(s) came together"))
            r.get_response_sender().send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
# Triton's async_execute_decouple_bls: awaits a decoupled BLS call per request, then passes
# its responses on
BLS_GATHER = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def one(self, request):
        wait = pb_utils.get_input_tensor_by_name(request, "WAIT")
        responses = await pb_utils.InferenceRequest(
            model_name="gather", inputs=[wait], requested_output_names=["OUT"]).async_exec(
            decoupled=True)
        sender = request.get_response_sender()
        for response in responses:
            if response.has_error():
                sender.send(response)
            elif pb_utils.get_output_tensor_by_name(response, "OUT") is not None:
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.get_output_tensor_by_name(response, "OUT")]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def execute(self, requests):
        await asyncio.gather(*(self.one(r) for r in requests))
        return None
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("async_models"))
    decoupled = "model_transaction_policy { decoupled: true }"
    write_model(repo, "overlap", CONFIG.format(decoupled=decoupled), DECOUPLED)
    write_model(repo, "later", CONFIG.format(decoupled=decoupled), LATER)
    write_model(repo, "plain", CONFIG.format(decoupled=""), PLAIN)
    write_model(repo, "gather", CONFIG.format(decoupled=decoupled), GATHER)
    write_model(repo, "bls_gather", CONFIG.format(decoupled=decoupled), BLS_GATHER)
    srv = Server(repo)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def _wait(value):
    x = grpcclient.InferInput("WAIT", [1], "FP32")
    x.set_data_from_numpy(np.array([value], np.float32))
    return [x]


def _stream(server, model, waits, answers):
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((time.monotonic(), result, error)))
    t0 = time.monotonic()
    for i, w in enumerate(waits):
        c.async_stream_infer(model, _wait(w), request_id=str(i))
    out = [got.get(timeout=60) for _ in range(answers)]
    c.stop_stream()
    c.close()
    return t0, out


def test_a_decoupled_models_executions_overlap_on_one_instance(server):
    _, out = _stream(server, "overlap", [2.0] * 4, 4)
    assert all(e is None and r.as_numpy("OUT").tolist() == [2.0] for _, r, e in out)
    # one after another, the answers would come 2 s apart (6 s from first to last); together,
    # at about the same time (the model's own sleeps, not a speed of the machine)
    times = [t for t, _, _ in out]
    assert max(times) - min(times) < 3.0


def test_a_task_the_model_started_answers_after_execute_returned(server):
    _, out = _stream(server, "later", [0.0], 2)
    assert [r.as_numpy("OUT").tolist() for _, r, _ in out] == [[1.0], [2.0]]


def test_an_exception_fails_the_open_request_and_is_logged(server):
    _, ((_, result, error),) = _stream(server, "overlap", [-1.0], 1)
    assert result is None and "wait_secs cannot be negative" in str(error)
    wait_for(lambda: "wait_secs cannot be negative" in server.log_text(), 30,
             "the exception in the server log")
    _, out = _stream(server, "overlap", [0.0], 1)       # the model serves on
    assert out[0][2] is None


def test_a_plain_async_model_answers_each_request(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for v in (1.0, 2.0, 3.0):
            assert c.infer("plain", _wait(v)).as_numpy("OUT").tolist() == [v]
    finally:
        c.close()


def test_awaited_decoupled_bls_calls_of_several_executions_run_together(server):
    """``await request.async_exec(decoupled=True)`` waits off the model's event loop (until the
    first response, as in Triton), so four executions each awaiting a call are in the callee
    at once: the callee answers only when all four are in it."""
    _, out = _stream(server, "bls_gather", [4.0] * 4, 4)
    assert [(e, r.as_numpy("OUT").tolist()) for _, r, e in out] == [(None, [4.0])] * 4
