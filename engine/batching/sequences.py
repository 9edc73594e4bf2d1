"""Triton's sequence batcher (docs/triton-compat.md §5.3) as a pure queue: stateful models whose
requests carry a correlation id and START/END flags.

Each live sequence is pinned to one instance, which holds its state (the model's own, or the
implicit state its worker keeps: workers/sequence.py), until its END request leaves for that
instance or it idles past ``max_sequence_idle_microseconds``. An instance holds at most
``capacity`` live sequences: its batch slots with the direct strategy (max_batch_size, at least
1), ``max_candidate_sequences`` with oldest. Sequences that find no room wait in a backlog, in
arrival order, for a sequence to end. A batch for an idle instance takes at most one request per
sequence pinned to it, oldest first, so a sequence's requests run in order, one at a time.

There are no padding requests: every request a model gets is real (READY true), so the batch
position of a sequence may change from one execution to the next; models find their sequence by
its CORRID or ``request.correlation_id()``.

Same interface as the other queues (engine/batching/queues.py), plus ``take_failed``: requests of the
sequences whose instance died, to fail with the reason (their state is gone).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from shmserve.engine.batching.queues import IdleInstances, QueuedRequest, QueueFull

log = logging.getLogger("shmserve.scheduler")

SEQUENCE_START = 1
SEQUENCE_END = 2
DEFAULT_IDLE_US = 1_000_000
LOST_KEPT = 4096            # sequences remembered as lost, so their next request says why
# Idle releases need no precision: their deadline is rounded up to this grid, so that it does
# not move (and re-arm the scheduler's alarm) with every request of every sequence
IDLE_GRID_NS = 100_000_000


class SequenceError(Exception):
    """A request the sequence rules refuse (400, INVALID_ARG); the message names why."""


@dataclass(frozen=True)
class SequenceConfig:
    model: str
    capacity: int                   # live sequences per instance
    max_batch: int                  # requests per execution
    oldest: bool = False
    delay_us: int = 0               # wait this long for fuller batches
    preferred: tuple[int, ...] = ()     # oldest: send at once when a batch reaches one of these
    min_slot_utilization: float = 0.0   # direct: send at once when this share of slots is ready
    idle_us: int = DEFAULT_IDLE_US


def sequence_config(cfg) -> SequenceConfig:
    """From a normalized ModelConfig with ``sequence_batching``, or its dict (the worker's)."""
    if not isinstance(cfg, dict):
        from shmserve.ipc.model_config import config_to_dict
        cfg = config_to_dict(cfg)
    sb = cfg.get("sequence_batching") or {}
    mbs = max(1, int(cfg.get("max_batch_size") or 0))
    idle = int(sb.get("max_sequence_idle_microseconds") or 0) or DEFAULT_IDLE_US
    if "oldest" in sb:
        o = sb["oldest"]
        preferred = (int(p) for p in o.get("preferred_batch_size") or ())
        return SequenceConfig(cfg["name"], max(1, int(o.get("max_candidate_sequences") or 0)),
                              mbs, True, int(o.get("max_queue_delay_microseconds") or 0),
                              tuple(sorted(p for p in preferred if 0 < p <= mbs)), idle_us=idle)
    d = sb.get("direct") or {}
    return SequenceConfig(cfg["name"], mbs, mbs, False,
                          int(d.get("max_queue_delay_microseconds") or 0),
                          min_slot_utilization=float(d.get("minimum_slot_utilization") or 0.0),
                          idle_us=idle)


@dataclass(eq=False)
class Sequence:
    cid: int | str
    queue: deque = field(default_factory=deque)     # its requests not yet sent
    instance: Hashable | None = None                # None: in the backlog
    open: bool = True               # its last request queued had no END
    running: bool = False           # a request of it is executing
    ran: bool = False               # a request of it has gone to its instance
    last_ns: int = 0                # when it last had a request queued or finished one


class SequenceBatcher(IdleInstances):
    def __init__(self, cfg: SequenceConfig, max_queue_size: int = 0,
                 clock: Callable[[], int] = time.monotonic_ns):
        self.cfg = cfg
        self.clock = clock
        self.max_queue_size = max_queue_size
        self.idle: list[Hashable] = []
        self.instances: dict[Hashable, list[Sequence]] = {}    # alive -> sequences pinned there
        self.sequences: dict[int | str, Sequence] = {}
        # pinned sequences with nothing queued or running, least recently active first: the
        # idle release and its deadline look at the first one only
        self.quiet: OrderedDict[Sequence, None] = OrderedDict()
        self.backlog: deque[Sequence] = deque()
        self.lost: OrderedDict[int | str, str] = OrderedDict()  # cid -> why it ended
        self.failed: list[tuple[QueuedRequest, str]] = []
        # requests that waited for a lent instance whose worker died: the caller enqueues them
        # again (take_back), where the lost sequences' ones are refused with the reason
        self.orphans: list[QueuedRequest] = []
        self.count = 0                  # queued requests
        # instances lent (engine/leases.py): the cids handed over, and the requests that wait
        # for them to come back (their sequences' rules are applied where they are)
        self.lent: dict[Hashable, tuple[list[int | str], list[QueuedRequest]]] = {}
        self.delay_ns = cfg.delay_us * 1000
        self.idle_ns = cfg.idle_us * 1000

    # ---- requests ----------------------------------------------------------------------------
    def enqueue(self, req: QueuedRequest) -> None:
        cid, name = req.sequence_id, self.cfg.model
        if self.lent:
            # the live sequences are the lent worker's: it hands them back (LeaseEnded, or
            # its death) before this is judged; meanwhile it counts as queued (the lease is
            # revoked for it)
            if self.max_queue_size and self.count >= self.max_queue_size:
                raise QueueFull("Exceeds maximum queue size")
            next(iter(self.lent.values()))[1].append(req)
            self.count += 1
            return
        if cid == 0 or cid == "":
            raise SequenceError(f"inference request to model '{name}' must specify a non-zero "
                                f"or non-empty correlation ID")
        if self.max_queue_size and self.count >= self.max_queue_size:
            raise QueueFull("Exceeds maximum queue size")
        now = self.clock()
        seq = self.sequences.get(cid)
        start = bool(req.flags & SEQUENCE_START)
        if not start and (seq is None or not seq.open):
            raise SequenceError(self.lost_start_error(cid, req.flags) or
                                f"inference request for sequence {cid} to model '{name}' must "
                                f"specify the START flag on the first request of the sequence")
        if start:
            self.lost.pop(cid, None)
            if seq is not None and seq.open:
                log.warning("sequence %s of model '%s' started again before it ended: the new "
                            "START ends the old one", cid, name)
        if seq is None:
            seq = self.sequences[cid] = Sequence(cid)
            self.place(seq)
        req.enqueued_ns = now
        seq.queue.append(req)
        seq.open = not req.flags & SEQUENCE_END
        seq.last_ns = now
        self.quiet.pop(seq, None)
        self.count += 1

    def calm(self, seq: Sequence, now: int) -> None:
        """``seq`` has nothing queued or running: its idle time counts from ``now``."""
        seq.last_ns = now
        self.quiet.pop(seq, None)
        self.quiet[seq] = None

    def place(self, seq: Sequence) -> None:
        """Pin a new sequence to the instance with the most room, or put it in the backlog."""
        best, room = None, 0
        for inst, pinned in self.instances.items():
            free = self.cfg.capacity - len(pinned)
            if free > room:
                best, room = inst, free
        if best is None:
            self.backlog.append(seq)
        else:
            seq.instance = best
            self.instances[best].append(seq)

    def release(self, seq: Sequence) -> None:
        """The sequence ended (or idled out): its slot goes to the oldest backlog sequence."""
        self.sequences.pop(seq.cid, None)
        self.quiet.pop(seq, None)
        inst = seq.instance
        if inst is None:
            return
        pinned = self.instances.get(inst)
        if pinned is not None and seq in pinned:
            pinned.remove(seq)
            if self.backlog:
                nxt = self.backlog.popleft()
                nxt.instance = inst
                pinned.append(nxt)

    # ---- lending (engine/leases.py) ---------------------------------------------------------------
    def lend(self, key: Hashable) -> list[tuple[int | str, int]]:
        """The idle instance ``key`` is lent, with nothing queued: its live sequences go with it,
        as (cid, last ran); the worker applies the rules to them until ``take_back``."""
        assert not self.count, "a sequence instance is lent only with nothing queued"
        pinned = self.instances.pop(key, [])
        if key in self.idle:
            self.idle.remove(key)
        for seq in self.backlog:        # drained (engine/core.py hand_over): they start afresh
            self.sequences.pop(seq.cid, None)
        self.backlog.clear()
        live = []
        for seq in pinned:
            self.sequences.pop(seq.cid, None)
            self.quiet.pop(seq, None)
            if seq.ran:     # one that never ran starts afresh where its START goes
                live.append((seq.cid, seq.last_ns))
        self.lent[key] = ([cid for cid, _ in live], [])
        return live

    def take_back(self, key: Hashable, live: list[tuple[int | str, int]] | None
                  ) -> list[QueuedRequest]:
        """The lent instance ``key`` comes back with its live sequences (None: its worker died
        holding them: they are lost). Returns the requests that came meanwhile, in arrival
        order, for the caller to enqueue again."""
        cids, waiting = self.lent.pop(key, ([], []))
        self.count -= len(waiting)
        if live is None:
            for cid in cids:
                self.mark_lost(cid)
            return waiting
        pinned = self.instances.setdefault(key, [])
        for cid, last_ns in sorted(live, key=lambda c: c[1]):     # the quiet order
            seq = self.sequences[cid] = Sequence(cid, instance=key, ran=True)
            pinned.append(seq)
            self.calm(seq, last_ns)
        return waiting

    # ---- batches -----------------------------------------------------------------------------
    def next_batches(self) -> list[tuple[Any, list[QueuedRequest]]]:
        if not self.count:
            return []
        out = []
        now = self.clock()
        for inst in list(self.idle):
            ready = [s for s in self.instances.get(inst, ()) if s.queue and not s.running]
            if not ready or not self.due(ready, now):
                continue
            ready.sort(key=lambda s: s.queue[0].enqueued_ns)
            batch = []
            for seq in ready[:self.cfg.max_batch]:
                req = seq.queue.popleft()
                req.dispatched_ns = now
                self.count -= 1
                seq.running = seq.ran = True
                seq.last_ns = now
                batch.append(req)
                if req.flags & SEQUENCE_END and not seq.queue:
                    seq.running = False
                    self.release(seq)
            self.idle.remove(inst)
            out.append((inst, batch))
        return out

    def due(self, ready: list[Sequence], now: int) -> bool:
        """Send now, or wait (up to the delay) for a fuller batch."""
        if not self.delay_ns:
            return True
        n = min(len(ready), self.cfg.max_batch)
        if n >= self.cfg.max_batch:
            return True
        if self.cfg.oldest:
            if self.cfg.preferred and n >= self.cfg.preferred[-1] or n in self.cfg.preferred:
                return True
        elif self.cfg.min_slot_utilization and n / self.cfg.capacity >= \
                self.cfg.min_slot_utilization:
            return True
        oldest = min(s.queue[0].enqueued_ns for s in ready)
        return now - oldest >= self.delay_ns

    def instance_idle(self, key: Hashable) -> None:
        """An instance is free: its sequences' requests are done (they may send the next)."""
        if key not in self.instances:       # a new (or restarted) instance: room for the backlog
            self.instances[key] = []
            while self.backlog and len(self.instances[key]) < self.cfg.capacity:
                seq = self.backlog.popleft()
                seq.instance = key
                self.instances[key].append(seq)
        now = self.clock()
        for seq in self.instances[key]:
            if seq.running:
                seq.running = False
                seq.last_ns = now
                if not seq.queue:
                    self.calm(seq, now)
        if key not in self.idle:
            self.idle.append(key)

    def instance_gone(self, key: Hashable) -> None:
        """Its worker died: the state of the sequences it held is gone with it. Their queued
        requests fail (``take_failed``), and so would their next ones without START. One whose
        next request is a START (it never ran there) lost nothing: it goes back to the backlog."""
        if key in self.idle:
            self.idle.remove(key)
        if key in self.lent:
            self.orphans.extend(self.take_back(key, None))
        pinned = self.instances.pop(key, None) or []
        fresh = []
        for seq in pinned:
            seq.running = False
            self.quiet.pop(seq, None)
            if seq.queue and seq.queue[0].flags & SEQUENCE_START:
                # its next request starts it afresh (it never ran here, or was started again):
                # nothing of it is lost; it goes first in the backlog
                seq.instance = None
                fresh.append(seq)
                continue
            self.sequences.pop(seq.cid, None)
            why = self.mark_lost(seq.cid)
            for req in seq.queue:
                self.failed.append((req, why))
            self.count -= len(seq.queue)
            seq.queue.clear()
        self.backlog.extendleft(reversed(fresh))
        for seq in list(self.backlog):      # room may have opened elsewhere
            self.backlog.remove(seq)
            self.place(seq)

    def lost_with_worker(self, cids: list[int | str]) -> None:
        """A leased worker that held ``cids`` ended (the frontend says so: some started under
        the lease, unknown here). One this batcher has open lives on; it started again."""
        for cid in cids:
            seq = self.sequences.get(cid)
            if seq is None or not seq.open:
                self.mark_lost(cid)

    def lost_start_error(self, cid: int | str, flags: int) -> str:
        """The error of a request (not a START) of a sequence that died with its worker, with
        why; "" for any other request. A request on its way to a lent instance is judged by it
        too, since the lent worker never knew the sequence."""
        if flags & SEQUENCE_START:
            return ""
        seq = self.sequences.get(cid)
        why = self.lost.get(cid) if seq is None or not seq.open else None
        if why is None:
            return ""
        return (f"inference request for sequence {cid} to model '{self.cfg.model}' must specify "
                f"the START flag on the first request of the sequence: {why}")

    def mark_lost(self, cid: int | str) -> str:
        """Sequence ``cid`` died with its worker: why, which its next request is told."""
        why = self.lost[cid] = (f"sequence {cid} of model '{self.cfg.model}' lost its state: "
                                f"the worker process that held it ended; start the sequence "
                                f"again")
        while len(self.lost) > LOST_KEPT:
            self.lost.popitem(last=False)
        return why

    def take_orphans(self) -> list[QueuedRequest]:
        out, self.orphans = self.orphans, []
        return out

    def take_failed(self) -> list[tuple[QueuedRequest, str]]:
        out, self.failed = self.failed, []
        return out

    # ---- time --------------------------------------------------------------------------------
    def take_expired(self) -> list[QueuedRequest]:
        """Idle sequences end silently (their slot is freed); a backlog sequence whose oldest
        request's timeout passed is rejected whole (Triton applies timeouts only there)."""
        now = self.clock()
        quiet = self.quiet
        while quiet and self.idle_ns:
            seq = next(iter(quiet))
            if now - seq.last_ns < self.idle_ns:
                break
            log.info("sequence %s of model '%s' idled for %.1f s: its slot is released",
                     seq.cid, self.cfg.model, self.idle_ns / 1e9)
            self.release(seq)
        out: list[QueuedRequest] = []
        for seq in list(self.backlog):
            head = seq.queue[0] if seq.queue else None
            if head is not None and head.timeout_us and \
                    now - head.enqueued_ns >= head.timeout_us * 1000:
                self.backlog.remove(seq)
                self.sequences.pop(seq.cid, None)
                out.extend(seq.queue)
                self.count -= len(seq.queue)
                seq.queue.clear()
        return out

    def next_deadline_ns(self) -> int | None:
        earliest = None

        def consider(t: int) -> None:
            nonlocal earliest
            if earliest is None or t < earliest:
                earliest = t
        if self.quiet and self.idle_ns:
            due = next(iter(self.quiet)).last_ns + self.idle_ns
            consider(-(-due // IDLE_GRID_NS) * IDLE_GRID_NS)
        for seq in self.backlog:
            if seq.queue and seq.queue[0].timeout_us:
                consider(seq.queue[0].enqueued_ns + seq.queue[0].timeout_us * 1000)
        if self.count:
            # waiting on an idle instance: due when the delay passes (now, without one: a
            # sequence just moved there from a dead instance)
            for inst in self.idle:
                for seq in self.instances.get(inst, ()):
                    if seq.queue and not seq.running:
                        consider(seq.queue[0].enqueued_ns + self.delay_ns)
        return earliest

    # ---- the rest of the queue interface ----------------------------------------------------------
    def requeue(self, req: QueuedRequest) -> None:
        seq = self.sequences.get(req.sequence_id)
        if seq is None:
            self.failed.append((req, f"sequence {req.sequence_id} of model '{self.cfg.model}' "
                                     f"has ended"))
            return
        seq.queue.appendleft(req)
        self.quiet.pop(seq, None)
        self.count += 1

    def cancel(self, frontend: int, req_id: int) -> QueuedRequest | None:
        found = self.take_cancelled(frontend, req_id)
        return found[0] if found else None

    def take_cancelled(self, frontend: int, req_id: int) -> list[QueuedRequest]:
        """The client cancelled a queued request of a sequence: as in Triton, the sequence's
        other queued requests are cancelled with it (they could only run out of order, or
        without their START); the cancelled one comes first."""
        for _, waiting in self.lent.values():
            for r in waiting:
                if r.req_id == req_id and r.frontend == frontend:
                    out = [r] + [q for q in waiting if q is not r and
                                 q.sequence_id == r.sequence_id]
                    waiting[:] = [q for q in waiting if q not in out]
                    self.count -= len(out)
                    return out
        for seq in self.sequences.values():
            for r in seq.queue:
                if r.req_id == req_id and r.frontend == frontend:
                    out = [r] + [q for q in seq.queue if q is not r]
                    self.count -= len(seq.queue)
                    seq.queue.clear()
                    if seq.instance is None and seq in self.backlog:
                        # nothing of it ran or waits to: it gives up its place in the backlog
                        # (else it would take a slot, and hold it until it idled out)
                        self.backlog.remove(seq)
                        self.sequences.pop(seq.cid, None)
                    elif not seq.ran:
                        # its START never ran and nothing else waits: it never began, and
                        # its slot goes to the next (a request without START is refused)
                        self.release(seq)
                    elif seq.instance is not None and not seq.running:
                        self.calm(seq, self.clock())
                    return out
        return []

    def pending(self) -> Iterator[QueuedRequest]:
        for seq in self.sequences.values():
            yield from seq.queue
        for _, waiting in self.lent.values():
            yield from waiting

    def drain(self) -> list[QueuedRequest]:
        out = list(self.pending())
        for seq in self.sequences.values():
            seq.queue.clear()
        for _, waiting in self.lent.values():
            waiting.clear()
        self.count = 0
        return out

    def __len__(self) -> int:
        return self.count
