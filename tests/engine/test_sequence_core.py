"""The sequence batcher inside SchedulerCore (docs/triton-compat.md §5.3): a repository with
sequence models, driven in-process with a fake port and a fake clock (tests/engine/fakes.py).
No sockets, no processes, no sleeping."""
import pytest
from fakes import IO, ONE, TWO, Harness, write_model

from shmserve.engine.batching.sequences import SEQUENCE_END, SEQUENCE_START
from shmserve.engine.leases import TERM_NS
from shmserve.ipc.messages.common import ErrorCode, SequenceSlot
from shmserve.ipc.messages.to_frontend import LeaseGranted
from shmserve.ipc.messages.to_scheduler import (
    CancelRequest,
    FrontendHello,
    LeasedDone,
    LeasedRecord,
    LeaseEnded,
    StatsQuery,
    SubmitRequest,
)
from shmserve.ipc.messages.to_worker import LeasedExecute, LendSequences, RevokeLease

S, E = SEQUENCE_START, SEQUENCE_END


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    # direct, 2 instances of 2 slots each
    write_model(r, "seq", f"max_batch_size: 2\n{IO}\n{TWO}\n"
                          f"sequence_batching {{ max_sequence_idle_microseconds: 5000000 }}")
    # direct, one instance of one slot (max_batch_size 0), Triton's default idle time (1 s)
    write_model(r, "one", f"max_batch_size: 0\n{IO}\n{ONE}\nsequence_batching {{ }}")
    write_model(r, "delayed", f"max_batch_size: 4\n{IO}\n{ONE}\nsequence_batching {{ direct {{ "
                              f"max_queue_delay_microseconds: 100000 "
                              f"minimum_slot_utilization: 0.75 }} }}")
    write_model(r, "oldest", f"max_batch_size: 4\n{IO}\n{ONE}\nsequence_batching {{ oldest {{ "
                             f"max_candidate_sequences: 6 preferred_batch_size: [ 3 ] "
                             f"max_queue_delay_microseconds: 100000 }} }}")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    return r


def sids(h, model):
    return [s for s in h.spawn_ids(model) if s not in h.port.reaped]


def stats(h, model):
    return h.core.statistics(StatsQuery(0, 1, model)).models[0]


def error(h, rid):
    res = h.results()[rid]
    return res.code, res.error


START_ERR = ("inference request for sequence {} to model '{}' must specify the START flag on "
             "the first request of the sequence")


# ---- Triton's 400s ---------------------------------------------------------------------------------------
def test_missing_correlation_id_is_invalid_arg(repo):
    h = Harness(repo).start()
    for cid in (0, ""):
        rid = h.submit_seq("seq", cid, S)
        assert error(h, rid) == (ErrorCode.INVALID_ARG,
                                 "inference request to model 'seq' must specify a non-zero or "
                                 "non-empty correlation ID")
    assert h.batches() == [] and stats(h, "seq").pending == 0


def test_non_start_for_an_unknown_or_ended_sequence_is_invalid_arg(repo):
    h = Harness(repo).start()
    rid = h.submit_seq("seq", 42)
    assert error(h, rid) == (ErrorCode.INVALID_ARG, START_ERR.format(42, "seq"))
    sid = sids(h, "seq")[0]
    first = h.submit_seq("seq", 42, S | E)
    assert h.sent_to(sid) == [[first]]
    h.finish(sid)
    rid = h.submit_seq("seq", 42, E)
    assert error(h, rid) == (ErrorCode.INVALID_ARG, START_ERR.format(42, "seq"))
    assert len(h.batches()) == 1 and stats(h, "seq").pending == 0


def test_start_for_a_live_sequence_restarts_it(repo):
    h = Harness(repo).start()
    a, _ = sids(h, "seq")
    r1 = h.submit_seq("seq", 1, S)
    r2 = h.submit_seq("seq", 1, S)          # again, before it ended: a new sequence
    h.finish(a)
    r3 = h.submit_seq("seq", 1)
    h.finish(a)
    h.finish(a)
    assert h.sent_to(a) == [[r1], [r2], [r3]] and h.results() == {}


# ---- order, instances, batches ---------------------------------------------------------------------
def test_a_sequence_runs_in_order_one_at_a_time_on_its_instance(repo):
    h = Harness(repo).start()
    a, b = sids(h, "seq")
    rids = [h.submit_seq("seq", 7, S), h.submit_seq("seq", 7), h.submit_seq("seq", 7),
            h.submit_seq("seq", 7, E)]
    assert h.sent_to(a) == [rids[:1]] and h.sent_to(b) == []     # "b" idles: 7 lives on "a"
    for _ in range(3):
        h.finish(a)
    assert h.sent_to(a) == [[r] for r in rids] and h.sent_to(b) == []
    h.finish(a)
    st = stats(h, "seq")
    assert st.inference_count == 4 and st.execution_count == 4 and st.pending == 0
    assert st.failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 0}


def test_sequences_spread_over_instances_and_batch_up_to_max_batch_size(repo):
    h = Harness(repo).start()
    a, b = sids(h, "seq")
    first, nxt = [], []
    for c in (1, 2, 3, 4):                  # 1, 3 on "a"; 2, 4 on "b"
        first.append(h.submit_seq("seq", c, S))
        h.clock.advance(0.001)              # heads go oldest first: arrivals in order
    assert h.sent_to(a) == [[first[0]]] and h.sent_to(b) == [[first[1]]]
    for c in (1, 1, 2, 3, 4):
        nxt.append(h.submit_seq("seq", c))
        h.clock.advance(0.001)
    h.finish(a)         # 3's START, 1's next; at most one request a sequence a batch
    assert h.sent_to(a)[-1] == [first[2], nxt[0]]
    h.finish(b)
    assert h.sent_to(b)[-1] == [first[3], nxt[2]]
    h.finish(a)
    assert h.sent_to(a)[-1] == [nxt[1], nxt[3]]
    h.finish(b)
    assert h.sent_to(b)[-1] == [nxt[4]]
    assert stats(h, "seq").pending == 0


# ---- capacity and backlog --------------------------------------------------------------------------
def test_backlog_in_arrival_order_promoted_when_the_end_is_sent(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S)
    r2 = h.submit_seq("one", 2, S)          # no slot: the backlog
    r3 = h.submit_seq("one", 3, S)
    assert h.sent_to(sid) == [[r1]]
    h.finish(sid)
    assert h.sent_to(sid) == [[r1]] and stats(h, "one").pending == 2   # 1 holds the slot
    e1 = h.submit_seq("one", 1, E)
    assert h.sent_to(sid) == [[r1], [e1]]
    h.finish(sid)
    assert h.sent_to(sid)[-1] == [r2]       # 1 ended: 2, the oldest in the backlog
    r2e = h.submit_seq("one", 2, E)
    h.finish(sid)
    assert h.sent_to(sid)[-1] == [r2e]
    h.finish(sid)
    assert h.sent_to(sid)[-1] == [r3]


def test_backlog_promoted_when_a_sequence_idles_out_timed_from_its_completion(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S)
    r2 = h.submit_seq("one", 2, S)
    assert h.core.batching_due() is None    # 1 runs, 2 has no timeout: no deadline
    h.tick(30)                              # 1 runs long: no idle time passes meanwhile
    assert h.sent_to(sid) == [[r1]]
    h.finish(sid)
    done = h.clock()
    assert h.core.batching_due() == done + 1_000_000_000     # the default 1 s idle time
    h.tick(0.999)
    assert h.sent_to(sid) == [[r1]]
    h.tick(0.001)
    assert h.sent_to(sid) == [[r1], [r2]]   # 1 was force-ended, 2 has its slot
    rid = h.submit_seq("one", 1)
    assert error(h, rid) == (ErrorCode.INVALID_ARG, START_ERR.format(1, "one"))


def test_a_queued_request_keeps_its_sequence_alive(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    h.submit_seq("one", 1, S)
    h.finish(sid)
    h.tick(0.9)
    r = h.submit_seq("one", 1)
    h.tick(5)                               # running: no idle release
    h.finish(sid)
    h.tick(0.5)
    r = h.submit_seq("one", 1)
    assert h.sent_to(sid)[-1] == [r] and r not in h.results()


def test_backlog_timeout_rejects_the_whole_backlogged_sequence(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S, timeout_us=1000)     # pinned: its timeout never applies
    t0 = h.clock()
    r2 = h.submit_seq("one", 2, S, timeout_us=200_000)
    h.tick(0.05)
    r2b = h.submit_seq("one", 2, timeout_us=1)
    assert h.core.batching_due() == t0 + 200_000_000    # the shell wakes for it
    h.tick(0.149)
    assert h.results() == {}
    h.tick(0.001)
    for rid in (r2, r2b):
        assert error(h, rid) == (ErrorCode.UNAVAILABLE, "Request timeout expired")
    assert r1 not in h.results() and stats(h, "one").failures["REJECTED"] == 2
    assert stats(h, "one").pending == 0
    rid = h.submit_seq("one", 2)
    assert error(h, rid)[0] is ErrorCode.INVALID_ARG
    h.finish(sid)
    assert h.sent_to(sid) == [[r1]]


# ---- delays: the shell wakes in time -----------------------------------------------------------------
def test_direct_delay_and_minimum_slot_utilization(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "delayed")
    t0 = h.clock()
    r1 = h.submit_seq("delayed", 1, S)
    assert h.sent_to(sid) == [] and h.core.batching_due() == t0 + 100_000_000
    h.tick(0.03)
    r2 = h.submit_seq("delayed", 2, S)
    h.tick(0.069)
    assert h.sent_to(sid) == []
    h.tick(0.001)
    assert h.sent_to(sid) == [[r1, r2]]     # the delay of the oldest passed
    h.finish(sid)
    rs = [h.submit_seq("delayed", 1), h.submit_seq("delayed", 2)]
    assert h.sent_to(sid)[-1] == [r1, r2]   # 2 of 4 slots: under 0.75, it waits
    rs.append(h.submit_seq("delayed", 3, S))
    assert h.sent_to(sid)[-1] == rs         # 3 of 4: sent at once
    h.finish(sid)
    assert h.core.batching_due() == h.clock() + 1_000_000_000   # then only idle timers


def test_oldest_preferred_batch_size_and_delay(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "oldest")
    rs = [h.submit_seq("oldest", c, S) for c in (1, 2)]
    assert h.sent_to(sid) == []
    rs.append(h.submit_seq("oldest", 3, S))
    assert h.sent_to(sid) == [rs]           # the preferred size
    h.finish(sid)
    t = h.clock()
    r = h.submit_seq("oldest", 2)
    assert h.core.batching_due() == t + 100_000_000
    h.tick(0.1)
    assert h.sent_to(sid)[-1] == [r]


# ---- cancel ---------------------------------------------------------------------------------------------
def test_cancel_of_a_queued_sequence_request(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S)
    r2 = h.submit_seq("one", 1)
    r3 = h.submit_seq("one", 1, E)
    h.core.handle(CancelRequest(0, r2))
    # as in Triton (its request-cancellation test), the sequence's queued requests all go
    for r in (r2, r3):
        assert error(h, r) == (ErrorCode.CANCELLED, "the request was cancelled by the client")
    h.finish(sid)
    assert h.sent_to(sid) == [[r1]]
    assert stats(h, "one").failures["CANCELED"] == 2


# ---- a worker dies --------------------------------------------------------------------------------------
def test_worker_death_fails_its_sequences_without_retry(repo):
    h = Harness(repo).start()
    a, b = sids(h, "seq")
    r1 = h.submit_seq("seq", 1, S)          # on "a"
    r2 = h.submit_seq("seq", 2, S)          # on "b"
    q1 = h.submit_seq("seq", 1)
    q1b = h.submit_seq("seq", 1)
    q2 = h.submit_seq("seq", 2)
    h.die(a)
    code, msg = error(h, r1)                # the running one: the death, no retry
    assert code is ErrorCode.INTERNAL
    assert msg == ("the worker process of instance 'seq_0_0' of model 'seq' exited "
                   "unexpectedly (killed by SIGSEGV) while executing this request")
    lost = ("sequence 1 of model 'seq' lost its state: the worker process that held it "
            "ended; start the sequence again")
    assert error(h, q1) == (ErrorCode.INTERNAL, lost)
    assert error(h, q1b) == (ErrorCode.INTERNAL, lost)
    assert h.sent_to(b) == [[r2]]           # never moved to "b"
    assert r2 not in h.results() and q2 not in h.results()
    rid = h.submit_seq("seq", 1, E)
    assert error(h, rid) == (ErrorCode.INVALID_ARG, START_ERR.format(1, "seq") + ": " + lost)
    again = h.submit_seq("seq", 1, S)       # started again: on "b", which has room
    h.finish(b)
    assert h.sent_to(b)[-1] == [q2, again]
    st = stats(h, "seq")
    assert st.failures["BACKEND"] == 1 and st.failures["OTHER"] == 2
    assert st.pending == 0


def test_a_restarted_instance_takes_the_backlog(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S)
    r2 = h.submit_seq("one", 2, S)          # the backlog
    h.die(sid)
    assert error(h, r1)[0] is ErrorCode.INTERNAL
    assert r2 not in h.results()            # a backlog sequence had no state to lose
    h.tick(0)
    [new] = h.waiting()
    assert h.core.batching_due() is None
    h.ready(new)
    assert h.sent_to(new) == [[r2]]
    h.finish(new)
    assert stats(h, "one").pending == 0


def test_a_worker_dying_idle_fails_the_queued_requests_of_its_sequences(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "delayed")
    r1, r2, r3 = (h.submit_seq("delayed", c, S) for c in (1, 2, 3))
    assert h.sent_to(sid) == [[r1, r2, r3]]
    h.finish(sid)
    q1 = h.submit_seq("delayed", 1)         # waits for the delay on the idle instance
    h.die(sid)
    assert error(h, q1) == (ErrorCode.INTERNAL,
                            "sequence 1 of model 'delayed' lost its state: the worker process "
                            "that held it ended; start the sequence again")
    assert h.core.batching_due() is None    # no idle timers for lost sequences
    assert stats(h, "delayed").failures["OTHER"] == 1


def test_a_sequence_that_never_ran_on_the_dead_worker_moves_on(repo):
    """Pinned to an instance while it was busy: only its START is queued, nothing of it is
    lost; it goes to the other instance (the shell's next batching_due sends it)."""
    h = Harness(repo).start()
    a, b = sids(h, "seq")
    r1 = h.submit_seq("seq", 1, S)          # 1, 3 on "a"; 2 on "b"
    r2 = h.submit_seq("seq", 2, S)
    h.finish(b)
    h.submit_seq("seq", 1)
    r3 = h.submit_seq("seq", 3, S)          # "a" is busy with 1
    h.die(a)
    assert error(h, r1)[0] is ErrorCode.INTERNAL and r3 not in h.results()
    h.tick(0)
    assert h.sent_to(b) == [[r2], [r3]]
    assert stats(h, "seq").failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 1}


def test_backlog_sequence_promoted_during_a_dying_end_is_not_lost(repo):
    h = Harness(repo).start()
    [sid] = sids(h, "one")
    r1 = h.submit_seq("one", 1, S | E)
    r2 = h.submit_seq("one", 2, S)          # the backlog; takes the slot as 1's END leaves
    h.die(sid)
    assert error(h, r1)[0] is ErrorCode.INTERNAL and r2 not in h.results()
    h.tick(0)
    [new] = h.waiting()
    h.ready(new)
    assert h.sent_to(new) == [[r2]]


# ---- leases, ids ------------------------------------------------------------------------------------------
OTHER = 2       # a second frontend


def grants(h):
    return [m for _, m in h.port.to_frontend if isinstance(m, LeaseGranted)]


def lent_to_frontend(h, sid):
    """Sequence 9 runs its START on the scheduler path, then the idle instance is lent."""
    r = h.submit_seq("one", 9, S)
    h.finish(sid)
    [g] = grants(h)
    return r, g


def test_a_one_instance_sequence_model_is_lent_with_its_live_sequences(repo):
    h = Harness(repo, instance_leases=True).start()
    [sid] = sids(h, "one")
    _, g = lent_to_frontend(h, sid)
    assert (g.model, g.spawn_id, g.depth) == ("one", sid, 0)
    # the worker hears of sequence 9 before the frontend hears of the lease
    kinds = [type(m) for s, m, _ in h.port.to_worker if s == sid]
    [lend] = [m for _, m, _ in h.port.to_worker if isinstance(m, LendSequences)]
    assert kinds.index(LendSequences) == len(kinds) - 1
    assert lend.lease_id == g.lease_id and [s.cid for s in lend.sequences] == [9]
    assert (g.sequences, g.slots) == ([9], 1)       # what the frontend routes by


def test_a_sequence_model_lends_all_its_instances_at_once_each_with_its_sequences(repo):
    h = Harness(repo, instance_leases=True).start()
    a, b = sids(h, "seq")
    r1 = h.submit_seq("seq", 1, S)
    r2 = h.submit_seq("seq", 2, S)
    assert h.sent_to(a) == [[r1]] and h.sent_to(b) == [[r2]]
    h.finish(a)
    assert grants(h) == []                  # b is busy: none is lent yet
    h.finish(b)
    by_spawn = {g.spawn_id: g for g in grants(h)}
    assert sorted(by_spawn) == [a, b]
    assert by_spawn[a].sequences == [1] and by_spawn[b].sequences == [2]
    assert {g.depth for g in by_spawn.values()} == {0}
    # sent before the grants arrived: each goes to the worker that has its sequence, a new
    # one to the worker with the fewest
    r3 = h.submit_seq("seq", 2)
    r4 = h.submit_seq("seq", 1, E)
    r5 = h.submit_seq("seq", 3, S)
    fwd = {m.head.req_id: s for s, m, _ in h.port.to_worker if isinstance(m, LeasedExecute)}
    assert fwd[r3] == b and fwd[r4] == a and fwd[r5] in (a, b)
    # a worker that gives its lease up (a new sequence found no slot) ends them all
    h.core.handle(LeaseEnded(a, by_spawn[a].lease_id, [SequenceSlot(1, h.clock())]))
    revoked = [m.lease_id for _, m, _ in h.port.to_worker if isinstance(m, RevokeLease)]
    assert revoked == [by_spawn[b].lease_id]


def test_requests_that_reach_the_scheduler_wait_for_the_lent_sequences(repo):
    h = Harness(repo, instance_leases=True).start()
    h.core.handle(FrontendHello(OTHER, "inproc://frontend-1"))
    [sid] = sids(h, "one")
    _, g = lent_to_frontend(h, sid)
    # another frontend's requests: sequence 9 goes on, 5 never started; they take the lease back
    h.core.handle(SubmitRequest(100, OTHER, "one", 1, 1, h.clock(), sequence_id=9), [b"p"])
    h.core.handle(SubmitRequest(101, OTHER, "one", 1, 1, h.clock(), sequence_id=5), [b"p"])
    assert [m.lease_id for _, m, _ in h.port.to_worker if isinstance(m, RevokeLease)] == \
        [g.lease_id]
    assert 100 not in h.results() and 101 not in h.results() and len(h.sent_to(sid)) == 1
    # the worker gives 9 back, and one it started meanwhile (7); 9 goes on where it was
    h.core.handle(LeaseEnded(sid, g.lease_id, [SequenceSlot(9, h.clock()),
                                               SequenceSlot(7, h.clock())]))
    assert error(h, 101) == (ErrorCode.INVALID_ARG, START_ERR.format(5, "one"))
    assert h.sent_to(sid)[-1] == [100]
    h.finish(sid)
    r7 = h.submit_seq("one", 7, E)          # 7 lives on at the scheduler too
    assert h.sent_to(sid)[-1] == [r7]


def test_a_request_sent_before_the_grant_is_forwarded_to_the_worker(repo):
    h = Harness(repo, instance_leases=True).start()
    [sid] = sids(h, "one")
    _, g = lent_to_frontend(h, sid)
    r = h.submit_seq("one", 9, E)           # the frontend had not heard of the lease yet
    [fwd] = [(m, p) for _, m, p in h.port.to_worker if isinstance(m, LeasedExecute)]
    assert fwd[0].lease_id == g.lease_id and fwd[0].head.req_id == r
    assert fwd[1] == [b"payload-%d" % r]
    note = grants(h)[-1]
    assert note.forwarded == [r] and note.returned == [] and r not in h.results()


def lent_pair(h):
    """Sequences 1 and 2 run their STARTs on the scheduler path, one on each instance of
    "seq"; then both instances are lent. Returns the grants by worker."""
    a, b = sids(h, "seq")
    h.submit_seq("seq", 1, S)
    h.submit_seq("seq", 2, S)
    h.finish(a)
    h.finish(b)
    return {g.spawn_id: g for g in grants(h)}


def test_a_sequence_models_leases_end_together_on_their_term(repo):
    # one instance's term passes (no progress) while the other's does not: both come back,
    # so no sequence is left on an instance its frontend cannot reach
    h = Harness(repo, instance_leases=True).start()
    by_spawn = lent_pair(h)
    a, b = sorted(by_spawn)
    h.clock.advance(TERM_NS / 2e9)
    record = LeasedRecord(b, "seq", 1, 2, h.clock(), h.clock() + 1000, 10, 20, 30, False, -1)
    h.core.handle(LeasedDone([record]))        # progress on b's worker only
    h.tick(TERM_NS / 2e9 + 0.01)
    revoked = sorted(m.lease_id for _, m, _ in h.port.to_worker if isinstance(m, RevokeLease))
    assert revoked == sorted(g.lease_id for g in by_spawn.values())


def test_lent_sequences_die_with_their_worker(repo):
    h = Harness(repo, instance_leases=True).start()
    h.core.handle(FrontendHello(OTHER, "inproc://frontend-1"))
    [sid] = sids(h, "one")
    lent_to_frontend(h, sid)
    h.core.handle(SubmitRequest(100, OTHER, "one", 1, 1, h.clock(), sequence_id=9), [b"p"])
    h.core.handle(SubmitRequest(101, OTHER, "one", 1, 1, h.clock(), sequence_id=3,
                                sequence_flags=S), [b"p"])
    h.die(sid)
    code, text = error(h, 100)
    assert code is ErrorCode.INVALID_ARG and "sequence 9 of model 'one' lost its state" in text
    h.tick(0)
    [new] = h.waiting()
    h.ready(new)
    assert h.sent_to(new) == [[101]]        # a new sequence runs on the new worker


def test_int_and_string_correlation_ids(repo):
    h = Harness(repo).start()
    a, b = sids(h, "seq")
    r_int = h.submit_seq("seq", 5, S)
    r_str = h.submit_seq("seq", "5", S)     # another sequence
    assert h.sent_to(a) == [[r_int]] and h.sent_to(b) == [[r_str]]
    rid = h.submit_seq("seq", "x")
    assert error(h, rid) == (ErrorCode.INVALID_ARG, START_ERR.format("x", "seq"))
    e_str = h.submit_seq("seq", "5", E)
    h.finish(b)
    assert h.sent_to(b)[-1] == [e_str]
