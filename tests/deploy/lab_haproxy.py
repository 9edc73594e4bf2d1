"""Three shmserve hosts behind the real HAProxy (configs/haproxy/haproxy.cfg), each host a
network namespace of its own (tests/netlab.py). Not collected by the suite's own run: its file
name does not start with test_; tests/deploy/test_haproxy.py runs it inside the lab's namespace.

The tests run in order on one lab: spread and affinity, a host killed under load, the host back,
a host drained by SIGTERM. Every host runs ``--model-control-mode on_demand`` (each loads only
the models HAProxy sends it) and ``--exit-grace-secs 4`` (HAProxy's inter 500 ms x fall 2 is 1 s;
docs/deploy.md advises 2 s, and the test leaves room for a machine busy with other tests).
"""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from netlab import GRPC_PORT, HTTP_PORT, Lab
from repo_builder import write_model
from serverproc import wait_for

MODELS = [f"m{i:02d}" for i in range(24)]
GRACE_S = 4.0
# Triton's identity backend, 5 ms an execution: requests are in flight when a host dies
CONFIG = """
    backend: "identity"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
    parameters { key: "execute_delay_ms" value { string_value: "5" } }
"""
BACKENDS = ("shmserve_http", "shmserve_grpc")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("models"))
    for m in MODELS:
        write_model(repo, m, CONFIG, None)
    lab = Lab(3)
    try:
        lab.start_all(repo, "--model-control-mode", "on_demand", "--exit-grace-secs",
                      str(GRACE_S))
        lab.repo = repo
        hp = lab.balance()
        for b in BACKENDS:
            wait_for(lambda: set(hp.status(b).values()) == {"UP"}, 30, f"{b} all UP")
        yield lab
    except BaseException:
        print(lab.report())
        raise
    finally:
        lab.close()


def http_infer(session: requests.Session, model: str, value: float) -> str:
    """"" when answered right, else what went wrong."""
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                        "data": [value] * 4}]}
    try:
        r = session.post(f"http://127.0.0.1:{HTTP_PORT}/v2/models/{model}/infer", json=body,
                         timeout=30)
    except requests.RequestException as e:
        return f"HTTP {model}: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"HTTP {model}: {r.status_code} {r.text}"
    if r.json()["outputs"][0]["data"] != [value] * 4:
        return f"HTTP {model}: wrong answer {r.text}"
    return ""


def grpc_infer(client, model: str, value: float, affinity: bool = False) -> str:
    x = np.full((1, 4), value, dtype=np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    try:
        res = client.infer(model, [inp], headers={"shmserve-model": model} if affinity else None,
                           client_timeout=30)
    except Exception as e:      # noqa: BLE001 - what the client sees is the result
        return f"gRPC {model}: {e}"
    if not np.array_equal(res.as_numpy("OUTPUT0"), x):
        return f"gRPC {model}: wrong answer"
    return ""


def served(lab, model: str) -> list[int]:
    """Requests of ``model`` each host answered (its own statistics)."""
    return [int(h.counter(f'nv_inference_request_success{{model="{model}"')) for h in lab.hosts]


class Load:
    """Clients sending requests through HAProxy until stopped: ``n`` over HTTP (each to models
    in turn) and ``n`` over gRPC (one model, no affinity header: round robin). Every result is
    kept with its time."""

    def __init__(self, n: int = 3):
        self.stop = threading.Event()
        self.results: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        # daemon threads: a failed test must not leave the process waiting for them
        self.threads = [threading.Thread(target=self._http, args=(k,), daemon=True)
                        for k in range(n)] + \
            [threading.Thread(target=self._grpc, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _keep(self, error: str) -> None:
        with self.lock:
            self.results.append((time.monotonic(), error))

    def _http(self, k: int) -> None:
        with requests.Session() as s:
            i = k
            while not self.stop.is_set():
                self._keep(http_infer(s, MODELS[i % len(MODELS)], float(i)))
                i += 1

    def _grpc(self, k: int) -> None:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as c:
            i = k
            while not self.stop.is_set():
                self._keep(grpc_infer(c, MODELS[0], float(i)))
                i += 1

    def __enter__(self) -> "Load":
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()

    def count(self) -> int:
        with self.lock:
            return len(self.results)

    def finish(self, more: int = 0) -> tuple[int, list[tuple[float, str]]]:
        """After ``more`` requests from now: (requests sent, the failed ones)."""
        n = self.count()
        wait_for(lambda: self.count() >= n + more, 60, f"{more} more requests")
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
            assert not t.is_alive()
        return len(self.results), [(t, e) for t, e in self.results if e]


def taken_out(hp, server: str) -> float:
    """When HAProxy has marked ``server`` DOWN in both backends."""
    for b in BACKENDS:
        wait_for(lambda: hp.status(b)[server] == "DOWN", 20, f"{b}: {server} DOWN")
    return time.monotonic()


def test_requests_spread_over_the_hosts_and_each_model_stays_on_one(lab):
    with requests.Session() as s:
        for m in MODELS:
            for i in range(5):
                assert http_infer(s, m, float(i)) == ""
    per_host = [0, 0, 0]
    for m in MODELS:
        counts = served(lab, m)
        # consistent hashing on /v2/models/<name>: every request of a model on one host, the
        # only one that loaded it
        assert sorted(counts) == [0, 0, 5], (m, counts)
        per_host[counts.index(5)] += 1
    assert all(per_host), per_host
    print(f"HTTP: {len(MODELS)} models over 3 hosts by their name's hash: {per_host}")

    # gRPC without the header: round robin, one model on every host
    before = served(lab, MODELS[0])
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as c:
        for i in range(30):
            assert grpc_infer(c, MODELS[0], float(i)) == ""
        after = [b - a for a, b in zip(before, served(lab, MODELS[0]))]
        assert all(after) and sum(after) == 30, after
        print(f"gRPC without the affinity header, one model: {after} requests per host")
        # with it: one host
        before = served(lab, MODELS[1])
        for i in range(30):
            assert grpc_infer(c, MODELS[1], float(i), affinity=True) == ""
        after = [b - a for a, b in zip(before, served(lab, MODELS[1]))]
        assert sorted(after) == [0, 0, 30], after


def test_a_killed_host_is_taken_out_and_only_requests_in_flight_can_fail(lab):
    hp, victim = lab.haproxy, lab.hosts[1]
    with Load() as load:
        wait_for(lambda: load.count() >= 200, 60, "the load to run")
        killed_at = time.monotonic()
        victim.kill()
        down_at = taken_out(hp, "host2")
        sent, failed = load.finish(more=200)
    print(f"kill: {sent} requests, {len(failed)} failed; host2 DOWN in both backends "
          f"{down_at - killed_at:.2f} s after the kill")
    for t, e in failed:
        print(f"  at +{t - killed_at:.3f} s: {e[:200]}")
    # at most the requests in flight on host2 when it died: one per client thread, and
    # none that began after HAProxy took it out
    assert len(failed) <= len(load.threads)
    assert all(t < down_at for t, _ in failed)


def test_a_host_brought_back_rejoins(lab):
    hp, host = lab.haproxy, lab.hosts[1]
    host.start(lab.repo, "--model-control-mode", "on_demand", "--exit-grace-secs",
               str(GRACE_S))
    for b in BACKENDS:
        wait_for(lambda: hp.status(b)["host2"] == "UP", 30, f"{b}: host2 UP again")
    with requests.Session() as s:
        for m in MODELS:
            assert http_infer(s, m, 1.0) == ""
    # its models hash to it again (consistent hashing), and it loads them on demand
    assert sum(served(lab, m)[1] for m in MODELS) > 0


def test_sigterm_drains_a_host_without_losing_a_request(lab):
    hp, host = lab.haproxy, lab.hosts[2]
    with Load() as load:
        wait_for(lambda: load.count() >= 200, 60, "the load to run")
        t0 = time.monotonic()
        host.server.send_signal(signal.SIGTERM)
        # the host says "not ready" at once and HAProxy takes it out while it still serves
        down_at = taken_out(hp, "host3")
        assert host.server.poll() is None, "the host stopped before HAProxy took it out"
        assert host.server.wait(timeout=90) == 0
        stopped_at = time.monotonic()
        sent, failed = load.finish(more=100)
    print(f"drain: {sent} requests, {len(failed)} failed; host3 DOWN {down_at - t0:.2f} s "
          f"after SIGTERM, exited 0 after {stopped_at - t0:.2f} s")
    assert failed == [], failed[:5]
    assert f"still serving for {GRACE_S:.1f} s" in host.log_text()
