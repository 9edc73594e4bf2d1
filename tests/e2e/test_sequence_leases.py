"""Sequences on the lease path (workers/leases/sequences.py, frontend/sequence_paths.py): a
sequence model with one instance is lent to a frontend with its live sequences, and its requests
go straight to the worker, which applies the sequence batcher's rules itself. What must hold
there as through the scheduler: every sequence's requests run in order and see their own state,
under concurrency, across leases that come and go (two frontends racing for the instance), a
worker that dies, a cancelled request, an unload, a reload; every request counted; nothing left
behind."""
import json
import os
import textwrap
import threading
import time

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
from test_sequences import ACCUMULATE, START_MSG, accumulate_config, pending
from tritonclient.utils import InferenceServerException

from shmserve.engine.leases import TERM_NS

MODEL = "seq_lent"
_ids = iter(range(70_000, 1 << 30))


PAIR = "seq_pair"
SLOW = "seq_slow"
# OUTPUT = the sequence's running sum; parameters: "sleep_ms" (it sleeps first, watching
# is_cancelled(); cancelled, it writes the "flag" file and adds nothing)
SLOW_ACCUMULATE = textwrap.dedent("""
    import json, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.sums = {}

        def execute(self, requests):
            out = []
            for r in requests:
                p = json.loads(r.parameters())
                cid = r.correlation_id()
                if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                    self.sums[cid] = 0
                deadline = time.monotonic() + p.get("sleep_ms", 0) / 1000.0
                cancelled = False
                while time.monotonic() < deadline and not cancelled:
                    cancelled = r.is_cancelled()
                    time.sleep(0.005)
                if cancelled:
                    open(p["flag"], "w").close()
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "cancelled", pb_utils.TritonError.CANCELLED)))
                    continue
                x = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
                total = (self.sums.get(cid, 0) + x).astype("int32")
                self.sums[cid] = total
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total)]))
            return out
""")
SLOW_CONFIG = """
    backend: "python"
    max_batch_size: 4
    sequence_batching { max_sequence_idle_microseconds: 5000000 }
    input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


def build(repo: str) -> str:
    # one instance, 4 slots: lent; values of -1 make its worker exit
    write_model(repo, MODEL, accumulate_config(4, 1, 5_000_000), ACCUMULATE)
    # two instances of 2 slots: lent together, each with its own sequences
    write_model(repo, PAIR, accumulate_config(2, 2, 5_000_000), ACCUMULATE)
    # one instance; requests that sleep, and see a cancel
    write_model(repo, SLOW, SLOW_CONFIG, SLOW_ACCUMULATE)
    return repo


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(build(str(tmp_path_factory.mktemp("sequence_leases"))))
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log_text()


def client_of(s, proto: str):
    if proto == "grpc":
        return grpcclient.InferenceServerClient(s.grpc_url)
    return httpclient.InferenceServerClient(s.url, network_timeout=60)


def step(client, cid: int, value: int, start=False, end=False, model=MODEL, out="OUTPUT",
         **kw) -> int:
    mod = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    inp = mod.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.full((1, 1), value, np.int32))
    r = client.infer(model, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, **kw)
    return int(r.as_numpy(out).reshape(-1)[0])


def run_sequence(client, values: list[int], model=MODEL) -> list[int]:
    cid = next(_ids)
    return [step(client, cid, v, start=i == 0, end=i == len(values) - 1, model=model)
            for i, v in enumerate(values)]


def sums(values: list[int]) -> list[int]:
    return [int(x) for x in np.cumsum(values)]


def inferences(s, model=MODEL) -> int:
    stats = requests.get(f"{s.base}/v2/models/{model}/stats", timeout=10).json()
    return stats["model_stats"][0]["inference_count"]


def lent_now(s, model=MODEL) -> int:
    """Sequences until one runs under a lease (the first ones get the instance lent); returns
    how many requests that took."""
    c = client_of(s, "http")
    sent = 0

    def lent() -> bool:
        nonlocal sent
        sent += 2
        return run_sequence(c, [1, 2], model) == [1, 3] and leased_requests(s, model) > before
    try:
        before = leased_requests(s, model)
        wait_for(lent, 20, "a sequence to run under a lease")
    finally:
        c.close()
    return sent


def concurrent_sequences(s, clients: int, per_client: int, length: int, model=MODEL) -> list:
    """Each client runs its sequences one after the other, the clients at once; returns the
    failures (wrong sums, errors)."""
    def run(k: int) -> list:
        c = client_of(s, "grpc" if k % 2 else "http")
        try:
            wrong = []
            for j in range(per_client):
                values = [k * 100 + j * 10 + i for i in range(length)]
                got = run_sequence(c, values, model)
                if got != sums(values):
                    wrong.append((k, j, got))
            return wrong
        finally:
            c.close()
    return at_once(clients, run)


def test_concurrent_sequences_run_in_order_under_the_lease_and_are_counted(srv):
    lent_now(srv)
    leased, counted = leased_requests(srv, MODEL), inferences(srv)
    assert concurrent_sequences(srv, 4, 5, 12) == []
    # 240 requests; a lease may be renewed on the way (those few go through the scheduler)
    assert leased_requests(srv, MODEL) - leased >= 200
    wait_for(lambda: inferences(srv) == counted + 240, 10, "every request to be counted")


def test_two_instances_are_lent_together_each_keeping_its_sequences(srv):
    lent_now(srv, PAIR)
    leased, counted = leased_requests(srv, PAIR), inferences(srv, PAIR)
    # three live sequences at a time on 2 x 2 slots
    assert concurrent_sequences(srv, 3, 4, 10, PAIR) == []
    assert leased_requests(srv, PAIR) - leased >= 100
    wait_for(lambda: inferences(srv, PAIR) == counted + 120, 10, "every request to be counted")
    # both workers served (each answer names its worker's pid)
    c = client_of(srv, "http")
    try:
        pids = set()
        cids = [next(_ids) for _ in range(4)]
        for cid in cids:
            pids.add(step(c, cid, 1, start=True, model=PAIR, out="PID"))
        for cid in cids:
            assert step(c, cid, 1, end=True, model=PAIR) == 2
        assert len(pids) == 2
    finally:
        c.close()


def test_a_quiet_sequence_keeps_its_state_when_the_other_instance_stays_busy(srv):
    """Each lease has its term (no progress for TERM_NS, and it is renewed): the quiet
    instance's ends while the busy one's would go on, which left the quiet sequence out of its
    frontend's reach (its next request went to the busy worker, which never had it). A
    sequence model's leases end together, and its next request finds its state."""
    lent_now(srv, PAIR)
    c = client_of(srv, "http")
    try:
        x, y = next(_ids), next(_ids)
        pid_x = step(c, x, 5, start=True, model=PAIR, out="PID")
        assert step(c, y, 7, start=True, model=PAIR, out="PID") != pid_x   # one on each
        total, until = 7, time.monotonic() + TERM_NS / 1e9 + 1.0
        while time.monotonic() < until:         # y keeps its instance busy past the term
            total += 1
            assert step(c, y, 1, model=PAIR) == total
        assert step(c, x, 1, model=PAIR, out="PID") == pid_x
        assert step(c, x, 1, end=True, model=PAIR) == 5 + 1 + 1
        assert step(c, y, 1, end=True, model=PAIR) == total + 1
    finally:
        c.close()


def test_a_new_sequence_beyond_the_slots_waits_at_the_scheduler(srv):
    """Four slots: a fifth live sequence takes the lease back (the scheduler's queue holds it
    until a slot frees), and runs once one ends."""
    lent_now(srv)
    c = client_of(srv, "http")
    try:
        live = [next(_ids) for _ in range(4)]
        for cid in live:
            assert step(c, cid, 5, start=True) == 5
        fifth = next(_ids)
        got: list = []

        def start_fifth() -> None:
            other = client_of(srv, "grpc")
            try:
                got.append(step(other, fifth, 7, start=True))
            finally:
                other.close()
        t = threading.Thread(target=start_fifth)
        t.start()
        # no slot yet: it waits in the scheduler's queue, where statistics see it
        wait_for(lambda: pending(srv, MODEL) == 1, 20, "the fifth sequence to wait")
        assert t.is_alive()
        assert step(c, live[0], 1, end=True) == 6
        t.join(30)
        assert got == [7]
        for cid in live[1:]:
            assert step(c, cid, 1, end=True) == 6
        assert step(c, fifth, 1, end=True) == 8
    finally:
        c.close()
    lent_now(srv)


def test_a_worker_that_dies_under_a_lease_loses_its_sequences_only(srv):
    lent_now(srv)
    c = client_of(srv, "http")
    try:
        alive = next(_ids)
        assert step(c, alive, 3, start=True) == 3
        with pytest.raises(InferenceServerException) as e:
            step(c, next(_ids), -1, start=True)         # its worker exits
        assert "exited unexpectedly" in e.value.message(), e.value.message()
        wait_for(lambda: srv.model_ready(MODEL), 30, "the model's worker to be restarted")
        with pytest.raises(InferenceServerException) as e:
            step(c, alive, 1)                           # its state died with the worker
        assert e.value.status() == "400"
        # started under the lease, the scheduler never had it, yet the reason is the same
        assert e.value.message().startswith(START_MSG.format(cid=alive, model=MODEL))
        assert f"sequence {alive} of model '{MODEL}' lost its state" in e.value.message()
    finally:
        c.close()
    lent_now(srv)                   # the new worker is lent in turn


def test_two_frontends_racing_for_the_instance_lose_nothing_and_leave_nothing(tmp_path):
    s = Server(build(str(tmp_path)), "--frontends", "2")
    try:
        sent = lent_now(s) + 240
        assert concurrent_sequences(s, 6, 4, 10) == []
        # each frontend passes its records on within 50 ms (a statistics query flushes only
        # the frontend it reaches)
        wait_for(lambda: inferences(s) == sent, 10, "every request to be counted")
        pids = descendants(s.proc.pid)
    finally:
        s.stop()
    left_nothing(s, pids)


def test_unloading_while_sequences_live_under_a_lease(tmp_path):
    s = Server(build(str(tmp_path)), "--model-control-mode", "explicit", "--load-model", MODEL)
    try:
        lent_now(s)
        c = client_of(s, "http")
        cid = next(_ids)
        assert step(c, cid, 2, start=True) == 2
        r = requests.post(f"{s.base}/v2/repository/models/{MODEL}/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(InferenceServerException) as e:
            step(c, cid, 1)
        assert MODEL in e.value.message()
        r = requests.post(f"{s.base}/v2/repository/models/{MODEL}/load", json={}, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(InferenceServerException) as e:
            step(c, cid, 1)                 # a new worker: the sequence must start again
        assert e.value.message().startswith(START_MSG.format(cid=cid, model=MODEL))
        lent_now(s)
        c.close()
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []



def test_a_cancelled_request_reaches_the_model_and_its_sequence_goes_on(srv, tmp_path):
    lent_now(srv, SLOW)
    c = client_of(srv, "grpc")
    try:
        cid, flag = next(_ids), str(tmp_path / "cancelled")
        assert step(c, cid, 5, start=True, model=SLOW) == 5
        leased = leased_requests(srv, SLOW)
        with pytest.raises(InferenceServerException) as e:
            step(c, cid, 100, model=SLOW, client_timeout=0.3,
                 parameters={"sleep_ms": 20_000, "flag": flag})
        assert "Deadline" in e.value.message(), e.value.message()
        wait_for(lambda: os.path.exists(flag), 20, "the model to see the cancel")
        assert step(c, cid, 1, model=SLOW) == 6             # the cancelled one added nothing
        assert step(c, cid, 1, end=True, model=SLOW) == 7
        assert leased_requests(srv, SLOW) > leased          # they went under the lease
    finally:
        c.close()
    lent_now(srv, SLOW)


def test_reloading_while_sequences_live_under_a_lease(tmp_path):
    """The running request finishes on the old worker; a live sequence's state stays with the
    old model, so its next request must start again; the new worker is lent in turn."""
    s = Server(build(str(tmp_path)), "--model-control-mode", "explicit", "--load-model", SLOW)
    try:
        lent_now(s, SLOW)
        c = client_of(s, "http")
        idle = next(_ids)
        assert step(c, idle, 2, start=True, model=SLOW) == 2
        got: list = []

        def running() -> None:
            other = client_of(s, "http")
            try:
                got.append(step(other, next(_ids), 7, start=True, end=True, model=SLOW,
                                parameters={"sleep_ms": 600}))
            finally:
                other.close()
        t = threading.Thread(target=running)
        t.start()
        wait_for(lambda: model_sleeping(s, SLOW), 20, "the request to run in the model")
        config = {"name": SLOW, "backend": "python", "max_batch_size": 4,
                  "sequence_batching": {"max_sequence_idle_microseconds": 5_000_000},
                  "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
                  "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
                  "parameters": {"reloaded": {"string_value": "1"}}}
        r = requests.post(f"{s.base}/v2/repository/models/{SLOW}/load",
                          json={"parameters": {"config": json.dumps(config)}}, timeout=60)
        assert r.status_code == 200, r.text
        t.join(30)
        assert got == [7]
        with pytest.raises(InferenceServerException) as e:
            step(c, idle, 1, model=SLOW)
        assert e.value.message().startswith(START_MSG.format(cid=idle, model=SLOW))
        lent_now(s, SLOW)
        c.close()
        pids = descendants(s.proc.pid)
    finally:
        s.stop()
    left_nothing(s, pids)
