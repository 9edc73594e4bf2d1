"""Start the real shmserve as a subprocess on OS-chosen ports, and stop it checking it left nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import requests

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll ``condition`` until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        _pause(interval)


def _pause(seconds: float) -> None:
    """Sleep, letting tritonclient.http's async requests go out meanwhile: they are gevent
    greenlets, sent only while the waiting thread yields to gevent's hub (time.sleep does not;
    a test that waits for such a request to reach the server would wait for ever)."""
    gevent = sys.modules.get("gevent")
    if gevent is not None and threading.current_thread() is threading.main_thread():
        gevent.sleep(seconds)
    else:
        time.sleep(seconds)


def infer_ones(server: "Server", n: int, model: str = "identity_fp32") -> None:
    """``n`` requests of a [1, 16] FP32 tensor of ones (the example repository's identity_fp32),
    so that the model's per-model series exist."""
    import numpy as np
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(server.url)
    x = np.ones((1, 16), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(n):
        client.infer(model, [inp])


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc, so no extra dependency)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def frontend_pids(server: "Server") -> list[int]:
    """The server's frontend processes, by pid."""
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"shmserve.frontend.main" in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return sorted(pids)


def connections(pids: list[int], port: int) -> dict[int, int]:
    """Established TCP connections on the server side of ``port``, per process."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    counts = {}
    for pid in pids:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                n += 1
        counts[pid] = n
    return counts


def worker_pid(server: "Server", model: str) -> int:
    """The pid of a worker of ``model`` (its first found), 0 if none runs."""
    label = f'"model_name":"{model}"'.encode()
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if label in f.read():
                    return pid
        except OSError:
            continue
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (a server's whole tree: workers,
    Triton's python backend stubs), from /proc: what the benches charge a server."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_reset(pid: int) -> int:
    """Start ``pid``'s peak resident set size (VmHWM) again from now; returns it."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return peak_rss(pid)


def peak_rss(pid: int) -> int:
    """The most memory ``pid`` has had resident (VmHWM) since its start or the last reset."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def at_once(clients: int, run, timeout: float = 120) -> list:
    """``run(k)`` in ``clients`` threads at once; returns what went wrong: the problems each
    returned (a list, may be empty) and the exceptions each raised."""
    problems: list = []

    def client(k: int) -> None:
        try:
            problems.extend(run(k) or ())
        except Exception as e:      # noqa: BLE001 - returned to the caller
            problems.append(e)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    problems += [f"client {k} still running after {timeout:g} s"
                 for k, t in enumerate(threads) if t.is_alive()]
    return problems


def left_nothing(server: "Server", pids: list[int]) -> None:
    """After ``server.stop()``: none of its shared memory segments and none of its processes
    (``pids``: descendants() before the stop) remain."""
    assert segments_of(server.proc.pid) == []
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10,
             "the server's processes to end")


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve_{pid}_")]


def answers_ready(base: str) -> bool:
    """Whether the server at ``base`` (http://host:port) says it is ready; False while it
    cannot be reached."""
    try:
        return requests.get(f"{base}/v2/health/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


class Server:
    def __init__(self, repositories, *extra_args: str, wait_ready: bool = True, timeout: float = 90,
                 prefix: tuple[str, ...] = (), wait_ports: bool = True,
                 env: dict[str, str] | None = None, command: list[str] | None = None,
                 cwd: str | None = None):
        """``prefix``: a command the server runs under (it must exec it, so the pid stays the
        launcher's), e.g. unshare for a /dev/shm of its own. ``wait_ports=False``: return once
        started, for a server that may exit before it serves (``--exit-on-error``). ``env``:
        variables set for it on top of this process's (e.g. TMPDIR: a temp dir of its own).
        ``command``: the server's command line as a user types it (README's), instead of the
        launcher with ``repositories``; ``cwd``: where it runs. Either way the OS picks the ports."""
        self.tmp = tempfile.mkdtemp(prefix="shmserve-test-")
        self.port_file = os.path.join(self.tmp, "ports.json")
        self.log_path = os.path.join(self.tmp, "server.log")
        repos = [repositories] if isinstance(repositories, str) else list(repositories)
        args = list(command) if command else [sys.executable, "-m", "shmserve.engine.launch.cli"]
        for r in repos:
            args += ["--model-repository", r]
        args += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host",
                 "127.0.0.1", "--port-file", self.port_file, *extra_args]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*prefix, *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=cwd,
                                     env={**os.environ, **env} if env else None)
        if not wait_ports:
            return
        try:
            ports = wait_for(self._ports, timeout, "the server to write its port file")
            self.http_port = ports["http"]
            self.metrics_port = ports.get("metrics")
            self.grpc_port = ports.get("grpc")
            self.grpc_url = f"127.0.0.1:{self.grpc_port}"
            self.url = f"127.0.0.1:{self.http_port}"
            self.base = f"http://{self.url}"
            if wait_ready:
                wait_for(self.ready, timeout, "the server to become ready")
        except BaseException:
            self.stop()
            print(self.log_text())
            raise

    def _ports(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
        try:
            with open(self.port_file) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def ready(self) -> bool:
        return answers_ready(self.base)

    def model_ready(self, name: str) -> bool:
        try:
            return requests.get(f"{self.base}/v2/models/{name}/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Stop the server; returns its exit code. Kills it if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to the server and every process under it."""
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(timeout=30)


def model_sleeping(server: "Server", model: str) -> bool:
    """A worker process of ``model`` is parked in time.sleep (so its request is inside execute)."""
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if f'"model_name":"{model}"' not in f.read():
                    continue
            with open(f"/proc/{pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return True
        except OSError:
            continue
    return False


def send_sleeping(server: "Server", client, model: str, n: int, delay_ms: int) -> list:
    """Send ``n`` async requests to a model that sleeps ``delay_ms`` in execute() (request i
    carries the value i), and return them once one of them is inside execute()."""
    import numpy as np
    import tritonclient.http as httpclient
    x = np.ones((1, 4), dtype=np.float32)
    pending = []
    for i in range(n):
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x * i)
        pending.append(client.async_infer(model, [inp], parameters={"delay_ms": delay_ms}))
    wait_for(lambda: model_sleeping(server, model), 20, f"a request of '{model}' to be executing")
    return pending


def leased_requests(server: "Server", model: str) -> int:
    """Requests of ``model`` that ran under a lease, from /metrics (for an ensemble: worker to
    worker; for a BLS callee: called straight from the caller's worker)."""
    import re
    page = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    m = re.search(rf'^shmserve_leased_requests_total{{model="{model}"}} (\S+)$', page, re.M)
    return int(float(m.group(1))) if m else 0
