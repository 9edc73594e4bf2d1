"""Several shmserve hosts on one machine, each in a network namespace of its own, behind the
real HAProxy with the shipped configs/haproxy/haproxy.cfg.

Everything runs inside a network namespace made for it (``in_lab`` re-runs a command under
``unshare -n``): the "lab" namespace holds HAProxy and the clients, and each host is a namespace
below it, joined to the lab by a veth pair (lab 10.77.<i>.1, host 10.77.<i>.2). So every address
the lab uses lives in namespaces that end with it; nothing is added to the machine's own network.
A host's namespace is held by a ``sleep`` started under ``unshare -n``; servers run in it through
``nsenter``. All hosts share the machine's /dev/shm, as servers on one machine do.

Used by tests/deploy/test_haproxy.py (through tests/deploy/lab_haproxy.py) and
bench/cluster_affinity.py. Needs root (namespaces), iproute2, util-linux and haproxy.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import requests
from serverproc import REPO_ROOT, answers_ready, descendants, segments_of, wait_for

HAPROXY_CFG = os.path.join(REPO_ROOT, "configs", "haproxy", "haproxy.cfg")
HTTP_PORT, GRPC_PORT = 18000, 18001         # HAProxy's, inside the lab
LAB_ENV = "SHMSERVE_NETLAB"                 # set inside the lab's namespace


def unavailable() -> str:
    """Why a lab cannot run here ("" if it can)."""
    for tool in ("unshare", "nsenter", "ip", "haproxy"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install haproxy iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    r = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30)
    if r.returncode != 0:
        return f"unshare -n fails here: {r.stderr.decode(errors='replace').strip()}"
    return ""


def in_lab(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` in a new network namespace (the lab), loopback up, in its own session so
    that whatever it leaves is killed with it."""
    env = {**os.environ, LAB_ENV: "1"}
    script = 'ip link set lo up && exec "$@"'
    p = subprocess.Popen(["unshare", "-n", "sh", "-c", script, "lab", *argv], env=env,
                         start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        raise
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)    # anything it left (it ends its own first)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=30, capture_output=True)


class Host:
    """One machine of the lab: a network namespace at 10.77.<index>.2, and its server."""

    def __init__(self, index: int, tmp: str):
        self.index = index
        self.address = f"10.77.{index}.2"
        self.tmp = tmp
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"],
                                       start_new_session=True)
        pid = self.holder.pid
        wait_for(lambda: os.readlink(f"/proc/{pid}/ns/net") !=
                 os.readlink("/proc/self/ns/net"), 10, "the host's namespace")
        lab_side = f"lab{index}"
        _run("ip", "link", "add", lab_side, "type", "veth", "peer", "name", "eth0",
             "netns", str(pid))
        _run("ip", "addr", "add", f"10.77.{index}.1/24", "dev", lab_side)
        _run("ip", "link", "set", lab_side, "up")
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["ip", "addr", "add", f"{self.address}/24", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"]):
            _run("nsenter", "-t", str(pid), "-n", *cmd)
        self.server: subprocess.Popen | None = None
        self.log_path = os.path.join(tmp, f"host{index}.log")

    @property
    def base(self) -> str:
        return f"http://{self.address}:8000"

    def start(self, repository: str, *flags: str, timeout: float = 120) -> None:
        """Start shmserve on the host's default ports; returns once it is ready."""
        assert self.server is None or self.server.poll() is not None
        log = open(self.log_path, "ab")
        self.server = subprocess.Popen(
            ["nsenter", "-t", str(self.holder.pid), "-n", sys.executable, "-m",
             "shmserve.engine.launch.cli", "--model-repository", repository, *flags],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()
        wait_for(lambda: self.ready() or self._exited(), timeout, f"host {self.index} ready")

    def _exited(self) -> bool:
        if self.server is not None and self.server.poll() is not None:
            raise RuntimeError(f"host {self.index}'s server exited {self.server.returncode}:\n"
                               f"{self.log_text()[-3000:]}")
        return False

    def ready(self) -> bool:
        return answers_ready(self.base)

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def metrics(self) -> str:
        return requests.get(f"http://{self.address}:8002/metrics", timeout=10).text

    def counter(self, prefix: str) -> float:
        """The sum of the samples on /metrics whose line starts with ``prefix``."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines()
                   if line.startswith(prefix))

    def kill(self) -> None:
        """SIGKILL to the server and every process under it, as a machine that dies."""
        if self.server is None or self.server.poll() is not None:
            return
        pids = [self.server.pid, *descendants(self.server.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.server.wait(timeout=30)
        # a SIGKILLed launcher leaves its segments to the next start on the machine: the
        # lab's hosts share one, so remove them as that next start would
        for name in segments_of(self.server.pid):   # (nsenter execs: the launcher's pid)
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, as a host being taken down; its exit code."""
        assert self.server is not None
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
        return self.server.wait(timeout=timeout)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            try:
                self.stop(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.holder.kill()
        self.holder.wait(timeout=30)


class HAProxy:
    """The shipped configuration, its server lines pointed at the lab's hosts and its ports at
    the lab's; ``edit`` changes lines of it as a reader of docs/deploy.md would."""

    def __init__(self, hosts: list[Host], tmp: str, edit=lambda text: text):
        with open(HAPROXY_CFG) as f:
            text = f.read()
        self.socket_path = os.path.join(tmp, "haproxy.sock")
        text = text.replace("/run/haproxy/shmserve.sock", self.socket_path)
        text = text.replace("bind :8000", f"bind 127.0.0.1:{HTTP_PORT}")
        text = text.replace("bind :8001", f"bind 127.0.0.1:{GRPC_PORT}")
        for h in hosts:
            text = text.replace(f"10.0.0.1{h.index}:", f"{h.address}:")
        self.config = edit(text)
        self.path = os.path.join(tmp, "haproxy.cfg")
        with open(self.path, "w") as f:
            f.write(self.config)
        self.log_path = os.path.join(tmp, "haproxy.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", self.path], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for(lambda: self._listening() or self._exited(), 30, "haproxy to listen")

    def _exited(self) -> bool:
        if self.proc.poll() is not None:
            with open(self.log_path, "rb") as f:
                raise RuntimeError(f"haproxy exited {self.proc.returncode}: {f.read()!r}")
        return False

    @staticmethod
    def _listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=1).close()
            return True
        except OSError:
            return False

    def command(self, line: str) -> str:
        """A command to HAProxy's runtime API (its stats socket)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(self.socket_path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def status(self, backend: str) -> dict[str, str]:
        """server name -> UP, DOWN, NOLB, MAINT, ... as HAProxy's health checks see it."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(",")))
            if row.get("pxname") == backend and row.get("svname") not in ("FRONTEND", "BACKEND"):
                out[row["svname"]] = row["status"].split(" ")[0]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Lab:
    """``n`` hosts (not started) in the current network namespace, which must be a lab's."""

    def __init__(self, n: int):
        assert os.environ.get(LAB_ENV), "a lab runs inside netlab.in_lab's namespace"
        self.tmp = tempfile.mkdtemp(prefix="shmserve-lab-")
        self.hosts: list[Host] = []
        self.haproxy: HAProxy | None = None
        try:
            for i in range(1, n + 1):
                self.hosts.append(Host(i, self.tmp))
        except BaseException:
            self.close()
            raise

    def start_all(self, repository: str, *flags: str) -> None:
        # one after another: they share the machine's cores, and the first pays the imports
        for h in self.hosts:
            h.start(repository, *flags)

    def balance(self, edit=lambda text: text) -> HAProxy:
        if self.haproxy is not None:
            self.haproxy.close()
        self.haproxy = HAProxy(self.hosts, self.tmp, edit)
        return self.haproxy

    def report(self) -> str:
        """The hosts' and HAProxy's logs, for a failing test."""
        parts = []
        for h in self.hosts:
            if os.path.exists(h.log_path):
                parts.append(f"--- host {h.index}\n{h.log_text()[-2000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        if self.haproxy is not None:
            self.haproxy.close()
        for h in self.hosts:
            h.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
