"""Workers forked from the fork server (engine/processes/forkserver.py, workers/zygote.py; issue 18): they
read in /proc as spawned workers do, are the scheduler's children, die with it, draw their own
random numbers; a model can ask for a fresh interpreter; a killed fork server comes back and
no load is lost meanwhile; --worker-start=spawn spawns every worker as before."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, alive, descendants, wait_for

from shmserve.engine.lifecycle import execution_env

DRAW = '''
import os, random
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        # drawn before any request, so the order requests come in cannot matter
        self.draw = np.concatenate([np.random.random(4), [random.random()]])

    def execute(self, requests):
        out = []
        for r in requests:
            pid = np.array([os.getpid()], dtype=np.int64)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("DRAW", self.draw),
                                                   pb_utils.Tensor("PID", pid)]))
        return out
'''

CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "DRAW", data_type: TYPE_FP64, dims: [ 5 ] },
             { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
'''

OPT_OUT = CONFIG + '''
    parameters { key: "FORK_WORKER" value: { string_value: "false" } }
'''

ENV_PATH = CONFIG + '''
    parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }
'''

EXE = os.fsencode(sys.executable)
MARK = b"SHMSERVE_ZYGOTE=1"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("forkserver"))
    for name in ("draw_a", "draw_b", "late"):
        write_model(root, name, CONFIG, DRAW)
    write_model(root, "opt_out", OPT_OUT, DRAW)
    write_model(root, "env_path", ENV_PATH, DRAW)
    # an unpacked execution environment (engine/lifecycle/execution_env.py): the worker starts
    # in engine/processes/env_worker.py, which execs workers/env_start.py
    os.makedirs(os.path.join(root, "env_path", "env", "lib", execution_env.python_dir(), "site-packages"))
    return root


def _explicit(*models: str) -> list[str]:
    args = ["--model-control-mode", "explicit"]
    for m in models:
        args += ["--load-model", m]
    return args


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, *_explicit("draw_a", "draw_b", "opt_out", "env_path"))
    yield s
    assert s.stop() == 0


def _read(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[str]:
    return _read(pid, "stat").decode().rsplit(")", 1)[1].split()


def _ppid(pid: int) -> int:
    return int(_stat(pid)[1])


def _workers(server, model: str) -> list[int]:
    return [p for p in descendants(server.proc.pid)
            if f'"model_name":"{model}"'.encode() in _read(p, "cmdline")]


def _worker(server, model: str) -> int:
    return wait_for(lambda: (_workers(server, model) or [None])[0], 30, f"a worker of {model}")


def _role(server, module: str) -> list[int]:
    return [p for p in descendants(server.proc.pid)
            if module.encode() in _read(p, "cmdline").split(b"\0")]


def _zygotes(server) -> list[int]:
    """The fork server: the scheduler's child with that module (not one of its own passing
    children, an intermediate of a fork or its import probe, which show the same command line)."""
    (scheduler,) = _role(server, "shmserve.engine.scheduler")
    return [p for p in _role(server, "shmserve.workers.zygote") if _ppid(p) == scheduler]


def _forked(pid: int) -> bool:
    """Forked workers carry the fork server's environment block (/proc/<pid>/environ is the
    memory the process started with, which a fork copies and an exec replaces)."""
    return MARK in _read(pid, "environ").split(b"\0")


def _infer(server, model: str) -> tuple[np.ndarray, int]:
    c = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        inp = httpclient.InferInput("INPUT0", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], dtype=np.int32))
        r = c.infer(model, [inp])
        return r.as_numpy("DRAW"), int(r.as_numpy("PID")[0])
    finally:
        c.close()


def test_a_forked_worker_reads_in_proc_as_a_spawned_one(srv):
    (scheduler,) = _role(srv, "shmserve.engine.scheduler")
    assert len(_zygotes(srv)) == 1
    pid = _worker(srv, "draw_a")
    assert _infer(srv, "draw_a")[1] == pid
    assert _forked(pid)
    # the command line a spawned worker has, its label first: NUL-separated, NUL-padded
    argv = _read(pid, "cmdline").rstrip(b"\0").split(b"\0")
    assert argv[:3] == [EXE, b"-m", b"shmserve.workers.main"] and len(argv) == 4, argv
    label = json.loads(argv[3])
    assert label["model_name"] == "draw_a" and label["instance_name"].startswith("draw_a_")
    assert os.readlink(f"/proc/{pid}/exe") == os.path.realpath(sys.executable)
    # the scheduler's child (re-parented from the fork server), in a session of its own
    fields = _stat(pid)
    assert int(fields[1]) == scheduler
    assert int(fields[2]) == pid and int(fields[3]) == pid     # process group, session


def test_forked_workers_draw_different_random_numbers(srv):
    a, pid_a = _infer(srv, "draw_a")
    b, pid_b = _infer(srv, "draw_b")
    assert _forked(pid_a) and _forked(pid_b)
    assert not np.array_equal(a[:4], b[:4]), "numpy's global generator was not re-seeded"
    assert a[4] != b[4], "random was not re-seeded"


@pytest.mark.parametrize("model", ["opt_out", "env_path"])
def test_a_model_can_ask_for_a_fresh_interpreter(srv, model):
    (scheduler,) = _role(srv, "shmserve.engine.scheduler")
    pid = _worker(srv, model)
    assert _infer(srv, model)[1] == pid
    assert not _forked(pid)
    assert os.readlink(f"/proc/{pid}/exe") == os.path.realpath(sys.executable)
    assert _ppid(pid) == scheduler
    # exactly what the scheduler exec'ed: no padding, the arguments file last
    argv = _read(pid, "cmdline").split(b"\0")
    # a model with an execution environment: workers/env_start.py, which runs workers/main.py
    module = b"shmserve.workers.env_start" if model == "env_path" else b"shmserve.workers.main"
    assert argv[-1] == b"" and argv[:3] == [EXE, b"-m", module], argv
    assert len(argv) == 6 and argv[4].endswith(b".args.json"), argv


def test_workers_and_the_fork_server_die_with_a_killed_scheduler(repo):
    s = Server(repo, *_explicit("draw_a"))
    try:
        worker = _worker(s, "draw_a")
        assert _forked(worker)
        (zygote,) = _zygotes(s)
        (scheduler,) = _role(s, "shmserve.engine.scheduler")
        os.kill(scheduler, signal.SIGKILL)
        # the parent-death signal the worker asked for once it was the scheduler's child
        wait_for(lambda: not alive(worker), 10, "the forked worker to die with the scheduler")
        wait_for(lambda: not alive(zygote), 10, "the fork server to die with the scheduler")
        s.proc.wait(timeout=60)
        assert s.proc.returncode == 1
    finally:
        s.stop()


def test_a_killed_fork_server_is_restarted_and_loads_go_on(repo):
    s = Server(repo, *_explicit("draw_a"))
    try:
        (zygote,) = _zygotes(s)
        os.kill(zygote, signal.SIGKILL)
        wait_for(lambda: f"the fork server (pid {zygote}) exited (killed by SIGKILL)"
                 in s.log_text(), 20, "the scheduler to notice the fork server's death")
        c = httpclient.InferenceServerClient(s.url, network_timeout=60)
        # whether the new fork server is ready yet or not, the load succeeds
        c.load_model("late")
        assert c.is_model_ready("late")
        _infer(s, "late")
        wait_for(lambda: [p for p in _zygotes(s) if p != zygote], 30, "a new fork server")
        # once it has finished its imports, workers are forked from it again (a reload makes a
        # new worker each time; the first ones may still be spawned)
        cfg = json.dumps(c.get_model_config("late"))

        def reloaded_forked():
            c.load_model("late", config=cfg)
            return _forked(_infer(s, "late")[1])
        wait_for(reloaded_forked, 60, "a worker forked by the new fork server", interval=0.2)
        assert _infer(s, "draw_a")[0].shape == (5,)
        c.close()
    finally:
        assert s.stop() == 0


def test_worker_start_spawn_starts_fresh_interpreters(repo):
    s = Server(repo, *_explicit("draw_a", "draw_b"), "--worker-start", "spawn")
    try:
        assert _zygotes(s) == []
        for model in ("draw_a", "draw_b"):
            pid = _worker(s, model)
            assert _infer(s, model)[1] == pid
            assert not _forked(pid)
            argv = _read(pid, "cmdline").split(b"\0")
            assert argv[:3] == [EXE, b"-m", b"shmserve.workers.main"] and len(argv) == 6
        assert not np.array_equal(_infer(s, "draw_a")[0], _infer(s, "draw_b")[0])
    finally:
        assert s.stop() == 0


def test_worker_start_refuses_other_values():
    r = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", "/x",
                        "--worker-start", "thread"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--worker-start" in r.stderr
