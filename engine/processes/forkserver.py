"""The scheduler's side of the fork server (workers/zygote.py, which says how a fork works).

The scheduler starts the fork server before any model loads, and asks it for each worker that
may be forked (``--worker-start fork``, the default; see ``supervision.fork_opt_out`` for the
models that get a fresh interpreter all the same). A forked worker is the scheduler's child,
in a session of its own, watched through a pidfd and reaped with ``os.waitpid`` like a spawned
one (``supervision.WorkerProcess``), so fault isolation, restarts and cleanup do not change.

Whenever the fork server cannot give a worker, the worker is spawned as before (``fork``
returns None) and no model is ever lost for it:
- it is still importing (only the first start is waited for, up to ``HELLO_TIMEOUT_S``);
- it died, or did not answer within ``REPLY_TIMEOUT_S``: it is killed, logged and started
  again (at once the first time, then after 1, 2, 4 s; after ``GIVE_UP_DEATHS`` deaths in a
  row, with neither a fork nor ``LIVED_LONG_S`` of life in between, it is not started again);
- it found a thread in itself (forking would be unsafe): it refuses, the scheduler logs it once
  and spawns every later worker;
- the worker's command line would not fit in the room its own arguments took.
A worker the fork server forked but the scheduler never heard of cannot run: it waits for a
"go" byte that only the scheduler, holding its pidfd, writes.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import msgspec

from shmserve.engine.processes.supervision import describe_exit
from shmserve.ipc.fork_protocol import ForkReply, ForkRequest, ZygoteHello, ZygoteSettings

log = logging.getLogger("shmserve.scheduler")

ZYGOTE_MODULE = "shmserve.workers.zygote"
WORKER_MODULE = "shmserve.workers.main"
ENV_MARK = "SHMSERVE_ZYGOTE"        # in the fork server's (and so its workers') /proc/<pid>/environ
WATCH_ID = 0                        # the exit watcher's id for the fork server (spawn ids are > 0)
TITLE_ROOM = 4096                   # bytes of blank argument a worker's command line can take
HELLO_TIMEOUT_S = 30.0              # the first start: how long the first fork waits for imports
REPLY_TIMEOUT_S = 10.0              # one fork (two fork() calls, normally milliseconds)
STOP_TIMEOUT_S = 2.0
MAX_RESTART_DELAY_S = 30.0
GIVE_UP_DEATHS = 5
LIVED_LONG_S = 60.0                 # a fork server that lived this long starts a new count


def worker_title(label: str) -> bytes:
    """The command line of a worker, NUL-terminated, as /proc/<pid>/cmdline shows it."""
    return b"\0".join([os.fsencode(sys.executable), b"-m", WORKER_MODULE.encode(),
                       label.encode()]) + b"\0"


class ForkServer:
    def __init__(self, watch: Callable[[int], None] | None = None,
                 unwatch: Callable[[int], None] | None = None):
        """``watch(pidfd)`` / ``unwatch(pidfd)``: have the scheduler's exit watcher report the
        fork server's death (as ``ProcessExited(WATCH_ID)``; the shell then calls ``exited``)."""
        self.watch, self.unwatch = watch, unwatch
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.pidfd = -1
        self.hello: ZygoteHello | None = None
        self.started_at = 0.0
        self.first = True                   # only the first start is waited for
        self.disabled = ""                  # why forking stopped for good
        self.deaths = 0                     # in a row, without a fork in between
        self.restart_at = 0.0
        self.seq = 0
        self.forks = 0
        self.decode_hello = msgspec.msgpack.Decoder(ZygoteHello).decode
        self.decode_reply = msgspec.msgpack.Decoder(ForkReply).decode

    # ---- the process -----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.proc is not None or self.disabled:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            settings = ZygoteSettings(os.getpid(), theirs.fileno())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", ZYGOTE_MODULE, msgspec.json.encode(settings).decode(),
                 " " * TITLE_ROOM],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True,
                env={**os.environ, ENV_MARK: "1"})
        except OSError as e:
            mine.close()
            self.proc = None
            self.lost(f"could not be started: {e}")
            return
        finally:
            theirs.close()
        self.sock = mine
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.started_at = time.monotonic()
        self.hello = None
        if self.watch is not None:
            self.watch(self.pidfd)
        log.debug("fork server started (pid %d)", self.proc.pid)

    def maintain(self, now: float) -> None:
        """Start it again once its restart delay has passed (called from housekeeping)."""
        if self.proc is None and not self.disabled and now >= self.restart_at:
            self.start()

    def exited(self) -> bool:
        """Its pidfd turned readable. False: a stale report, it still runs (rearm the watch)."""
        if self.proc is None or self.pidfd < 0:
            return True
        if not select.select([self.pidfd], [], [], 0)[0]:
            return False
        pid = self.pid
        rc = self._kill_and_reap()          # it has exited: this collects its status
        self.lost(f"exited ({describe_exit(rc)})", pid)
        return True

    def lost(self, why: str, pid: int | None = None) -> None:
        """It died or failed us: kill what is left, log it, and plan its restart; until then
        (and for good after GIVE_UP_DEATHS in a row) workers are spawned."""
        pid = pid or self.pid
        self._kill_and_reap()
        if self.started_at and time.monotonic() - self.started_at > LIVED_LONG_S:
            self.deaths = 0
        self.deaths += 1
        self.first = False
        if self.deaths >= GIVE_UP_DEATHS:
            self.disable(f"the fork server {why}, {self.deaths} times in a row")
            return
        delay = 0.0 if self.deaths == 1 else min(MAX_RESTART_DELAY_S, 2.0 ** (self.deaths - 2))
        self.restart_at = time.monotonic() + delay
        log.warning("the fork server%s %s; workers start as fresh interpreters until it is "
                    "back (restarting it in %.0f s)", f" (pid {pid})" if pid else "", why,
                    delay)
        if delay == 0.0:
            self.start()

    def disable(self, why: str) -> None:
        if not self.disabled:
            log.warning("%s: workers start as fresh interpreters from now on (as with "
                        "--worker-start=spawn)", why)
        self.disabled = why
        self._kill_and_reap()

    def _kill_and_reap(self) -> int | None:
        """SIGKILL its process group (itself and an intermediate process mid-fork), reap it;
        returns its exit status."""
        proc, self.proc = self.proc, None
        if self.pidfd >= 0:
            if self.unwatch is not None:
                self.unwatch(self.pidfd)
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)     # not reaped yet: still our group id
                except (ProcessLookupError, PermissionError):
                    pass
                select.select([self.pidfd], [], [], STOP_TIMEOUT_S)
            os.close(self.pidfd)
            self.pidfd = -1
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.hello = None
        return rc

    def close(self) -> None:
        """At shutdown: close its socket (it exits when it reads the end), then make sure."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.pidfd >= 0:
            select.select([self.pidfd], [], [], STOP_TIMEOUT_S)
        self.disabled = self.disabled or "stopped"
        self._kill_and_reap()

    # ---- forks ---------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether it has said hello; waits for that only on the first start."""
        if self.hello is not None:
            return True
        if self.sock is None:
            return False
        timeout = HELLO_TIMEOUT_S if self.first else 0.0
        if not select.select([self.sock], [], [], timeout)[0]:
            if self.first:
                self.lost(f"did not finish its imports within {HELLO_TIMEOUT_S:g} s")
            return False
        self.first = False
        try:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("it closed its socket")
            hello = self.decode_hello(data)
        except (OSError, EOFError, msgspec.DecodeError) as e:
            self.lost(f"failed before it was ready ({e})")
            return False
        self.hello = hello
        log.debug("fork server (pid %d) ready: %d bytes of command line; preloaded %s",
                  hello.pid, hello.title_room, ", ".join(hello.preloaded))
        for note in hello.notes:
            log.debug("fork server: %s", note)
        return True

    def fork(self, label: str, args_path: str) -> tuple[int, int] | None:
        """A worker forked from the fork server, re-parented to us and running: (pid, pidfd).
        None: spawn it instead (the reason is logged where it matters)."""
        if self.disabled:
            return None
        if self.proc is None:
            self.maintain(time.monotonic())
        if self.proc is None or not self.ready():
            return None
        assert self.hello is not None and self.sock is not None
        if len(worker_title(label)) > self.hello.title_room:
            log.info("worker %s: its command line is too long for a forked worker; spawning it",
                     label)
            return None
        self.seq += 1
        try:
            self.sock.send(msgspec.msgpack.encode(
                ForkRequest(self.seq, label, args_path, os.getpid())))
            if not select.select([self.sock], [], [], REPLY_TIMEOUT_S)[0]:
                raise TimeoutError(f"no answer within {REPLY_TIMEOUT_S:g} s")
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            if not data:
                raise EOFError("it closed its socket")
            reply = self.decode_reply(data)
            if reply.seq != self.seq:
                raise ValueError(f"answer {reply.seq} to request {self.seq}")
        except (OSError, EOFError, TimeoutError, ValueError, msgspec.DecodeError) as e:
            # it may have forked a worker before it failed: that one never gets its "go"
            self.lost(f"failed a fork ({type(e).__name__}: {e})")
            return None
        if reply.pid <= 0 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if reply.refuse_for_good:
                self.disable(reply.error)
            else:
                log.warning("the fork server could not fork a worker (%s); spawning it",
                            reply.error or "no pid")
            return None
        go = fds[0]
        try:
            # a zombie child of ours at worst: its pid cannot have been reused yet
            pidfd = os.pidfd_open(reply.pid)
            try:
                os.write(go, b"g")
            except OSError:
                os.close(pidfd)
                raise
        except OSError as e:
            # without its "go" it exits at once, and is reaped as an orphan
            log.warning("could not take over forked worker %d (%s); spawning it", reply.pid, e)
            return None
        finally:
            os.close(go)
        self.deaths = 0
        self.forks += 1
        return reply.pid, pidfd
