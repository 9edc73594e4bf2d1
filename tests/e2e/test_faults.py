"""A failing model costs its own requests, never the server or the other models."""
import os
import signal
import threading

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serverproc import alive, wait_for


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
