"""Python models' custom metrics on /metrics, request.is_cancelled(), and stop signals: the
first one is seen at once, a second one forces the exit."""
import json
import os
import signal
import textwrap

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from repo_builder import PID_SLOW, write_model
from serverproc import Server, alive, descendants, model_sleeping, segments_of, send_sleeping, wait_for

METRICS_MODEL = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            F = pb_utils.MetricFamily
            self.requests = F("test_requests", "requests seen", F.COUNTER).Metric(
                labels={"model": args["model_name"], "flavour": "plain"})
            self.last = F("test_last_value", "last input", F.GAUGE).Metric(labels={"unit": "x"})
            self.values = F("test_values", "inputs", F.HISTOGRAM).Metric(
                labels={"model": args["model_name"]}, buckets=[1, 2.5, 10])
            # a name the server already uses: left out of /metrics, which must stay valid
            F("nv_inference_count", "a clash", F.GAUGE).Metric().set(-1)

        def execute(self, requests):
            out = []
            for r in requests:
                x = r.inputs()[0].as_numpy()
                self.requests.increment(1)
                self.last.set(float(x[0]))
                self.values.observe(float(x[0]))
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')

# Waits for its client to go away; a safety deadline keeps a broken cancellation from hanging
# the test. The outcome is counted, so the test reads it from /metrics.
WAIT_CANCEL = textwrap.dedent('''
    import time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.outcomes = pb_utils.MetricFamily("test_cancel_outcomes", "how waits ended",
                                                  pb_utils.MetricFamily.COUNTER)

        def execute(self, requests):
            out = []
            for r in requests:
                deadline = time.monotonic() + 20
                while not r.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                outcome = "cancelled" if r.is_cancelled() else "deadline"
                self.outcomes.Metric(labels={"outcome": outcome}).increment(1)
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(outcome)))
            return out
''')

# Echoes what the server told it about the request: correlation id, flags, custom parameters.
SEQUENCE_ECHO = textwrap.dedent('''
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                seen = {"id": r.correlation_id(), "flags": r.flags(),
                        "params": json.loads(r.parameters())}
                text = np.array([json.dumps(seen, sort_keys=True).encode()], dtype=np.object_)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", text)]))
            return out
''')

# what the model sees as sys.argv (Triton's embedded stub: [""])
ARGV_ECHO = textwrap.dedent('''
    import json, sys
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            text = np.array([json.dumps(sys.argv).encode()], dtype=np.object_)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", text)])
                    for _ in requests]
''')

IO = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("no_stubs"))
    write_model(root, "custom_metrics", IO + "instance_group [ { count: 2, kind: KIND_CPU } ]",
                METRICS_MODEL)
    write_model(root, "wait_cancel", IO, WAIT_CANCEL)
    write_model(root, "argv_echo", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "SEEN", data_type: TYPE_STRING, dims: [ 1 ] } ]
    ''', ARGV_ECHO)
    write_model(root, "sequence_echo", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "SEEN", data_type: TYPE_STRING, dims: [ 1 ] } ]
    ''', SEQUENCE_ECHO)
    write_model(root, "sleeper", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
                 { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
        parameters { key: "retry_on_worker_death" value: { string_value: "false" } }
    ''', PID_SLOW)
    return root


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _families(srv) -> dict:
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}   # raises if malformed


def _value(fams, family, sample, labels):
    fam = fams.get(family)
    if fam is None:
        return None
    if fam.type == "counter":
        sample += "_total"          # prometheus_client's parser names every counter sample so
    return next((s.value for s in fam.samples if s.name == sample and s.labels == labels), None)


def _infer(url, model, value):
    c = httpclient.InferenceServerClient(url)
    i = httpclient.InferInput("INPUT0", [1], "FP32")
    i.set_data_from_numpy(np.array([value], dtype=np.float32))
    return c.infer(model, [i])


def test_custom_metrics_on_the_metrics_page(srv):
    values = [0.5, 1.0, 2.0, 7.0, 30.0]
    for v in values:
        _infer(srv.url, "custom_metrics", v)
    counter = ("test_requests", "test_requests", {"model": "custom_metrics", "flavour": "plain"})
    # the worker ships its metrics at most every 100 ms: poll until the last request shows
    fams = wait_for(lambda: (f := _families(srv)) and _value(f, *counter) == len(values) and f,
                    20, "the custom counter to count every request")
    assert fams["test_requests"].type == "counter"
    # both instances' families are there, and they add up; the gauge shows the latest set(),
    # whichever instance ran the last request (the lease may move between them)
    assert _value(fams, "test_last_value", "test_last_value", {"unit": "x"}) == 30.0
    hist = {"model": "custom_metrics"}
    assert fams["test_values"].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fams["test_values"].samples
               if s.name == "test_values_bucket"}
    assert buckets == {"1": 2, "2.5": 3, "10": 4, "+Inf": 5}
    assert _value(fams, "test_values", "test_values_count", hist) == 5
    assert _value(fams, "test_values", "test_values_sum", hist) == sum(values)
    # the clashing family is left out and the built-in counter is intact
    assert fams["nv_inference_count"].type == "counter"
    assert all(s.value >= 0 for s in fams["nv_inference_count"].samples)
    assert "custom metric family 'nv_inference_count' left out" in srv.log_text()
    # HELP/TYPE lines carry the model's own names, with no _total added
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text
    assert "# TYPE test_requests counter" in text and "test_requests_total" not in text


def _outcome(srv, outcome):
    fams = _families(srv)
    return _value(fams, "test_cancel_outcomes", "test_cancel_outcomes",
                  {"outcome": outcome}) or 0


def _executing(srv, model):
    # the model's loop sleeps 10 ms between polls, so its worker is seen in nanosleep
    return model_sleeping(srv, model)


def test_is_cancelled_when_an_http_client_goes_away(srv):
    before = _outcome(srv, "cancelled")
    c = httpclient.InferenceServerClient(srv.url, network_timeout=3.0)
    i = httpclient.InferInput("INPUT0", [1], "FP32")
    i.set_data_from_numpy(np.array([1], dtype=np.float32))
    with pytest.raises(TimeoutError):
        c.infer("wait_cancel", [i])         # gives up after 3 s and closes the connection
    c.close()
    # the model sees it well before its 20 s safety deadline
    wait_for(lambda: _outcome(srv, "cancelled") == before + 1, 10,
             "the model to see that its request was cancelled")
    assert _outcome(srv, "deadline") == 0


def test_is_cancelled_when_a_grpc_call_is_cancelled(srv):
    before = _outcome(srv, "cancelled")
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    i = grpcclient.InferInput("INPUT0", [1], "FP32")
    i.set_data_from_numpy(np.array([1], dtype=np.float32))
    results = []
    call = c.async_infer("wait_cancel", [i], callback=lambda result, error: results.append(error))
    wait_for(lambda: _executing(srv, "wait_cancel"), 20, "the request to be executing")
    call.cancel()
    wait_for(lambda: _outcome(srv, "cancelled") == before + 1, 10,
             "the model to see that its request was cancelled")
    assert _outcome(srv, "deadline") == 0
    c.close()


def _worker_pid(srv, model):
    for pid in descendants(srv.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if f'"model_name":"{model}"' in f.read():
                    return pid
        except OSError:
            continue
    return None


def test_second_sigterm_makes_a_busy_worker_exit_at_once(srv):
    c = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    (pending,) = send_sleeping(srv, c, "sleeper", 1, delay_ms=60000)
    pid = _worker_pid(srv, "sleeper")
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: "SIGTERM: stopping after the current batch" in srv.log_text(), 20,
             "the worker to note the first SIGTERM")
    assert alive(pid)                       # the first one lets the batch finish
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not alive(pid), 20, "the worker to exit on the second SIGTERM")
    with pytest.raises(Exception) as e:
        pending.get_result()
    assert "exited" in str(e.value)
    assert "second SIGTERM: exiting at once" in srv.log_text()
    wait_for(lambda: srv.model_ready("sleeper"), 30, "the worker to be restarted")


def test_sigterm_stops_the_launcher_and_leaves_nothing(repo):
    s = Server(repo)
    _infer(s.url, "custom_metrics", 1.0)
    procs = descendants(s.proc.pid)
    assert s.stop(timeout=30) == 0
    for pid in procs:
        wait_for(lambda: not alive(pid), 10, f"process {pid} to exit")
    assert segments_of(s.proc.pid) == []
    assert "SIGTERM received: stopping the server" in s.log_text()


def test_second_sigint_forces_a_stuck_shutdown(repo):
    s = Server(repo, "--exit-timeout-secs", "300")
    try:
        c = httpclient.InferenceServerClient(s.url, network_timeout=120)
        send_sleeping(s, c, "sleeper", 1, delay_ms=60000)
        procs = descendants(s.proc.pid)
        s.proc.send_signal(signal.SIGTERM)
        # the drain now waits for a request that sleeps a minute
        wait_for(lambda: "SIGTERM received: stopping the server" in s.log_text(), 20,
                 "the launcher to start stopping")
        wait_for(lambda: not s.ready(), 20, "readiness to turn off")
        assert s.proc.poll() is None
        s.proc.send_signal(signal.SIGINT)
        s.proc.wait(timeout=20)
        assert s.proc.returncode == 128 + signal.SIGINT
        for pid in procs:
            wait_for(lambda: not alive(pid), 10, f"process {pid} to exit")
        assert segments_of(s.proc.pid) == []
        assert "second SIGINT: killing" in s.log_text()
    finally:
        s.stop()


def _scheduler_pid(srv) -> int:
    for pid in descendants(srv.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if "shmserve.engine.scheduler" in f.read():
                    return pid
        except OSError:
            continue
    raise AssertionError("no scheduler process")


def test_second_sigterm_forces_the_scheduler_out(repo):
    """The scheduler's first SIGTERM starts its drain, which here waits for a batch that
    sleeps a minute; a second one kills its workers and ends it at once."""
    s = Server(repo, "--exit-timeout-secs", "300")
    try:
        c = httpclient.InferenceServerClient(s.url, network_timeout=120)
        send_sleeping(s, c, "sleeper", 1, delay_ms=60000)
        sched = _scheduler_pid(s)
        workers = descendants(sched)
        os.kill(sched, signal.SIGTERM)
        wait_for(lambda: "stopping: waiting up to 300s" in s.log_text(), 20,
                 "the scheduler to start its drain")
        assert alive(sched)
        os.kill(sched, signal.SIGTERM)
        wait_for(lambda: not alive(sched), 20, "the scheduler to exit on the second SIGTERM")
        for pid in workers:
            wait_for(lambda: not alive(pid), 10, f"worker {pid} to exit")
        assert "second SIGTERM: killing the workers and exiting" in s.log_text()
        # the launcher sees a core process die and stops the server, cleaning up after it
        s.proc.wait(timeout=60)
        assert s.proc.returncode == 1
        assert segments_of(s.proc.pid) == []
    finally:
        s.stop()


def _seen(result) -> dict:
    return json.loads(result.as_numpy("SEEN")[0])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sequence_parameters_reach_the_model(srv, protocol):
    """sequence_id/start/end become request.correlation_id() and request.flags(); reserved
    parameters are not passed on as custom ones, others are."""
    mod = httpclient if protocol == "http" else grpcclient
    c = mod.InferenceServerClient(srv.url if protocol == "http" else srv.grpc_url)
    inp = mod.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
    r = c.infer("sequence_echo", [inp], sequence_id=42, sequence_start=True, priority=0,
                parameters={"note": "kept"})
    assert _seen(r) == {"id": 42, "flags": 1, "params": {"note": "kept"}}
    r = c.infer("sequence_echo", [inp], sequence_id="user-7", sequence_end=True)
    assert _seen(r) == {"id": "user-7", "flags": 2, "params": {}}
    r = c.infer("sequence_echo", [inp])
    assert _seen(r) == {"id": 0, "flags": 0, "params": {}}


def test_bad_sequence_parameters_name_the_field(srv):
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    for params, field in (({"sequence_id": -1}, "sequence_id"), ({"sequence_id": 1.5}, "sequence_id"),
                          ({"sequence_start": 1}, "sequence_start")):
        r = requests.post(f"{srv.base}/v2/models/sequence_echo/infer",
                          json={**body, "parameters": params}, timeout=30)
        assert r.status_code == 400 and f"'{field}'" in r.json()["error"]


def test_a_model_sees_the_argv_of_tritons_stub(srv):
    """Not the worker's own arguments, which unittest.main() in a model took for test names."""
    c = httpclient.InferenceServerClient(srv.url)
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, dtype=np.float32))
    seen = c.infer("argv_echo", [inp]).as_numpy("SEEN")[0]
    assert json.loads(seen) == [""]
