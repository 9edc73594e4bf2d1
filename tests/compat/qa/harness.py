"""Start shmserve as Triton's qa/common/util.sh starts tritonserver, and record cases.

``QaServer`` is util.sh's ``run_server``/``kill_server``: the server on the fixed ports the QA
files hard-code (HTTP 8000, gRPC 8001, metrics 8002), ready once ``localhost:8000/v2/health/ready``
answers 200 (or never, when the process exits first), stopped with SIGTERM and waited for.
``Suite`` collects the verdicts of one Triton suite; ``runners`` runs its unittest/pytest files.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))      # tests/, for serverproc
from serverproc import descendants  # noqa: E402

PORTS = (8000, 8001, 8002)
# Set by run_triton_qa.py: what every server's environment adds (PYTHONPATH to this checkout).
SERVER_ENV: dict[str, str] = {}
PORT_ARGS = ["--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"]
# The server's command before its arguments; run_triton_qa.py --tritonserver sets Triton's own
# (and SERVER_ENV its libraries) to learn which failures the real Triton shares.
SERVER_CMD: list[str] = [sys.executable, "-m", "shmserve.engine.launch.cli"]


class PortsBusy(RuntimeError):
    pass


def port_free(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                if s.connect_ex((host, port)) == 0:
                    return False
        except OSError:
            continue
    return True


def wait_ports_free(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(port_free(p) for p in PORTS):
        if time.monotonic() > deadline:
            busy = [p for p in PORTS if not port_free(p)]
            raise PortsBusy(f"ports {busy} are in use (Triton's QA files need 8000-8002 free); "
                            "stop whatever holds them and run again")
        time.sleep(0.5)


@dataclass
class Case:
    suite: str
    name: str
    status: str                 # PASS, FAIL or SKIP
    reason: str = ""            # one line
    detail: str = ""            # the failure's text (traceback, log lines), may be long
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class QaServer:
    """One shmserve, started with Triton's flags on the fixed ports; ``started`` tells whether it
    became ready (util.sh's SERVER_PID != 0)."""

    def __init__(self, args: list[str], log_path: str, cwd: str, env: dict | None = None,
                 timeout: float = 120, wait_ready: bool = True):
        wait_ports_free()
        self.args = list(args)
        base, n = log_path, 1
        while os.path.exists(log_path):     # test.sh reuses some names; keep every log
            n += 1
            log_path = f"{base}.{n}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [*SERVER_CMD, *PORT_ARGS, *self.args]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, **SERVER_ENV, **(env or {})})
        self.returncode: int | None = None
        self.started = False
        self.why_not = ""
        if wait_ready:
            self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.why_not = f"the server exited with {self.proc.returncode} before it was ready"
                self._reap()
                return
            try:
                if requests.get("http://localhost:8000/v2/health/ready", timeout=2).status_code == 200:
                    self.started = True
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.why_not = f"not ready after {timeout:.0f} s"
        self.stop()                                 # util.sh: kill $SERVER_PID; SERVER_PID=0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int | None:
        """kill_server: the signal, then wait; SIGKILL to the whole tree if it does not end."""
        if self.returncode is not None:
            return self.returncode
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.why_not = self.why_not or f"did not exit within {timeout:.0f} s of signal {sig}"
                self.kill()
        self._reap(tree)
        return self.returncode

    def kill(self) -> None:
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def _reap(self, tree: list[int] | None = None) -> None:
        """Record the exit code; end what the server left running (its group, its old tree)."""
        self.returncode = self.proc.poll()
        deadline = time.monotonic() + 10
        leftovers = [p for p in (tree or []) if _alive(p)]
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.2)
            leftovers = [p for p in leftovers if _alive(p)]
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self.log.closed:
            self.log.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def tail(text: str, n: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def error_lines(text: str, n: int = 3) -> str:
    """The server log's error lines (glog 'E' lines, message only), else its last lines."""
    errors = [line.split("] ", 1)[-1] for line in text.splitlines()
              if re.match(r"^E\d{4} ", line) or line.startswith(("Error", "error:", "usage:"))]
    return " | ".join(errors[:n]) if errors else tail(text, n).replace("\n", " | ")


@dataclass
class Suite:
    """The verdicts of one Triton suite, and what its steps need to run."""
    name: str
    ctx: object
    cases: list[Case] = field(default_factory=list)

    def __post_init__(self):
        # the run's list of suites, so that an interrupted run still reports what it ran
        getattr(self.ctx, "suites", []).append(self)

    def add(self, name: str, status: str, reason: str = "", detail: str = "",
            seconds: float = 0.0) -> None:
        case = Case(self.name, name, status, " ".join(reason.split())[:300], detail, seconds)
        self.cases.append(case)
        if getattr(self.ctx, "verbose", False):
            print(f"  {status:4}  {self.name}: {name}{'  -- ' + case.reason if case.reason else ''}",
                  flush=True)

    def skip(self, name: str, reason: str) -> None:
        self.add(name, "SKIP", reason)

    def check(self, name: str, ok: bool, expected: str, got: str = "", detail: str = "") -> bool:
        """A check test.sh makes itself (a log grep, an exit code)."""
        self.add(name, "PASS" if ok else "FAIL", "" if ok else
                 f"expected {expected}" + (f"; got {got}" if got else ""), "" if ok else detail)
        return ok

    def start(self, step: str, args: list[str], log_name: str, cwd: str,
              env: dict | None = None) -> QaServer | None:
        """run_server; a server that does not become ready is a FAIL of ``step``, and None."""
        server = QaServer(args, os.path.join(cwd, log_name), cwd, env)
        if not server.started:
            self.add(f"{step}: server start", "FAIL",
                     f"shmserve {' '.join(args)}: {server.why_not}: "
                     + error_lines(server.log_text()), tail(server.log_text(), 60))
            return None
        return server

    def expect_start_failure(self, step: str, args: list[str], log_name: str, cwd: str,
                             messages: list[str], count_exact: bool = True) -> None:
        """test.sh's "Expect fail to start" checks: the server must not become ready and its log
        must hold each message (exactly once where test.sh greps -c ... != 1)."""
        server = QaServer(args, os.path.join(cwd, log_name), cwd, timeout=30)
        if server.started:
            server.stop()
            self.add(f"{step}: fails to start", "FAIL",
                     f"expected the start to fail with '{messages[0]}'; shmserve started and "
                     f"became ready", tail(server.log_text(), 30))
            return
        text = server.log_text()
        how = server.why_not        # exited (with its code) or stayed up, never ready
        for msg in messages:
            n = text.count(msg)
            ok = n == 1 if count_exact else n >= 1
            self.check(f"{step}: log has '{msg}'", ok,
                       f"'{msg}' {'exactly once' if count_exact else ''} in the server log",
                       f"{n} times ({how}); the log says: " + error_lines(text), tail(text, 40))

    def stopped_gracefully(self, step: str, server: QaServer) -> None:
        """test.sh's ``wait $SERVER_PID`` exit-status check after kill (SIGTERM)."""
        code = server.stop()
        self.check(f"{step}: graceful shutdown", code == 0, "exit status 0 after SIGTERM",
                   f"exit status {code}", tail(server.log_text(), 30))
