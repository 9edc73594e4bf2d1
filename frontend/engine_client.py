"""The frontend's link to the scheduler and workers, driven by the asyncio (uvloop) loop.

Requests go to the scheduler as a routing header plus an opaque payload frame; results come back
straight from the worker that ran them (one hop fewer than relaying through the scheduler), or
from the scheduler when a request never reached a worker.

While a model's queue is empty the scheduler may lend this frontend idle instances
(LeaseGranted): requests for that model then go straight to a worker (one at a time; or with no
limit for a model with a single instance or a plain dynamic batcher, whose idle instances are
all lent, each request going to the one with the fewest in flight), and the scheduler hears of
them only from the worker's statistics (engine/leases.py has the protocol).
A request the worker hands back (LeaseBounced), or that a dying leased worker never answered
(LeaseLost), is submitted to the scheduler: nothing is lost.

Every accepted request is answered by its deadline (frontend/deadlines.py), whatever happens to
it elsewhere: one timer on the loop answers those past it with "Request timeout expired" and
cancels them in the scheduler. The last line of defence against an answer lost anywhere.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from typing import Callable, Iterable

import zmq

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.engine.requests.prepare import SEQUENCE_END, SEQUENCE_START, PreparedRequest
from shmserve.frontend.colocation import Colocation
from shmserve.frontend.deadlines import Deadlines
from shmserve.frontend.priority import DrainPriority
from shmserve.frontend.sequence_paths import HOLD, SequencePaths
from shmserve.ipc import channel, logs, packets
from shmserve.ipc.chain_route import Route
from shmserve.ipc.lease_table import Lease, LeaseTable
from shmserve.ipc.messages import decode_payload
from shmserve.ipc.messages import encode as encode_message
from shmserve.ipc.messages.common import (
    CacheRecord,
    ChainHop,
    ControlAction,
    ErrorCode,
    LeasedRecord,
    LogSettings,
    ShmRef,
    TraceChanges,
)
from shmserve.ipc.messages.to_frontend import (
    ControlReply,
    InferResult,
    InferResults,
    LeaseBounced,
    LeaseGranted,
    LeaseLost,
    LeaseRevoked,
    ModelTable,
    ReadinessReply,
    StatsReply,
    WorkerGone,
)
from shmserve.ipc.messages.to_scheduler import (
    CancelRequest,
    ControlRequest,
    ForgetSegments,
    FrontendHello,
    LeasedDone,
    ReadinessQuery,
    SequencesLost,
    SetLogSettings,
    SetTraceSettings,
    StatsQuery,
    SubmitRequest,
)
from shmserve.ipc.messages.to_worker import ANYWHERE, ChainExecute, LeasedExecute, ReleaseOutputs

log = logging.getLogger("shmserve.frontend")

ResultCallback = Callable[[InferResult], None]

# How long completion records of leased requests wait to go to the scheduler in bulk.
LEASED_FLUSH_S = 0.05

# How often the deadline sweep runs while requests are held (sooner when a deadline is nearer).
SWEEP_S = 0.5

# Sequences lost with a leased worker that ended, remembered until their next request.
LOST_SEQUENCES_KEPT = 4096

# Segments whose owning worker is remembered (arenas reuse a few segments; forgotten all at once)
SLOT_OWNERS_KEPT = 4096

# How long a model's own is_ready() may take before the version reads not ready (Triton's).
READINESS_TIMEOUT_S = 5.0


class EngineClient:
    def __init__(self, run_dir: str, frontend_id: int, loop: asyncio.AbstractEventLoop,
                 max_inflight: int = 0, request_deadline_secs: float = 3600.0,
                 priority: DrainPriority | None = None, colocation: Colocation | None = None,
                 first_id: int = 1, segment_prefix: str = ""):
        self.max_inflight = max_inflight
        self.priority = priority
        self.colocation = colocation
        self.cpu = ANYWHERE     # where leased requests say to wait (frontend/colocation.py)
        self.deadlines = Deadlines(request_deadline_secs)
        self.sweeper: asyncio.TimerHandle | None = None
        self.frontend_id = frontend_id
        self.run_dir = run_dir
        self.segment_prefix = segment_prefix    # the server's: workers' arenas are named from it
        # segment -> the address of the worker whose arena it is (bounded: see release)
        self.slot_owners: dict[str, str] = {}
        # where the scheduler takes back the slots of an ensemble's answer it made
        self.scheduler_slots = channel.scheduler_worker_address(run_dir)
        self.loop = loop
        self.inbox = packets.PacketInbox(channel.frontend_address(run_dir, frontend_id))
        self.scheduler = channel.Outbox(channel.address(run_dir, "scheduler"))
        self.workers: dict[str, packets.PacketOutbox] = {}
        self.catalog = ModelCatalog()
        self.pending: dict[int, ResultCallback] = {}
        # what each pending request was sent as, to submit it again if its answer dies with
        # its worker (WorkerGone); a reference to bytes made anyway, no copy
        self.sent: dict[int, tuple[SubmitRequest, bytes]] = {}
        self.order: dict[tuple[str, int], deque[int]] = {}     # preserve_ordering models
        self.ordered_key: dict[int, tuple[str, int]] = {}
        self.held: dict[int, InferResult] = {}
        self.queries: dict[int, asyncio.Future] = {}
        # trace settings another frontend's client changed: (changes, model) -> None
        self.on_trace_settings: Callable[[TraceChanges, str], None] | None = None
        self.leases = LeaseTable()              # the instances lent to us (ipc/lease_table.py)
        self.sequences = SequencePaths()        # which way each sequence's requests go
        # (model, version, correlation id) of sequences lost with a leased worker (in order)
        self.lost_sequences: OrderedDict[tuple, bool] = OrderedDict()
        # ensembles whose steps may run worker to worker (workers/leases/chain.py): their steps
        self.routes: dict[tuple[str, int], Route] = {}
        # leased requests of this turn of the event loop, per worker, sent when it ends
        self.corked: dict[packets.PacketOutbox, list[tuple[Lease, SubmitRequest, bytes]]] = {}
        self.lost: list[LeaseLost] = []         # handled once the inbox is drained
        self.done: list[LeasedRecord] = []      # leased completion records not yet sent
        self.cache_done: list[CacheRecord] = []  # response cache records not yet sent
        self.on_table: Callable[[], None] | None = None     # after each new model table
        self.flusher: asyncio.TimerHandle | None = None
        # a frontend restarted in a dead one's place starts elsewhere (ipc/channel.py)
        self.ids = itertools.count(first_id)
        # requests of decoupled models that have answered and go on answering:
        # req_id -> (spawn id, worker address) of the worker sending them
        self.streaming: dict[int, tuple[int, str]] = {}
        self.table_event = asyncio.Event()
        self.handlers: dict[type, Callable] = {
            InferResult: self._deliver, InferResults: self._deliver_many,
            WorkerGone: self._worker_gone,
            ModelTable: self._update_table, StatsReply: self._answer_query,
            ControlReply: self._answer_query, ReadinessReply: self._answer_query,
            LeaseGranted: self._lease_granted,
            LeaseRevoked: self._lease_revoked, LeaseBounced: self._lease_bounced,
            LeaseLost: self._lease_lost, SetLogSettings: self._log_settings,
            SetTraceSettings: self._trace_settings,
        }
        loop.add_reader(self.inbox.fileno(), self._drain)
        loop.call_soon(self._drain)     # collect anything that came before the reader
        self.scheduler.send(FrontendHello(frontend_id, self.inbox.address))

    def submit(self, model: str, version: int, prepared: PreparedRequest,
               on_result: ResultCallback, ordered: bool = False) -> int:
        """Send a request; ``on_result`` gets its InferResult. With ``ordered`` (the model's
        preserve_ordering), results are handed over in submission order."""
        req_id = next(self.ids)
        now = time.monotonic_ns()
        if self.colocation is not None:
            self.cpu = self.colocation.on_request(len(self.pending), now)
        if self.max_inflight and len(self.pending) >= self.max_inflight:
            on_result(InferResult(req_id, model, version, code=ErrorCode.UNAVAILABLE,
                                  error=f"the server is overloaded: {len(self.pending)} requests "
                                        f"in flight (--max-inflight-requests); try again later"))
            return req_id
        p = prepared.payload
        head = SubmitRequest(req_id, self.frontend_id, model, version, prepared.batch_size,
                             now, prepared.priority, prepared.timeout_us,
                             prepared.shape_key, sequence_id=p.correlation_id,
                             sequence_flags=p.flags, trace=prepared.trace is not None)
        payload = encode_message(prepared.payload)
        leases = self.leases
        lease = leases.pick(model, version) if leases else None
        chain = None
        if self.routes and not head.trace:
            route = self.routes.get((model, version))
            chain = leases.route(route.hops) if route and leases else None
            # leases on every step but none with room: the scheduler must not hold it for them
            head.no_lease = route is not None and chain is None and leases.holds_all(route.hops)
            if chain is not None and route and not route.serves(p):
                chain, head.no_lease = None, True       # (ipc/chain_route.py)
        if lease is not None and (ordered or lease.full):
            # a lease we hold but cannot use: the scheduler must not hand it back to us
            head.no_lease = not lease.depth
            lease = None
        hold = False
        if head.sequence_id and chain is None:      # one way at a time for each sequence
            seq_key = (model, version, head.sequence_id)
            lease = self._sequence_way(head, lease)
            if lease is HOLD:
                hold, lease = True, None
        # pending before it is sent: a send that fails answers it at once (_resubmit)
        self.pending[req_id] = on_result
        self.sent[req_id] = (head, payload)
        deadline = self.deadlines.add(req_id, head.received_ns, head.timeout_us)
        if self.sweeper is None:
            self._arm(deadline - head.received_ns)
        if ordered:
            key = (model, version)
            self.order.setdefault(key, deque()).append(req_id)
            self.ordered_key[req_id] = key
        if head.sequence_id and chain is None:
            self.sequences.track(seq_key, req_id)
            if hold:
                self.sequences.hold(req_id)
                return req_id
        if chain is not None:
            self._send_chain(chain, self.routes[(model, version)].hops, head, payload)
        elif lease is not None:
            self._send_leased(lease, head, payload)
        else:
            self._resubmit(head, payload)
        return req_id

    def _send_sequence(self, req_id: int) -> None:
        """A request of a sequence that waited for the earlier ones to come back."""
        sent = self.sent.get(req_id)
        if sent is None or req_id not in self.pending:
            self._sequence_done(req_id)
            return
        head, payload = sent
        lease = self._sequence_way(head, self.leases.pick(head.model, head.version)
                                   if self.leases else None)
        if lease is HOLD:
            self.sequences.hold(req_id)
        elif lease is None:
            self._resubmit(head, payload)
        else:
            self._send_leased(lease, head, payload)

    def _sequence_way(self, head: SubmitRequest, lease: Lease | None):
        """How a sequence's request goes (frontend/sequence_paths.py): under ``lease`` or, for
        a sequence model's, the lease whose worker has its sequence; None (the scheduler);
        or HOLD."""
        key = (head.model, head.version, head.sequence_id)
        if self.lost_sequences and self.lost_sequences.pop(key, False) and \
                not head.sequence_flags & SEQUENCE_START:
            lease = None    # the scheduler was told why it was lost (SequencesLost): it says so
        if lease is not None and lease.cids is not None:
            lease = self.leases.place(head.model, head.version, head.sequence_id,
                                      bool(head.sequence_flags & SEQUENCE_START))
        return self.sequences.choose(key, lease)

    def _sequence_done(self, req_id: int) -> None:
        for rid in self.sequences.finished(req_id):
            self._send_sequence(rid)

    def _deliver(self, msg: InferResult) -> None:
        if not msg.final:
            self._deliver_partial(msg)
            return
        if self.streaming:
            self.streaming.pop(msg.req_id, None)
        sent = self.sent.pop(msg.req_id, None)
        if self.colocation is not None and self.colocation.measuring is not None \
                and sent is not None:
            self.colocation.on_answer(sent[0].received_ns, time.monotonic_ns())
        if self.leases.busy():
            self.leases.done(msg.req_id)
        if self.sequences:
            if sent is not None and sent[0].sequence_flags & SEQUENCE_END and not msg.error:
                self.leases.ended_sequence(sent[0].model, sent[0].version, sent[0].sequence_id)
            self._sequence_done(msg.req_id)
        if msg.done is not None and sent is not None:
            self.done.append(msg.done)
            if msg.steps:
                self.done.extend(msg.steps)
            if self.flusher is None:
                self.flusher = self.loop.call_later(LEASED_FLUSH_S, self.flush_done)
        key = self.ordered_key.get(msg.req_id)
        if key is None:
            cb = self.pending.pop(msg.req_id, None)
            if cb is not None:
                cb(msg)
            else:
                self._drop_late(msg)
            return
        if msg.req_id in self.held:         # a second answer (it was submitted again)
            self._drop_late(msg)
            return
        self.held[msg.req_id] = msg
        queue = self.order[key]
        while queue and queue[0] in self.held:
            rid = queue.popleft()
            del self.ordered_key[rid]
            result = self.held.pop(rid)
            cb = self.pending.pop(rid, None)
            if cb is not None:
                try:
                    cb(result)
                except Exception:       # the answers held behind this one must still go out
                    log.exception("error answering request %d", rid)

    def _deliver_partial(self, msg: InferResult) -> None:
        """One of a decoupled model's answers, more to come: the request stays pending. Once
        part of its answer is out it can never run again (WorkerGone with a reason ends it)."""
        cb = self.pending.get(msg.req_id)
        if cb is None:
            self._drop_late(msg)
            return
        self.sent.pop(msg.req_id, None)
        self.streaming[msg.req_id] = (msg.spawn_id, msg.worker)
        cb(msg)

    # ---- deadlines ----------------------------------------------------------------------------
    def _arm(self, until_next_ns: int) -> None:
        delay = min(SWEEP_S, max(0.0, until_next_ns / 1e9))
        self.sweeper = self.loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        """Answer the requests whose deadline passed; runs while any is held."""
        self.sweeper = None
        deadlines = self.deadlines
        now = time.monotonic_ns()
        for rid, own_timeout in deadlines.expired(now, self.pending):
            self._expire(rid, deadlines.message(own_timeout))
        deadlines.compact(self.pending)
        nxt = deadlines.next_ns()
        if nxt is not None:
            self._arm(nxt - now)

    def _expire(self, rid: int, message: str) -> None:
        if rid in self.held:        # answered; waits for an earlier one (preserve_ordering)
            return
        sent = self.sent.get(rid)
        model, version = (sent[0].model, sent[0].version) if sent else ("", 0)
        log.warning("request %d for '%s' got no answer in time: %s", rid, model, message)
        self.cancel(rid)            # still queued: dropped; running: the worker is told
        try:
            self._deliver(InferResult(rid, model, version, error=message,
                                      code=ErrorCode.UNAVAILABLE))
        except Exception:           # the other expired requests must still be answered
            log.exception("error answering request %d", rid)

    def _drop_late(self, msg: InferResult) -> None:
        """An answer nobody waits for (its request already failed, or was answered by its
        resubmission): give its slots back."""
        if msg.worker:
            refs = [t.shm for t in msg.outputs if t.shm is not None]
            if refs:
                self.release(msg.worker, refs)

    def _worker_gone(self, msg: WorkerGone) -> None:
        """A dead worker had answered these; an answer we have not seen died in its queue.
        Each is submitted again, once: its inputs are still held, and a late original answer,
        should one still arrive, is dropped like any answer nobody waits for."""
        if msg.reason:              # a decoupled model's worker: end what it was streaming
            for rid, (spawn_id, _) in list(self.streaming.items()):
                if spawn_id == msg.spawn_id:
                    self._deliver(InferResult(rid, "", 0, error=msg.reason,
                                              code=ErrorCode.INTERNAL))
        for rid in msg.requests:
            sent = self.sent.pop(rid, None)
            if sent is None or rid not in self.pending:
                continue
            head, payload = sent
            log.warning("request %d was answered by worker %d, which died; the answer did not "
                        "arrive, so it is submitted again", rid, msg.spawn_id)
            self._resubmit(head, payload)

    def release(self, worker: str, refs: list[ShmRef]) -> None:
        """Give output slots back to where the answer said (``worker``). A worker's answer goes
        back slot by slot to the workers whose arenas hold them: itself, or for an ensemble run
        worker to worker the worker of the step that made it, so a slot never depends on
        another worker living on. The scheduler's answer for an ensemble it ran goes back to
        it whole: it counts the references to each slot (engine/ensemble/slots.py)."""
        if worker == self.scheduler_slots:
            self._release_to(worker, refs)
            return
        owners = self.slot_owners
        mine: list[ShmRef] = []
        others: dict[str, list[ShmRef]] | None = None
        for ref in refs:
            owner = owners.get(ref.segment)
            if owner is None:
                spawn_id = channel.segment_worker(self.segment_prefix, ref.segment)
                owner = worker if spawn_id is None else \
                    channel.worker_address(self.run_dir, spawn_id)
                if len(owners) >= SLOT_OWNERS_KEPT:
                    owners.clear()
                owners[ref.segment] = owner
            if owner == worker:
                mine.append(ref)
            else:
                if others is None:
                    others = {}
                others.setdefault(owner, []).append(ref)
        if mine:
            self._release_to(worker, mine)
        if others:
            for owner, owned in others.items():
                self._release_to(owner, owned)

    def _release_to(self, worker: str, refs: list[ShmRef]) -> None:
        try:
            box = self._worker_box(worker)
            box.send(ReleaseOutputs(refs), flags=channel.NOBLOCK)
        except packets.PeerGone:        # the worker died: its segments went with it
            gone = self.workers.pop(worker, None)
            if gone is not None:
                gone.close()
        except zmq.Again:
            log.warning("could not return %d output slot(s) to %s", len(refs), worker)

    def cancel(self, req_id: int) -> None:
        """The client went away: the scheduler drops the request if it has not started."""
        if req_id in self.leases.chained:   # every worker of its route hears it
            for box in self.leases.boxes_of(req_id):
                try:
                    box.send(CancelRequest(self.frontend_id, req_id), flags=channel.NOBLOCK)
                except (packets.PeerGone, zmq.Again):
                    pass
            return
        lease = self.leases.direct.get(req_id)
        if lease is not None:           # sent to a leased worker: it hears it directly
            if self._uncorked(lease, req_id):
                return
            if self.corked:             # after the request itself
                self._uncork()
            try:
                lease.box.send(CancelRequest(self.frontend_id, req_id), flags=channel.NOBLOCK)
            except (packets.PeerGone, zmq.Again):
                pass
            return
        streaming = self.streaming.get(req_id)
        if streaming is not None:       # answering past its execution: its worker hears it
            try:
                self._worker_box(streaming[1]).send(CancelRequest(self.frontend_id, req_id),
                                                    flags=channel.NOBLOCK)
            except (packets.PeerGone, zmq.Again):
                pass
            return
        if req_id in self.pending:
            try:
                self.scheduler.send(CancelRequest(self.frontend_id, req_id), flags=channel.NOBLOCK)
            except zmq.Again:
                pass

    def _uncorked(self, lease: Lease, req_id: int) -> bool:
        """A request still held for its leased worker (``_send_leased``) is taken back and
        answered as cancelled: it never reaches the worker (a client that resets its calls as
        fast as it sends them must not make the model run them)."""
        held = self.corked.get(lease.box) or []
        for i, (_, head, _) in enumerate(held):
            if head.req_id == req_id:
                del held[i]
                if not held:
                    del self.corked[lease.box]
                self._deliver(InferResult(req_id, head.model, head.version,
                                          code=ErrorCode.CANCELLED,
                                          error="the request was cancelled by the client"))
                return True
        return False

    def drain_abandoned(self, req_id: int, handler: ResultCallback) -> None:
        """The caller stopped listening to a request: its further answers go to ``handler``."""
        if req_id in self.pending:
            self.pending[req_id] = handler

    def new_id(self) -> int:
        """An id for a request answered without the scheduler (a response cache hit)."""
        return next(self.ids)

    def cache_record(self, record: CacheRecord) -> None:
        """A response cache lookup or insert, sent with the leased records (statistics)."""
        self.cache_done.append(record)
        if self.flusher is None:
            self.flusher = self.loop.call_later(LEASED_FLUSH_S, self.flush_done)

    def flush_done(self) -> None:
        """Send the scheduler the completion records of leased requests and the response
        cache's records (statistics)."""
        self.flusher = None
        if not self.done and not self.cache_done:
            return
        try:
            self.scheduler.send(LeasedDone(self.done, self.cache_done), flags=channel.NOBLOCK)
        except zmq.Again:           # the scheduler is behind: keep them for the next flush
            self.flusher = self.loop.call_later(LEASED_FLUSH_S, self.flush_done)
            return
        self.done = []
        self.cache_done = []

    # ---- leases -----------------------------------------------------------------------------------
    def _worker_box(self, address: str):
        box = self.workers.get(address)
        if box is None:
            box = self.workers[address] = packets.PacketOutbox(address)
        return box

    def _send_leased(self, lease: Lease, head: SubmitRequest, payload: bytes) -> None:
        """Send a request under a lease. To an idle worker it goes at once; to a busy one, with
        the others sent to it in this turn of the event loop, in one packet (``_uncork``):
        the worker reads them in one wake-up, and would not have started them sooner."""
        idle = not lease.inflight
        self.leases.sent(lease, head.req_id)
        if head.sequence_id:
            self.sequences.went(head.req_id, lease.lease_id)
        held = self.corked.get(lease.box)
        if held is not None:
            held.append((lease, head, payload))
        elif idle:
            self._send_held(lease.box, [(lease, head, payload)])
        else:
            if not self.corked:
                self.loop.call_soon(self._uncork)
            self.corked[lease.box] = [(lease, head, payload)]

    def _uncork(self) -> None:
        corked, self.corked = self.corked, {}
        for box, held in corked.items():
            self._send_held(box, held)

    def _send_held(self, box: packets.PacketOutbox,
                   held: list[tuple[Lease, SubmitRequest, bytes]]) -> None:
        """Send leased requests to one worker; one it cannot take now (gone, or its inbox
        full) goes to the scheduler instead."""
        cpu = self.cpu
        sent = box.send_many([(LeasedExecute(lease.lease_id, head, cpu), (payload,))
                              for lease, head, payload in held], channel.NOBLOCK)
        if sent == len(held):
            return
        if box.gone:
            self._forget_worker(lambda lease: lease.box is box)
        for lease, head, payload in held[sent:]:
            self.leases.done(head.req_id)
            # a lease we hold but could not use: the scheduler must not hand it back to us
            head.no_lease = not lease.depth or box.gone
            self._resubmit(head, payload)

    def _send_chain(self, leases: list[Lease], route: list[ChainHop], head: SubmitRequest,
                    payload: bytes) -> None:
        """Send an ensemble request to its first step's worker, which hands it on
        (workers/leases/chain.py). It counts as in flight under each step's lease until answered."""
        self.leases.sent_route(leases, head.req_id)
        if self.corked:         # what this turn sent that worker before goes first
            self._uncork()
        box = leases[0].box
        msg = ChainExecute(head, route, [lease.lease_id for lease in leases],
                           [lease.spawn_id for lease in leases], cpu=self.cpu)
        if box.send_many([(msg, (payload,))], channel.NOBLOCK) == 1:
            return
        if box.gone:
            self._forget_worker(lambda lease: lease.box is box)
        self.leases.done(head.req_id)
        self._resubmit(head, payload)

    def _lease_granted(self, msg: LeaseGranted) -> None:
        lease = self.leases.granted(msg, lambda spawn_id: self._worker_box(
            channel.worker_address(self.run_dir, spawn_id)))
        for rid in msg.returned:        # ours, held by the scheduler: they go first
            sent = self.sent.get(rid)
            if sent is None or rid not in self.pending:
                continue
            head, payload = sent
            if head.model != msg.model:
                # an ensemble's, held while its steps' leases came (engine/core.py
                # hold_for_chain): worker to worker now, or back to the scheduler for good
                route = self.routes.get((head.model, head.version))
                chain = self.leases.route(route.hops) if route else None
                if route and chain is not None and route.serves(decode_payload(payload)):
                    self._send_chain(chain, route.hops, head, payload)
                else:
                    head.no_lease = True
                    self._resubmit(head, payload)
                continue
            if lease is None:
                head.no_lease = True
                self._resubmit(head, payload)
            else:
                self._send_leased(lease, head, payload)
        for rid in msg.forwarded:       # a sequence model's: sent to the worker by the scheduler
            sent = self.sent.get(rid)
            if sent is None or rid not in self.pending:
                continue
            if lease is None:           # its worker is gone: it goes round again as lost
                sent[0].lost = f"the worker process {msg.spawn_id} that held it ended"
                self._resubmit(*sent)
            else:
                self.leases.sent(lease, rid)
                self.sequences.went(rid, lease.lease_id)
                # the scheduler placed its sequence there (a new one may differ from our guess)
                head = sent[0]
                self.leases.ended_sequence(head.model, head.version, head.sequence_id)
                lease.took(head.sequence_id)

    def _lease_revoked(self, msg: LeaseRevoked) -> None:
        self.leases.revoked(msg.lease_id)

    def _lease_bounced(self, msg: LeaseBounced) -> None:
        """The worker read our request after its lease ended: the scheduler runs it."""
        self.leases.done(msg.req_id)
        sent = self.sent.get(msg.req_id)
        if sent is not None and msg.req_id in self.pending:
            self._resubmit(sent[0], sent[1])

    def _forget_worker(self, match) -> None:
        """Stop using the leases on a worker that ended. The sequences it held are lost; the
        scheduler hears which before any later request of theirs (one channel, in order), so
        that their next requests say why they must start again."""
        for (model, version), lease in self.leases.forget(match):
            if lease.cids:
                self.scheduler.send(SequencesLost(model, version, list(lease.cids)))
                # their next requests go to the scheduler, even under a new lease, for the reason
                lost = self.lost_sequences
                lost.update(((model, version, cid), True) for cid in lease.cids)
                while len(lost) > LOST_SEQUENCES_KEPT:
                    lost.popitem(last=False)

    def _lease_lost(self, msg: LeaseLost) -> None:
        if self.corked:         # what is held for the worker finds it gone, before its box closes
            self._uncork()
        self._forget_worker(lambda held: held.spawn_id == msg.spawn_id)
        gone = self.workers.pop(channel.worker_address(self.run_dir, msg.spawn_id), None)
        if gone is not None:
            gone.close()
        # its answers may still be unread in the inbox: decide once everything is read
        self.lost.append(msg)

    def _resolve_lost(self) -> None:
        lost, self.lost = self.lost, []
        for msg in lost:
            # sent under a lease on it, or worker to worker through it (unless it stopped
            # cleanly: then such a request is answered by a later step's worker, or bounced)
            for rid in self.leases.lost(msg.spawn_id, chained=not msg.clean):
                sent = self.sent.get(rid)
                if sent is None or rid not in self.pending:
                    continue
                log.warning("request %d was running on leased worker %d, which ended; it "
                            "goes to the scheduler", rid, msg.spawn_id)
                head = sent[0]
                head.lost, head.lost_retry = msg.reason, msg.retry
                self._resubmit(head, sent[1])

    def _resubmit(self, head: SubmitRequest, payload: bytes) -> None:
        if head.sequence_id:
            self.sequences.went(head.req_id, 0)
        try:
            self.scheduler.send(head, (payload,), channel.NOBLOCK)
        except zmq.Again:
            self._deliver(InferResult(head.req_id, head.model, head.version,
                                      error="the scheduler queue is full",
                                      code=ErrorCode.UNAVAILABLE))

    def forget_segments(self, segments: list[str], cuda_handles: Iterable[bytes] = ()) -> None:
        self.scheduler.send(ForgetSegments(segments, list(cuda_handles)))

    async def control(self, action: ControlAction, name: str, config: str = "",
                      unload_dependents: bool = False, timeout: float = 600.0,
                      upload_dir: str = "") -> ControlReply:
        """Load or unload a model; answers once the scheduler has finished it. ``upload_dir``:
        the model's uploaded files (engine/lifecycle/upload_files.py), the scheduler's once sent."""
        qid = next(self.ids)
        fut = self.loop.create_future()
        self.queries[qid] = fut
        self.flush_done()
        self.scheduler.send(ControlRequest(self.frontend_id, qid, action, name, config,
                                           unload_dependents, upload_dir))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.queries.pop(qid, None)

    async def log_settings(self, settings: LogSettings, timeout: float = 5.0) -> ControlReply:
        """Tell the scheduler, which passes them on to every worker and other frontend;
        answers once it has (frontend/observability/log_settings.py)."""
        qid = next(self.ids)
        fut = self.loop.create_future()
        self.queries[qid] = fut
        self.scheduler.send(SetLogSettings(settings, self.frontend_id, qid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.queries.pop(qid, None)

    def _log_settings(self, msg: SetLogSettings) -> None:
        """Another frontend's client changed them."""
        logs.apply(msg.settings)

    async def trace_settings(self, changes: TraceChanges, model: str,
                             timeout: float = 5.0) -> None:
        """Tell the scheduler, which passes them on to every other frontend; answers once it
        has (frontend/observability/trace.py)."""
        qid = next(self.ids)
        fut = self.loop.create_future()
        self.queries[qid] = fut
        self.scheduler.send(SetTraceSettings(changes, model, self.frontend_id, qid))
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            self.queries.pop(qid, None)

    def _trace_settings(self, msg: SetTraceSettings) -> None:
        if self.on_trace_settings is not None:
            self.on_trace_settings(msg.changes, msg.model)

    async def model_decides_ready(self, model: str, version: int,
                                  timeout: float = READINESS_TIMEOUT_S) -> bool:
        """What the model's own is_ready() says now (every instance of the version); not ready
        when it has not said within ``timeout`` (Triton's 5 s)."""
        qid = next(self.ids)
        fut = self.loop.create_future()
        self.queries[qid] = fut
        self.scheduler.send(ReadinessQuery(self.frontend_id, qid, model, version))
        try:
            return (await asyncio.wait_for(fut, timeout)).ready
        except asyncio.TimeoutError:
            return False
        finally:
            self.queries.pop(qid, None)

    async def statistics(self, model: str = "", version: int = -1,
                         timeout: float = 5.0) -> StatsReply:
        qid = next(self.ids)
        fut = self.loop.create_future()
        self.queries[qid] = fut
        self.flush_done()           # the query must not miss what its client has seen answered
        self.scheduler.send(StatsQuery(self.frontend_id, qid, model, version))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.queries.pop(qid, None)

    def _drain(self) -> None:
        # answers of one wake-up are written before the clients they wake may run
        # (frontend/priority.py)
        if self.priority is not None and self.priority.raise_for(len(self.pending)):
            try:
                self._take_all()
            finally:
                self.priority.lower()
        else:
            self._take_all()

    def _take_all(self) -> None:
        inbox, handlers = self.inbox, self.handlers
        # one look at the sockets per wake-up (what arrives after it wakes the loop again),
        # then what it read
        look = True
        while True:
            got = inbox.take(look)
            look = False
            if got is None:
                if self.lost:
                    self._resolve_lost()
                return
            msg = got[0]
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("ignoring an unexpected %s message", type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception:
                # the messages already read out of the socket wait in the inbox, and the fd
                # does not show them: stopping here would strand them until the next arrives,
                # so a failing callback costs only itself
                log.exception("error handling a %s message", type(msg).__name__)

    def _deliver_many(self, msg: InferResults) -> None:
        for result in msg.results:
            try:
                self._deliver(result)
            except Exception:           # the rest of the batch must still be answered
                log.exception("error answering request %d", result.req_id)

    def _update_table(self, msg: ModelTable) -> None:
        self.catalog.update(msg)
        self.routes = {(m.name, v.version): Route(v.route) for m in msg.models
                       for v in m.versions if v.route}
        self.table_event.set()
        if self.on_table is not None:
            self.on_table()

    def _answer_query(self, msg: StatsReply | ControlReply | ReadinessReply) -> None:
        fut = self.queries.get(msg.query_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_all(self, message: str) -> None:
        pending, self.pending = self.pending, {}
        self.sent.clear()
        self.streaming.clear()
        self.corked.clear()
        self.leases.clear()
        self.sequences.clear()
        self.deadlines.clear()
        self.order.clear()
        self.ordered_key.clear()
        self.held.clear()
        for req_id, cb in pending.items():
            cb(InferResult(req_id, "", 0, error=message, code=ErrorCode.UNAVAILABLE))

    def close(self) -> None:
        if self.flusher is not None:
            self.flusher.cancel()
        self.flush_done()
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        self.loop.remove_reader(self.inbox.fileno())
        self.inbox.close()
        self.scheduler.close()
        for box in self.workers.values():
            box.close()
