"""Scheduler process shell: owns the repository, model states, queues and worker processes.

It decodes only routing headers (``SubmitRequest``) and forwards request payload frames to
workers untouched; tensor bytes never pass through here except tiny inline ones.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

import msgspec
import zmq

from shmserve.ipc import channel, shm
from shmserve.ipc.messages import (BatchDone, CancelRequest, ControlRequest, ErrorCode, ExecuteBatch,
                                   ForgetSegments, FrontendHello, InferResult, InstanceSpec, Pong,
                                   ProcessExited, Wake,
                                   RequestRoute, ServerSettings, Shutdown, StatsQuery, StatsReply,
                                   SubmitRequest, WorkerLoadFailed, WorkerReady)
from shmserve.ipc.proc import StopFlag, die_with_parent

from .alarm import Alarm
from .exits import ExitWatcher
from .batching import QueuedRequest, QueueFull
from .health import InstanceHealth
from .lifecycle import Lifecycle, Load
from .models import Instance, ModelVersion
from .repository import ModelEntry, ModelRepository
from .states import InstanceState, ModelState
from .supervision import spawn_worker

log = logging.getLogger("shmserve.scheduler")


class Scheduler(Lifecycle, InstanceHealth):
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.inbox = channel.Inbox(channel.address(settings.run_dir, "scheduler"))
        self.frontends: dict[int, channel.Outbox] = {}
        self.repository = ModelRepository(settings.model_repositories,
                                          settings.model_config_name or None,
                                          auto_complete=settings.auto_complete)
        self.entries: dict[str, ModelEntry] = {}
        self.versions: dict[tuple[str, int], ModelVersion] = {}
        self.by_spawn: dict[int, tuple[ModelVersion, Instance]] = {}
        # the alarm and exit-watcher threads post into the inbox, the loop's only wait
        wake_addr = f"inproc://shmserve-scheduler-{os.getpid()}"
        self.inbox.bind_also(wake_addr)
        self.alarm = Alarm(channel.context(), wake_addr)
        self.exits = ExitWatcher(channel.context(), wake_addr)
        self.next_housekeeping = 0.0    # monotonic time of the next restart/ping/hang/poll check
        self.spawn_counter = 0
        self.batch_counter = 0
        self.startup_done = False
        self.exit_requested = False
        self.backoff: set[tuple[ModelVersion, Instance]] = set()   # instances waiting to restart
        self.loads: dict[str, Load] = {}            # model name -> its load in progress
        self.draining: list[ModelVersion] = []      # replaced or unloaded, finishing their work
        self.retired: dict[tuple[str, int], str] = {}   # unloaded versions and why
        self.repo_dirs: dict[str, list[str]] = {}
        self.queued_in: dict[tuple[int, int], ModelVersion] = {}   # (frontend, req) -> queue
        self.ping_counter = 0
        self.next_ping = 0.0
        self.handlers = {
            WorkerReady: self.worker_ready,
            WorkerLoadFailed: self.worker_load_failed, FrontendHello: self.frontend_hello,
            ForgetSegments: self.forget_segments, Pong: self.pong, CancelRequest: self.cancel,
            ControlRequest: self.control, StatsQuery: self.stats_query,
            ProcessExited: self.process_exited,
        }
        self.fingerprints: dict[str, tuple] = {}    # model name -> files when last loaded
        self.next_poll = 0.0
        self.batching: list[ModelVersion] = []      # versions whose batcher has deadlines

    # ---- loading -------------------------------------------------------------------------------
    def spawn(self, ver: ModelVersion, inst: Instance) -> None:
        self.spawn_counter += 1
        sid = self.spawn_counter
        spec = InstanceSpec(ver.name, ver.version, ver.path, ver.config_json, inst.name, inst.kind,
                            inst.device_id, ver.config.backend, ver.auto_complete)
        inst.spawn_id = sid
        inst.state = InstanceState.STARTING
        inst.started_at = time.monotonic()
        inst.process = spawn_worker(sid, self.settings.run_dir, self.inbox.address,
                                    self.segment_prefix(sid), spec, self.settings.log_verbose)
        self.by_spawn[sid] = (ver, inst)
        self.exits.watch(inst.process.pidfd, sid)

    def segment_prefix(self, spawn_id: int) -> str:
        return f"{self.settings.segment_prefix}w{spawn_id}_"

    def check_startup(self) -> None:
        if not self.startup_done and not self.loads:
            self.startup_done = True
            failed = [n for n, e in self.entries.items() if e.error] + \
                     [f"{v.name}:{v.version}" for v in self.versions.values()
                      if v.state == ModelState.UNAVAILABLE]
            if failed and self.settings.exit_on_error:
                log.error("failed to load %s; exiting because --exit-on-error is true",
                          ", ".join(failed))
                self.exit_requested = True
            else:
                log.info("startup finished: %d model version(s) ready",
                         sum(v.state == ModelState.READY for v in self.versions.values()))

    # ---- model table -----------------------------------------------------------------------------
    def publish(self) -> None:
        table = self.model_table()
        for box in self.frontends.values():
            box.send(table)

    # ---- messages --------------------------------------------------------------------------------
    def handle(self, msg, frames) -> None:
        if isinstance(msg, SubmitRequest):          # the hot path first
            self.submit(msg, frames[0])
            return
        if isinstance(msg, BatchDone):
            self.batch_done(msg)
            return
        if isinstance(msg, Wake):       # the loop looks at batch deadlines after every message
            return
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(msg)
        self.next_housekeeping = 0.0    # rare messages may start restarts or loads: check now

    def frontend_hello(self, msg: FrontendHello) -> None:
        box = self.frontends.get(msg.frontend)
        if box is None:
            box = self.frontends[msg.frontend] = channel.Outbox(msg.address)
        box.send(self.model_table())

    def forget_segments(self, msg: ForgetSegments) -> None:
        for _, inst in self.by_spawn.values():
            if inst.outbox is not None:
                inst.outbox.send(msg)

    def stats_query(self, msg: StatsQuery) -> None:
        self.frontends[msg.frontend].send(self.statistics(msg))

    def reply_error(self, frontend: int, req_id: int, model: str, version: int, code: str,
                    message: str) -> None:
        box = self.frontends.get(frontend)
        if box is not None:
            box.send(InferResult(req_id, model, version, error=message, code=code))

    def statistics(self, q: StatsQuery) -> StatsReply:
        ipc = channel.COUNTERS.as_dict()
        if q.model and q.model not in self.entries:
            return StatsReply(q.query_id, [], ipc, f"requested model '{q.model}' is not available")
        chosen = [v for (name, version), v in sorted(self.versions.items())
                  if (not q.model or name == q.model) and (q.version < 0 or version == q.version)
                  and v.state == ModelState.READY]
        if q.model and not chosen:
            if q.version >= 0:
                return StatsReply(q.query_id, [], ipc, f"requested model version is not "
                                                       f"available for model '{q.model}'")
            return StatsReply(q.query_id, [], ipc, f"requested model '{q.model}' is not available")
        return StatsReply(q.query_id, [v.stats.snapshot(len(v.scheduler)) for v in chosen], ipc)

    def submit(self, msg: SubmitRequest, payload) -> None:
        ver = self.versions.get((msg.model, msg.version))
        if ver is None or ver.state != ModelState.READY:
            self.reply_error(msg.frontend, msg.req_id, msg.model, msg.version, ErrorCode.UNAVAILABLE,
                             f"Request for unknown model: '{msg.model}' version {msg.version} is "
                             f"not at ready state")
            return
        req = QueuedRequest(msg.req_id, msg.frontend, msg.batch_size, payload,
                            priority=msg.priority, timeout_us=msg.timeout_us,
                            shape_key=msg.shape_key, received_ns=msg.received_ns)
        try:
            ver.scheduler.enqueue(req)
        except QueueFull as e:
            self.reject(ver, req, str(e))
            return
        self.queued_in[(msg.frontend, msg.req_id)] = ver
        self.dispatch(ver)

    def cancel(self, msg: CancelRequest) -> None:
        """A request whose client left: dropped if still queued (running ones finish)."""
        ver = self.queued_in.pop((msg.frontend, msg.req_id), None)
        if ver is None:
            return
        req = ver.scheduler.cancel(msg.frontend, msg.req_id)
        if req is not None:
            ver.stats.failed("CANCELED", time.monotonic_ns() - req.received_ns)
            self.reply_error(req.frontend, req.req_id, ver.name, ver.version,
                             ErrorCode.CANCELLED, "the request was cancelled by the client")

    def reject(self, ver: ModelVersion, req: QueuedRequest, message: str) -> None:
        self.queued_in.pop((req.frontend, req.req_id), None)
        ver.stats.failed("REJECTED", time.monotonic_ns() - req.received_ns)
        self.reply_error(req.frontend, req.req_id, ver.name, ver.version, ErrorCode.UNAVAILABLE,
                         message)

    def dispatch(self, ver: ModelVersion) -> None:
        for req in ver.scheduler.take_expired():
            self.reject(ver, req, "Request timeout expired")
        for inst, reqs in ver.scheduler.next_batches():
            for r in reqs:
                self.queued_in.pop((r.frontend, r.req_id), None)
            self.batch_counter += 1
            inst.state = InstanceState.BUSY
            inst.batch = reqs
            inst.batch_id = self.batch_counter
            routes = [RequestRoute(r.req_id, r.frontend) for r in reqs]
            inst.busy_since = time.monotonic()
            if ver.execution_timeout_s > 0:
                self.next_housekeeping = min(self.next_housekeeping,
                                             inst.busy_since + ver.execution_timeout_s)
            inst.outbox.send(ExecuteBatch(self.batch_counter, routes), [r.payload for r in reqs])

    def batch_done(self, msg: BatchDone) -> None:
        found = self.by_spawn.get(msg.instance)
        if found is None:
            return
        ver, inst = found
        if inst.batch_id != msg.batch_id or inst.state != InstanceState.BUSY:
            return
        self.account(ver, inst.batch, msg)
        inst.deaths_in_a_row = 0
        inst.batch = None
        inst.state = InstanceState.IDLE
        ver.scheduler.instance_idle(inst)
        self.dispatch(ver)
        self.drain_progress(ver)

    def account(self, ver: ModelVersion, batch: list[QueuedRequest], done: BatchDone) -> None:
        now = time.monotonic_ns()
        failed = set(done.failed)
        stats = ver.stats
        stats.executed(sum(r.batch_size for i, r in enumerate(batch) if i not in failed) or
                       sum(r.batch_size for r in batch), done.compute_input_ns,
                       done.compute_infer_ns, done.compute_output_ns)
        for i, r in enumerate(batch):
            if i in failed:
                stats.failed("BACKEND", now - r.received_ns)
            else:
                stats.succeeded(r.batch_size, now - r.received_ns, r.dispatched_ns - r.enqueued_ns,
                                done.compute_input_ns, done.compute_infer_ns,
                                done.compute_output_ns)

    def worker_ready(self, msg: WorkerReady) -> None:
        found = self.by_spawn.get(msg.instance)
        if found is None:
            return
        ver, inst = found
        inst.outbox = channel.Outbox(msg.address)
        if ver.auto_complete and msg.config_json and \
                not self.apply_completed_config(ver, msg.config_json):
            return
        inst.state = InstanceState.IDLE
        ver.scheduler.instance_idle(inst)
        if ver.state == ModelState.LOADING and ver.all_started():
            self.version_started(ver)
        self.dispatch(ver)

    def worker_load_failed(self, msg: WorkerLoadFailed) -> None:
        found = self.by_spawn.get(msg.instance)
        if found is None:
            return
        ver, inst = found
        inst.state = InstanceState.STOPPED
        if ver.state == ModelState.LOADING:
            self.version_failed(ver, msg.reason)
        elif ver.state == ModelState.READY:
            # a restart that no longer loads: keep the others serving, retry with backoff
            log.error("instance %s of '%s' failed to reload: %s", inst.name, ver.name, msg.reason)
            inst.state = InstanceState.BACKOFF
            inst.restart_at = time.monotonic() + inst.backoff_s
            self.backoff.add((ver, inst))

    def batching_due(self) -> int | None:
        """Form batches whose delay or timeout passed; the next such deadline (monotonic ns)."""
        earliest = None
        for ver in self.batching:
            deadline = ver.scheduler.next_deadline_ns()
            if deadline is None:
                continue
            if deadline <= time.monotonic_ns():     # read after the deadline: it may be "now"
                self.dispatch(ver)
                deadline = ver.scheduler.next_deadline_ns()
                if deadline is None:
                    continue
            if earliest is None or deadline < earliest:
                earliest = deadline
        return earliest

    def poll_due(self) -> float:
        """Poll mode: rescan the repository when it is time; seconds until the next scan."""
        every = self.settings.repository_poll_secs
        if self.settings.model_control_mode != "poll" or every <= 0:
            return 1.0
        now = time.monotonic()
        if not self.next_poll:
            self.next_poll = now + every
        if now >= self.next_poll:
            self.poll_repository()
            self.next_poll = now + every
        return min(1.0, self.next_poll - now)

    # ---- loop --------------------------------------------------------------------------------------
    stopping = False

    def run(self, stop: StopFlag) -> None:
        self.load_initial()
        armed_ms = None
        while not stop.set and not self.exit_requested:
            try:
                msg, frames = self.inbox.recv()
            except zmq.Again:               # the receive timeout: housekeeping is due
                pass
            else:
                self.handle(msg, frames)
            if stop.set:
                break
            # batch deadlines need sub-millisecond precision, which the alarm thread gives;
            # restarts, pings, hang checks and repository polls are fine with milliseconds
            self.alarm.set(self.batching_due())
            now = time.monotonic()
            if now >= self.next_housekeeping:
                self.next_housekeeping = now + min(self.restart_due(), self.poll_due(),
                                                   self.hang_due(), self.ping_due())
            ms = max(1, math.ceil((self.next_housekeeping - now) * 1000))
            if ms != armed_ms:
                self.inbox.set_timeout(ms)
                armed_ms = ms

    def shutdown(self, timeout_s: float) -> None:
        self.stopping = True
        for ver in [*self.versions.values(), *self.draining]:
            for r in ver.scheduler.drain():
                self.reply_error(r.frontend, r.req_id, ver.name, ver.version,
                                 ErrorCode.UNAVAILABLE, "the server is shutting down")
        for ver, inst in self.by_spawn.values():
            if inst.outbox is not None:
                inst.outbox.send(Shutdown())    # finishes the batch it holds, then exits
            else:
                inst.process.kill()             # still loading: nothing to lose
        deadline = time.monotonic() + timeout_s
        for sid, (ver, inst) in list(self.by_spawn.items()):
            proc = inst.process
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                proc.kill()
                proc.popen.wait()
            self.exits.unwatch(proc.pidfd)
            proc.close()
            shm.unlink_prefixed(self.segment_prefix(sid))
        self.exits.close()
        self.alarm.close()


def main() -> None:
    settings = msgspec.json.decode(sys.argv[1].encode(), type=ServerSettings)
    die_with_parent(settings.launcher_pid)
    logging.basicConfig(level=logging.DEBUG if settings.log_verbose else logging.INFO,
                        format="%(asctime)s scheduler %(levelname)s %(message)s")
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = StopFlag(signals=(signal.SIGTERM,))
    sched = Scheduler(settings)
    try:
        sched.run(stop)
    finally:
        sched.shutdown(settings.exit_timeout_secs)
    os._exit(1 if sched.exit_requested else 0)


if __name__ == "__main__":
    main()
