"""The process a user (or supervisor) starts: spawns the scheduler and frontend, watches them,
and owns shutdown and shared-memory cleanup.
"""
from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec

from shmserve.ipc import shm
from shmserve.ipc.messages import ServerSettings
from shmserve.ipc.proc import StopFlag

from .supervision import describe_exit

log = logging.getLogger("shmserve")


def _spawn(module: str, settings: ServerSettings, *extra: str) -> subprocess.Popen:
    blob = msgspec.json.encode(settings).decode()
    # A session of their own: a signal to the launcher's process group (Ctrl-C in a terminal,
    # `timeout`, supervisor's stopasgroup) reaches only the launcher, which stops them in order.
    return subprocess.Popen([sys.executable, "-m", module, blob, *extra],
                            stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)


def _stop(children: dict[str, subprocess.Popen], timeout: float) -> None:
    """Stop children one after another, in the given order, each within ``timeout``."""
    for name, p in children.items():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", name, timeout)
            p.kill()
            p.wait()


def run(settings: ServerSettings) -> int:
    logging.basicConfig(level=logging.DEBUG if settings.log_verbose else logging.INFO,
                        format="%(asctime)s launcher %(levelname)s %(message)s")
    for path in settings.model_repositories:
        if not os.path.isdir(path):
            log.error("model repository path '%s' is not a directory", path)
            return 1
    removed = shm.remove_stale_segments()
    if removed:
        log.info("removed %d shared-memory segment(s) left by a server that was killed", removed)
    settings.model_repositories = [os.path.abspath(p) for p in settings.model_repositories]
    settings.run_dir = tempfile.mkdtemp(prefix="shmserve-")
    settings.segment_prefix = shm.new_server_prefix()
    settings.launcher_pid = os.getpid()
    if settings.port_file and os.path.exists(settings.port_file):
        os.unlink(settings.port_file)
    stop = StopFlag()
    children: dict[str, subprocess.Popen] = {}
    code = 0
    try:
        children["scheduler"] = _spawn("shmserve.engine.scheduler", settings)
        children["frontend"] = _spawn("shmserve.frontend.main", settings, "0")
        poller = select.poll()
        fds = {}
        for name, p in children.items():
            fd = os.pidfd_open(p.pid)
            fds[fd] = name
            poller.register(fd, select.POLLIN)
        while not stop.set:
            events = poller.poll(500)
            if events:
                name = fds[events[0][0]]
                rc = children[name].wait()
                log.error("%s process exited (%s); stopping the server", name, describe_exit(rc))
                code = 1
                break
        for fd in fds:
            os.close(fd)
    finally:
        # frontend first: it stops accepting and answers what it holds; then the scheduler
        # drains and stops its workers
        _stop({k: children[k] for k in ("frontend", "scheduler") if k in children},
              settings.exit_timeout_secs + 5)
        n = shm.unlink_prefixed(settings.segment_prefix)
        if n:
            log.info("unlinked %d shared-memory segment(s)", n)
        shutil.rmtree(settings.run_dir, ignore_errors=True)
        if settings.port_file and os.path.exists(settings.port_file):
            os.unlink(settings.port_file)
    log.info("shmserve stopped")
    return code
