"""Scheduler process shell: sockets, worker processes, timers, signals and the loop around a
``SchedulerCore`` (engine/core.py), which makes every decision.

    python -m shmserve.engine.scheduler '<json ServerSettings>'

The loop waits on one thing, a blocking receive on the inbox (channel.SchedulerInbox: ZeroMQ
from frontends, packets from workers). Two threads post into that inbox over inproc: the alarm
(a batch deadline, with the OS timer's precision) and the exit watcher (a worker's pidfd turned
readable). A stop signal posts there too, so it wakes the loop at once.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from shmserve.engine.alarm import Alarm
from shmserve.engine.processes import supervision
from shmserve.engine.processes.exits import ExitWatcher
from shmserve.engine.processes.forkserver import WATCH_ID, ForkServer
from shmserve.engine.processes.supervision import WorkerProcess, fork_opt_out, spawn_worker
from shmserve.ipc import channel, logs, packets, shm
from shmserve.ipc.messages.common import LogSettings
from shmserve.ipc.messages.to_scheduler import ProcessExited
from shmserve.ipc.proc import InboxWaker, StopFlag, die_with_parent, freeze_startup_heap
from shmserve.ipc.spawn_args import ServerSettings

if TYPE_CHECKING:
    from shmserve.engine.core import SchedulerCore

log = logging.getLogger("shmserve.scheduler")


class SchedulerShell:
    """Implements the core's port (engine/port.py) with ZeroMQ and subprocesses."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.inbox = channel.SchedulerInbox(
            channel.address(settings.run_dir, "scheduler"),
            channel.scheduler_worker_address(settings.run_dir))
        self.wake_address = f"inproc://shmserve-scheduler-{os.getpid()}"
        self.inbox.bind_also(self.wake_address)
        self.alarm = Alarm(channel.context(), self.wake_address)
        self.exits = ExitWatcher(channel.context(), self.wake_address)
        self.frontends: dict[int, packets.PacketOutbox | channel.Outbox] = {}
        self.workers: dict[int, packets.PacketOutbox | channel.Outbox] = {}
        self.procs: dict[int, WorkerProcess] = {}
        # started before any model loads; workers are forked from it (engine/processes/forkserver.py)
        self.forkserver: ForkServer | None = None
        if settings.worker_start == "fork":
            self.forkserver = ForkServer(watch=lambda fd: self.exits.watch(fd, WATCH_ID),
                                         unwatch=self.exits.unwatch)
            self.forkserver.start()
        # imported once the fork server is starting, so that its imports (numpy, the backends)
        # run beside ours (the core pulls in the protobuf config modules): a cold start of 50
        # models was ready about 0.4 s sooner
        from shmserve.engine.core import SchedulerCore
        self.core: SchedulerCore = SchedulerCore(settings, self,
                                                 counters=channel.COUNTERS.as_dict)
        self.stop: StopFlag | None = None       # once install_signals ran
        self.waker: InboxWaker | None = None
        self.next_orphan_reap = 0.0

    # ---- the port ---------------------------------------------------------------------------------
    def connect_frontend(self, frontend: int, address: str) -> None:
        # a second hello is a new frontend process in the place of one that died: the
        # connection to the dead one's socket is closed, never reused
        old = self.frontends.pop(frontend, None)
        if old is not None:
            old.close()
        try:
            self.frontends[frontend] = channel.outbox_for(address)
        except packets.PeerGone as e:
            log.warning("frontend %d said hello but cannot be reached: %s", frontend, e)

    def send_frontend(self, frontend: int, msg) -> None:
        box = self.frontends.get(frontend)
        if box is None:
            return
        try:
            box.send(msg)
        except (packets.PeerGone, packets.PeerStalled) as e:
            # a frontend that died or stopped reading: what it waited for is lost with it
            log.warning("dropping a %s for frontend %d: %s", type(msg).__name__, frontend, e)
            if isinstance(e, packets.PeerGone):
                del self.frontends[frontend]
                box.close()

    def connect_worker(self, spawn_id: int, address: str) -> None:
        try:
            self.workers[spawn_id] = channel.outbox_for(address)
        except packets.PeerGone as e:       # it died right after saying ready: its exit follows
            log.warning("worker %d cannot be reached: %s", spawn_id, e)

    def send_worker(self, spawn_id: int, msg, payloads=()) -> None:
        box = self.workers.get(spawn_id)
        if box is None:
            return
        try:
            box.send(msg, payloads)
        except (packets.PeerGone, packets.PeerStalled) as e:
            # dead (its exit is reported next and its batch retried) or stopped (killed soon)
            log.warning("could not send a %s to worker %d: %s", type(msg).__name__, spawn_id, e)

    def spawn(self, spawn_id: int, spec) -> None:
        forkserver = self.forkserver
        if forkserver is not None and fork_opt_out(spec):
            forkserver = None               # this model asks for a fresh interpreter
        proc = spawn_worker(spawn_id, self.settings.run_dir, self.inbox.worker_address,
                            self.segment_prefix(spawn_id), spec, logs.current(), logs.log_file(),
                            forkserver, self.settings.cuda_memory_pool,
                            (self.settings.model_upload_dir,
                             self.settings.model_upload_max_bytes))
        self.procs[spawn_id] = proc
        self.exits.watch(proc.pidfd, spawn_id)

    def kill(self, spawn_id: int) -> None:
        proc = self.procs.get(spawn_id)
        if proc is not None:
            proc.kill()

    def stopped(self, spawn_id: int) -> bool:
        proc = self.procs.get(spawn_id)
        return proc is not None and supervision.process_stopped(proc.pid)

    def last_words(self, spawn_id: int) -> str:
        proc = self.procs.get(spawn_id)
        return "" if proc is None else proc.last_words()

    def last_execution(self, spawn_id: int) -> tuple[int, int, int]:
        proc = self.procs.get(spawn_id)
        return (0, 0, 0) if proc is None else proc.last_execution()

    def reap(self, spawn_id: int) -> int | None:
        proc = self.procs.pop(spawn_id)
        self.exits.unwatch(proc.pidfd)      # before closing: the number may be reused
        rc = proc.reap()
        proc.close()
        box = self.workers.pop(spawn_id, None)
        if box is not None:
            box.close()
        return rc

    def unlink(self, spawn_id: int) -> None:
        shm.unlink_prefixed(self.segment_prefix(spawn_id))

    def memory(self, spawn_id: int) -> int | None:
        proc = self.procs.get(spawn_id)
        return None if proc is None else pss_bytes(proc.pid)

    def apply_log_settings(self, settings: LogSettings) -> None:
        logs.apply(settings)
        logs.save(settings, self.settings.run_dir)      # for the launcher

    def segment_prefix(self, spawn_id: int) -> str:
        return channel.worker_segment_prefix(self.settings.segment_prefix, spawn_id)

    # ---- signals ----------------------------------------------------------------------------------
    def install_signals(self) -> StopFlag:
        """First SIGTERM: a flag, and a Wake into the inbox so the loop sees it at once. A
        second one: kill the workers and exit now. (The launcher owns Ctrl-C.)"""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        waker = self.waker = InboxWaker(f"shmserve-scheduler-{os.getpid()}")
        self.inbox.bind_also(waker.address)
        stop = self.stop = StopFlag(signals=(signal.SIGTERM,), on_signal=waker,
                                    on_repeat=self.force_exit)
        return stop

    def force_exit(self, signum: int) -> None:
        log.warning("second SIGTERM: killing the workers and exiting")
        for proc in self.procs.values():
            proc.kill()
        logs.flush(0.5)
        os._exit(1)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        core.start()
        freeze_startup_heap()
        inbox = self.inbox
        armed_ms = None
        stop = self.stop or StopFlag(signals=())
        while not stop.set and not core.exit_requested:
            try:
                msg, frames = inbox.recv()
            except zmq.Again:               # the receive timeout: housekeeping is due
                msg = None
            except msgspec.DecodeError as e:    # not one of our messages: drop it
                log.error("dropped an undecodable message: %s", e)
                continue
            try:
                if msg is None:
                    pass
                elif type(msg) is ProcessExited:
                    self.process_exited(msg.spawn_id)
                else:
                    core.handle(msg, frames)
                if stop.set:
                    break
                # batch deadlines need sub-millisecond precision, which the alarm thread gives;
                # restarts, pings, hang checks and repository polls are fine with milliseconds
                self.alarm.set(core.batching_due())
                now = time.monotonic()
                if now >= core.housekeeping_at:
                    core.housekeeping()
                    self.reap_orphans(now)
            except Exception:
                # a bug must cost the message that found it, never the scheduler (and with it
                # every model): log it and go on with the next one
                log.exception("error handling %s; the scheduler carries on",
                              type(msg).__name__ if msg is not None else "housekeeping")
                now = time.monotonic()
                if core.housekeeping_at <= now:
                    core.housekeeping_at = now + 1.0
            ms = max(1, math.ceil((core.housekeeping_at - now) * 1000))
            if ms != armed_ms:
                inbox.set_timeout(ms)
                armed_ms = ms

    def process_exited(self, spawn_id: int) -> None:
        if spawn_id == WATCH_ID:
            fs = self.forkserver
            if fs is not None and not fs.exited():
                self.exits.rearm(fs.pidfd)
            return
        proc = self.procs.get(spawn_id)
        if proc is None:
            return                          # already handled (a stale report)
        if not proc.exited():               # a reused pidfd number; see ExitWatcher.rearm
            self.exits.rearm(proc.pidfd)
            return
        self.core.process_exited(spawn_id)

    def reap_orphans(self, now: float) -> None:
        """Collect the exit status of orphans that came to us as subreaper (what the models'
        processes left behind), at most once a second, so none stays a zombie."""
        if now >= self.next_orphan_reap:
            self.next_orphan_reap = now + 1.0
            known = {p.pid for p in self.procs.values()}
            if self.forkserver is not None:
                self.forkserver.maintain(now)       # restarts it when its delay has passed
                if self.forkserver.pid is not None:
                    known.add(self.forkserver.pid)
            supervision.reap_orphans(known)

    def shutdown(self, timeout_s: float) -> None:
        """Queued requests get 503; each worker finishes its batch and exits, or is killed
        when ``timeout_s`` has passed; every worker's segments are unlinked."""
        waits = self.core.begin_shutdown()
        log.info("stopping: waiting up to %gs for %d worker(s) to finish", timeout_s, len(waits))
        deadline = time.monotonic() + timeout_s
        for sid, proc in list(self.procs.items()):
            if not proc.exited(max(0.0, deadline - time.monotonic())):
                proc.kill()
                proc.exited(None)
            self.reap(sid)
            self.unlink(sid)
        if self.forkserver is not None:
            self.forkserver.close()
        # what escaped the workers' process groups (a child that called setsid) came to us
        n = supervision.kill_orphans(())
        if n:
            log.info("killed or reaped %d process(es) left by the models", n)
        self.exits.close()
        self.alarm.close()
        if self.waker is not None:
            self.waker.close()


def pss_bytes(pid: int) -> int | None:
    """A process's proportional set size (Pss = Pss_Anon + Pss_File + Pss_Shmem) in bytes,
    from /proc/<pid>/smaps_rollup; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return None
    start = text.find(b"\nPss:")
    if start < 0:
        return None
    fields = text[start + 5:text.find(b"\n", start + 5)].split()
    try:
        return int(fields[0]) * 1024        # kB
    except (IndexError, ValueError):
        return None


def main() -> None:
    settings = msgspec.json.decode(sys.argv[1].encode(), type=ServerSettings)
    die_with_parent(settings.launcher_pid)
    logs.setup("scheduler", settings=logs.from_server(settings), path=settings.log_file)
    supervision.become_subreaper()
    shell = SchedulerShell(settings)
    shell.install_signals()
    try:
        shell.run()
    finally:
        shell.shutdown(settings.exit_timeout_secs)
        logs.flush()
    os._exit(1 if shell.core.exit_requested else 0)


if __name__ == "__main__":
    main()
