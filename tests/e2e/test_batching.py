"""Dynamic batching end to end: batches formed from concurrent requests, delay, queue policies,
priorities, ordering, and what /stats and /metrics report about it."""
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from serverproc import leased_requests, model_sleeping, wait_for
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def aclient(server):
    c = httpclient.InferenceServerClient(server.url, concurrency=16, network_timeout=60)
    yield c
    c.close()


def _input(value: float, batch: int = 1):
    x = np.full((batch, 4), value, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _stats(server, model):
    r = requests.get(f"{server.base}/v2/models/{model}/stats", timeout=10)
    assert r.status_code == 200, r.text
    (s,) = r.json()["model_stats"]
    return s


def _stats_when(server, model, ready):
    """Statistics are counted when the scheduler hears BatchDone, which can come a moment after
    the client has its answer: poll until they show what the test expects."""
    return wait_for(lambda: (lambda s: s if ready(s) else None)(_stats(server, model)), 20,
                    f"the statistics of '{model}' to catch up")


def test_concurrent_requests_form_one_batch(server, aclient):
    before = _stats(server, "batch4")
    pending = [aclient.async_infer("batch4", [_input(i)]) for i in range(4)]
    results = [p.get_result() for p in pending]
    calls = {int(r.as_numpy("CALL")[0, 0]) for r in results}
    assert len(calls) == 1, calls                       # one execution served all four
    assert all(int(r.as_numpy("REQUESTS")[0, 0]) == 4 for r in results)
    for i, r in enumerate(results):
        assert r.as_numpy("OUTPUT0")[0, 0] == i          # and each got its own answer back
    after = _stats_when(server, "batch4",
                        lambda s: s["inference_count"] - before["inference_count"] >= 4)
    assert after["execution_count"] - before["execution_count"] == 1
    assert after["inference_count"] - before["inference_count"] == 4
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sizes.get(4, 0) >= 1
    assert after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"] == 4


def test_a_request_of_batch_size_two_counts_two(server, aclient):
    pending = [aclient.async_infer("batch4", [_input(1, batch=2)]),
               aclient.async_infer("batch4", [_input(2, batch=2)])]
    results = [p.get_result() for p in pending]
    assert results[0].as_numpy("CALL")[0, 0] == results[1].as_numpy("CALL")[0, 0]
    assert results[0].as_numpy("OUTPUT0").shape == (2, 4)


def test_lone_request_waits_for_the_queue_delay(server):
    c = httpclient.InferenceServerClient(server.url)
    t = time.monotonic()
    c.infer("delayed", [_input(1)])
    # semantics, not speed: the batcher must hold a lone request for its 300 ms delay
    assert time.monotonic() - t >= 0.25


def _leased(server, model):
    """Send requests one at a time until they go under a lease: a batcher with queue rules and
    no delay is lent one request at a time (engine/leases.py), and its rules must hold for the
    requests that then queue behind a leased one."""
    c = httpclient.InferenceServerClient(server.url)
    before = leased_requests(server, model)
    wait_for(lambda: c.infer(model, [_input(0)]) and leased_requests(server, model) > before,
             20, f"requests of '{model}' to go under a lease")
    c.close()


def test_queue_timeout_rejects_with_503(server, aclient):
    _leased(server, "timeout_reject")
    first = aclient.async_infer("timeout_reject", [_input(1)], parameters={"delay_ms": 600})
    _wait_executing(server, "timeout_reject")
    second = aclient.async_infer("timeout_reject", [_input(2)])
    with pytest.raises(InferenceServerException) as e:
        second.get_result()
    assert e.value.status() == "503" and "Request timeout expired" in e.value.message()
    first.get_result()
    s = _stats(server, "timeout_reject")
    assert s["inference_stats"]["fail"]["count"] >= 1


def test_full_queue_rejects_with_503(server, aclient):
    _leased(server, "bounded")
    running = aclient.async_infer("bounded", [_input(1)], parameters={"delay_ms": 800})
    _wait_executing(server, "bounded")
    queued = aclient.async_infer("bounded", [_input(2)])
    _wait_pending(server, "bounded", 1)
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as e:
        c.infer("bounded", [_input(3)])
    assert e.value.status() == "503" and "Exceeds maximum queue size" in e.value.message()
    running.get_result()
    queued.get_result()


def test_higher_priority_runs_first(server, aclient):
    _leased(server, "prio")
    running = aclient.async_infer("prio", [_input(0)], parameters={"delay_ms": 600})
    _wait_executing(server, "prio")
    low = aclient.async_infer("prio", [_input(1)], priority=2)
    _wait_pending(server, "prio", 1)
    high = aclient.async_infer("prio", [_input(2)], priority=1)
    _wait_pending(server, "prio", 2)
    running.get_result()
    low_call = int(low.get_result().as_numpy("CALL")[0, 0])
    high_call = int(high.get_result().as_numpy("CALL")[0, 0])
    assert high_call < low_call


@pytest.mark.parametrize("model, in_order", [("ordered", True), ("unordered", False)])
def test_preserve_ordering(server, aclient, model, in_order):
    slow = aclient.async_infer(model, [_input(1)], parameters={"delay_ms": 700})
    _wait_executing(server, model)
    fast = aclient.async_infer(model, [_input(2)])
    fast_result = fast.get_result()
    slow_done_first = _done(slow)
    # the fast request finished on the other instance; with preserve_ordering its answer is
    # held until the slow one (sent earlier) is answered
    assert slow_done_first == in_order
    slow.get_result()
    assert fast_result.as_numpy("OUTPUT0")[0, 0] == 2


def _done(async_request) -> bool:
    return async_request._greenlet.ready()


def _metric_samples(server) -> dict:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # the parser reports counter samples as <name>_total; the wire has Triton's names
            name = s.name[:-len("_total")] if fam.type == "counter" and s.name.endswith("_total") else s.name
            out[(name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _wait_executing(server, model):
    def executing():
        s = _metric_samples(server)
        key = ("nv_inference_pending_request_count", (("model", model), ("version", "1")))
        return s.get(key) == 0 and model_sleeping(server, model)
    wait_for(executing, 20, f"a request of '{model}' to be executing")


def _wait_pending(server, model, n):
    key = ("nv_inference_pending_request_count", (("model", model), ("version", "1")))
    wait_for(lambda: _metric_samples(server).get(key) == n, 20, f"{n} queued request(s) of '{model}'")


def test_metrics_agree_with_statistics(server, aclient):
    for i in range(6):
        aclient.async_infer("batch4", [_input(i)])
    # six requests: one batch of 4 goes at once, the last two wait; add two more to fill it
    done = [aclient.async_infer("batch4", [_input(i)]) for i in range(2)]
    for d in done:
        d.get_result()
    wait_for(lambda: _stats(server, "batch4")["inference_count"] % 4 == 0, 20, "batches to finish")
    stats = _stats(server, "batch4")
    m = _metric_samples(server)
    labels = (("model", "batch4"), ("version", "1"))
    assert m[("nv_inference_request_success", labels)] == stats["inference_stats"]["success"]["count"]
    assert m[("nv_inference_count", labels)] == stats["inference_count"]
    assert m[("nv_inference_exec_count", labels)] == stats["execution_count"]
    assert m[("nv_inference_queue_duration_us", labels)] == stats["inference_stats"]["queue"]["ns"] // 1000
    assert m[("nv_inference_compute_infer_duration_us", labels)] == \
        stats["inference_stats"]["compute_infer"]["ns"] // 1000
    assert m[("nv_inference_request_failure", tuple(sorted(labels + (("reason", "REJECTED"),))))] == 0
    assert 0.0 <= m[("nv_cpu_utilization", ())] <= 1.0
    assert m[("nv_cpu_memory_total_bytes", ())] > m[("nv_cpu_memory_used_bytes", ())] > 0
    assert m[("nv_model_load_duration_secs", labels)] > 0


def test_counters_survive_a_worker_restart(server):
    from test_faults import _faulty, _wait_restarted, _worker_pid
    c = httpclient.InferenceServerClient(server.url, network_timeout=60)
    before = _stats(server, "faulty")
    pid = _worker_pid(c)
    with pytest.raises(InferenceServerException):
        _faulty(c, 3)                                  # the worker exits mid-request
    _wait_restarted(c, pid)
    _faulty(c, 9)
    ok_before = before["inference_stats"]["success"]["count"]
    labels = (("model", "faulty"), ("version", "1"))

    def settled():
        """The last answers may reach the client before the scheduler counts them: take
        statistics and metrics once the count holds still across both reads."""
        first, m, last = _stats(server, "faulty"), _metric_samples(server), _stats(server, "faulty")
        n = last["inference_stats"]["success"]["count"]
        same = first["inference_stats"]["success"]["count"] == n == \
            m.get(("nv_inference_request_success", labels))
        return (last, m) if same and n >= ok_before + 2 else None

    after, m = wait_for(settled, 20, "the statistics of 'faulty' to settle")
    ok_after = after["inference_stats"]["success"]["count"]
    assert ok_after >= ok_before + 2, (before, after)  # _worker_pid twice at least, plus 9
    assert after["inference_stats"]["fail"]["count"] == \
        before["inference_stats"]["fail"]["count"] + 1, (before, after)
    assert m[("nv_inference_request_failure", tuple(sorted(labels + (("reason", "BACKEND"),))))] >= 1
    assert m[("nv_inference_request_success", labels)] == ok_after


def test_statistics_endpoints_and_errors(server):
    r = requests.get(f"{server.base}/v2/models/stats", timeout=10)
    names = {s["name"] for s in r.json()["model_stats"]}
    assert {"simple", "batch4", "mlp_onnx"} <= names
    s = requests.get(f"{server.base}/v2/models/simple/versions/1/stats", timeout=10).json()
    entry = s["model_stats"][0]
    assert set(entry["inference_stats"]) == {"success", "fail", "queue", "compute_input",
                                             "compute_infer", "compute_output", "cache_hit",
                                             "cache_miss"}
    r = requests.get(f"{server.base}/v2/models/no_such/stats", timeout=10)
    assert r.status_code == 400 and "requested model 'no_such' is not available" in r.json()["error"]
    r = requests.get(f"{server.base}/v2/models/simple/versions/4/stats", timeout=10)
    assert r.status_code == 400 and "version is not available" in r.json()["error"]


def test_bad_priority_and_timeout_parameters(server):
    inputs = [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    for params, text in (({"priority": -1}, "'priority'"), ({"timeout": "soon"}, "'timeout'")):
        r = requests.post(f"{server.base}/v2/models/prio/infer",
                          json={"inputs": inputs, "parameters": params}, timeout=30)
        assert r.status_code == 400 and text in r.json()["error"]


def test_client_disconnect_cancels_its_queued_request(server, aclient):
    import json
    import socket
    running = aclient.async_infer("prio", [_input(0)], parameters={"delay_ms": 800})
    _wait_executing(server, "prio")
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"POST /v2/models/prio/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait_pending(server, "prio", 1)
    # the client is gone while its request waits in the queue: it is dropped, never executed
    key = ("nv_inference_request_failure", (("model", "prio"), ("reason", "CANCELED"), ("version", "1")))
    wait_for(lambda: _metric_samples(server).get(key, 0) >= 1, 20, "the request to be cancelled")
    first_call = int(running.get_result().as_numpy("CALL")[0, 0])
    c = httpclient.InferenceServerClient(server.url)
    next_call = int(c.infer("prio", [_input(5)]).as_numpy("CALL")[0, 0])
    assert next_call == first_call + 1          # nothing ran in between
