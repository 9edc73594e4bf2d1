"""BLS calls under leases (workers/python_backend/bls.py): once the scheduler has lent the callee's instance to
the caller's BLS client, a call goes straight to the callee's worker. What must hold on that
path as through the scheduler: every call counted at once, a callee that dies under a call, a
call that times out (its cancel reaches the callee), a callee unloaded or reloaded while a call
runs, two frontends racing for the caller, a model calling itself still refused; and nothing
left behind."""
import json
import os
import textwrap
import threading

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import (
    Server,
    at_once,
    descendants,
    leased_requests,
    left_nothing,
    model_sleeping,
    segments_of,
    wait_for,
)

# OUT = 10 * callee(IN); the request's parameters go to the call ("target": whom to call, and
# "timeout_us" its timeout); a failed call's message comes back in ERR
CALLER = textwrap.dedent('''
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                p = json.loads(r.parameters())
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                call = pb_utils.InferenceRequest(
                    model_name=p.pop("target", "callee"), requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x)], timeout=int(p.pop("timeout_us", 0)),
                    parameters=p)
                resp = call.exec()
                err = resp.error().message() if resp.has_error() else ""
                y = np.zeros(1, np.int32) if err else \\
                    pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy() * 10
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", y.astype(np.int32)),
                    pb_utils.Tensor("ERR", np.array([err.encode()], dtype=np.object_))]))
            return out
''')
# OUT = IN + 1; "sleep_ms": sleeps first, watching is_cancelled() (then writes the "flag" file);
# "die": exits its process
CALLEE = textwrap.dedent('''
    import json, os, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                p = json.loads(r.parameters())
                if p.get("die"):
                    os._exit(1)
                deadline = time.monotonic() + p.get("sleep_ms", 0) / 1000.0
                while time.monotonic() < deadline:
                    if r.is_cancelled():
                        if p.get("flag"):
                            open(p["flag"], "w").close()
                        break
                    time.sleep(0.005)
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
            return out
''')
IO = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
'''
CALLER_IO = IO + '''
    output [ { name: "ERR", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


def build(repo: str) -> str:
    write_model(repo, "caller", CALLER_IO, CALLER)
    write_model(repo, "callee", IO, CALLEE)
    return repo


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(build(str(tmp_path_factory.mktemp("bls_leases"))))
    yield s
    s.stop()


def call(s, value: int, **params) -> tuple[int, str]:
    c = httpclient.InferenceServerClient(s.url)
    try:
        inp = httpclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([value], dtype=np.int32))
        r = c.infer("caller", [inp], parameters=params or None)
        return int(r.as_numpy("OUT")[0]), r.as_numpy("ERR")[0].decode()
    finally:
        c.close()


def inferences(s, model: str) -> int:
    stats = requests.get(f"{s.base}/v2/models/{model}/stats", timeout=10).json()
    return stats["model_stats"][0]["inference_count"]


def leased_now(s) -> int:
    """Calls until one goes to the callee under a lease (the first ones get it lent); returns
    how many calls that took."""
    before = leased_requests(s, "callee")
    calls = 0

    def lent() -> bool:
        nonlocal calls
        calls += 1
        return call(s, 1) == (20, "") and leased_requests(s, "callee") > before
    wait_for(lent, 20, "a BLS call to run under a lease")
    return calls


def test_calls_go_straight_to_the_callee_and_each_is_counted_at_once(srv):
    leased_now(srv)
    lent, counted = leased_requests(srv, "callee"), inferences(srv, "callee")
    for i in range(20):
        assert call(srv, i) == (10 * (i + 1), "")
        # its record came back with the caller's answer: counted before the client hears
        assert inferences(srv, "callee") == counted + i + 1
    assert leased_requests(srv, "callee") - lent >= 19       # a lease may be renewed once on the way


def test_a_callee_that_dies_under_a_call_fails_that_call_and_calls_go_on(srv):
    leased_now(srv)
    out, err = call(srv, 1, die=True)
    assert out == 0 and "exited unexpectedly" in err, err
    wait_for(lambda: srv.model_ready("callee"), 30, "the callee to be restarted")
    leased_now(srv)


def test_a_call_that_times_out_is_cancelled_in_the_callee(srv, tmp_path):
    leased_now(srv)
    flag = str(tmp_path / "cancelled")
    out, err = call(srv, 1, timeout_us=200_000, sleep_ms=20_000, flag=flag)
    assert out == 0 and "Request timeout expired" in err, err
    wait_for(lambda: os.path.exists(flag), 20, "the callee to see the cancel")
    leased_now(srv)


def test_a_model_calling_itself_is_still_refused(srv):
    leased_now(srv)
    out, err = call(srv, 1, target="caller")
    assert out == 0 and "would wait for itself (deadlock)" in err, err


def _explicit(tmp_path) -> Server:
    return Server(build(str(tmp_path)), "--model-control-mode", "explicit", "--load-model",
                  "caller", "--load-model", "callee")


def _call_running_in_the_callee(s) -> tuple[threading.Thread, list]:
    """A call under the lease, 600 ms long, running in the callee now; its answer goes to the
    list once the thread ends."""
    leased_now(s)
    got: list = []
    t = threading.Thread(target=lambda: got.append(call(s, 1, sleep_ms=600)))
    t.start()
    wait_for(lambda: model_sleeping(s, "callee"), 20, "the call to run in the callee")
    return t, got


def test_unloading_the_callee_while_a_call_runs_lets_it_finish(tmp_path):
    s = _explicit(tmp_path)
    try:
        t, got = _call_running_in_the_callee(s)
        r = requests.post(f"{s.base}/v2/repository/models/callee/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        t.join(30)
        assert got == [(20, "")]
        out, err = call(s, 1)
        assert out == 0 and "callee" in err, err      # gone now: a clear error
        body = json.dumps({})
        assert requests.post(f"{s.base}/v2/repository/models/callee/load", data=body,
                             timeout=60).status_code == 200
        leased_now(s)
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []


def test_two_frontends_racing_lose_nothing_and_leave_nothing(tmp_path):
    """Requests to the caller come through two frontends at once (its lease changes hands
    between them); its BLS calls go on under the callee's lease through all of it."""
    s = Server(build(str(tmp_path)), "--frontends", "2")
    try:
        sent = leased_now(s) + 150

        def client(k: int) -> list:
            got = [(i, call(s, k * 100 + i)) for i in range(25)]
            return [(k, i, g) for i, g in got if g != (10 * (k * 100 + i + 1), "")]
        errors = at_once(6, client)
        assert not errors, errors[:3]
        # every call counted once, whichever frontend's request made it (each frontend passes
        # its records on within 50 ms; a statistics query flushes only the one it reaches)
        wait_for(lambda: inferences(s, "caller") == inferences(s, "callee") == sent, 10,
                 "every call to be counted")
        pids = descendants(s.proc.pid)
    finally:
        s.stop()
    left_nothing(s, pids)


def test_reloading_the_callee_while_a_call_runs_loses_nothing(tmp_path):
    s = _explicit(tmp_path)
    try:
        t, got = _call_running_in_the_callee(s)
        # a new config: the callee's new worker serves the next calls, the old one drains
        config = {"name": "callee", "backend": "python", "max_batch_size": 0,
                  "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
                  "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}],
                  "parameters": {"reloaded": {"string_value": "1"}}}
        r = requests.post(f"{s.base}/v2/repository/models/callee/load",
                          json={"parameters": {"config": json.dumps(config)}}, timeout=60)
        assert r.status_code == 200, r.text
        t.join(30)
        assert got == [(20, "")]
        leased_now(s)                   # the new worker is lent to the caller in turn
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []
