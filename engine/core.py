"""``SchedulerCore``: every decision the scheduler process makes, with no socket, process or
wall clock of its own.

It takes decoded messages (``handle``), worker exits (``process_exited``) and the passing of time
(``housekeeping``, ``batching_due``), and acts only through a ``SchedulerPort``. It is built from
parts that each own their state:

- ``ModelLifecycle`` (engine/lifecycle/loading.py): the serving map, loads, draining, retired versions;
- ``InstanceSupervisor`` (engine/processes/instances.py): worker processes, backoff, pings, hangs;
- one ``RequestQueue`` per version (engine/batching/queues.py, engine/batching/dynamic.py).

The core itself routes requests: queue, dispatch, completion, retry, failure, statistics.
The process shell (engine/scheduler.py) owns the sockets, the alarm, the exit watcher and the
loop; tests drive the core in-process with a fake port and a fake clock (tests/engine/).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

import msgspec

from shmserve.engine.accounting import Accounting
from shmserve.engine.batching.queues import QueuedRequest, QueueFull, RequestQueue
from shmserve.engine.batching.rate_limiter import RateLimiter
from shmserve.engine.batching.sequences import SEQUENCE_START, SequenceBatcher, SequenceError
from shmserve.engine.ensemble.chain_lending import ChainLending
from shmserve.engine.ensemble.runner import EnsembleRunner
from shmserve.engine.ensemble.step_costs import EnsembleCosts
from shmserve.engine.leases import LeaseBook, submitted, unlimited
from shmserve.engine.lifecycle.loading import ModelLifecycle, Waiter
from shmserve.engine.lifecycle.on_demand import OnDemand
from shmserve.engine.lifecycle.repository import ModelRepository
from shmserve.engine.models import ModelVersion
from shmserve.engine.port import SchedulerPort
from shmserve.engine.processes.deaths import WorkerDeaths
from shmserve.engine.processes.instances import InstanceSupervisor
from shmserve.engine.readiness import ReadinessChecks
from shmserve.engine.states import InstanceState, KillReason, ModelState
from shmserve.ipc import channel
from shmserve.ipc.backend_catalog import BackendCatalog
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.messages.common import (
    BLS_FRONTEND_BASE,
    ENSEMBLE_FRONTEND,
    CudaRef,
    CustomMetrics,
    ErrorCode,
    LeasedRecord,
    LogSettings,
    ShmRef,
    TraceChanges,
)
from shmserve.ipc.messages.to_frontend import ControlReply, InferResult, StatsReply
from shmserve.ipc.messages.to_scheduler import (
    BatchDone,
    CancelRequest,
    ControlRequest,
    ForgetSegments,
    FrontendHello,
    LeasedDone,
    LeaseEnded,
    Pong,
    ReadinessQuery,
    ReadinessReport,
    ResponseReport,
    SequencesLost,
    SetLogSettings,
    SetTraceSettings,
    StatsQuery,
    SubmitRequest,
    Wake,
    WorkerLoadFailed,
    WorkerReady,
)
from shmserve.ipc.messages.to_worker import ExecuteBatch, ReleaseOutputs, RequestRoute
from shmserve.ipc.spawn_args import ServerSettings

log = logging.getLogger("shmserve.scheduler")

# decoupled requests whose worker is remembered for a cancel after their execution ended
STREAMED_KEPT = 65536


class SchedulerCore:
    def __init__(self, settings: ServerSettings, port: SchedulerPort,
                 clock: Callable[[], int] = time.monotonic_ns,
                 counters: Callable[[], dict[str, int]] = dict):
        self.settings = settings
        self.port = port
        self.clock = clock                      # monotonic ns, the clock frontends stamp with
        self.counters = counters                # the shell's IPC byte counters, for /metrics
        self.supervisor = InstanceSupervisor(port, clock, settings.model_load_timeout_secs,
                                             settings.default_max_batch_size)
        self.leases = LeaseBook(port, clock, settings.instance_leases)
        repository = ModelRepository(settings.model_repositories,
                                     settings.model_config_name or None,
                                     gpu_count=gpu.visible_gpus(),
                                     auto_complete=settings.auto_complete,
                                     backends=BackendCatalog([settings.backend_directory]))
        self.supervisor.backends = repository.backends
        self.lifecycle = ModelLifecycle(settings, repository, self.supervisor, clock,
                                        self.publish, self.reply_control, self.dispatch)
        self.versions = self.lifecycle.versions         # the serving map, shared
        self.ensembles = EnsembleRunner(
            self.submit, self.cancel_step,
            self.port.send_frontend, self.release_to, self.lifecycle.ready_version, clock,
            channel.scheduler_worker_address(settings.run_dir),
            lambda ver, frontend: self.chains.lend(ver, frontend))
        self.chains = ChainLending(self)        # pipelines lent to run worker to worker
        # ensembles whose steps could run side by side: which run worker to worker now
        self.ensemble_costs = EnsembleCosts()
        self.ensemble_review_at = 0
        self.worker_addresses: dict[str, int] = {}      # inbox address -> spawn id
        self.frontends: set[int] = set()
        self.lease_takers: set[int] = set()     # frontends (and BLS clients) that take leases
        self.queued_in: dict[tuple[int, int], ModelVersion] = {}   # (frontend, req) -> version
        # the worker whose execution of a decoupled model's request has ended, which may still
        # be answering it (the scheduler does not hear when it stops): for a cancel. Bounded:
        # the oldest go first
        self.streamed_by: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.deaths = WorkerDeaths(self)        # what a worker's death means (engine/processes/deaths.py)
        self.accounting = Accounting(clock, self.ensembles.timings)
        self.readiness = ReadinessChecks(port, clock)      # models that decide it (is_ready())
        # --rate-limit execution_count (engine/batching/rate_limiter.py); None: off
        self.rate_limiter = RateLimiter(settings.rate_limit_resources) \
            if settings.rate_limit else None
        self.lifecycle.rate_limiter = self.rate_limiter
        self.log_settings: LogSettings | None = None    # set by a client (SetLogSettings)
        self.trace_changes: dict[str, TraceChanges] = {}   # likewise (SetTraceSettings)
        self.batch_counter = 0
        self.next_poll = 0.0
        self.table_dirty = False        # on demand: a model table is due (publish)
        # seconds on the clock when housekeeping() is next due (0 = now); the shell reads it
        self.housekeeping_at = 0.0
        self.stopping = False
        self.handlers: dict[type, Callable] = {
            WorkerReady: self.worker_ready, WorkerLoadFailed: self.worker_load_failed,
            FrontendHello: self.frontend_hello, ForgetSegments: self.forget_segments,
            Pong: self.supervisor.pong, CancelRequest: self.cancel,
            ControlRequest: self.lifecycle.control, StatsQuery: self.stats_query,
            CustomMetrics: self.custom_metrics_in, ResponseReport: self.response_report,
            Wake: lambda msg: None,
            LeaseEnded: self.lease_ended, LeasedDone: self.leased_done,
            SequencesLost: self.sequences_lost,
            SetLogSettings: self.set_log_settings,
            SetTraceSettings: self.set_trace_settings,
            ReleaseOutputs: self.release_handed,
            ReadinessQuery: self.readiness_query, ReadinessReport: self.readiness.report,
        }
        # --model-control-mode=on_demand (engine/lifecycle/on_demand.py): requests hold loads
        self.on_demand = OnDemand(self) if settings.model_control_mode == "on_demand" else None
        if self.on_demand is not None:
            self.handlers[ControlRequest] = self.on_demand.control

    @property
    def exit_requested(self) -> bool:
        return self.lifecycle.exit_requested

    def start(self) -> None:
        self.lifecycle.load_initial()
        if self.on_demand is not None:
            self.on_demand.start()
            self.flush_table()
        if self.settings.model_control_mode == "poll":
            self.next_poll = self.clock() / 1e9 + self.settings.repository_poll_secs

    # ---- messages -------------------------------------------------------------------------------
    def handle(self, msg, frames=()) -> None:
        kind = type(msg)
        if kind is SubmitRequest:               # the hot path first
            self.submit(msg, frames[0])
        elif kind is BatchDone:
            self.batch_done(msg)
        elif kind is InferResult:           # an ensemble step's answer streamed by a worker
            self.ensembles.result(msg)
        elif kind is LeasedDone:
            self.leased_done(msg)
        else:
            handler = self.handlers.get(kind)
            if handler is None:
                log.warning("ignoring an unexpected %s", kind.__name__)
                return
            handler(msg)
            if kind is not Wake:    # rare messages may start restarts, loads or pings: check now
                self.housekeeping_at = 0.0
        if self.table_dirty:
            self.flush_table()

    def frontend_hello(self, msg: FrontendHello) -> None:
        if msg.frontend in self.frontends:      # a frontend process died; this one replaces it
            self.frontend_restarted(msg.frontend)
        self.frontends.add(msg.frontend)
        if msg.leases:
            self.lease_takers.add(msg.frontend)
        self.port.connect_frontend(msg.frontend, msg.address)
        self.port.send_frontend(msg.frontend, self.lifecycle.model_table())
        # settings clients changed before it came (a frontend started late, or restarted)
        if self.log_settings is not None:
            self.port.send_frontend(msg.frontend, SetLogSettings(self.log_settings))
        for model, changes in sorted(self.trace_changes.items()):     # the global ones first
            self.port.send_frontend(msg.frontend, SetTraceSettings(changes, model))

    def frontend_restarted(self, fid: int) -> None:
        """The launcher started a new frontend under the id of one that died. The dead one's
        requests are cancelled wherever they are (queued, held for an on-demand load, in an
        ensemble, running: their clients' connections died with it; a running model sees
        ``is_cancelled()``), and its leases are taken back, so that nothing it held keeps an
        instance. (What still answers it is dropped by the new one, whose request ids are its
        own, and whose arena has another name: frontend/main.py.)"""
        log.warning("frontend %d was restarted: dropping the requests and leases of the one "
                    "that died", fid)
        keys = {k for k in self.queued_in if k[0] == fid}
        keys.update(k for k in self.ensembles.runs if k[0] == fid)
        keys.update(k for k in self.streamed_by if k[0] == fid)
        for _, inst in self.supervisor.by_spawn.values():
            keys.update((r.frontend, r.req_id) for r in inst.batch or () if r.frontend == fid)
        if self.on_demand is not None:
            keys.update(self.on_demand.held_from(fid))
        for key in sorted(keys):
            self.cancel(CancelRequest(*key))
        self.deaths.forget_frontend(fid)
        self.leases.frontend_gone(fid)

    def publish(self) -> None:
        if self.on_demand is not None:
            # hundreds of models: the table is built and sent once per message handled, before
            # any reply that depends on it (reply_control, reply_error) and at the end
            self.table_dirty = True
            return
        table = self.lifecycle.model_table()
        for fid in self.frontends:
            self.port.send_frontend(fid, table)

    def flush_table(self) -> None:
        self.table_dirty = False
        table = self.lifecycle.model_table()
        for fid in self.frontends:
            self.port.send_frontend(fid, table)

    def reply_control(self, waiter: Waiter | None, code: ErrorCode | None, error: str) -> None:
        if self.table_dirty:
            self.flush_table()
        if waiter is None:
            if error:
                log.error("%s", error)
            return
        self.port.send_frontend(waiter[0], ControlReply(waiter[1], error, code))

    def reply_error(self, frontend: int, req_id: int, model: str, version: int,
                    code: ErrorCode, message: str) -> None:
        if self.table_dirty:
            self.flush_table()
        res = InferResult(req_id, model, version, error=message, code=code)
        if frontend == ENSEMBLE_FRONTEND:       # an ensemble's step: the runner hears it
            self.ensembles.result(res)
        else:
            self.port.send_frontend(frontend, res)

    # ---- ensembles (engine/ensemble/runner.py) -----------------------------------------------------------
    def cancel_step(self, req_id: int, spawn_id: int = 0) -> None:
        """An ensemble cancels a step: dropped if queued, its worker told if running; one that
        streams past its execution (``spawn_id``, a decoupled model) is in no batch, so its
        worker is told directly, as a frontend tells it for its own clients."""
        msg = CancelRequest(ENSEMBLE_FRONTEND, req_id)
        found = self.supervisor.by_spawn.get(spawn_id) if spawn_id else None
        if found is not None:
            if found[1].connected:
                self.port.send_worker(spawn_id, msg)
            return
        self.cancel(msg)

    def release_to(self, address: str, refs: list) -> None:
        """Give a worker back output slots an ensemble's step filled (host or device)."""
        sid = self.worker_addresses.get(address)
        if sid is not None:
            self.port.send_worker(sid, ReleaseOutputs([r for r in refs if type(r) is ShmRef],
                                                      [r for r in refs if type(r) is CudaRef]))

    def release_handed(self, msg: ReleaseOutputs) -> None:
        """A frontend is done with the outputs of an ensemble's answer, which live in the
        slots of the workers that ran its steps."""
        for address, refs in self.ensembles.book.released(msg.refs).items():
            self.release_to(address, refs)

    def forget_segments(self, msg: ForgetSegments) -> None:
        for sid, (_, inst) in self.supervisor.by_spawn.items():
            if inst.connected:
                self.port.send_worker(sid, msg)

    def set_log_settings(self, msg: SetLogSettings) -> None:
        """A client changed the log settings at a frontend: this process, every connected
        worker and every other frontend obey them, then that frontend hears it is done."""
        self.log_settings = msg.settings
        self.port.apply_log_settings(msg.settings)
        out = SetLogSettings(msg.settings)
        for sid, (_, inst) in self.supervisor.by_spawn.items():
            if inst.connected:
                self.port.send_worker(sid, out)
        for fid in self.frontends:
            if fid != msg.frontend:
                self.port.send_frontend(fid, out)
        if msg.query_id:
            self.port.send_frontend(msg.frontend, ControlReply(msg.query_id))

    def set_trace_settings(self, msg: SetTraceSettings) -> None:
        """A client changed trace settings at a frontend: every other frontend takes them
        (each samples and writes its own traces), then that frontend hears it is done."""
        out = SetTraceSettings(msg.changes, msg.model)
        # per model ("" global), the last value each setting was given: replaying that to a
        # frontend that comes later leaves it where the others are
        done = self.trace_changes.get(msg.model)
        self.trace_changes[msg.model] = msg.changes if done is None else \
            msgspec.structs.replace(done, **msg.changes.given())
        for fid in self.frontends:
            if fid != msg.frontend:
                self.port.send_frontend(fid, out)
        if msg.query_id:
            self.port.send_frontend(msg.frontend, ControlReply(msg.query_id))

    def custom_metrics_in(self, msg: CustomMetrics) -> None:
        if msg.spawn_id in self.supervisor.by_spawn:
            self.accounting.custom_metrics_in(msg)

    def response_report(self, msg: ResponseReport) -> None:
        found = self.supervisor.by_spawn.get(msg.spawn_id)
        if found is not None:
            found[0].stats.response(msg.index, msg.kind, msg.start_ns, msg.output_start_ns,
                                    msg.end_ns)

    def stats_query(self, q: StatsQuery) -> None:
        self.port.send_frontend(q.frontend, self.statistics(q))

    def statistics(self, q: StatsQuery) -> StatsReply:
        return self.accounting.reply(q, self.versions, self.lifecycle.entries,
                                     self.supervisor.by_spawn, self.counters(),
                                     self.on_demand.statistics() if self.on_demand else None)

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, msg: SubmitRequest, payload) -> None:
        ver = self.versions.get((msg.model, msg.version))
        if self.on_demand is not None:
            self.on_demand.used(msg.model)
        if ver is None or ver.state != ModelState.READY:
            if self.on_demand is not None and self.on_demand.hold(msg, payload):
                return      # held while its model loads
            self.reply_error(msg.frontend, msg.req_id, msg.model, msg.version,
                             ErrorCode.UNAVAILABLE,
                             f"Request for unknown model: '{msg.model}' version {msg.version} is "
                             f"not at ready state")
            return
        if msg.chain and ver.name in msg.chain and not any(
                i.state == InstanceState.IDLE or (i.state == InstanceState.LEASED
                                                  and i.spawn_id + BLS_FRONTEND_BASE
                                                  != msg.frontend)
                for i in ver.instances):
            # a busy instance may be the one whose execution waits for this answer, and so
            # may the caller's own, leased or not (it cannot give its lease back while it
            # waits); another leased instance comes back when the request queues (its lease
            # is revoked), as for any request that finds no idle instance
            self.reply_error(msg.frontend, msg.req_id, ver.name, ver.version,
                             ErrorCode.UNAVAILABLE,
                             f"BLS request for model '{ver.name}' refused: it comes from "
                             f"{' -> '.join(msg.chain)}, whose executions hold the instances "
                             f"of '{ver.name}', so it would wait for itself (deadlock); give "
                             f"'{ver.name}' more instances or break the cycle")
            return
        if ver.ensemble is not None:
            if msg.lost and self.chains.lost(ver, msg):
                return
            if not self.chains.hold(ver, msg, payload):
                self.ensembles.start(ver, ver.ensemble, msg, payload)
            return
        req = QueuedRequest(msg.req_id, msg.frontend, msg.batch_size, payload,
                            priority=msg.priority, timeout_us=msg.timeout_us,
                            shape_key=msg.shape_key, received_ns=msg.received_ns,
                            sequence_id=msg.sequence_id, flags=msg.sequence_flags,
                            trace=msg.trace)
        if msg.lost:        # it went to a leased worker that died: retried alone, or failed
            blamed = self.deaths.blamed(msg.frontend, msg.req_id)
            if msg.sequence_id and isinstance(ver.queue, SequenceBatcher):
                # its sequence's state died with the worker: it fails (the one the worker
                # died of with that reason), as on the scheduler path; a START may run anew
                why = ver.queue.mark_lost(msg.sequence_id)
                if blamed or not msg.sequence_flags & SEQUENCE_START:
                    ver.stats.failed("OTHER", self.clock() - msg.received_ns)
                    self.reply_error(msg.frontend, msg.req_id, ver.name, ver.version,
                                     ErrorCode.INTERNAL, blamed or why)
                    return
            retry = msg.lost_retry and ver.retry_on_death and not self.stopping
            if not retry or blamed:
                ver.stats.failed("BACKEND", self.clock() - msg.received_ns)
                self.reply_error(msg.frontend, msg.req_id, ver.name, ver.version,
                                 ErrorCode.INTERNAL, blamed if retry else msg.lost)
                return
            req.alone = True
        # a worker's BLS client takes leases too, but never on a model whose execution waits
        # for the answer (the instance it would be lent may be the one waiting)
        taker = not msg.chain or (msg.frontend > ENSEMBLE_FRONTEND and ver.name not in msg.chain)
        if msg.sequence_id and isinstance(ver.queue, SequenceBatcher):
            refused = ver.queue.lost_start_error(msg.sequence_id, msg.sequence_flags)
            if refused:     # before a lent worker, which never knew the sequence, gets it
                self.reply_error(msg.frontend, msg.req_id, ver.name, ver.version,
                                 ErrorCode.INVALID_ARG, refused)
                return
        if self.leases.by_version and not msg.no_lease and taker and not msg.lost and \
                self.leases.give_back(ver, msg, payload):
            return
        if taker:
            self.leases.note_request(ver, msg.frontend)
        else:
            # an ensemble's step: the next idle spell does not go to the last client frontend
            # either, as a lease granted as the step ends would be revoked by the next step
            # (a pipeline's steps are lent when its run ends: engine/ensemble/chain_lending.py)
            self.leases.note_request(ver, None)
        if self.enqueue(ver, req):
            self.dispatch(ver)

    def enqueue(self, ver: ModelVersion, req: QueuedRequest) -> bool:
        try:
            ver.queue.enqueue(req)
        except QueueFull as e:
            self.reject(ver, req, str(e))
            return False
        except SequenceError as e:      # the sequence rules refuse it: the client's mistake
            self.reply_error(req.frontend, req.req_id, ver.name, ver.version,
                             ErrorCode.INVALID_ARG, str(e))
            return False
        self.queued_in[(req.frontend, req.req_id)] = ver
        return True

    def cancel(self, msg: CancelRequest) -> None:
        """The client went away: a queued request is dropped; a running one is finished by its
        worker, which is told so that ``request.is_cancelled()`` turns true."""
        key = (msg.frontend, msg.req_id)
        ver = self.queued_in.pop(key, None)
        if ver is None and self.ensembles.runs and self.ensembles.cancel(*key):
            return
        if ver is None and self.on_demand is not None and self.on_demand.cancel(*key):
            return
        if ver is None:
            for sid, (_, inst) in self.supervisor.by_spawn.items():
                if inst.batch and inst.connected and any(
                        (r.frontend, r.req_id) == key for r in inst.batch):
                    self.port.send_worker(sid, msg)
                    return
            # in no batch: a decoupled model's request may still be answered from a thread
            # the model started (execute() returned before its first response, so its client
            # has no worker to tell yet): the worker that ran it hears it
            ran = self.streamed_by.get(key)
            found = self.supervisor.by_spawn.get(ran) if ran is not None else None
            if ran is not None and found is not None and found[1].connected:
                self.port.send_worker(ran, msg)
            return
        for req in ver.queue.take_cancelled(msg.frontend, msg.req_id):
            self.queued_in.pop((req.frontend, req.req_id), None)
            ver.stats.failed("CANCELED", self.clock() - req.received_ns)
            self.reply_error(req.frontend, req.req_id, ver.name, ver.version,
                             ErrorCode.CANCELLED, "the request was cancelled by the client")

    def reject(self, ver: ModelVersion, req: QueuedRequest, message: str) -> None:
        self.queued_in.pop((req.frontend, req.req_id), None)
        ver.stats.failed("REJECTED", self.clock() - req.received_ns)
        self.reply_error(req.frontend, req.req_id, ver.name, ver.version,
                         ErrorCode.UNAVAILABLE, message)

    def dispatch(self, ver: ModelVersion, finished: bool = False) -> None:
        """Send what can run now; ``finished``: an instance of ``ver`` just finished a batch
        (sustained load: its queue may be handed over with a lease)."""
        queue = ver.queue
        for req in queue.take_expired():
            self.reject(ver, req, "Request timeout expired")
        # with the rate limiter, its instances run only while they hold their resources: only
        # those with resources take a batch, and one is lent only with its resources held for
        # the lease (lend_limited)
        limiter = self.rate_limiter
        if limiter is not None and not limiter.constrained(ver):
            limiter = None
        if finished and self.leases.enabled and len(queue) and queue.idle and limiter is None \
                and unlimited(ver) and self.leases.leasable(ver) and self.hand_over(ver, queue):
            return
        parked = limiter.gate(ver, queue.idle) if limiter is not None else []
        batches = queue.next_batches()
        if self.leases.by_version and (len(queue) or ver.state != ModelState.READY):
            # requests wait for an instance, or the version drains: a leased one comes back
            self.leases.revoke(ver)
        elif not len(queue) and self.leases.enabled and queue.idle and limiter is None:
            self.leases.offer(ver, queue.idle)
        if batches:
            self.send_batches(ver, batches)
        if limiter is not None:
            limiter.settle(ver, queue.idle, parked, [inst for inst, _ in batches],
                           bool(len(queue)))
            self.lend_limited(ver, limiter)

    def lend_limited(self, ver: ModelVersion, limiter: RateLimiter,
                     frontend: int | None = None) -> bool:
        """A rate-limited version is lent one idle instance at a time (to ``frontend``, or its
        last) while nothing queues and no version waits for resources; the instance holds its
        resources for as long as the lease lasts. The first version that must wait for
        resources takes back every lease that holds some (engine/batching/rate_limiter.py).
        Whether it was lent."""
        if limiter.blocked:
            for other in limiter.lent_versions():
                self.leases.revoke(other)
            return False
        queue = ver.queue
        if len(queue) or not queue.idle:
            return False
        inst = limiter.lendable(ver, queue.idle)
        if inst is None:
            return False
        one = [inst]
        if not self.leases.offer(ver, one, frontend) or one:     # (offer: whether leasable)
            return False
        queue.idle.remove(inst)
        limiter.lend(ver, inst)
        return True

    def send_batches(self, ver: ModelVersion, batches: list) -> None:
        queued_in = self.queued_in
        now_s = self.clock() / 1e9
        for inst, reqs in batches:
            for r in reqs:
                queued_in.pop((r.frontend, r.req_id), None)
            self.batch_counter += 1
            inst.state = InstanceState.BUSY
            inst.batch = reqs
            inst.batch_id = self.batch_counter
            inst.busy_since = now_s
            if ver.execution_timeout_s > 0:     # the hang check must run in time
                due = now_s + ver.execution_timeout_s
                if due < self.housekeeping_at:
                    self.housekeeping_at = due
            routes = [RequestRoute(r.req_id, r.frontend, r.trace) for r in reqs]
            self.port.send_worker(inst.spawn_id, ExecuteBatch(self.batch_counter, routes),
                                  [r.payload for r in reqs])

    def dispatch_waiting(self) -> None:
        """Resources were given back: versions that wait for them try again, the lowest
        priority first (engine/batching/rate_limiter.py)."""
        assert self.rate_limiter is not None
        for ver in self.rate_limiter.waiting():
            if ver.state in (ModelState.READY, ModelState.UNLOADING):   # serving, or draining
                self.dispatch(ver)
            else:
                self.rate_limiter.forget(ver)

    def hand_over(self, ver: ModelVersion, queue: RequestQueue) -> bool:
        """An instance of ``ver`` that takes unlimited leases is idle and requests queue: when
        they all come from one frontend, lease it the idle instances and return them to it to
        send under the leases (engine/leases.py), instead of dispatching them here."""
        frontend = next(iter(queue.pending())).frontend
        if isinstance(queue, SequenceBatcher) and queue.backlog:
            return False        # a sequence waits for a slot: the worker would give it back
        if frontend not in self.lease_takers or any(r.frontend != frontend or r.alone
                                                    for r in queue.pending()) or \
                not self.leases.can_hand_over(ver, frontend):
            return False
        taken = queue.drain()
        sequences = isinstance(queue, SequenceBatcher)
        if not self.leases.offer(ver, queue.idle, frontend,
                                 [] if sequences else [r.req_id for r in taken]):
            for r in reversed(taken):
                queue.requeue(r)
            return False
        for r in taken:
            self.queued_in.pop((r.frontend, r.req_id), None)
        if sequences:       # they go behind the sequences lent (engine/leases.py forward)
            self.leases.forward(ver, frontend, [(submitted(ver, r), r.payload) for r in taken])
        return True

    def sequences_lost(self, msg: SequencesLost) -> None:
        ver = self.versions.get((msg.model, msg.version))
        if ver is not None and isinstance(ver.queue, SequenceBatcher):
            ver.queue.lost_with_worker(msg.cids)

    def leased_done(self, msg: LeasedDone) -> None:
        """Statistics of requests frontends sent under leases (their workers answered them),
        taken a worker's and version's records at a time."""
        groups: dict[tuple[int, str, int], list[LeasedRecord]] = {}
        for rec in msg.records:
            groups.setdefault((rec.spawn_id, rec.model, rec.version), []).append(rec)
        by_spawn, versions = self.supervisor.by_spawn, self.versions
        for (spawn_id, model, version), records in groups.items():
            if self.on_demand is not None:
                self.on_demand.used(model)
            found = by_spawn.get(spawn_id)
            if found is not None:
                found[1].deaths_in_a_row = 0
                self.leases.progress(spawn_id, max(r.finished_ns for r in records))
            # its worker may have ended since
            ver = found[0] if found is not None else versions.get((model, version))
            self.accounting.leased(ver, model, records)
        for c in msg.cache:
            ver = versions.get((c.model, c.version))
            if ver is not None:
                if c.hit and self.on_demand is not None:
                    self.on_demand.used(c.model)
                ver.stats.cached(c.hit, c.cache_ns, c.total_ns, c.count)

    def batch_done(self, msg: BatchDone) -> None:
        self.finish_batch(msg)
        for res in msg.answers:     # after: the instance is idle for the next step already
            self.ensembles.result(res)

    def finish_batch(self, msg: BatchDone) -> None:
        found = self.supervisor.by_spawn.get(msg.spawn_id)
        if found is None:
            return
        ver, inst = found
        if inst.batch_id != msg.batch_id or inst.state != InstanceState.BUSY:
            return
        batch = inst.batch or []
        self.accounting.account(ver, batch, msg)
        if ver.config.model_transaction_policy.decoupled:
            streamed = self.streamed_by
            for r in batch:
                streamed[(r.frontend, r.req_id)] = msg.spawn_id
            while len(streamed) > STREAMED_KEPT:
                streamed.popitem(last=False)
        inst.answered.extend((r.frontend, r.req_id) for r in batch)
        inst.deaths_in_a_row = 0
        inst.batch = None
        inst.state = InstanceState.IDLE
        ver.queue.instance_idle(inst)
        self.dispatch(ver, finished=True)
        if self.rate_limiter is not None and self.rate_limiter.blocked:
            self.dispatch_waiting()
        if ver.state != ModelState.READY:      # draining: its last batch may have ended
            self.lifecycle.drain_progress(ver)
        if self.on_demand is not None:
            self.on_demand.finished(ver)

    def lease_ended(self, msg: LeaseEnded) -> None:
        lease = self.leases.ended(msg.spawn_id, msg.lease_id)
        if lease is None:
            return
        ver, inst = lease.version, lease.instance
        if isinstance(ver.queue, SequenceBatcher) and inst in ver.queue.lent:
            # its live sequences come back; what came for them meanwhile is judged now
            waiting = ver.queue.take_back(inst, [(s.cid, s.last_ns)
                                                 for s in msg.sequences or ()])
            for req in waiting:
                self.queued_in.pop((req.frontend, req.req_id), None)
                self.enqueue(ver, req)
        if inst.state == InstanceState.LEASED:
            inst.state = InstanceState.IDLE
            ver.queue.instance_idle(inst)
            self.dispatch(ver)
        if self.rate_limiter is not None and self.rate_limiter.blocked:
            self.dispatch_waiting()     # the lease held resources another version waits for
        if ver.state != ModelState.READY:
            self.lifecycle.drain_progress(ver)
        if self.on_demand is not None:
            self.on_demand.finished(ver)        # it may make room for a load now

    # ---- workers ----------------------------------------------------------------------------------
    def worker_ready(self, msg: WorkerReady) -> None:
        found = self.supervisor.connected(msg.spawn_id, msg.address)
        if found is None:
            return
        ver, inst = found
        self.worker_addresses[msg.address] = msg.spawn_id
        if self.log_settings is not None:
            # a change made while it loaded went only to the workers connected then
            self.port.send_worker(msg.spawn_id, SetLogSettings(self.log_settings))
        if ver.auto_complete and msg.config_json and \
                not self.lifecycle.apply_completed_config(ver, msg.config_json):
            return
        if msg.asks_model and not ver.asks_model:
            ver.asks_model = True       # frontends ask it (engine/readiness.py) from now on
            self.table_dirty = True
        if ver.state == ModelState.READY:
            self.table_dirty = True     # a restarted instance: the version is healthy again
        inst.state = InstanceState.IDLE
        ver.queue.instance_idle(inst)
        if ver.state == ModelState.LOADING and ver.all_started():
            self.lifecycle.version_started(ver)
        self.dispatch(ver)

    def worker_load_failed(self, msg: WorkerLoadFailed) -> None:
        found = self.supervisor.find(msg.spawn_id)
        if found is None:
            return
        ver, inst = found
        if ver.state == ModelState.LOADING:
            inst.state = InstanceState.STOPPED
            self.lifecycle.version_failed(ver, msg.reason)
        elif ver.state == ModelState.READY:
            # a restart that no longer loads: the others keep serving; its exit, which follows,
            # counts as a death in a row (backoff, and a crash loop if it never loads again)
            log.error("instance %s of '%s' failed to reload: %s", inst.name, ver.name, msg.reason)
            inst.exit_detail = f"failed to load the model again ({msg.reason})"
        else:
            inst.state = InstanceState.STOPPED

    def process_exited(self, spawn_id: int) -> None:
        """The shell saw the worker process of ``spawn_id`` end (engine/processes/deaths.py)."""
        found = self.supervisor.find(spawn_id)
        self.readiness.worker_gone(spawn_id)
        self.deaths.exited(spawn_id)
        if found is not None and found[0].state == ModelState.READY:
            self.flush_table()      # its readiness reads the instance's health (unhealthy)

    def readiness_query(self, msg: ReadinessQuery) -> None:
        self.readiness.query(msg, self.versions.get((msg.model, msg.version)))

    def fail_queued(self, ver: ModelVersion, code: ErrorCode, stat: str, message: str) -> None:
        now = self.clock()
        for r in ver.queue.drain():
            self.queued_in.pop((r.frontend, r.req_id), None)
            if stat:
                ver.stats.failed(stat, now - r.received_ns)
            self.reply_error(r.frontend, r.req_id, ver.name, ver.version, code, message)

    # ---- time -------------------------------------------------------------------------------------
    def batching_due(self) -> int | None:
        """Form batches whose delay or timeout passed; the next such deadline (monotonic ns)."""
        earliest = None
        for ver in self.lifecycle.batching:
            queue = ver.queue
            deadline = queue.next_deadline_ns()
            if deadline is None:
                continue
            if deadline <= self.clock():    # read after the deadline: it may be "now"
                self.dispatch(ver)
                deadline = queue.next_deadline_ns()
                if deadline is None:
                    continue
            if earliest is None or deadline < earliest:
                earliest = deadline
        return earliest

    def housekeeping(self) -> None:
        """Restarts, repository polls, hang checks and pings that are due; sets when the next
        one is (``housekeeping_at``)."""
        sup = self.supervisor
        live = self.lifecycle.live_versions()
        wait = min(sup.restart_due(), self.poll_due(), sup.hang_due(live),
                   self.on_demand.due() if self.on_demand is not None else 1.0,
                   sup.ping_due(self.versions.values()), self.leases_due(),
                   self.lifecycle.slow_loads_due(), self.ensemble_routes_due())
        self.housekeeping_at = self.clock() / 1e9 + wait
        if self.rate_limiter is not None and self.rate_limiter.blocked:
            self.dispatch_waiting()     # an instance that died busy held resources
        if self.table_dirty:
            self.flush_table()

    def ensemble_routes_due(self) -> float:
        """Ensembles whose steps could run side by side: worker to worker or here, by what
        their steps cost now (engine/ensemble/step_costs.py); seconds until the next look."""
        now = self.clock()
        if now < self.ensemble_review_at:
            return (self.ensemble_review_at - now) / 1e9
        self.ensemble_review_at = now + 1_000_000_000
        plans = [v.ensemble for v in self.versions.values()
                 if v.ensemble is not None and v.ensemble.side_by_side]
        if plans and self.ensemble_costs.review(plans, self._compute_so_far,
                                                self.lifecycle.ready_version):
            self.publish()
        return 1.0

    def _compute_so_far(self, model: str, version: int) -> tuple[int, int] | None:
        ver = self.versions.get((model, version))
        if ver is None:
            return None
        infer = ver.stats.record.compute_infer
        return infer.count, infer.ns

    def leases_due(self) -> float:
        wait, hung = self.leases.due()
        for lease in hung:
            inst = lease.instance
            if inst.kill_reason == KillReason.NONE:
                limit = lease.version.execution_timeout_s
                self.supervisor.kill(lease.version, inst, KillReason.EXECUTION_TIMEOUT,
                                     f"exceeded the execution timeout of {limit:g} s and was "
                                     f"killed")
        return wait

    def poll_due(self) -> float:
        """Poll mode: rescan the repository when it is time; seconds until the next scan."""
        every = self.settings.repository_poll_secs
        if self.settings.model_control_mode != "poll" or every <= 0:
            return 1.0
        now = self.clock() / 1e9
        if now >= self.next_poll:
            self.lifecycle.poll_repository()
            self.next_poll = now + every
        return min(1.0, self.next_poll - now)

    def begin_shutdown(self) -> list[int]:
        """Answer every queued request, ask every worker to finish its batch and exit.
        Returns the spawn ids the shell should wait for."""
        self.stopping = True
        if self.on_demand is not None:
            self.on_demand.shutdown()
        self.leases.stopping = True
        for ver in self.lifecycle.live_versions():
            self.fail_queued(ver, ErrorCode.UNAVAILABLE, "", "the server is shutting down")
        if self.table_dirty:
            self.flush_table()
        return self.supervisor.stop_all()
