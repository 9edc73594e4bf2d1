"""Ensembles run worker to worker (workers/leases/chain.py) on a real server: a two-step pipeline
(OUT = 2 * (IN + 1), steps ``inc`` then ``dbl``, each its own worker) once the scheduler has
lent its steps' instances to the frontend. What must hold on that path as on the scheduler's:
every answer right, every step and the ensemble counted, a step's worker that dies, a step
unloaded or reloaded while a request runs, a cancelled request, two frontends at once; and
nothing left behind (processes, shared-memory segments)."""
import json
import os
import textwrap
import threading

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
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
from tritonclient.utils import InferenceServerException

# Y = X + 1 (inc) or 2 * X (dbl). Parameters: "sleep_ms" (inc sleeps, watching is_cancelled(),
# and writes the "flag" file when cancelled); "die": the model of that name exits its process.
STEP = textwrap.dedent('''
    import json, os, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.name = json.loads(args["model_config"])["name"]

        def execute(self, requests):
            out = []
            for r in requests:
                p = json.loads(r.parameters())
                if p.get("die") == self.name:
                    os._exit(1)
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                if self.name == "inc":
                    deadline = time.monotonic() + p.get("sleep_ms", 0) / 1000.0
                    while time.monotonic() < deadline:
                        if r.is_cancelled():
                            if p.get("flag"):
                                open(p["flag"], "w").close()
                            break
                        time.sleep(0.005)
                y = x + 1 if self.name == "inc" else 2 * x
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))]))
            return out
''')
STEP_CONFIG = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
    output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''
PIPE_CONFIG = '''
    platform: "ensemble"
    max_batch_size: 8
    input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
    output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
    ensemble_scheduling { step [
      { model_name: "inc" model_version: -1 input_map { key: "X" value: "IN" }
        output_map { key: "Y" value: "t" } },
      { model_name: "dbl" model_version: -1 input_map { key: "X" value: "t" }
        output_map { key: "Y" value: "OUT" } } ] }
'''


def build(repo: str) -> str:
    for name in ("inc", "dbl"):
        write_model(repo, name, STEP_CONFIG, STEP)
    write_model(repo, "pipe", PIPE_CONFIG, None)
    return repo


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(build(str(tmp_path_factory.mktemp("chain"))))
    yield s
    s.stop()


def infer(s, value: float, **params) -> np.ndarray:
    c = httpclient.InferenceServerClient(s.url)
    try:
        x = np.full((1, 4), value, dtype=np.float32)
        inp = httpclient.InferInput("IN", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        return c.infer("pipe", [inp], parameters=params or None).as_numpy("OUT")
    finally:
        c.close()


def counts(s, model: str) -> tuple[int, int]:
    stats = requests.get(f"{s.base}/v2/models/{model}/stats", timeout=10).json()
    st = stats["model_stats"][0]
    return st["inference_count"], st["inference_stats"]["success"]["count"]


def chained_now(s) -> int:
    """Requests until one runs worker to worker (the first ones lend the steps' instances);
    how many it sent."""
    before = leased_requests(s, "pipe")
    sent = []

    def one() -> bool:
        sent.append((infer(s, 0.0) == 2).all())
        return sent[-1] and leased_requests(s, "pipe") > before
    wait_for(one, 20, "an ensemble request to run worker to worker")
    return len(sent)


def test_the_pipeline_runs_worker_to_worker_and_every_step_is_counted(srv):
    chained_now(srv)
    before = {m: counts(srv, m) for m in ("pipe", "inc", "dbl")}
    lent = leased_requests(srv, "pipe")
    for i in range(20):
        assert (infer(srv, float(i)) == 2 * (i + 1)).all()
    # the statistics query flushes the frontend's completion records first
    after = {m: counts(srv, m) for m in ("pipe", "inc", "dbl")}
    for m in ("pipe", "inc", "dbl"):
        assert after[m][0] - before[m][0] == 20 and after[m][1] - before[m][1] == 20, m
    assert leased_requests(srv, "pipe") - lent >= 19         # a lease may be renewed once on the way


def test_a_dying_step_fails_the_request_by_its_step_and_the_pipeline_serves_on(srv):
    chained_now(srv)
    with pytest.raises(InferenceServerException) as e:
        infer(srv, 1.0, die="dbl")
    assert "in ensemble 'pipe', step 1 (model 'dbl')" in e.value.message()
    assert "exited unexpectedly" in e.value.message()
    wait_for(lambda: srv.model_ready("dbl"), 30, "dbl to be restarted")
    chained_now(srv)            # and worker to worker again
    assert (infer(srv, 3.0) == 8).all()


def test_a_cancelled_request_reaches_the_running_step_and_nothing_is_lost(srv, tmp_path):
    chained_now(srv)
    flag = str(tmp_path / "cancelled")
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    inp = grpcclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException):
        c.infer("pipe", [inp], client_timeout=0.5,
                parameters={"sleep_ms": 20_000, "flag": flag})
    wait_for(lambda: os.path.exists(flag), 20, "the running step to see the cancel")
    assert (infer(srv, 5.0) == 12).all()
    c.close()


def test_two_frontends_at_once_lose_nothing_and_leave_nothing(tmp_path):
    s = Server(build(str(tmp_path)), "--frontends", "2")
    try:
        # one frontend runs it worker to worker; then both race for it
        before = chained_now(s)

        def client(k: int) -> list:
            got = [(v, infer(s, v)) for v in (float(k * 100 + i) for i in range(25))]
            return [(v, out) for v, out in got if not (out == 2 * (v + 1)).all()]
        errors = at_once(6, client)
        assert not errors, errors[:3]
        # each frontend passes its records on within 50 ms (a statistics query flushes only
        # the frontend it reaches): every request is counted once, soon
        wait_for(lambda: counts(s, "pipe")[1] == before + 150, 10,
                 "every request to be counted")
        pids = descendants(s.proc.pid)
    finally:
        s.stop()
    left_nothing(s, pids)


def _explicit(tmp_path) -> Server:
    return Server(build(str(tmp_path)), "--model-control-mode", "explicit", "--load-model",
                  "pipe")


def _control(s, action: str, model: str, config: dict | None = None) -> None:
    body = {"parameters": {"config": json.dumps(config)}} if config else {}
    r = requests.post(f"{s.base}/v2/repository/models/{model}/{action}", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _slow_request(s, results: list) -> threading.Thread:
    def run():
        try:
            results.append(infer(s, 1.0, sleep_ms=600))
        except InferenceServerException as e:
            results.append(e)
    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: model_sleeping(s, "inc"), 20, "the request to run step 0")
    return t


def test_unloading_the_running_step_lets_the_request_finish(tmp_path):
    s = _explicit(tmp_path)
    try:
        chained_now(s)
        results: list = []
        t = _slow_request(s, results)
        _control(s, "unload", "inc")    # answers once the step's worker has finished
        t.join(30)
        assert len(results) == 1 and not isinstance(results[0], Exception), [str(r) for r in results]
        assert (results[0] == 4).all(), results
        with pytest.raises(InferenceServerException):
            infer(s, 1.0)               # its step is gone now
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []


def test_reloading_the_next_step_while_a_request_runs_loses_nothing(tmp_path):
    s = _explicit(tmp_path)
    try:
        chained_now(s)
        results: list = []
        t = _slow_request(s, results)
        # a new config: a new version of dbl's serving state, the old worker drains; the
        # request, handed to it after its lease ended, goes back and runs again on the new one
        _control(s, "load", "dbl", {"name": "dbl", "backend": "python", "max_batch_size": 8,
                                    "input": [{"name": "X", "data_type": "TYPE_FP32",
                                               "dims": [4]}],
                                    "output": [{"name": "Y", "data_type": "TYPE_FP32",
                                                "dims": [4]}],
                                    "parameters": {"reloaded": {"string_value": "1"}}})
        t.join(30)
        assert len(results) == 1 and (results[0] == 4).all(), results
        chained_now(s)                  # the new worker takes chained requests too
        assert (infer(s, 2.0) == 6).all()
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []


def test_steps_that_share_a_rate_limited_resource_run_worker_to_worker(tmp_path):
    """Both steps need the one resource R (--rate-limit execution_count): each step's instance
    is lent with R held for it, two units for two leases. Requests one at a time run worker to
    worker and are right, and so are a step's own requests sent between them (under its
    lease)."""
    repo = str(tmp_path)
    limited = STEP_CONFIG + '''
    instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" count: 1 } ] } } ]
    '''
    for name in ("inc", "dbl"):
        write_model(repo, name, limited, STEP)
    write_model(repo, "pipe", PIPE_CONFIG, None)
    s = Server(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "R:2")
    try:
        chained_now(s)
        x = httpclient.InferInput("X", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        c = httpclient.InferenceServerClient(s.url)
        try:
            for k in range(6):
                np.testing.assert_array_equal(infer(s, float(k)), np.full((1, 4), 2 * (k + 1.0)))
                np.testing.assert_array_equal(c.infer("dbl", [x]).as_numpy("Y"),
                                              np.full((1, 4), 2.0))
        finally:
            c.close()
        assert counts(s, "pipe")[1] == counts(s, "pipe")[0]
    finally:
        s.stop()
