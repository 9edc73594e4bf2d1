"""The worker's half of a lease (engine/leases.py): it runs what a frontend sent under a lease
until it reads the revoke, answers LeaseEnded then, and hands back (LeaseBounced) anything of
that lease it reads later, or still holds when it stops."""
from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
from bare_worker import BareWorker
from serverproc import wait_for

from shmserve.ipc import channel
from shmserve.ipc.messages.common import ENSEMBLE_FRONTEND, SequenceSlot
from shmserve.ipc.messages.to_frontend import InferResult, InferResults, LeaseBounced
from shmserve.ipc.messages.to_scheduler import LeaseEnded, SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute, LendSequences, Ping, RequestRoute, RevokeLease
from shmserve.workers.leases.batch import LeasedBatcher
from shmserve.workers.leases.chain import Chains
from shmserve.workers.leases.sequences import SequenceLease

SPAWN = 7


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, msg, *a, **kw):
        self.sent.append(msg)


@pytest.fixture
def worker(tmp_path):
    w = BareWorker()      # only the lease logic; execute() is recorded, not run
    w.args = SimpleNamespace(spawn_id=SPAWN)
    w.inbox = channel.inbox_for(channel.worker_address(str(tmp_path), SPAWN))
    w.backlog, w.revoked_upto = deque(), 0
    w.lease_batcher = LeasedBatcher({"max_batch_size": 0})     # no dynamic batching
    w.sequence_lease = None                                     # not a sequence model
    w.scheduler = Recorder()
    w.tell_lock = threading.Lock()
    w.executed, w.sent = [], []
    w.execute = lambda batch, frames, leased=None: w.executed.append((batch, frames, leased))
    w.answer = lambda fid, msg: w.sent.append((fid, msg))
    w.chains = Chains(w)
    out = channel.outbox_for(w.inbox.address)
    yield w, out
    out.close()
    w.inbox.close()


def head(req_id: int, frontend: int = 2) -> SubmitRequest:
    return SubmitRequest(req_id, frontend, "m", 1, 1, received_ns=5)


def test_runs_leased_requests_until_the_revoke_then_hands_them_back(worker):
    w, _ = worker
    w.leased(LeasedExecute(3, head(10)), [b"p10"])
    [(batch, frames, leased)] = w.executed
    assert batch.batch_id == 0 and [(r.req_id, r.frontend) for r in batch.routes] == [(10, 2)]
    assert frames == [b"p10"] and leased == [head(10)]   # its LeasedRecord comes from it
    w.revoke_lease(RevokeLease(3))
    assert w.scheduler.sent == [LeaseEnded(SPAWN, 3)]
    w.leased(LeasedExecute(3, head(11)), [b"p11"])       # read after the revoke: not run
    w.leased(LeasedExecute(2, head(12, frontend=4)), [b"p12"])   # an older lease, too
    assert len(w.executed) == 1
    assert w.sent == [(2, LeaseBounced(SPAWN, 11)), (4, LeaseBounced(SPAWN, 12))]
    w.leased(LeasedExecute(4, head(13)), [b"p13"])       # the next lease runs
    assert len(w.executed) == 2


def test_stopping_hands_back_the_leased_requests_it_still_holds(worker):
    w, out = worker
    out.send(LeasedExecute(1, head(20)), (b"x",))
    out.send(Ping(1))
    out.send(LeasedExecute(1, head(21)), (b"y",))
    w.inbox.set_timeout(10_000)
    w.backlog.append(w.inbox.recv())    # one was read during the last execute()
    w.bounce_leased()
    assert w.executed == []
    assert w.sent == [(2, LeaseBounced(SPAWN, 20)), (2, LeaseBounced(SPAWN, 21))]


def test_the_answers_of_one_execution_go_one_message_per_frontend(worker):
    """A leased batch's answers wake their frontend once (InferResults); an ensemble's steps
    are handed back to ride in the BatchDone instead."""
    w, _ = worker
    routes = [RequestRoute(i, fid) for i, fid in
              enumerate([2, 2, 4, 2, ENSEMBLE_FRONTEND, 2])]
    results = [InferResult(i, "m", 1) for i in range(6)]
    results[5] = None           # answered through its response sender: gone already
    steps = w.answer_all(routes, results)
    assert w.sent == [(2, InferResults([results[0], results[1], results[3]])),
                         (4, results[2])]
    assert steps == [results[4]]


def seq_head(req_id: int, cid: int, flags: int = 0) -> SubmitRequest:
    return SubmitRequest(req_id, 2, "m", 1, 1, received_ns=5, sequence_id=cid,
                         sequence_flags=flags)


def test_a_sequence_lease_runs_in_order_and_hands_back_what_it_still_queues(worker):
    """The lent sequences come first (a LeasedExecute may be read before the LendSequences
    the scheduler sent ahead of the grant: it is looked for in the inbox); requests behind a
    leased one join its batch, one per sequence; the revoke hands back what is still queued,
    in order, and the live sequences go with LeaseEnded."""
    w, out = worker
    w.sequence_lease = SequenceLease(w, {"name": "m", "max_batch_size": 4,
                                         "sequence_batching": {}})
    out.send(LendSequences(3, [SequenceSlot(9, time.monotonic_ns())]))
    out.send(LeasedExecute(3, seq_head(11, 9)), (b"p11",))
    out.send(LeasedExecute(3, seq_head(12, 5, 1)), (b"p12",))
    out.send(LeasedExecute(3, seq_head(13, 9)), (b"p13",))
    wait_for(lambda: w.inbox.has_message(), 10, "the inbox to fill")
    w.leased(LeasedExecute(3, seq_head(10, 9)), [b"p10"])   # read first, from the frontend
    ran = [[h.req_id for h in leased] for _, _, leased in w.executed]
    # 10 and 12 together (one per sequence); 11 and 13 of sequence 9 after, one each
    assert ran == [[10, 12], [11], [13]]
    assert w.executed[0][1] == [b"p10", b"p12"]
    w.executed.clear()
    out.send(LeasedExecute(3, seq_head(14, 9)), (b"p14",))
    w.sequence_lease.seqs.batcher.idle.clear()          # as if the worker were busy
    wait_for(lambda: w.inbox.has_message(), 10, "the inbox to fill")
    w.leased(*w.inbox.recv())
    assert w.executed == []
    w.revoke_lease(RevokeLease(3))
    [ended] = w.scheduler.sent
    assert (ended.lease_id, sorted(s.cid for s in ended.sequences)) == (3, [5, 9])
    assert w.sent == [(2, LeaseBounced(SPAWN, 14))]


def test_a_sequence_that_finds_no_slot_gives_the_lease_back(worker):
    w, _ = worker
    w.sequence_lease = SequenceLease(w, {"name": "m", "max_batch_size": 1,
                                         "sequence_batching": {}})
    w.lend_sequences(LendSequences(3, [SequenceSlot(9, time.monotonic_ns())]))
    w.leased(LeasedExecute(3, seq_head(10, 4, 1)), [b"p10"])    # the one slot is 9's
    assert w.executed == [] and w.revoked_upto == 3
    [ended] = w.scheduler.sent
    assert [s.cid for s in ended.sequences] == [9]
    assert w.sent == [(2, LeaseBounced(SPAWN, 10))]
    w.leased(LeasedExecute(3, seq_head(11, 9)), [b"p11"])       # later ones bounce too
    assert w.sent[-1] == (2, LeaseBounced(SPAWN, 11))
