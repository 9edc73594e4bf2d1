"""What once left the server, a model or a request waiting for ever now ends in bounded time
(issue 13): a hung initialize() (load timeout), a SIGSTOPped worker, a request whose answer
never comes (the frontend's request deadline), and a log pipe that nobody reads."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from oshelpers import full_pipe
from repo_builder import IDENTITY, PID_SLOW, write_model
from serverproc import Server, alive, descendants, wait_for
from tritonclient.utils import InferenceServerException

IDENTITY_CONFIG = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
'''

HANG_INIT = '''
import threading

class TritonPythonModel:
    def initialize(self, args):
        threading.Event().wait()        # never returns

    def execute(self, requests):
        return []
'''

HANG_EXECUTE = '''
import threading

class TritonPythonModel:
    def execute(self, requests):
        threading.Event().wait()        # never returns
'''


def _serves(client, model: str = "good") -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer(model, [inp]).as_numpy("OUTPUT0"), x)


def _index(server) -> dict:
    return {e["name"]: e for e in
            requests.post(f"{server.base}/v2/repository/index", timeout=10).json()}


def _workers_of(server, model: str) -> list[int]:
    out = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if f'"model_name":"{model}"' in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


# ---- a hung initialize() ---------------------------------------------------------------------------
def test_a_hung_initialize_fails_the_load_after_the_load_timeout(tmp_path):
    repo = str(tmp_path)
    write_model(repo, "good", IDENTITY_CONFIG, IDENTITY)
    write_model(repo, "hangs", IDENTITY_CONFIG, HANG_INIT)
    srv = Server(repo, "--model-load-timeout-secs", "2", wait_ready=False)
    try:
        def failed():
            entry = _index(srv).get("hangs", {})
            return entry if entry.get("state") == "UNAVAILABLE" else None
        entry = wait_for(failed, 30, "the hung load to fail")
        assert "did not become ready within 2 s" in entry["reason"]
        assert "initialize() hung?" in entry["reason"]
        wait_for(lambda: not _workers_of(srv, "hangs"), 10, "the hung worker to be killed")
        c = httpclient.InferenceServerClient(srv.url, network_timeout=30)
        _serves(c)                              # the other model serves
        c.close()
        assert srv.model_ready("good") and not srv.model_ready("hangs")
        assert not srv.ready()                  # strict readiness: a model failed to load
    finally:
        assert srv.stop() == 0


# ---- a SIGSTOPped worker ---------------------------------------------------------------------------
def _sleeping_pid(server, model: str):
    for pid in _workers_of(server, model):
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return pid
        except OSError:
            continue
    return None


def test_a_stopped_busy_worker_is_killed_and_its_request_retried(tmp_path):
    write_model(str(tmp_path), "slow", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
                 { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
        instance_group [ { count: 2, kind: KIND_CPU } ]
    ''', PID_SLOW)
    srv = Server(str(tmp_path))
    try:
        results, errors = [], []

        def slow():
            c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
            x = np.full((1, 4), 7, dtype=np.float32)
            inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
            inp.set_data_from_numpy(x)
            try:
                results.append(c.infer("slow", [inp], parameters={"delay_ms": 1500}))
            except Exception as e:          # noqa: BLE001 - reported by the assertion below
                errors.append(e)
            c.close()

        t = threading.Thread(target=slow)
        t.start()
        victim = wait_for(lambda: _sleeping_pid(srv, "slow"), 20, "the request to run")
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        t.join(60)                      # the execution timeout is 300 s: only the fix ends it
        took = time.monotonic() - stopped_at
        print(f"answered {took:.1f} s after the SIGSTOP")
        assert not t.is_alive() and errors == []
        assert int(results[0].as_numpy("PID")[0, 0]) != victim     # retried elsewhere
        wait_for(lambda: not alive(victim), 10, "the stopped worker to be killed")
        assert "was stopped" in srv.log_text()
        wait_for(lambda: len(_workers_of(srv, "slow")) == 2, 30, "the instance to restart")
    finally:
        assert srv.stop() == 0


# ---- the frontend's request deadline ------------------------------------------------------------------
def test_a_request_nobody_answers_gets_an_error_at_the_deadline(tmp_path):
    repo = str(tmp_path)
    write_model(repo, "good", IDENTITY_CONFIG, IDENTITY)
    write_model(repo, "hangs", IDENTITY_CONFIG, HANG_EXECUTE)
    srv = Server(repo, "--execution-timeout-secs", "0", "--request-deadline-secs", "2",
                 "--exit-timeout-secs", "2")
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        for _ in range(2):      # the first runs (and hangs), the second waits in the queue
            t = time.monotonic()
            with pytest.raises(InferenceServerException) as e:
                _serves(c, "hangs")
            print(f"error after {time.monotonic() - t:.1f} s: {e.value}")
            assert e.value.status() == "503"
            assert "Request timeout expired" in e.value.message()
            assert "--request-deadline-secs" in e.value.message()
            _serves(c)
        stats = c.get_inference_statistics("hangs")["model_stats"][0]
        assert stats["inference_stats"]["fail"]["count"] >= 1   # the queued one, cancelled
        c.close()
    finally:
        assert srv.stop() == 0


# ---- a log pipe that nobody reads ---------------------------------------------------------------------



def test_a_full_log_pipe_does_not_freeze_the_server(tmp_path):
    repo = str(tmp_path / "models")
    write_model(repo, "good", IDENTITY_CONFIG, IDENTITY)
    port_file = str(tmp_path / "ports.json")
    r, w = full_pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", repo,
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--port-file", port_file, "--log-verbose", "1", "--model-control-mode", "explicit",
         "--load-model", "good"],
        stdout=w, stderr=w, stdin=subprocess.DEVNULL)
    os.close(w)
    drained = bytearray()
    try:
        def ports():
            assert proc.poll() is None, proc.returncode
            try:
                with open(port_file) as f:
                    return json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                return None
        url = f"127.0.0.1:{wait_for(ports, 30, 'the server to listen')['http']}"
        c = httpclient.InferenceServerClient(url, network_timeout=20)
        wait_for(lambda: c.is_model_ready("good"), 30, "the model to load")
        cfg = c.get_model_config("good")
        cfg["parameters"] = {"execution_timeout_ms": {"string_value": "nan"}}
        cfg = json.dumps(cfg)
        for i in range(300):        # each refused load logs an error line in the scheduler
            with pytest.raises(InferenceServerException):
                c.load_model("good", config=cfg)
            if i % 50 == 0:
                _serves(c)
        c.unload_model("good")      # the scheduler's loop still runs: load and unload finish
        c.load_model("good")
        _serves(c)
        c.close()
        assert proc.poll() is None

        def drain():
            try:
                while chunk := os.read(r, 65536):
                    drained.extend(chunk)
            except OSError:
                pass
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        wait_for(lambda: b"failed to load 'good': parameter execution_timeout_ms" in drained, 20,
                 "the held log lines to come out once the pipe drains")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(r)
