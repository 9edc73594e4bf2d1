"""Decoupled models (issue 16): a python model answers a request with any number of responses
through request.get_response_sender(), from execute() or from its own threads, over the gRPC
stream; unary endpoints refuse it with Triton's words; errors, worker deaths and clients that
leave end a stream cleanly."""
import os
import queue
import shutil
import textwrap
from functools import partial

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import REPO_ROOT, Server, wait_for
from tritonclient.utils import InferenceServerException

MODES = textwrap.dedent('''
    import json, os, threading, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    def out(x):
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([x], np.int32))])

    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                p = json.loads(r.parameters())
                mode = p.get("mode", "inline")
                values = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist()
                s = r.get_response_sender()
                if mode == "inline":            # all from execute(), FINAL with the last
                    for v in values[:-1]:
                        s.send(out(v))
                    s.send(out(values[-1]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                elif mode == "error_mid":       # an error response does not end the request
                    s.send(out(values[0]))
                    s.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("bad step")))
                    s.send(out(values[1]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                elif mode == "raise":
                    s.send(out(values[0]))
                    raise RuntimeError("boom")
                elif mode == "return_list":
                    return [out(0) for _ in requests]
                elif mode == "die":
                    s.send(out(values[0]))
                    threading.Thread(target=lambda: (time.sleep(0.2), os._exit(3))).start()
                elif mode == "until_cancelled":
                    threading.Thread(target=self.until_cancelled, args=(s, p["flag"])).start()
                elif mode == "silent_until_cancelled":  # no response before the cancel
                    threading.Thread(target=self.silent_until_cancelled,
                                     args=(s, p["flag"])).start()
                elif mode == "twice":           # sending after FINAL is refused
                    s.send(out(1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    try:
                        s.send(out(2))
                    except pb_utils.TritonModelException as e:
                        open(p["flag"], "w").write(str(e))
            return None

        @staticmethod
        def silent_until_cancelled(sender, flag):
            open(flag + ".started", "w").close()
            deadline = time.monotonic() + 30
            while not sender.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.02)
            with open(flag, "w") as f:
                f.write("cancelled" if sender.is_cancelled() else "never cancelled")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        @staticmethod
        def until_cancelled(sender, flag):
            deadline = time.monotonic() + 30
            i = 0
            while not sender.is_cancelled() and time.monotonic() < deadline:
                sender.send(out(i))
                i += 1
                time.sleep(0.02)
            with open(flag, "w") as f:
                f.write("cancelled" if sender.is_cancelled() else "never cancelled")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
''')

AUTO_DECOUPLED = textwrap.indent(textwrap.dedent('''
    @staticmethod
    def auto_complete_config(c):
        c.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [-1]})
        c.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]})
        c.set_model_transaction_policy({"decoupled": True})
        return c
'''), "    ")

SENDER_ONCE = textwrap.dedent('''
    import threading
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().copy()
                s = r.get_response_sender()
                threading.Thread(target=lambda s=s, x=x: s.send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)).start()
            return None
''')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("decoupled"))
    shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", "repeat_int32"),
                    os.path.join(repo, "repeat_int32"))
    write_model(repo, "modes", '''
        backend: "python"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
        output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
    ''', MODES)
    # decoupled by its own auto_complete_config, not by config.pbtxt
    write_model(repo, "ac_modes", 'backend: "python"\n', MODES.replace(
        "class TritonPythonModel:\n", "class TritonPythonModel:\n" + AUTO_DECOUPLED, 1))
    write_model(repo, "sender_once", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ 4 ] } ]
        output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 4 ] } ]
    ''', SENDER_ONCE)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _repeat_inputs(values, delays, wait):
    inputs = [grpcclient.InferInput("IN", [len(values)], "INT32"),
              grpcclient.InferInput("DELAY", [len(delays)], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.array(values, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.array(delays, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([wait], dtype=np.uint32))
    return inputs


class Stream:
    """A tritonclient stream whose callbacks land in a queue."""

    def __init__(self, srv, **kw):
        self.client = grpcclient.InferenceServerClient(srv.grpc_url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=partial(self._cb), **kw)

    def _cb(self, result, error):
        self.q.put(error if error is not None else result)

    def get(self, timeout=20):
        return self.q.get(timeout=timeout)

    def close(self, cancel_requests=False):
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


def _final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def test_repeat_streams_each_element_as_a_response(srv):
    s = Stream(srv)
    try:
        s.client.async_stream_infer("repeat_int32", _repeat_inputs([4, 2, 0, 1], [1, 2, 3, 4], 5),
                                    request_id="0", outputs=[grpcclient.InferRequestedOutput("OUT"),
                                                             grpcclient.InferRequestedOutput("IDX")])
        got = [s.get() for _ in range(4)]
        assert [r.as_numpy("OUT").tolist() for r in got] == [[4], [2], [0], [1]]
        assert [r.as_numpy("IDX").tolist() for r in got] == [[0], [1], [2], [3]]
        assert all(r.get_response().id == "0" and not _final(r) for r in got)
        # the FINAL flag alone sends nothing unless the request asks for an empty final answer
        s.client.async_stream_infer("repeat_int32", _repeat_inputs([7], [0], 0), request_id="1",
                                    enable_empty_final_response=True)
        first, last = s.get(), s.get()
        assert first.as_numpy("OUT").tolist() == [7] and not _final(first)
        assert _final(last) and last.get_response().id == "1" and not last.get_response().outputs
        assert s.q.empty()
    finally:
        s.close()


def test_requests_on_one_stream_interleave(srv):
    s = Stream(srv)
    try:
        s.client.async_stream_infer("repeat_int32", _repeat_inputs([1, 1, 1], [200, 200, 200], 0),
                                    request_id="slow")
        s.client.async_stream_infer("repeat_int32", _repeat_inputs([2, 2, 2], [0, 0, 0], 0),
                                    request_id="fast")
        ids = [s.get().get_response().id for _ in range(6)]
        assert sorted(ids) == ["fast"] * 3 + ["slow"] * 3
        assert ids.index("fast") < ids.index("slow")      # not held behind the earlier request
    finally:
        s.close()


def test_unary_endpoints_refuse_a_decoupled_model(srv):
    c = httpclient.InferenceServerClient(srv.url)
    i = httpclient.InferInput("IN", [1], "INT32")
    i.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("modes", [i])
    assert e.value.status() == "501"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in \
        e.value.message()
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    gi = grpcclient.InferInput("IN", [1], "INT32")
    gi.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        g.infer("modes", [gi])
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in \
        e.value.message()


def _modes(s, mode, values=(1, 2, 3), request_id="r", **params):
    i = grpcclient.InferInput("IN", [len(values)], "INT32")
    i.set_data_from_numpy(np.array(values, dtype=np.int32))
    s.client.async_stream_infer("modes", [i], request_id=request_id,
                                parameters={"mode": mode, **params})


def test_responses_from_execute_errors_and_bad_returns(srv):
    s = Stream(srv)
    try:
        _modes(s, "inline")
        got = [s.get() for _ in range(3)]
        assert [r.as_numpy("OUT").tolist() for r in got] == [[1], [2], [3]]
        assert [_final(r) for r in got] == [False, False, True]
        _modes(s, "error_mid")          # the error is one message; the stream goes on
        first, err, last = s.get(), s.get(), s.get()
        assert first.as_numpy("OUT").tolist() == [1]
        assert isinstance(err, InferenceServerException) and "bad step" in err.message()
        assert last.as_numpy("OUT").tolist() == [2] and _final(last)
        _modes(s, "raise")
        first, err = s.get(), s.get()
        assert first.as_numpy("OUT").tolist() == [1]
        assert "boom" in err.message()
        _modes(s, "return_list")
        err = s.get()
        assert "is using the decoupled mode and the execute function must return None" in \
            err.message()
        _modes(s, "inline", values=(9,))    # and the stream still serves
        assert s.get().as_numpy("OUT").tolist() == [9]
    finally:
        s.close()


def test_sending_after_final_is_refused_in_the_model(srv, tmp_path):
    s = Stream(srv)
    flag = str(tmp_path / "twice")
    try:
        _modes(s, "twice", flag=flag)
        assert s.get().as_numpy("OUT").tolist() == [1]
        wait_for(lambda: os.path.exists(flag) and open(flag).read(), 20, "the model's refusal")
        assert "Response sender has been closed" in open(flag).read()
    finally:
        s.close()


def test_a_worker_death_ends_its_streams_and_the_server_goes_on(srv):
    s = Stream(srv)
    try:
        _modes(s, "die", request_id="d")
        assert s.get().as_numpy("OUT").tolist() == [1]
        err = s.get(timeout=30)
        assert isinstance(err, InferenceServerException)
        assert "while sending responses" in err.message()
        wait_for(lambda: srv.model_ready("modes"), 60, "the worker to be restarted")
        _modes(s, "inline", values=(5,))
        assert s.get(timeout=30).as_numpy("OUT").tolist() == [5]
    finally:
        s.close()


def test_a_client_that_leaves_cancels_the_stream_in_the_model(srv, tmp_path):
    flag = str(tmp_path / "cancel")
    s = Stream(srv)
    _modes(s, "until_cancelled", flag=flag)
    s.get()                             # it is streaming
    s.close(cancel_requests=True)       # the client hangs up
    wait_for(lambda: os.path.exists(flag) and open(flag).read(), 30,
             "the model to see the request cancelled")
    assert open(flag).read() == "cancelled"


def test_a_cancel_before_the_first_response_reaches_the_models_thread(srv, tmp_path):
    """Triton's execute_cancel test: execute() returned, a thread of the model answers later
    and polls is_cancelled(); the client cancels before any response came (so it knows no
    worker to tell: the scheduler has the request in no batch any more)."""
    flag = str(tmp_path / "cancel")
    s = Stream(srv)
    _modes(s, "silent_until_cancelled", flag=flag)
    wait_for(lambda: os.path.exists(flag + ".started"), 30, "the model's thread to start")
    s.close(cancel_requests=True)
    wait_for(lambda: os.path.exists(flag) and open(flag).read(), 30,
             "the model to see the request cancelled")
    assert open(flag).read() == "cancelled"


def test_error_header_ends_the_stream_with_the_status(srv):
    s = Stream(srv, headers={"triton_grpc_error": "true"})
    try:
        _modes(s, "error_mid")
        assert s.get().as_numpy("OUT").tolist() == [1]
        err = s.get()
        assert isinstance(err, InferenceServerException) and "bad step" in err.message()
        assert err.status() == "StatusCode.INTERNAL"
    finally:
        s.close()


def test_aio_stream_client(srv):
    import asyncio

    async def scenario():
        async with aiogrpc.InferenceServerClient(srv.grpc_url) as c:
            async def requests_():
                yield {"model_name": "repeat_int32", "inputs": _repeat_inputs_aio(),
                       "request_id": "aio"}
            got = []
            async for result, error in c.stream_infer(requests_()):
                assert error is None
                got.append(result.as_numpy("OUT").tolist())
                if len(got) == 3:
                    break
            return got

    assert asyncio.run(scenario()) == [[10], [11], [12]]


def _repeat_inputs_aio():
    inputs = [aiogrpc.InferInput("IN", [3], "INT32"), aiogrpc.InferInput("DELAY", [3], "UINT32"),
              aiogrpc.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.array([10, 11, 12], dtype=np.int32))
    inputs[1].set_data_from_numpy(np.zeros(3, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, dtype=np.uint32))
    return inputs


def test_a_non_decoupled_model_may_answer_through_its_sender(srv):
    c = httpclient.InferenceServerClient(srv.url)
    i = httpclient.InferInput("IN", [4], "INT32")
    x = np.arange(4, dtype=np.int32)
    i.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("sender_once", [i]).as_numpy("OUT"), x * 2)
    stats = requests.get(f"{srv.base}/v2/models/modes/stats", timeout=10).json()
    assert stats["model_stats"][0]["inference_count"] >= 1


def test_decoupled_needs_the_python_backend(tmp_path):
    repo = str(tmp_path)
    write_model(repo, "ort_decoupled", '''
        backend: "onnxruntime"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
        output [ { name: "OUT", data_type: TYPE_INT32, dims: [ -1 ] } ]
    ''', None)
    s = Server(repo, wait_ready=False)
    try:
        def reason():
            idx = requests.post(f"{s.base}/v2/repository/index", timeout=10).json()
            return next((e.get("reason") for e in idx if e["name"] == "ort_decoupled"
                         and e.get("state") == "UNAVAILABLE"), None)
        assert "cannot serve a decoupled model" in wait_for(reason, 60, "the load to fail")
    finally:
        s.stop()


_ = grpc    # the status codes above are grpc's, as tritonclient reports them


def test_a_model_decoupled_by_auto_complete_streams_and_hears_cancels(srv, tmp_path):
    flag = str(tmp_path / "cancel")
    s = Stream(srv)
    i = grpcclient.InferInput("IN", [1], "INT32")
    i.set_data_from_numpy(np.array([1], dtype=np.int32))
    s.client.async_stream_infer("ac_modes", [i], parameters={"mode": "until_cancelled",
                                                               "flag": flag})
    assert not _final(s.get())          # streaming
    s.close(cancel_requests=True)
    wait_for(lambda: os.path.exists(flag) and open(flag).read(), 30,
             "the model to see the request cancelled")
    assert open(flag).read() == "cancelled"
