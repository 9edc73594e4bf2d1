"""Start-up with bad models, command-line errors, and shutdown that leaves nothing behind."""
import glob
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from repo_builder import build_bad_repository, write_model
from serverproc import Server, alive, descendants, segments_of, send_sleeping, wait_for


@pytest.fixture(scope="module")
def bad_repo(tmp_path_factory):
    return build_bad_repository(str(tmp_path_factory.mktemp("bad")))


def _index(server):
    r = requests.post(f"{server.base}/v2/repository/index", timeout=10)
    return {e["name"]: e for e in r.json()}


def test_bad_models_are_unavailable_with_reasons_and_good_ones_serve(bad_repo):
    srv = Server(bad_repo, wait_ready=False)
    try:
        wait_for(lambda: srv.model_ready("good"), 60, "model 'good' to be ready")
        wait_for(lambda: all(e["state"] != "LOADING" for e in _index(srv).values()), 60,
                 "every model to finish loading")
        idx = _index(srv)
        assert idx["good"]["state"] == "READY"
        expected = {
            "bad_pbtxt": "failed to parse",
            "no_model_file": "Python model file not found in ",
            "bad_init": "initialize failed on purpose",
            "wrong_name": "does not match the directory name",
            "bad_backend": "unable to find backend library for backend 'tensorflow'",
            # Triton's words for a python model's process that died loading, then ours
            "init_exit": "Stub process 'init_exit_0_0' is not healthy. (worker process of "
                         "instance 'init_exit_0_0' exited unexpectedly",
        }
        if not _has_cuda_provider():
            expected["onnx_gpu"] = "CUDA execution provider"
        for name, text in expected.items():
            assert idx[name]["state"] == "UNAVAILABLE", idx[name]
            assert text in idx[name]["reason"], idx[name]
        assert "failed to load 'init_exit': Stub process" in srv.log_text()
        # strict readiness (Triton's default): not ready while a model is unavailable
        assert requests.get(f"{srv.base}/v2/health/ready", timeout=10).status_code == 400
        r = requests.post(f"{srv.base}/v2/models/bad_init/infer", json={"inputs": []}, timeout=10)
        assert r.status_code == 404 and "initialize failed on purpose" in r.json()["error"]
        assert requests.get(f"{srv.base}/v2/models/bad_init/ready", timeout=10).status_code == 400
        c = httpclient.InferenceServerClient(srv.url)
        x = np.ones((1, 3), dtype=np.float32)
        i = httpclient.InferInput("INPUT0", x.shape, "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("good", [i]).as_numpy("OUTPUT0"), x)
    finally:
        assert srv.stop() == 0


def _has_cuda_provider() -> bool:
    import onnxruntime
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def test_strict_readiness_off_and_exit_on_error(bad_repo):
    srv = Server(bad_repo, "--strict-readiness", "false")
    assert srv.stop() == 0
    # it may exit before its frontend has written the port file: do not wait for that
    srv = Server(bad_repo, "--exit-on-error", "true", wait_ports=False)
    try:
        srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert srv.proc.returncode == 1
    assert "exit-on-error" in srv.log_text()
    assert segments_of(srv.proc.pid) == []


def _leaves_nothing(srv: Server, sig: int):
    procs = descendants(srv.proc.pid)
    # launcher, scheduler, frontend, and one worker per instance: 4 models, mlp_onnx has 2
    assert len(procs) >= 2 + 5, procs
    assert segments_of(srv.proc.pid), "the frontend should have received a large body into shm"
    assert srv.stop(sig) == 0
    for pid in procs:
        wait_for(lambda: not alive(pid), 10, f"process {pid} to exit")
    assert segments_of(srv.proc.pid) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_stops_every_process_and_unlinks_every_segment(example_repo, sig):
    srv = Server(example_repo)
    c = httpclient.InferenceServerClient(srv.url)
    x = np.ones((1, 1 << 18), dtype=np.float32)        # 1 MiB: travels through shared memory
    i = httpclient.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    c.infer("identity_fp32", [i])
    _leaves_nothing(srv, sig)


@pytest.mark.parametrize("module", ["shmserve.engine.scheduler", "shmserve.frontend.main"])
def test_core_process_death_stops_the_server(example_repo, module):
    srv = Server(example_repo)
    procs = descendants(srv.proc.pid)
    victim = next(p for p in procs if module in open(f"/proc/{p}/cmdline").read())
    os.kill(victim, signal.SIGKILL)
    srv.proc.wait(timeout=60)
    assert srv.proc.returncode == 1
    for pid in procs:
        wait_for(lambda: not alive(pid), 10, f"process {pid} to exit")
    assert segments_of(srv.proc.pid) == []
    srv.stop()


def test_stale_segments_of_a_killed_server_are_removed(example_repo):
    # a name in shmserve's format whose launcher pid cannot exist
    stale = "/dev/shm/shmserve_4194999_deadbeef0000_f0_0"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    srv = Server(example_repo)
    try:
        assert not os.path.exists(stale)
    finally:
        srv.stop()


def test_leftovers_named_after_the_launchers_own_pid_are_removed(example_repo):
    """In a container every launcher is pid 1, and /dev/shm and /tmp may outlive a restart: a
    launcher that starts finds what an earlier pid 1 left under its own pid, and removes it (it
    has made nothing yet). The launcher runs as pid 1 of a pid namespace of its own."""
    if subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare -p needs root)")
    token = os.urandom(6).hex()
    stale_segment = f"/dev/shm/shmserve_1_{token}_f0_0"
    with open(stale_segment, "wb") as f:
        f.write(b"\0" * 4096)
    # a temp dir of its own, short (its sockets' paths must fit 107 characters)
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="pid1-"))
    stale_dir = tmp_path / "shmserve-1-leftover"
    stale_dir.mkdir()
    (stale_dir / "scheduler.sock").write_bytes(b"")
    port_file = tmp_path / "ports.json"
    proc = subprocess.Popen(
        ["unshare", "-p", "-f", "--mount-proc", "--kill-child", sys.executable, "-m",
         "shmserve.engine.launch.cli", "--model-repository", example_repo, "--http-port", "0",
         "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--port-file", str(port_file)],
        env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, 90,
                 "the pid-1 launcher to listen")
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        assert not os.path.exists(stale_segment)
        assert not stale_dir.exists()
        # its own run directory, named after pid 1 too, is there
        assert [p.name.split("-")[1] for p in tmp_path.glob("shmserve-*")] == ["1"]
        [launcher] = descendants(proc.pid)[:1]
        os.kill(launcher, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if os.path.exists(stale_segment):
            os.unlink(stale_segment)
        left = list(tmp_path.glob("shmserve-*"))
        shutil.rmtree(tmp_path, ignore_errors=True)
    out = proc.stdout.read().decode(errors="replace")
    assert "removed 1 shared-memory segment(s) left by a server that was killed" in out, out
    assert not left


def test_a_temp_dir_too_long_for_unix_sockets_is_one_clear_line(example_repo, tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    r = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository",
                        example_repo, "--http-port", "0", "--grpc-port", "0", "--metrics-port",
                        "0"], env={**os.environ, "TMPDIR": str(deep)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert "set TMPDIR to a shorter directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert list(deep.iterdir()) == []


def test_run_dir_of_a_killed_server_is_removed(example_repo):
    """A launcher killed with SIGKILL leaves its run directory (sockets, worker argument files)
    in the temp dir; the next start removes it, and only such directories. Both servers use a
    temp dir of their own (TMPDIR), so that another server starting on the host meanwhile, which
    would clean up the same way, cannot take the directories from under the test."""
    import shutil
    import signal
    import tempfile
    tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")        # short: sockets live under it
    env = {"TMPDIR": tmp}
    fake = os.path.join(tmp, "shmserve-4194999-abc")        # no pid is that large
    os.makedirs(os.path.join(fake, "sub"), exist_ok=True)
    mine = os.path.join(tmp, "shmserve-notapid-abc")        # not a name the launcher makes
    os.makedirs(mine, exist_ok=True)
    first = Server(example_repo, env=env)
    run_dir = [d for d in os.listdir(tmp) if d.startswith(f"shmserve-{first.proc.pid}-")]
    assert len(run_dir) == 1
    procs = descendants(first.proc.pid)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    for pid in procs:
        wait_for(lambda: not alive(pid), 20, f"process {pid} of the killed server to exit")
    assert os.path.isdir(os.path.join(tmp, run_dir[0]))
    second = Server(example_repo, env=env)
    try:
        assert not os.path.exists(fake) and not os.path.exists(os.path.join(tmp, run_dir[0]))
        assert os.path.isdir(mine)
    finally:
        second.stop()
        first.log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_errors_are_clear():
    r = _cli("--model-repository", "/nonexistent", "--bogus-flag")
    assert r.returncode == 2 and "unrecognized arguments: --bogus-flag" in r.stderr
    r = _cli("--http-port", "1")
    assert r.returncode == 2 and "--model-repository" in r.stderr
    r = _cli("--model-repository", "/nonexistent/repo")
    assert r.returncode == 1 and "is not a directory" in r.stderr
    r = _cli("--model-repository", "/tmp", "--strict-readiness", "maybe")
    assert r.returncode == 2 and "expected a boolean" in r.stderr


def _queued(srv: Server, model: str) -> int:
    """The scheduler's queue of ``model`` (nv_inference_pending_request_count)."""
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count{") and f'model="{model}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_sigterm_answers_every_request_in_flight(test_repo):
    # no leases: every request waits in the scheduler's queue, where the test can count them
    srv = Server(test_repo, "--exit-timeout-secs", "20", "--instance-leases", "false")
    c = httpclient.InferenceServerClient(srv.url, concurrency=8, network_timeout=60)
    pending = send_sleeping(srv, c, "pid_slow", 8, delay_ms=400)
    # all 8 in flight (2 executing, 6 queued) before the signal: one still connecting would be
    # refused, which is not what this test is about
    stats = httpclient.InferenceServerClient(srv.url)

    def arrived() -> int:       # queued, plus 2 executing while any is queued, plus answered
        done = stats.get_inference_statistics("pid_slow")["model_stats"][0]["inference_count"]
        queued = _queued(srv, "pid_slow")
        return queued + (2 if queued else 0) + int(done)
    wait_for(lambda: arrived() >= 8, 20, "all 8 requests to reach the server")
    t = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    # the launcher's handler marks the stop for the frontends at once (ipc/proc.py)
    [mark] = glob.glob(os.path.join(tempfile.gettempdir(), f"shmserve-{srv.proc.pid}-*",
                                    "stopping"))
    wait_for(lambda: open(mark, "rb").read() == b"\x01", 10, "the launcher's stopping mark")
    # not ready any more as soon as the drain starts
    wait_for(lambda: not srv.ready(), 10, "readiness to turn off")
    for i, p in enumerate(pending):
        assert p.get_result().as_numpy("OUTPUT0")[0, 0] == i      # none lost
    assert srv.proc.wait(timeout=60) == 0       # not srv.stop(): a second SIGTERM forces the exit
    srv.stop()
    print(f"shutdown with 8 requests in flight took {time.monotonic() - t:.2f} s")
    assert segments_of(srv.proc.pid) == []


def _infer_status(srv: Server, model: str = "pid_slow") -> tuple[int, str]:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                        "data": [0, 0, 0, 0]}]}
    try:
        r = requests.post(f"{srv.base}/v2/models/{model}/infer", json=body, timeout=10)
    except requests.ConnectionError as e:
        return 0, str(e)
    return r.status_code, r.text


def test_exit_grace_serves_while_not_ready_then_refuses(test_repo):
    """--exit-grace-secs: after SIGTERM the server answers "not ready" at once, as a load
    balancer's health check needs, yet still serves requests until the grace period ends; then
    it refuses them as without the flag, and exits 0."""
    srv = Server(test_repo, "--exit-grace-secs", "3")
    try:
        assert _infer_status(srv)[0] == 200
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not srv.ready(), 10, "readiness to turn off")
        # gRPC says so too: ServerReady, and the standard health service
        with grpc.insecure_channel(srv.grpc_url) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not grpcclient.InferenceServerClient(srv.grpc_url).is_server_ready()
        served = 0
        while time.monotonic() - t < 1.5:   # well inside the grace period: every one served
            code, text = _infer_status(srv)
            assert code == 200, text
            served += 1
        assert srv.proc.poll() is None
        # then refused with Triton's words, while in-flight work would still be answered
        code, text = wait_for(lambda: (r := _infer_status(srv))[0] != 200 and r, 20,
                              "requests to be refused after the grace period")
        assert code in (0, 503), text
        assert code == 0 or "the server is shutting down" in text
        assert srv.proc.wait(timeout=60) == 0
        assert time.monotonic() - t >= 3
        print(f"{served} requests served during the first 1.5 s of a 3 s grace period")
    finally:
        srv.stop()
    assert segments_of(srv.proc.pid) == []


def test_exit_grace_is_bounded():
    for bad in ("-1", "3601", "nan"):
        r = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli",
                            "--model-repository", "/nonexistent", "--exit-grace-secs", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (bad, r.stderr)
        assert "--exit-grace-secs" in r.stderr


def test_overload_is_refused_at_once(test_repo):
    srv = Server(test_repo, "--max-inflight-requests", "2")
    try:
        c = httpclient.InferenceServerClient(srv.url, concurrency=4, network_timeout=60)
        held = send_sleeping(srv, c, "pid_slow", 2, delay_ms=1500)
        x = np.ones((1, 4), dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        t = time.monotonic()
        with pytest.raises(Exception) as e:
            httpclient.InferenceServerClient(srv.url).infer("pid_slow", [inp])
        assert "503" in str(e.value) and "overloaded" in str(e.value)
        assert time.monotonic() - t < 1.0          # refused, not queued behind the others
        for h in held:
            h.get_result()
    finally:
        assert srv.stop() == 0


def test_exit_timeout_cancels_what_is_left(test_repo):
    srv = Server(test_repo, "--exit-timeout-secs", "1")
    c = httpclient.InferenceServerClient(srv.url, concurrency=2, network_timeout=60)
    (slow,) = send_sleeping(srv, c, "pid_slow", 1, delay_ms=8000)
    t = time.monotonic()
    assert srv.stop() == 0
    assert time.monotonic() - t < 6            # not the 8 s the request wanted
    with pytest.raises(Exception) as e:
        slow.get_result()
    assert "shutting down" in str(e.value) or "503" in str(e.value) or "closed" in str(e.value).lower()
    assert segments_of(srv.proc.pid) == []


GATED_LOAD = '''
import os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        gate = os.path.join(args["model_repository"], "open")
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)        # the test opens the gate once it has looked at the server

    def execute(self, requests):
        return [pb_utils.InferenceResponse([r.inputs()[0]]) for r in requests]
'''


def test_while_the_startup_load_runs_live_is_up_ready_is_not_and_the_index_lists_it(tmp_path):
    repo = str(tmp_path)
    write_model(repo, "gated", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
    ''', GATED_LOAD)
    srv = Server(repo, wait_ready=False)
    try:
        wait_for(lambda: requests.get(f"{srv.base}/v2/health/live", timeout=5).status_code == 200,
                 30, "the server to be live")
        # the first index a client reads is never empty-and-final: it names the loading model
        assert [(e["name"], e["state"]) for e in
                requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()] == \
            [("gated", "LOADING")]
        assert requests.get(f"{srv.base}/v2/health/ready", timeout=5).status_code == 400
        with open(os.path.join(repo, "gated", "open"), "w"):
            pass
        wait_for(lambda: requests.get(f"{srv.base}/v2/health/ready", timeout=5).status_code == 200,
                 60, "the server to be ready once the load finished")
        assert _index(srv)["gated"]["state"] == "READY"
    finally:
        assert srv.stop() == 0
