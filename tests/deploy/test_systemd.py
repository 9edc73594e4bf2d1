"""configs/systemd/shmserve.service: systemd accepts it, and its ExecStart, stopped the way
the unit stops it, drains and leaves nothing behind.

There is no systemd running in the test environment, so the unit is checked in two halves:
``systemd-analyze verify`` reads it as systemd would, and the command line of its ExecStart
runs as a plain process, signalled as its KillSignal= and KillMode= say.
"""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import IDENTITY, write_model
from serverproc import REPO_ROOT, alive, descendants, segments_of, wait_for

UNIT = os.path.join(REPO_ROOT, "configs", "systemd", "shmserve.service")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values, in order (a key may repeat, e.g. Environment=). Comments
    (# and ;) and backslash continuations as systemd reads them."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        line, logical = logical + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting before any section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, str]:
    """The [Service] section, each key's last value (what systemd uses for a single-valued
    key)."""
    with open(UNIT) as f:
        return {k: v[-1] for k, v in parse_unit(f.read())["Service"].items()}


def console_script() -> str:
    """The installed shmserve console script (pip puts it beside the interpreter; a virtual
    environment's bin/), which is what the unit's ExecStart names."""
    beside = os.path.join(os.path.dirname(sys.executable), "shmserve")
    path = beside if os.access(beside, os.X_OK) else shutil.which("shmserve")
    assert path, "no shmserve console script: install the package (pip install -e .)"
    return os.path.abspath(path)


def exec_start_argv() -> list[str]:
    command = service()["ExecStart"]
    # shlex reads it as systemd does only without systemd's own expansions and prefixes
    assert "%" not in command and "$" not in command and command[0] not in "-@:+!", command
    argv = shlex.split(command)
    assert os.path.basename(argv[0]) == "shmserve" and os.path.isabs(argv[0]), argv[0]
    return argv


def seconds(value: str) -> float:
    """A systemd time span of the forms this unit uses: "75", "75s", "2min", "1min 15s"."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for part in value.split():
        number = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        total += float(number) * units[part[len(number):]]
    return total


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _verify(path) -> tuple[int, list[str]]:
    """systemd-analyze verify's exit status and the lines it printed about this unit file.
    Problems in a unit's settings (an unknown key, a value it cannot parse) are warnings that
    leave the exit status 0, so the lines count as much as the status; lines about the host's
    own units are not this test's business."""
    r = subprocess.run([SYSTEMD_ANALYZE, "verify", str(path)], capture_output=True, text=True,
                       timeout=60)
    ours = [line for line in (r.stdout + r.stderr).splitlines() if path.name in line]
    return r.returncode, ours


def _with_real_binary(text: str) -> str:
    """The unit with ExecStart's program replaced by the installed console script: verify
    checks that the program exists and is executable."""
    return text.replace(f"ExecStart={exec_start_argv()[0]} ", f"ExecStart={console_script()} ")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed "
                    "(Debian/Ubuntu: apt-get install systemd)")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    with open(UNIT) as f:
        text = _with_real_binary(f.read())
    assert console_script() in text
    path = tmp_path / "shmserve.service"
    path.write_text(text)
    code, ours = _verify(path)
    assert (code, ours) == (0, []), "\n".join(ours)
    # the check sees what systemd warns about: an unknown key and a bad value both exit 0
    bad = tmp_path / "shmserve-bad.service"
    bad.write_text(text.replace("KillMode=mixed", "KillMode=mixd\nKillSignall=SIGTERM"))
    code, ours = _verify(bad)
    assert code == 0 and len(ours) == 2, ours


def test_unit_settings_match_how_the_server_stops():
    s = service()
    argv = exec_start_argv()
    assert s["Type"] in ("exec", "simple")       # shmserve does not call sd_notify
    assert s["KillSignal"] == "SIGTERM"          # the signal that drains (SIGINT would too)
    # only the launcher gets SIGTERM; the default (control-group) would signal every worker
    assert s["KillMode"] == "mixed"
    # the launcher waits --exit-timeout-secs + 5 s for the frontends, then as long for the
    # scheduler: systemd's SIGKILL must come only after both
    exit_timeout = float(flag(argv, "--exit-timeout-secs"))
    assert seconds(s["TimeoutStopSec"]) >= 2 * (exit_timeout + 5)
    assert s["Restart"] == "on-failure"          # the launcher exits 1 when its server died
    assert s["OOMPolicy"] == "continue"          # a worker's OOM kill is the server's to mend
    # clients' /dev/shm segments are opened as this user and must survive a stop
    assert s.get("User") and s.get("DynamicUser", "no") == "no" and s["RemoveIPC"] == "no"
    assert s.get("PrivateDevices", "no") == "no"    # it would hide the GPUs


def _repository(root) -> str:
    repo = os.path.join(root, "models")
    write_model(repo, "identity", textwrap.dedent('''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    '''), IDENTITY)
    return repo


class UnitProcess:
    """The unit's ExecStart as systemd would run it: its own session (systemd makes the main
    process a session leader), the unit's Environment=, a /tmp of its own (PrivateTmp=), on
    a repository of one model and on ports the OS picks."""

    def __init__(self, tmp_path):
        argv = exec_start_argv()
        argv[0] = console_script()
        argv[argv.index("--model-repository") + 1] = _repository(tmp_path)
        for name in ("--http-port", "--grpc-port", "--metrics-port"):
            argv[argv.index(name) + 1] = "0"
        self.port_file = tmp_path / "ports.json"
        argv += ["--port-file", str(self.port_file)]
        # short: Unix socket paths in it must fit 107 characters (pytest's tmp_path may not)
        self.private_tmp = pathlib.Path(tempfile.mkdtemp(prefix="unit-tmp-"))
        with open(UNIT) as f:
            env_lines = parse_unit(f.read())["Service"].get("Environment", [])
        env = {**os.environ, "TMPDIR": str(self.private_tmp)}
        for line in env_lines:
            env.update(dict(item.split("=", 1) for item in shlex.split(line)))
        self.log_path = tmp_path / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def ports(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return json.loads(self.port_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def serve_one(self) -> list[int]:
        """Wait until it is ready, run one request; its processes (launcher's children on)."""
        ports = wait_for(self.ports, 90, "the server to write its port file")
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['http']}")
        wait_for(lambda: _ready(client), 90, "the server to be ready")
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer("identity", [inp]).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, x)
        pids = descendants(self.proc.pid)
        assert len(pids) >= 3, "expected a frontend, a scheduler and a worker"
        # its run directory is in the /tmp given to it, as under PrivateTmp=
        assert [n for n in os.listdir(self.private_tmp)
                if n.startswith(f"shmserve-{self.proc.pid}-")]
        return pids

    def left_nothing(self, pids: list[int]) -> None:
        wait_for(lambda: not any(alive(p) for p in pids), 10, "the server's processes to end")
        assert segments_of(self.proc.pid) == []
        # the run directory went with it (other files there are not the server's: importing
        # onnxruntime leaves a .ses file in $TMPDIR)
        assert [n for n in os.listdir(self.private_tmp) if n.startswith("shmserve-")] == []

    def cleanup(self) -> None:
        """Whatever happened: nothing of this server outlives the test (KillMode=mixed's
        final SIGKILL, by hand)."""
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.private_tmp, ignore_errors=True)


def _ready(client) -> bool:
    try:
        return client.is_server_ready()
    except Exception:       # not listening yet
        return False


def test_kill_signal_stops_the_server_cleanly_within_the_stop_timeout(tmp_path):
    s = service()
    server = UnitProcess(tmp_path)
    try:
        pids = server.serve_one()
        # KillMode=mixed: the KillSignal goes to the main process only
        os.kill(server.proc.pid, signal.Signals[s["KillSignal"]])
        try:
            code = server.proc.wait(timeout=seconds(s["TimeoutStopSec"]))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after TimeoutStopSec:\n{server.log()}")
        assert code == 0, server.log()       # 0: Restart=on-failure leaves it stopped
        server.left_nothing(pids)
    finally:
        server.cleanup()


def test_a_dead_scheduler_exits_non_zero_so_the_unit_restarts(tmp_path):
    """Restart=on-failure relies on it: the launcher of a server whose scheduler died exits
    non-zero (and cleans up), where a stop exits 0."""
    server = UnitProcess(tmp_path)
    try:
        pids = server.serve_one()
        scheduler = next(p for p in pids
                         if b"shmserve.engine.scheduler" in open(f"/proc/{p}/cmdline", "rb").read())
        os.kill(scheduler, signal.SIGKILL)
        try:
            code = server.proc.wait(timeout=seconds(service()["TimeoutStopSec"]))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit after its scheduler died:\n{server.log()}")
        assert code == 1, server.log()
        server.left_nothing(pids)
    finally:
        server.cleanup()
