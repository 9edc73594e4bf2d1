"""The process a user (or supervisor) starts: spawns the scheduler and frontend, watches them,
and owns shutdown and shared-memory cleanup.
"""
from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque

import msgspec

from shmserve.engine.processes.supervision import become_subreaper, describe_exit, kill_orphans
from shmserve.ipc import channel, compiled, logs, shm
from shmserve.ipc.proc import StopFlag, StoppingMark
from shmserve.ipc.spawn_args import ServerSettings

log = logging.getLogger("shmserve")


def _spawn(module: str, settings: ServerSettings, *extra: str) -> subprocess.Popen:
    blob = msgspec.json.encode(settings).decode()
    # A session of their own: a signal to the launcher's process group (Ctrl-C in a terminal,
    # `timeout`, supervisor's stopasgroup) reaches only the launcher, which stops them in order.
    return subprocess.Popen([sys.executable, "-m", module, blob, *extra],
                            stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)


# How long a frontend may hold its requests once the scheduler is gone: nothing can answer them.
ORPHANED_FRONTEND_S = 5.0


RUN_DIR_PREFIX = "shmserve-"


def _listen_addresses(settings: ServerSettings) -> list[tuple[str, str, str]]:
    """(address, port field, its flag) of each port the frontends will listen on."""
    return [(host, field, flag) for allowed, host, field, flag in (
        (settings.allow_http, settings.http_address, "http_port", "--http-port"),
        (settings.allow_grpc, settings.grpc_address, "grpc_port", "--grpc-port"),
        (settings.allow_metrics, settings.metrics_address or settings.http_address,
         "metrics_port", "--metrics-port")) if allowed]


def port_in_use(settings: ServerSettings) -> str:
    """Before any model loads: a line naming the first port another program holds, and the
    flag that moves it ("" when all are free). Bound without SO_REUSEPORT, so a port another
    shmserve shares out to its frontends counts as taken too."""
    for host, field, flag in _listen_addresses(settings):
        port = getattr(settings, field)
        if not port:
            continue            # the OS picks a free one
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
        except OSError as e:
            return (f"cannot listen on {host or '0.0.0.0'}:{port}: "
                    f"{e.strerror or e}; choose another port with {flag}")
    return ""


def reserve_ports(settings: ServerSettings) -> list[socket.socket]:
    """With several frontends, each listens on the same HTTP and gRPC port with SO_REUSEPORT.
    A port of 0 must become one port for all of them, so the launcher binds a socket of that
    group first (never listening: the kernel hands connections only to listening members) and
    keeps it open until the end, which also keeps the port from going to another program. The
    metrics port too, which frontend 0 alone serves: a frontend 0 started in the place of one
    that died finds its port again."""
    held = []
    for host, port_field, _ in _listen_addresses(settings):
        port = getattr(settings, port_field)
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        held.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        setattr(settings, port_field, sock.getsockname()[1])
    return held


def remove_stale_run_dirs() -> int:
    """Remove the run directories (sockets, worker argument files) of servers whose launcher
    was killed: their names carry the launcher's pid (called before this launcher makes its
    own, so one named after its pid is an earlier launcher's: shm.launcher_alive)."""
    removed = 0
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        pid_text = name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if not (pid_text.isascii() and pid_text.isdigit()) or shm.launcher_alive(int(pid_text)):
            continue
        path = os.path.join(tmp, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


# With several frontends (--frontends N), one that dies is replaced at once: the others keep
# serving, the scheduler and its models stay as they are, and the new one listens on the same
# ports (the launcher holds them, reserve_ports). More than FRONTEND_RESTARTS deaths within
# FRONTEND_RESTART_WINDOW_S is a loop a restart does not mend: the server then exits 1, as when
# the scheduler dies, so that its supervisor starts it afresh. A server's only frontend is not
# replaced: nothing would serve meanwhile anyway, and its ports are not held (a port the OS
# picked could change), so the server exits 1 then too.
FRONTEND_RESTARTS = 5
FRONTEND_RESTART_WINDOW_S = 60.0


class FrontendRestarts:
    """Counts frontend deaths, and each frontend id's incarnations (frontend/main.py)."""

    def __init__(self, limit: int = FRONTEND_RESTARTS,
                 window_s: float = FRONTEND_RESTART_WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.deaths: deque[float] = deque()
        self.incarnations: dict[int, int] = {}

    def allow(self, now: float) -> bool:
        """One more death now; whether a restart is still in order."""
        self.deaths.append(now)
        while now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        return len(self.deaths) <= self.limit

    def next_incarnation(self, frontend: int) -> int:
        n = self.incarnations[frontend] = self.incarnations.get(frontend, 0) + 1
        return n


def frontend_name(i: int) -> str:
    return "frontend" if i == 0 else f"frontend-{i}"


def frontend_names(settings: ServerSettings) -> list[str]:
    return [frontend_name(i) for i in range(settings.frontends)]


def _stop(groups: list[dict[str, subprocess.Popen]], timeout: float,
          scheduler: subprocess.Popen | None) -> None:
    """Stop groups of children one group after another; the members of a group together (all
    frontends stop accepting at once), each within ``timeout``. A second signal meanwhile kills
    them all (``_kill_now``), which ends these waits at once."""
    for children in groups:
        for p in children.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in children.items():
            wait = timeout
            if name.startswith("frontend") and scheduler is not None \
                    and scheduler.poll() is not None:
                wait = min(timeout, ORPHANED_FRONTEND_S)
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", name, wait)
                p.kill()
                p.wait()


def _kill_now(children: dict[str, subprocess.Popen]) -> None:
    """SIGKILL every child's session: the scheduler and the frontend lead their own process
    groups; the workers lead theirs and die with the scheduler (PR_SET_PDEATHSIG), and what is
    left of them comes to the launcher, a subreaper, which kills it before it exits."""
    for p in children.values():
        if p.returncode is None:            # not reaped, so the pid is still this child's
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _drain_notice(grace_s: float, wake_r: int, forced: list) -> None:
    """The server answers "not ready" and still serves for ``grace_s``, so that a load
    balancer's health check takes it out of rotation before any request is refused; a second
    signal ends the wait (it has killed the children already)."""
    log.info("not ready; still serving for %.1f s (--exit-grace-secs), then refusing new "
             "requests", grace_s)
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    deadline = time.monotonic() + grace_s
    while not forced:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if poller.poll(left * 1000):
            try:
                os.read(wake_r, 64)
            except BlockingIOError:
                pass


def run(settings: ServerSettings, notes: list[str] | tuple = ()) -> int:
    """``notes``: lines to log at the start (tritonserver flags that have no effect here)."""
    logs.setup("launcher", settings=logs.from_server(settings), path=settings.log_file)
    for note in notes:
        log.warning("%s", note)
    for name in compiled.stale():
        log.warning("%s runs compiled from an older source: 'pip install -e .' builds it again "
                    "(SHMSERVE_PURE_PYTHON=1 drops the compiled modules)", name)
    # orphans of a scheduler that died (its workers, their children) come to us, not to init
    become_subreaper()
    for path in settings.model_repositories:
        if not os.path.isdir(path):
            log.error("model repository path '%s' is not a directory", path)
            return 1
    removed = shm.remove_stale_segments()
    if removed:
        log.info("removed %d shared-memory segment(s) left by a server that was killed", removed)
    taken = port_in_use(settings)
    if taken:
        log.error("%s", taken)
        return 1
    settings.model_repositories = [os.path.abspath(p) for p in settings.model_repositories]
    stale = remove_stale_run_dirs()
    if stale:
        log.info("removed %d run director(ies) left by a server that was killed", stale)
    settings.run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    too_long = channel.run_dir_too_long(settings.run_dir)
    if too_long:
        log.error("%s", too_long)
        os.rmdir(settings.run_dir)
        return 1
    # models uploaded through the load API live here (engine/lifecycle/upload_files.py), so they go with
    # the run directory: at exit, and at the next start after a kill
    settings.model_upload_dir = os.path.join(settings.run_dir, "uploads")
    settings.segment_prefix = shm.new_server_prefix()
    settings.launcher_pid = os.getpid()
    if settings.port_file and os.path.exists(settings.port_file):
        os.unlink(settings.port_file)
    children: dict[str, subprocess.Popen] = {}
    forced: list[int] = []
    try:
        held = reserve_ports(settings) if settings.frontends > 1 else []
    except OSError as e:
        log.error("cannot reserve the ports for %d frontends: %s", settings.frontends, e)
        shutil.rmtree(settings.run_dir, ignore_errors=True)
        return 1
    # The loop sleeps in poll() on the children's pidfds and the read end of this pipe; the
    # signal handler writes a byte, so a stop signal ends the wait at once.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stopping = StoppingMark(settings.run_dir, create=True)

    def wake(signum: int) -> None:
        # frontends refuse new requests from now on (ipc/proc.py); with a grace period, they
        # answer "not ready" first and still serve until it ends (drain_notice)
        if settings.exit_grace_secs > 0:
            stopping.drain()
        else:
            stopping.set()
        try:
            os.write(wake_w, b"\0")
        except OSError:                     # full: the loop has a wake-up waiting already
            pass

    def force(signum: int) -> None:
        if not forced:
            log.warning("second %s: killing the frontend, the scheduler and the workers now",
                        signal.Signals(signum).name)
        forced.append(signum)
        _kill_now(children)
        try:
            os.write(wake_w, b"\0")         # ends a grace period's wait (_drain_notice)
        except OSError:
            pass

    stop = StopFlag(on_signal=wake, on_repeat=force)
    code = 0
    try:
        children["scheduler"] = _spawn("shmserve.engine.scheduler", settings)
        for i, name in enumerate(frontend_names(settings)):
            children[name] = _spawn("shmserve.frontend.main", settings, str(i))
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        fds = {}
        for name, p in children.items():
            fd = os.pidfd_open(p.pid)
            fds[fd] = name
            poller.register(fd, select.POLLIN)
        restarts = FrontendRestarts()
        index = {frontend_name(i): i for i in range(settings.frontends)} \
            if settings.frontends > 1 else {}

        def replace(fd: int) -> bool:
            """A child exited: start a frontend again in its place; False: stop the server."""
            name = fds.pop(fd)
            poller.unregister(fd)
            os.close(fd)
            how = describe_exit(children[name].wait())
            if name not in index or stop.set:
                log.error("%s process exited (%s); stopping the server", name, how)
                return False
            if not restarts.allow(time.monotonic()):
                log.error("%s process exited (%s); frontends died %d times within %g s, which "
                          "restarting them does not mend: stopping the server", name, how,
                          len(restarts.deaths), restarts.window_s)
                return False
            i = index[name]
            incarnation = restarts.next_incarnation(i)
            # the dead one's arena: nobody else will unlink it (workers' mappings of it stay
            # valid until they drop them); the new one's segments have other names
            n = shm.unlink_prefixed(channel.frontend_segment_prefix(
                settings.segment_prefix, i, incarnation - 1))
            log.error("%s process exited (%s); starting another in its place (%d shared-memory "
                      "segment(s) of the dead one unlinked)", name, how, n)
            children[name] = p = _spawn("shmserve.frontend.main", settings, str(i),
                                        str(incarnation))
            fd = os.pidfd_open(p.pid)
            fds[fd] = name
            poller.register(fd, select.POLLIN)
            return True

        while not stop.set:
            exited = [fd for fd, _ in poller.poll() if fd in fds]
            logs.reload(settings.run_dir)   # the settings a client set since (logging extension)
            if not all(replace(fd) for fd in exited):
                code = 1
                break
        if stop.set:
            log.info("%s received: stopping the server (a second signal kills it at once)",
                     signal.Signals(stop.signum).name)
            if settings.exit_grace_secs > 0 and not forced:
                _drain_notice(settings.exit_grace_secs, wake_r, forced)
            stopping.set()
        for fd in fds:
            os.close(fd)
    finally:
        # frontend first: it stops accepting and answers what it holds; then the scheduler
        # drains and stops its workers
        _stop([{k: children[k] for k in frontend_names(settings) if k in children},
               {k: children[k] for k in ("scheduler",) if k in children}],
              settings.exit_timeout_secs + 5, children.get("scheduler"))
        for sock in held:
            sock.close()
        orphans = kill_orphans(())
        if orphans:
            log.warning("killed or reaped %d process(es) left by the scheduler's workers",
                        orphans)
        n = shm.unlink_prefixed(settings.segment_prefix)
        if n:
            log.info("unlinked %d shared-memory segment(s)", n)
        shutil.rmtree(settings.run_dir, ignore_errors=True)
        if settings.port_file and os.path.exists(settings.port_file):
            os.unlink(settings.port_file)
        os.close(wake_r)
        os.close(wake_w)
        stopping.close()
    if forced:
        log.warning("shmserve killed by a second %s", signal.Signals(forced[0]).name)
        return 128 + forced[0]
    log.info("shmserve stopped")
    return code
