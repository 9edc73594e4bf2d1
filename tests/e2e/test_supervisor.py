"""configs/supervisor/shmserve.conf under real supervisord: a killed server comes back ready."""
import json
import os
import signal
import subprocess
import sys
import textwrap

from serverproc import REPO_ROOT, alive, answers_ready, descendants, wait_for


def _ports(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _ready(port) -> bool:
    return answers_ready(f"http://127.0.0.1:{port}")


def test_supervisor_restarts_a_killed_server(tmp_path):
    port_file = tmp_path / "ports.json"
    with open(os.path.join(REPO_ROOT, "configs", "supervisor", "shmserve.conf")) as f:
        program = f.read()
    # the shipped program, on ports the OS picks, reporting them to a file
    program = program.replace("%(here)s/..", os.path.join(REPO_ROOT, "configs"))
    program = program.replace("--http-port 8000 --grpc-port 8001 --metrics-port 8002",
                              f"--http-port 0 --grpc-port 0 --metrics-port 0 --host 127.0.0.1 "
                              f"--port-file {port_file}")
    program = program.replace("command=shmserve ", f"command={sys.executable} -m shmserve.engine.launch.cli ")
    (tmp_path / "shmserve.conf").write_text(program)
    (tmp_path / "supervisord.conf").write_text(textwrap.dedent(f"""
        [supervisord]
        nodaemon=true
        logfile={tmp_path}/supervisord.log
        pidfile={tmp_path}/supervisord.pid
        childlogdir={tmp_path}

        [include]
        files = {tmp_path}/shmserve.conf
    """))
    sup = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c",
                            str(tmp_path / "supervisord.conf")], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = wait_for(lambda: _ports(port_file), 90, "shmserve to start under supervisord")
        wait_for(lambda: _ready(first["http"]), 90, "the first server to be ready")
        launcher = next(p for p in descendants(sup.pid)
                        if "shmserve.engine.launch.cli" in open(f"/proc/{p}/cmdline").read())
        children = descendants(launcher)
        os.kill(launcher, signal.SIGKILL)
        for pid in children:
            wait_for(lambda: not alive(pid), 20, f"process {pid} of the killed server to exit")
        second = wait_for(lambda: (lambda p: p if p and p != first else None)(_ports(port_file)),
                          90, "supervisord to start the server again")
        wait_for(lambda: _ready(second["http"]), 90, "the restarted server to be ready")
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve_{launcher}_")]
    finally:
        running = descendants(sup.pid)
        sup.send_signal(signal.SIGTERM)         # supervisord stops shmserve with SIGTERM
        try:
            sup.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(sup.pid, signal.SIGKILL)
            raise
    for pid in running:
        wait_for(lambda: not alive(pid), 20, f"process {pid} to exit with supervisord")
