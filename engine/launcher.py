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

import msgspec

from shmserve.ipc import logs, shm
from shmserve.ipc.messages import ServerSettings
from shmserve.ipc.proc import StopFlag, StoppingMark

from .supervision import become_subreaper, describe_exit, kill_orphans

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


def reserve_ports(settings: ServerSettings) -> list[socket.socket]:
    """With several frontends, each listens on the same HTTP and gRPC port with SO_REUSEPORT.
    A port of 0 must become one port for all of them, so the launcher binds a socket of that
    group first (never listening: the kernel hands connections only to listening members) and
    keeps it open until the end, which also keeps the port from going to another program."""
    held = []
    for allowed, host_field, port_field in ((settings.allow_http, "http_address", "http_port"),
                                            (settings.allow_grpc, "grpc_address", "grpc_port")):
        if not allowed:
            continue
        host, port = getattr(settings, host_field), getattr(settings, port_field)
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
    was killed: their names carry the launcher's pid."""
    removed = 0
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        pid_text = name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if not (pid_text.isascii() and pid_text.isdigit()) or shm.pid_alive(int(pid_text)):
            continue
        path = os.path.join(tmp, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


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


def run(settings: ServerSettings, notes: list[str] | tuple = ()) -> int:
    """``notes``: lines to log at the start (tritonserver flags that have no effect here)."""
    logs.setup("launcher", settings=logs.from_server(settings), path=settings.log_file)
    for note in notes:
        log.warning("%s", note)
    # orphans of a scheduler that died (its workers, their children) come to us, not to init
    become_subreaper()
    for path in settings.model_repositories:
        if not os.path.isdir(path):
            log.error("model repository path '%s' is not a directory", path)
            return 1
    removed = shm.remove_stale_segments()
    if removed:
        log.info("removed %d shared-memory segment(s) left by a server that was killed", removed)
    settings.model_repositories = [os.path.abspath(p) for p in settings.model_repositories]
    stale = remove_stale_run_dirs()
    if stale:
        log.info("removed %d run director(ies) left by a server that was killed", stale)
    settings.run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    # models uploaded through the load API live here (frontend/model_upload.py), so they go with
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
        stopping.set()          # frontends refuse new requests from now on (ipc/proc.py)
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
        while not stop.set:
            exited = [fds[fd] for fd, _ in poller.poll() if fd in fds]
            logs.reload(settings.run_dir)   # the settings a client set since (logging extension)
            if exited:
                rc = children[exited[0]].wait()
                log.error("%s process exited (%s); stopping the server", exited[0],
                          describe_exit(rc))
                code = 1
                break
        if stop.set:
            log.info("%s received: stopping the server (a second signal kills it at once)",
                     signal.Signals(stop.signum).name)
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
