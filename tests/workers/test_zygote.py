"""The fork server's parts (workers/zygote.py, engine/processes/forkserver.py) without a server: the
command line a forked worker writes over its arguments, the models that opt out, the refusal
to fork with a thread running, OpenBLAS's threads and the import probe, and the whole hand-over
(a worker re-parented to a subreaper, running only after its "go") in a harness process."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import msgspec
import pytest

from shmserve.engine.processes.supervision import fork_opt_out
from shmserve.ipc.fork_protocol import ForkReply, ForkRequest
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers import zygote

LABEL = '{"model_name":"unit","version":1,"instance_name":"unit_0","spawn_id":7}'


def _run(script: str, *args: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_command_line_is_written_over_the_arguments():
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f'''
            import sys
            from shmserve.workers import zygote
            zygote.set_title(zygote.worker_argv({LABEL!r}))
            try:
                zygote.set_title([b"x" * 5000])
            except ValueError:
                print("too long refused", flush=True)
            sys.stdin.read()
         '''), " " * 1000],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "too long refused\n"
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            cmdline = f.read()
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    argv = cmdline.rstrip(b"\0").split(b"\0")
    assert argv == [os.fsencode(sys.executable), b"-m", b"shmserve.workers.main", LABEL.encode()]
    assert set(cmdline[len(zygote.title_bytes(argv)):]) == {0}     # padding: NULs only


def _spec(backend: str, params: dict) -> InstanceSpec:
    cfg = {"name": "m", "backend": backend,
           "parameters": {k: {"string_value": v} for k, v in params.items()}}
    return InstanceSpec("m", 1, "/x", json.dumps(cfg), "m_0", "CPU", 0, backend)


@pytest.mark.parametrize("backend,params,why", [
    ("python", {}, ""),
    ("python", {"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}, "EXECUTION_ENV_PATH"),
    ("python", {"EXECUTION_ENV_PATH": ""}, ""),
    ("onnxruntime", {"EXECUTION_ENV_PATH": "x"}, ""),
    ("onnxruntime", {"FORK_WORKER": "false"}, "FORK_WORKER"),
    ("python", {"FORK_WORKER": " No "}, "FORK_WORKER"),
    ("python", {"FORK_WORKER": "0"}, "FORK_WORKER"),
    ("python", {"FORK_WORKER": "true"}, ""),
])
def test_which_models_get_a_fresh_interpreter(backend, params, why):
    assert fork_opt_out(_spec(backend, params)) == why


def test_the_zygote_refuses_to_fork_while_a_thread_runs(monkeypatch):
    """serve() checks before each fork; with a thread alive it answers 'refuse for good' and
    never forks (this test process has threads, so nothing is forked here)."""
    forks = []
    monkeypatch.setattr(zygote, "fork_worker", lambda req: forks.append(req))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    replies = []

    def scheduler():
        for seq in (1, 2):
            mine.send(msgspec.msgpack.encode(ForkRequest(seq, LABEL, "/nonexistent", 1)))
            mine.settimeout(30)
            replies.append(msgspec.msgpack.decode(mine.recv(4096), type=ForkReply))
        mine.close()                            # the zygote's loop ends on EOF
    t = threading.Thread(target=scheduler)
    t.start()
    try:
        zygote.serve(theirs, os.getppid())
    finally:
        t.join(30)
        theirs.close()
    assert forks == []
    assert [r.seq for r in replies] == [1, 2]
    assert all(r.pid == 0 and r.refuse_for_good and "threads" in r.error for r in replies)


def test_openblas_threads_stop_and_the_probe_keeps_threads_out(tmp_path):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    res = _run('''
        import json, sys
        import numpy
        from shmserve.workers import zygote
        sys.path.insert(0, sys.argv[1])
        out = {"before": zygote.thread_count(), "stopped": zygote.stop_openblas_threads()}
        out["after"] = zygote.single_threaded(zygote.SETTLE_S)
        out["json"] = zygote.probe_import("json")
        out["threads"] = zygote.probe_import("starts_a_thread")
        out["missing"] = zygote.probe_import("no_such_module_here")
        out["imported"] = "starts_a_thread" in sys.modules
        out["end"] = zygote.single_threaded(zygote.SETTLE_S)
        print(json.dumps(out))
    ''', str(tmp_path))
    if res["stopped"]:                          # numpy's BLAS is OpenBLAS
        assert res["after"]
    assert res["json"] == [True, ""]
    assert res["threads"][0] is False and "starts 1 thread(s)" in res["threads"][1]
    assert res["missing"] == [False, "not installed"]
    assert not res["imported"]
    assert res["end"] == res["after"]


HARNESS = '''
    import json, os, select, signal, sys, time
    from shmserve.engine.processes import forkserver
    from shmserve.engine.processes.supervision import become_subreaper
    from shmserve.ipc.fork_protocol import ForkRequest
    from shmserve.workers import zygote

    LABEL = sys.argv[1]
    tmp = sys.argv[2]
    assert become_subreaper()
    out = {}

    def stat(pid):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()

    def feed(path, data, pid):
        """The worker blocks opening its arguments file (a FIFO) until we open it to write:
        then it is in its main, its command line written. Returns that command line."""
        deadline = time.monotonic() + 30
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert time.monotonic() < deadline, "the worker never opened its arguments"
                time.sleep(0.01)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        os.write(fd, data)
        os.close(fd)
        return [a.decode() for a in cmdline.rstrip(b"\\0").split(b"\\0")]

    def wait_exit(pid, pidfd):
        assert select.select([pidfd], [], [], 30)[0], "the worker did not exit"
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)          # only works for a child of ours
        return os.waitstatus_to_exitcode(status)

    # 1. through the fork server: the worker is our child, in its own session, with the label
    fs = forkserver.ForkServer()
    fs.start()
    fifo = os.path.join(tmp, "w7.args.json")
    os.mkfifo(fifo)
    forked = fs.fork(LABEL, fifo)
    assert forked is not None, "the first fork waits for the fork server's imports"
    pid, pidfd = forked
    out["argv"] = feed(fifo, b"{}", pid)        # not WorkerArgs: the worker's main fails
    # read once it is in its main: its setsid() may come after the fork server has answered
    # (it is unreaped until wait_exit, so its /proc entry stays)
    fields = stat(pid)
    out["ppid_is_us"] = int(fields[1]) == os.getpid()
    out["own_session"] = int(fields[2]) == pid and int(fields[3]) == pid
    out["exit"] = wait_exit(pid, pidfd)

    # 2. a killed fork server is started again; forks resume once it is ready
    old = fs.pid
    os.kill(old, signal.SIGKILL)
    assert select.select([fs.pidfd], [], [], 30)[0]
    assert fs.exited()
    out["restarted"] = fs.pid is not None and fs.pid != old
    deadline = time.monotonic() + 60
    fifo2 = os.path.join(tmp, "w8.args.json")
    os.mkfifo(fifo2)
    while (forked := fs.fork(LABEL, fifo2)) is None:
        assert time.monotonic() < deadline, "no fork from the restarted fork server"
        time.sleep(0.05)
    pid, pidfd = forked
    out["ppid_after_restart"] = int(stat(pid)[1]) == os.getpid()
    feed(fifo2, b"{}", pid)
    wait_exit(pid, pidfd)
    fs.close()
    out["closed"] = fs.pid is None

    # 3. a worker that never hears "go" exits without running anything
    fifo3 = os.path.join(tmp, "w9.args.json")
    os.mkfifo(fifo3)
    pid, go = zygote.fork_worker(ForkRequest(1, LABEL, fifo3, os.getpid()))
    pidfd = os.pidfd_open(pid)
    os.close(go)                                # what a scheduler that never got the answer does
    out["no_go_exit"] = wait_exit(pid, pidfd)
    print(json.dumps(out))
'''


def test_a_forked_worker_is_handed_over_to_the_subreaper(tmp_path):
    res = _run(HARNESS, LABEL, str(tmp_path))
    assert res["ppid_is_us"] and res["own_session"]
    assert res["argv"] == [sys.executable, "-m", "shmserve.workers.main", LABEL]
    assert res["exit"] == 1                     # its main ran, and refused the arguments
    assert res["restarted"] and res["ppid_after_restart"] and res["closed"]
    assert res["no_go_exit"] == 1


def test_a_fork_server_that_keeps_dying_is_given_up(monkeypatch, caplog):
    """Started again at once, then after 1, 2, 4 s; the fifth death in a row ends forking."""
    from shmserve.engine.processes import forkserver
    starts = []
    fs = forkserver.ForkServer()
    monkeypatch.setattr(fs, "start", lambda: starts.append(1))
    delays = []
    for _ in range(4):
        fs.lost("exited (killed by SIGKILL)", pid=1)
        delays.append(round(fs.restart_at - forkserver.time.monotonic()))
        assert not fs.disabled
    assert starts == [1] and delays == [0, 1, 2, 4]
    fs.lost("exited (killed by SIGKILL)", pid=1)
    assert fs.disabled and "5 times in a row" in fs.disabled
    assert fs.fork(LABEL, "/nonexistent") is None
    fs.maintain(forkserver.time.monotonic() + 3600)
    assert starts == [1]
    assert "workers start as fresh interpreters from now on" in caplog.text
