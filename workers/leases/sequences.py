"""The sequence batcher of a leased stateful model, in its worker.

A sequence model's instances are lent to a frontend like any others (engine/leases.py): the
scheduler sends each worker the live sequences it had pinned there (LendSequences), and the
frontend sends each sequence's requests straight to the worker that has it. They meet here, in the scheduler's
own sequence batcher (engine/batching/sequences.py: the same class, so the same rules: START
required, capacity and backlog, one request per sequence in a batch, oldest first, the delay,
idle release). A new sequence that finds no free slot ends the lease from the worker's side:
waiting requests are the scheduler's to queue, count and time out. When the lease ends,
requests still queued go back to their frontend unrun (LeaseBounced), each sequence's in order,
and the live sequences go back to the scheduler with LeaseEnded; the frontend sends a
sequence's later requests only after its bounced ones (frontend/sequence_paths.py), so no
sequence runs out of order.

Pure: no sockets; the worker's loop feeds it and runs what it returns.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from shmserve.engine.batching.queues import DEFAULT_MAX_QUEUE, QueuedRequest, QueueFull
from shmserve.engine.batching.sequences import SequenceBatcher, SequenceError, sequence_config
from shmserve.ipc import channel
from shmserve.ipc.messages.common import ErrorCode, SequenceSlot
from shmserve.ipc.messages.to_frontend import InferResult, LeaseBounced
from shmserve.ipc.messages.to_worker import ExecuteBatch, LeasedExecute, LendSequences, RequestRoute

log = logging.getLogger("shmserve.worker")

KEY = "leased"      # the batcher's one instance: this worker


class LeasedSequences:
    def __init__(self, config: dict, clock: Callable[[], int] = time.monotonic_ns):
        self.cfg = sequence_config(config)
        self.clock = clock
        self.batcher: SequenceBatcher | None = None
        self.lease_id = 0           # the lease whose sequences these are (0: none)

    def lend(self, msg: LendSequences) -> None:
        b = self.batcher = SequenceBatcher(self.cfg, DEFAULT_MAX_QUEUE, self.clock)
        b.instance_idle(KEY)
        b.take_back(KEY, [(s.cid, s.last_ns) for s in msg.sequences])
        self.lease_id = msg.lease_id

    def take(self, msg: LeasedExecute, frames) -> tuple[ErrorCode, str] | None:
        """Queue a request of the lease; an error to answer it with when the rules refuse it."""
        assert self.batcher is not None
        head = msg.head
        req = QueuedRequest(head.req_id, head.frontend, head.batch_size, (msg, frames),
                            timeout_us=head.timeout_us, received_ns=head.received_ns,
                            sequence_id=head.sequence_id, flags=head.sequence_flags,
                            trace=head.trace)
        try:
            self.batcher.enqueue(req)
        except SequenceError as e:
            return ErrorCode.INVALID_ARG, str(e)
        except QueueFull as e:
            return ErrorCode.UNAVAILABLE, str(e)
        return None

    def expired(self) -> list[QueuedRequest]:
        """Idle sequences released; backlog requests past their timeout, to refuse."""
        return self.batcher.take_expired() if self.batcher is not None else []

    def next_batch(self) -> list[QueuedRequest]:
        """The requests to run now (the worker is idle), or []."""
        if self.batcher is None:
            return []
        for _, reqs in self.batcher.next_batches():
            return reqs
        return []

    def ran(self) -> None:
        """The batch ran: its sequences may send their next requests."""
        if self.batcher is not None:
            self.batcher.instance_idle(KEY)

    def crowded(self) -> bool:
        """A sequence waits for a slot (the backlog)."""
        return self.batcher is not None and bool(self.batcher.backlog)

    def waiting(self) -> bool:
        return self.batcher is not None and len(self.batcher) > 0

    def wait_ms(self) -> int:
        """How long the loop may wait for a message before a queued request is due."""
        due = self.batcher.next_deadline_ns() if self.batcher is not None else None
        if due is None:
            return 1000
        return max(1, -(-(due - self.clock()) // 1_000_000))

    def take_cancelled(self, frontend: int, req_id: int) -> list[QueuedRequest]:
        return self.batcher.take_cancelled(frontend, req_id) if self.batcher is not None else []

    def end(self) -> tuple[list[QueuedRequest], list[SequenceSlot]]:
        """The lease ends: the requests still queued (to hand back, each sequence's in order)
        and the live sequences (for the scheduler)."""
        b, self.batcher, self.lease_id = self.batcher, None, 0
        if b is None:
            return [], []
        queued = b.drain()
        live = [SequenceSlot(cid, last_ns) for cid, last_ns in b.lend(KEY)] \
            if KEY in b.instances else []
        return queued, live


class SequenceLease:
    """The worker's side of a leased sequence model: feeds LeasedSequences from the inbox and
    runs what it returns (workers/worker.py calls in)."""

    # how long a leased request waits for the LendSequences that the scheduler sent before the
    # grant (it is in the inbox already: this bounds a broken protocol, not a normal wait)
    TABLE_WAIT_S = 1.0

    def __init__(self, worker, config: dict):
        self.worker = worker
        self.seqs = LeasedSequences(config)

    def lend(self, msg: LendSequences) -> None:
        self.seqs.lend(msg)

    def leased(self, msg: LeasedExecute, frames) -> None:
        """A request of the lease in force: queued, with the ones right behind it in the inbox
        (a batch takes one request per sequence), and then what may run, runs."""
        w, seqs = self.worker, self.seqs
        if seqs.lease_id != msg.lease_id:
            self._await_table(msg.lease_id)
        self._expire()      # a sequence idle too long ends before its next request is judged
        self._take(msg, frames)
        backlog, inbox = w.backlog, w.inbox
        while True:
            if not backlog:
                if not inbox.has_message():
                    break
                try:
                    backlog.append(inbox.recv(channel.NOBLOCK))
                except zmq.Again:
                    break
            nxt, more = backlog[0]
            if type(nxt) is not LeasedExecute or nxt.lease_id != msg.lease_id:
                break
            backlog.popleft()
            self._take(nxt, more)
        if seqs.crowded():
            # a new sequence finds no slot: it would wait for one to end, unseen by the
            # scheduler's statistics and timeouts. The lease ends (what is queued goes back,
            # in order), and the scheduler's queue takes over while requests wait
            w.end_lease(msg.lease_id)
            return
        self.run()

    def run(self) -> None:
        """Run every batch that is due now."""
        w, seqs = self.worker, self.seqs
        self._expire()
        while True:
            batch = seqs.next_batch()
            if not batch:
                return
            heads = [r.payload[0].head for r in batch]
            w.execute(ExecuteBatch(0, [RequestRoute(h.req_id, h.frontend, h.trace)
                                       for h in heads]),
                      [f for r in batch for f in r.payload[1]], heads)
            seqs.ran()

    def cancel(self, frontend: int, req_id: int) -> None:
        """A queued request's client left: it and its sequence's later ones end (as the
        scheduler's queue does)."""
        for req in self.seqs.take_cancelled(frontend, req_id):
            self._refuse(req, ErrorCode.CANCELLED, "the request was cancelled by the client")

    def end(self) -> list[SequenceSlot]:
        """The lease ends (revoked, or the worker stops): queued requests go back to their
        frontend unrun, in order; returns the live sequences."""
        w = self.worker
        queued, live = self.seqs.end()
        for req in queued:
            w.answer(req.frontend, LeaseBounced(w.args.spawn_id, req.req_id))
        return live

    def _expire(self) -> None:
        for req in self.seqs.expired():
            self._refuse(req, ErrorCode.UNAVAILABLE, "Request timeout expired")

    def _take(self, msg: LeasedExecute, frames) -> None:
        refused = self.seqs.take(msg, frames)
        if refused is not None:
            head = msg.head
            self.worker.answer(head.frontend, InferResult(
                head.req_id, head.model, head.version, error=refused[1], code=refused[0]))

    def _refuse(self, req: QueuedRequest, code: ErrorCode, message: str) -> None:
        head = req.payload[0].head
        self.worker.answer(head.frontend, InferResult(head.req_id, head.model, head.version,
                                                      error=message, code=code))

    def _await_table(self, lease_id: int) -> None:
        w = self.worker
        backlog = w.backlog
        deadline = time.monotonic() + self.TABLE_WAIT_S
        i = 0
        while True:
            while i < len(backlog):
                m = backlog[i][0]
                if type(m) is LendSequences and m.lease_id == lease_id:
                    del backlog[i]
                    self.seqs.lend(m)
                    return
                i += 1
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("lease %d: the scheduler's LendSequences did not come; its live "
                          "sequences are taken as none", lease_id)
                self.seqs.lend(LendSequences(lease_id, []))
                return
            if not w.inbox.has_message():
                w.inbox.wait(left)
            try:
                backlog.append(w.inbox.recv(channel.NOBLOCK))
            except zmq.Again:
                pass
