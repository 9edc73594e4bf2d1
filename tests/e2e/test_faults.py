"""A failing model costs its own requests, never the server or the other models."""
import os
import signal
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from serverproc import Server, alive, wait_for
from tritonclient.utils import InferenceServerException


def _faulty(client, value: int):
    inp = httpclient.InferInput("INPUT0", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], dtype=np.int32))
    return client.infer("faulty", [inp])


def _others_still_serve(client):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", a.shape, "INT32"), httpclient.InferInput("INPUT1", a.shape, "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)


def _worker_pid(client) -> int:
    return int(_faulty(client, 5).as_numpy("OUTPUT0")[0])


@pytest.fixture
def client(server):
    c = httpclient.InferenceServerClient(server.url, network_timeout=60)
    yield c
    c.close()


def test_execute_raising_fails_only_that_request(client):
    pid = _worker_pid(client)
    with pytest.raises(InferenceServerException) as e:
        _faulty(client, 1)
    assert e.value.status() == "500"
    assert "model raised on purpose" in e.value.message()
    assert _worker_pid(client) == pid          # same worker, still alive
    assert int(_faulty(client, 7).as_numpy("OUTPUT0")[0]) == 7


def test_error_response_keeps_its_code(client):
    with pytest.raises(InferenceServerException) as e:
        _faulty(client, 2)
    assert e.value.status() == "400" and "value 2 is refused" in e.value.message()


def _wait_restarted(client, old_pid: int) -> int:
    def new_pid():
        try:
            pid = _worker_pid(client)
        except InferenceServerException:
            return None
        return pid if pid != old_pid else None
    return wait_for(new_pid, 30, "the worker to be restarted")


def test_worker_os_exit_fails_in_flight_request_and_restarts(server, client):
    pid = _worker_pid(client)
    with pytest.raises(InferenceServerException) as e:
        _faulty(client, 3)
    assert e.value.status() == "500"
    assert "exited unexpectedly" in e.value.message() and "exit code 3" in e.value.message()
    wait_for(lambda: not alive(pid), 10, "the dead worker to be reaped")
    _wait_restarted(client, pid)
    _others_still_serve(client)
    assert server.ready()


def test_worker_sigkill_fails_in_flight_request_and_restarts(server, client):
    pid = _worker_pid(client)
    errors = []

    def blocked():
        # tritonclient.http is gevent based: each thread needs a client of its own
        c = httpclient.InferenceServerClient(server.url, network_timeout=60)
        try:
            _faulty(c, 4)               # sleeps inside execute until killed
        except InferenceServerException as e:
            errors.append(e)
        finally:
            c.close()

    t = threading.Thread(target=blocked)
    t.start()
    # kill only once the request is inside execute: the worker's stack shows the sleep
    wait_for(lambda: _in_sleep(pid), 20, "the request to reach execute()")
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and errors[0].status() == "500"
    assert "SIGKILL" in errors[0].message()
    _wait_restarted(client, pid)
    _others_still_serve(client)


def _in_sleep(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(") ")[1][0]
    except OSError:
        return False
    # time.sleep parks the process in hrtimer_nanosleep; zmq's poll would show a poll wait
    return state == "S" and "nanosleep" in wchan


def test_hung_execute_is_killed_after_the_execution_timeout(server, client):
    pid = _worker_pid(client)
    t = time.monotonic()
    with pytest.raises(InferenceServerException) as e:
        _faulty(client, 4)                  # sleeps 60 s; the model's timeout is 3 s
    assert e.value.status() == "500"
    assert "exceeded the execution timeout of 3 s" in e.value.message()
    assert time.monotonic() - t < 30
    _wait_restarted(client, pid)
    _others_still_serve(client)


# Starts once; every later start (a restart after its first death) dies loading.
CRASHY = """
import os

class TritonPythonModel:
    def initialize(self, args):
        started = os.path.join(args["model_repository"], "started")
        if os.path.exists(started):
            os._exit(7)
        open(started, "w").close()

    def execute(self, requests):
        os._exit(7)
"""


def test_crash_loop_makes_the_model_unavailable_with_the_reason(tmp_path):
    """Deaths while loading (or idle) count toward the crash loop; a death while running a
    request does not (that is the request's: test_poison.py)."""
    from repo_builder import write_model
    write_model(str(tmp_path), "crashy", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    """, CRASHY)
    srv = Server(str(tmp_path))
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)

        def crashed_out():
            try:
                inp = httpclient.InferInput("INPUT0", [1], "INT32")
                inp.set_data_from_numpy(np.array([1], dtype=np.int32))
                c.infer("crashy", [inp])
            except InferenceServerException as e:
                return "crash loop" in e.message() or None
            return None
        wait_for(crashed_out, 60, "the crash loop to be detected")
        assert not srv.model_ready("crashy") and not srv.ready()
        idx = {e["name"]: e for e in requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
        assert idx["crashy"]["state"] == "UNAVAILABLE"
        assert "crash loop" in idx["crashy"]["reason"] and "exit code 7" in idx["crashy"]["reason"]
    finally:
        assert srv.stop() == 0


def test_request_of_a_killed_worker_is_retried_on_another_instance(server):
    """pid_slow is stateless and keeps the default retry: the client never sees the death."""
    results = []

    def slow():
        c = httpclient.InferenceServerClient(server.url, network_timeout=60)
        x = np.full((1, 4), 7, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        results.append(c.infer("pid_slow", [inp], parameters={"delay_ms": 1500}))
        c.close()

    t = threading.Thread(target=slow)
    t.start()
    victim = wait_for(lambda: _sleeping_pid(server, "pid_slow"), 20, "the request to run")
    os.kill(victim, signal.SIGKILL)
    t.join(60)
    assert len(results) == 1
    assert results[0].as_numpy("OUTPUT0")[0, 0] == 7
    assert int(results[0].as_numpy("PID")[0, 0]) != victim     # answered by another process


def _sleeping_pid(server, model):
    from serverproc import descendants
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if f'"model_name":"{model}"' not in f.read():
                    continue
            if _in_sleep(pid):
                return pid
        except OSError:
            continue
    return None


def test_segfault_in_native_code_is_contained(server, client):
    pid = _worker_pid(client)
    with pytest.raises(InferenceServerException) as e:
        _faulty(client, 6)
    assert e.value.status() == "500" and "SIGSEGV" in e.value.message()
    t = time.monotonic()
    _wait_restarted(client, pid)
    print(f"worker restart after a crash took {time.monotonic() - t:.2f} s")
    _others_still_serve(client)


def test_worker_that_stops_answering_pings_is_replaced(server, client):
    pid = _worker_pid(client)
    os.kill(pid, signal.SIGSTOP)            # alive, but it will never answer again
    try:
        wait_for(lambda: not alive(pid), 30, "the silent worker to be killed")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    _wait_restarted(client, pid)
    _others_still_serve(client)


def test_reload_brings_a_crash_looping_model_back(tmp_path):
    from repo_builder import write_model
    marker = tmp_path / "crash-now"
    marker.write_text("1")
    started = tmp_path / "started"
    # while the marker is there: the first start serves, its request kills it, and every
    # restart dies loading
    write_model(str(tmp_path / "repo"), "flaky", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    """, "import os\nimport triton_python_backend_utils as pb_utils\n\n"
         "class TritonPythonModel:\n    def initialize(self, args):\n"
         f"        if os.path.exists({str(marker)!r}) and os.path.exists({str(started)!r}):\n"
         "            os._exit(9)\n"
         f"        open({str(started)!r}, 'w').close()\n\n"
         "    def execute(self, requests):\n"
         f"        if os.path.exists({str(marker)!r}):\n            os._exit(9)\n"
         "        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', "
         "pb_utils.get_input_tensor_by_name(r, 'INPUT0').as_numpy())]) for r in requests]\n")
    srv = Server(str(tmp_path / "repo"), "--model-control-mode", "explicit", "--load-model", "flaky")
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        inp = httpclient.InferInput("INPUT0", [1], "INT32")
        inp.set_data_from_numpy(np.array([5], dtype=np.int32))

        def crashed_out():
            try:
                c.infer("flaky", [inp])
            except InferenceServerException as e:
                return "crash loop" in e.message() or None
            return None
        wait_for(crashed_out, 60, "the crash loop to be detected")
        assert not srv.model_ready("flaky")
        marker.unlink()                             # the fault is fixed
        c.load_model("flaky")
        assert srv.model_ready("flaky")
        assert c.infer("flaky", [inp]).as_numpy("OUTPUT0")[0] == 5
    finally:
        assert srv.stop() == 0
