"""SequenceBatcher (docs/triton-compat.md §5.3) alone: a pure queue driven with a fake clock and
plain instance keys, no processes, no sleeps; and what normalize() does to sequence_batching."""
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.batching.queues import QueuedRequest, QueueFull
from shmserve.engine.batching.sequences import (
    DEFAULT_IDLE_US,
    IDLE_GRID_NS,
    SEQUENCE_END,
    SEQUENCE_START,
    SequenceBatcher,
    SequenceConfig,
    SequenceError,
    sequence_config,
)
from shmserve.ipc.model_config import ConfigError, normalize

US = 1_000      # ns per microsecond
T0 = 1_000_000_000
S, E = SEQUENCE_START, SEQUENCE_END
START_ERR = ("inference request for sequence {} to model 'm' must specify the START flag on the "
             "first request of the sequence")


def idle_due(deadline, exact: int) -> bool:
    """An idle release's deadline: ``exact``, rounded up to the batcher's grid (it need not
    be precise, and must not move with every request)."""
    return deadline is not None and exact <= deadline < exact + IDLE_GRID_NS


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now

    def advance_us(self, us):
        self.now += us * US


@pytest.fixture
def clock():
    return Clock()


def make(clock, capacity=2, max_batch=2, instances=("a",), max_queue_size=0, **kw):
    b = SequenceBatcher(SequenceConfig("m", capacity, max_batch, **kw), max_queue_size, clock)
    for key in instances:
        b.instance_idle(key)
    return b


class Reqs:
    """Requests numbered in the order they are made."""

    def __init__(self):
        self.n = 0

    def __call__(self, cid, flags=0, timeout_us=0):
        self.n += 1
        return QueuedRequest(req_id=self.n, frontend=0, batch_size=1, payload=b"",
                             timeout_us=timeout_us, sequence_id=cid, flags=flags)


@pytest.fixture
def req():
    return Reqs()


def send(b, *reqs):
    for r in reqs:
        b.enqueue(r)
    return [r.req_id for r in reqs]


def ids(batches):
    return [(inst, [r.req_id for r in rs]) for inst, rs in batches]


def cids(batches):
    return [(inst, [r.sequence_id for r in rs]) for inst, rs in batches]


def pinned(b, key):
    return [s.cid for s in b.instances[key]]


def backlog(b):
    return [s.cid for s in b.backlog]


# ---- START, END and the correlation id ---------------------------------------------------------

@pytest.mark.parametrize("cid", [0, ""])
def test_missing_correlation_id_is_refused(clock, req, cid):
    b = make(clock)
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(cid, S))
    assert str(e.value) == ("inference request to model 'm' must specify a non-zero or non-empty "
                            "correlation ID")
    assert len(b) == 0 and b.sequences == {}


def test_non_start_for_an_unknown_sequence_is_refused(clock, req):
    b = make(clock)
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(7))
    assert str(e.value) == START_ERR.format(7)
    with pytest.raises(SequenceError, match="must specify the START flag"):
        b.enqueue(req(7, E))                     # an END alone does not start it either
    assert len(b) == 0 and b.sequences == {} and backlog(b) == []


def test_non_start_after_end_is_refused_queued_or_sent(clock, req):
    b = make(clock)
    send(b, req(1, S), req(1, E))
    with pytest.raises(SequenceError, match="sequence 1 .*START"):  # END queued, not sent yet
        b.enqueue(req(1))
    assert ids(b.next_batches()) == [("a", [1])]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2])]     # the END leaves: the sequence is over
    assert b.sequences == {} and pinned(b, "a") == []
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(1))
    assert str(e.value) == START_ERR.format(1)


def test_start_and_end_on_one_request(clock, req):
    b = make(clock)
    send(b, req(5, S | E))
    assert ids(b.next_batches()) == [("a", [1])]
    assert b.sequences == {} and pinned(b, "a") == []    # released when it was sent


def test_start_for_a_live_sequence_restarts_it_on_its_instance(clock, req):
    b = make(clock, instances=("a", "b"))
    send(b, req(1, S))
    assert ids(b.next_batches()) == [("a", [1])]
    send(b, req(1))
    send(b, req(1, S))                              # restarted before it ended: accepted
    assert len(b) == 2 and pinned(b, "a") == [1] and pinned(b, "b") == []
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2])]     # still in order, still on "a"
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [3])]
    b.instance_idle("a")
    send(b, req(1), req(1, E))                      # the new sequence goes on
    assert ids(b.next_batches()) == [("a", [4])]


def test_restart_of_a_sequence_whose_end_is_queued(clock, req):
    b = make(clock)
    send(b, req(1, S), req(1, E), req(1, S), req(1))
    out = []
    for _ in range(4):
        out += ids(b.next_batches())
        b.instance_idle("a")
    assert out == [("a", [1]), ("a", [2]), ("a", [3]), ("a", [4])]
    assert pinned(b, "a") == [1]                    # the second one is live


# ---- order, one at a time, one instance -------------------------------------------------------------

def test_a_sequence_runs_in_order_one_at_a_time_on_one_instance(clock, req):
    b = make(clock, capacity=4, max_batch=4, instances=("a", "b"))
    send(b, req(1, S), req(1), req(1), req(1, E))
    out = ids(b.next_batches())
    assert out == [("a", [1])]                      # one request; "b" stays idle
    assert b.idle == ["b"] and b.next_batches() == []
    for want in ([2], [3], [4]):
        b.instance_idle("a")
        assert ids(b.next_batches()) == [("a", want)]
    assert len(b) == 0 and b.sequences == {}


def test_at_most_one_request_per_sequence_per_batch(clock, req):
    b = make(clock, capacity=4, max_batch=4)
    send(b, req(1, S), req(1), req(2, S), req(2), req(1))
    assert ids(b.next_batches()) == [("a", [1, 3])]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2, 4])]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [5])]


def test_a_batch_takes_up_to_max_batch_across_sequences_oldest_first(clock, req):
    b = make(clock, capacity=5, max_batch=3)
    for cid in (1, 2, 3, 4, 5):
        send(b, req(cid, S))
        clock.advance_us(1)
    assert cids(b.next_batches()) == [("a", [1, 2, 3])]
    b.instance_idle("a")
    send(b, req(1))                                 # newer than 4 and 5's heads
    assert cids(b.next_batches()) == [("a", [4, 5, 1])]


def test_heads_are_ordered_by_arrival_not_by_pinning(clock, req):
    b = make(clock, capacity=3, max_batch=2)
    send(b, req(1, S), req(2, S), req(3, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]
    b.instance_idle("a")
    clock.advance_us(5)
    send(b, req(2))
    clock.advance_us(1)
    send(b, req(1))
    assert cids(b.next_batches()) == [("a", [3, 2])]    # 3 waited longest, then 2's request


# ---- capacity and the backlog --------------------------------------------------------------------

def config(text):
    return normalize(text_format.Parse('backend: "python"\n' + text, mc.ModelConfig()), "m")


@pytest.mark.parametrize("mbs, capacity", [(0, 1), (1, 1), (4, 4)])
def test_direct_capacity_is_the_batch_slots(mbs, capacity):
    sc = sequence_config(config(f"max_batch_size: {mbs}\nsequence_batching {{ }}"))
    assert (sc.capacity, sc.max_batch, sc.oldest) == (capacity, max(1, mbs), False)
    assert sc.idle_us == DEFAULT_IDLE_US


def test_oldest_capacity_is_max_candidate_sequences():
    sc = sequence_config(config(
        "max_batch_size: 4\nsequence_batching { max_sequence_idle_microseconds: 7000 "
        "oldest { max_candidate_sequences: 10 preferred_batch_size: [ 2, 4 ] "
        "max_queue_delay_microseconds: 300 } }"))
    assert (sc.capacity, sc.max_batch, sc.oldest, sc.delay_us, sc.preferred, sc.idle_us) == \
        (10, 4, True, 300, (2, 4), 7000)


def test_direct_delay_and_utilization_from_the_config():
    sc = sequence_config(config(
        "max_batch_size: 4\nsequence_batching { direct { max_queue_delay_microseconds: 50 "
        "minimum_slot_utilization: 0.5 } }"))
    assert (sc.delay_us, sc.min_slot_utilization, sc.capacity) == (50, 0.5, 4)


def test_new_sequences_go_to_the_instance_with_the_most_room(clock, req):
    b = make(clock, capacity=2, max_batch=2, instances=("a", "b"))
    send(b, req(1, S), req(2, S), req(3, S), req(4, S), req(5, S))
    assert (pinned(b, "a"), pinned(b, "b"), backlog(b)) == ([1, 3], [2, 4], [5])
    assert cids(b.next_batches()) == [("a", [1, 3]), ("b", [2, 4])]


def test_backlog_waits_in_arrival_order_and_takes_the_slot_of_an_ended_sequence(clock, req):
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S), req(2, S), req(3, S))
    assert backlog(b) == [2, 3]
    send(b, req(3), req(2))
    assert ids(b.next_batches()) == [("a", [1])]
    b.instance_idle("a")
    assert b.next_batches() == []                   # 1 is live: the backlog waits
    send(b, req(1, E))
    assert ids(b.next_batches()) == [("a", [6])]     # the END leaves: 2 takes the slot
    assert pinned(b, "a") == [2] and backlog(b) == [3]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2])]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [5])]     # its queued requests, in order
    b.instance_idle("a")
    assert b.next_batches() == [] and backlog(b) == [3] and len(b) == 2


def test_backlog_takes_the_slot_of_a_sequence_that_idled_out(clock, req):
    b = make(clock, capacity=1, max_batch=1, idle_us=1000)
    send(b, req(1, S))
    assert ids(b.next_batches()) == [("a", [1])]
    send(b, req(2, S))
    clock.advance_us(5000)
    b.instance_idle("a")                           # 1 finished now: its idle time starts
    assert b.take_expired() == [] and b.next_batches() == []
    assert idle_due(b.next_deadline_ns(), clock.now + 1000 * US)
    clock.advance_us(999)
    assert b.take_expired() == [] and pinned(b, "a") == [1]
    clock.advance_us(1)
    assert b.take_expired() == []                   # idle release rejects nothing
    assert pinned(b, "a") == [2] and backlog(b) == [] and 1 not in b.sequences
    assert ids(b.next_batches()) == [("a", [2])]
    with pytest.raises(SequenceError) as e:        # 1 was force-ended
        b.enqueue(req(1))
    assert str(e.value) == START_ERR.format(1)


# ---- idle release --------------------------------------------------------------------------------

def test_idle_release_counts_from_the_last_completion_never_while_running(clock, req):
    b = make(clock, idle_us=1000)
    send(b, req(1, S))
    assert b.next_deadline_ns() == T0               # no delay: it can go now
    assert ids(b.next_batches()) == [("a", [1])]
    assert b.next_deadline_ns() is None             # running: no idle timer
    clock.advance_us(10_000)                        # runs ten times the idle time
    assert b.take_expired() == [] and 1 in b.sequences
    b.instance_idle("a")
    done = clock.now
    assert idle_due(b.next_deadline_ns(), done + 1000 * US)
    clock.advance_us(999)
    b.take_expired()
    assert 1 in b.sequences
    send(b, req(1))                                 # a queued request keeps it alive
    assert b.next_deadline_ns() == clock.now        # and goes now
    assert ids(b.next_batches()) == [("a", [2])]
    clock.advance_us(500)
    b.instance_idle("a")
    assert idle_due(b.next_deadline_ns(), clock.now + 1000 * US)
    clock.advance_us(1000)
    b.take_expired()
    assert b.sequences == {} and pinned(b, "a") == []
    assert b.next_deadline_ns() is None


def test_a_sequence_waiting_for_its_instance_does_not_idle_out(clock, req):
    b = make(clock, capacity=2, max_batch=1, idle_us=1000)
    send(b, req(1, S), req(2, S))
    assert cids(b.next_batches()) == [("a", [1])]
    clock.advance_us(5000)                          # 2 waits for the busy instance
    b.take_expired()
    assert 2 in b.sequences and len(b) == 1


def test_a_sequence_idles_while_another_runs_on_its_instance(clock, req):
    b = make(clock, capacity=2, max_batch=2, idle_us=1000)
    send(b, req(1, S), req(2, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]
    b.instance_idle("a")
    send(b, req(1))
    assert cids(b.next_batches()) == [("a", [1])]
    assert idle_due(b.next_deadline_ns(), clock.now + 1000 * US)    # 2's, though "a" is busy
    clock.advance_us(1000)
    b.take_expired()
    assert 2 not in b.sequences and 1 in b.sequences


# ---- backlog timeouts ------------------------------------------------------------------------------

def test_backlog_timeout_rejects_the_whole_backlogged_sequence(clock, req):
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S, timeout_us=100))              # pinned: its timeout does not apply
    assert ids(b.next_batches()) == [("a", [1])]
    send(b, req(2, S, timeout_us=300))
    clock.advance_us(50)
    send(b, req(2, timeout_us=10), req(3, S))       # only the head's timeout counts
    assert b.next_deadline_ns() == T0 + 300 * US
    clock.advance_us(249)
    assert b.take_expired() == []
    clock.advance_us(1)
    assert [r.req_id for r in b.take_expired()] == [2, 3]
    assert backlog(b) == [3] and 2 not in b.sequences and len(b) == 1
    assert b.next_deadline_ns() is None             # 1 runs, 3 has no timeout
    clock.advance_us(10_000)
    assert b.take_expired() == [] and pinned(b, "a") == [1]
    with pytest.raises(SequenceError):              # it was rejected: it must start again
        b.enqueue(req(2))
    send(b, req(2, S))                              # and may
    assert backlog(b) == [3, 2]


def test_a_promoted_sequence_no_longer_times_out(clock, req):
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S | E), req(2, S, timeout_us=100))
    assert ids(b.next_batches()) == [("a", [1])]     # 1 ended: 2 has its slot
    clock.advance_us(1000)
    assert b.take_expired() == [] and pinned(b, "a") == [2]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2])]


# ---- direct: delay and slot utilization ------------------------------------------------------------

def test_direct_delay_waits_for_more_slots(clock, req):
    b = make(clock, capacity=4, max_batch=4, delay_us=100)
    send(b, req(1, S))
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 100 * US
    clock.advance_us(40)
    send(b, req(2, S))
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 100 * US    # the oldest head's
    clock.advance_us(59)
    assert b.next_batches() == []
    clock.advance_us(1)
    assert cids(b.next_batches()) == [("a", [1, 2])]
    assert b.next_deadline_ns() is None


def test_direct_delay_ends_when_every_slot_is_ready(clock, req):
    b = make(clock, capacity=2, max_batch=2, delay_us=100)
    send(b, req(1, S), req(2, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]


def test_direct_minimum_slot_utilization_sends_early(clock, req):
    b = make(clock, capacity=4, max_batch=4, delay_us=1000, min_slot_utilization=0.5)
    send(b, req(1, S))
    assert b.next_batches() == []                   # 1 of 4 slots
    send(b, req(2, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]     # 2 of 4: half


def test_direct_delay_deadline_only_for_an_idle_instance(clock, req):
    b = make(clock, capacity=2, max_batch=2, delay_us=100, instances=())
    send(b, req(1, S))
    assert backlog(b) == [1] and b.next_deadline_ns() is None   # no instance yet
    b.instance_idle("a")                            # it takes the backlog
    assert pinned(b, "a") == [1]
    assert b.next_deadline_ns() == T0 + 100 * US
    clock.advance_us(100)
    assert cids(b.next_batches()) == [("a", [1])]
    send(b, req(1))
    assert b.next_deadline_ns() is None             # "a" is busy
    clock.advance_us(500)
    b.instance_idle("a")
    assert cids(b.next_batches()) == [("a", [1])]   # waited its delay already


# ---- oldest: preferred sizes and delay ----------------------------------------------------------------

def test_oldest_preferred_batch_size_sends_early(clock, req):
    b = make(clock, capacity=8, max_batch=4, oldest=True, delay_us=1000, preferred=(2, 3))
    send(b, req(1, S))
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 1000 * US
    send(b, req(2, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]


def test_oldest_sends_at_the_largest_preferred_size_or_more(clock, req):
    b = make(clock, capacity=8, max_batch=4, oldest=True, delay_us=1000, preferred=(2,),
             instances=())
    send(b, req(1, S), req(2, S), req(3, S))
    b.instance_idle("a")
    assert cids(b.next_batches()) == [("a", [1, 2, 3])]


def test_oldest_delay_without_preferred_sizes(clock, req):
    b = make(clock, capacity=8, max_batch=4, oldest=True, delay_us=200)
    send(b, req(1, S), req(2, S), req(3, S))
    assert b.next_batches() == []
    clock.advance_us(200)
    assert cids(b.next_batches()) == [("a", [1, 2, 3])]
    b.instance_idle("a")
    send(b, req(4, S), req(5, S), req(6, S), req(7, S))     # a full batch goes at once
    assert cids(b.next_batches()) == [("a", [4, 5, 6, 7])]


def test_oldest_candidates_beyond_max_batch_wait_their_turn(clock, req):
    b = make(clock, capacity=3, max_batch=2, oldest=True)
    send(b, req(1, S), req(2, S), req(3, S), req(4, S))
    assert backlog(b) == [4]
    assert cids(b.next_batches()) == [("a", [1, 2])]
    b.instance_idle("a")
    assert cids(b.next_batches()) == [("a", [3])]


def test_next_deadline_is_the_earliest_of_all_kinds(clock, req):
    b = make(clock, capacity=1, max_batch=2, idle_us=1000, delay_us=300, instances=("a", "b"))
    send(b, req(1, S))                              # waits 300 on "a"
    clock.advance_us(100)
    send(b, req(2, S))                              # waits 300 on "b"
    send(b, req(3, S, timeout_us=50))               # backlog, times out at +50
    assert b.next_deadline_ns() == T0 + 150 * US
    assert [r.req_id for r in b.take_expired()] == []
    clock.advance_us(50)
    assert [r.req_id for r in b.take_expired()] == [3]
    assert b.next_deadline_ns() == T0 + 300 * US
    clock.advance_us(150)
    assert cids(b.next_batches()) == [("a", [1])]
    assert b.next_deadline_ns() == T0 + 400 * US
    clock.advance_us(100)
    assert cids(b.next_batches()) == [("b", [2])]
    b.instance_idle("a")
    assert idle_due(b.next_deadline_ns(), clock.now + 1000 * US)    # 1's idle time


# ---- cancel, queue size, drain ----------------------------------------------------------------------

def test_cancel_of_a_queued_request_cancels_its_sequences_queue(clock, req):
    """As in Triton: the sequence's other queued requests go with it (the cancelled first)."""
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S), req(1), req(1, E))
    assert ids(b.next_batches()) == [("a", [1])]
    assert [r.req_id for r in b.take_cancelled(0, 2)] == [2, 3]
    assert b.cancel(0, 2) is None and b.cancel(1, 3) is None    # gone; another frontend's
    assert b.cancel(0, 1) is None                   # running: not queued
    assert len(b) == 0
    b.instance_idle("a")
    assert ids(b.next_batches()) == []


def test_cancel_in_the_backlog(clock, req):
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S), req(2, S, timeout_us=10))
    assert ids(b.next_batches()) == [("a", [1])]
    assert b.cancel(0, 2).req_id == 2 and len(b) == 0
    clock.advance_us(100)
    assert b.take_expired() == []                   # nothing left to reject
    assert b.next_deadline_ns() is None


def test_max_queue_size(clock, req):
    b = make(clock, max_queue_size=2)
    send(b, req(1, S), req(1))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        b.enqueue(req(2, S))
    assert 2 not in b.sequences and len(b) == 2
    with pytest.raises(SequenceError):              # the client's mistake is named first
        b.enqueue(req(0, S))


def test_drain_takes_every_queued_request(clock, req):
    b = make(clock, capacity=1, max_batch=1)
    send(b, req(1, S), req(1), req(2, S))
    b.next_batches()
    assert sorted(r.req_id for r in b.drain()) == [2, 3] and len(b) == 0


# ---- a dead instance -----------------------------------------------------------------------------

def test_instance_gone_fails_its_sequences_which_must_start_again(clock, req):
    b = make(clock, capacity=2, max_batch=2, instances=("a", "b"))
    send(b, req(1, S), req(2, S), req(3, S))        # 1, 3 on "a"; 2 on "b"
    assert cids(b.next_batches()) == [("a", [1, 3]), ("b", [2])]
    send(b, req(1), req(1), req(2))
    b.instance_gone("a")
    failed = b.take_failed()
    why = ("sequence 1 of model 'm' lost its state: the worker process that held it ended; "
           "start the sequence again")
    assert [(r.req_id, w) for r, w in failed] == [(4, why), (5, why)]
    assert b.take_failed() == [] and len(b) == 1
    assert "a" not in b.instances and b.idle == []
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(1))
    assert str(e.value) == START_ERR.format(1) + ": " + why
    with pytest.raises(SequenceError, match="sequence 3 of model 'm' lost its state"):
        b.enqueue(req(3, E))
    send(b, req(1, S))                              # a new START: the loss is forgotten
    assert pinned(b, "b") == [2, 1]
    b.enqueue(req(1, E))
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(1))
    assert str(e.value) == START_ERR.format(1)


def test_a_restarted_instance_takes_the_backlog(clock, req):
    b = make(clock, capacity=1, max_batch=1, instances=("a", "b"))
    send(b, req(1, S), req(2, S), req(3, S), req(4, S))
    assert backlog(b) == [3, 4]
    assert cids(b.next_batches()) == [("a", [1]), ("b", [2])]
    b.instance_gone("a")
    assert b.take_failed() == []                    # 1 had nothing more queued
    assert backlog(b) == [3, 4]                     # "b" is still full
    b.instance_idle("a")                            # back: empty, room for the backlog
    assert pinned(b, "a") == [3] and backlog(b) == [4]
    assert cids(b.next_batches()) == [("a", [3])]


def test_an_instance_that_dies_idle_fails_the_queued_requests_of_its_sequences(clock, req):
    b = make(clock, capacity=2, max_batch=2, delay_us=100)
    send(b, req(1, S), req(2, S))
    assert cids(b.next_batches()) == [("a", [1, 2])]
    b.instance_idle("a")
    send(b, req(1))                                 # waits for the delay on the idle "a"
    assert b.next_deadline_ns() == clock.now + 100 * US
    b.instance_gone("a")
    [(r, why)] = b.take_failed()
    assert r.req_id == 3 and "sequence 1 of model 'm' lost its state" in why and len(b) == 0
    assert b.next_deadline_ns() is None and b.sequences == {}
    with pytest.raises(SequenceError, match="sequence 2 of model 'm' lost its state"):
        b.enqueue(req(2))                           # it had state there, queued or not


def test_sequences_lost_with_a_leased_worker_are_refused_with_the_reason(clock, req):
    """A frontend names the sequences a leased worker held when it ended (some started under
    the lease, never seen here); one this batcher has open is not touched."""
    b = make(clock, capacity=2, max_batch=2)
    send(b, req(1, S))
    b.lost_with_worker([1, 7])
    with pytest.raises(SequenceError, match="sequence 7 of model 'm' lost its state"):
        b.enqueue(req(7))
    send(b, req(1))                                 # open here: it lives on
    send(b, req(7, S))                              # a START begins it again
    assert 7 not in b.lost


# ---- ids -------------------------------------------------------------------------------------------------

def test_int_and_string_ids_are_different_sequences(clock, req):
    b = make(clock, capacity=4, max_batch=4)
    send(b, req(5, S), req("5", S), req("abc", S))
    assert cids(b.next_batches()) == [("a", [5, "5", "abc"])]
    b.instance_idle("a")
    send(b, req("5", E))
    with pytest.raises(SequenceError) as e:
        b.enqueue(req("zz"))
    assert str(e.value) == START_ERR.format("zz")
    assert cids(b.next_batches()) == [("a", ["5"])]
    assert set(b.sequences) == {5, "abc"}


# ---- normalize() -----------------------------------------------------------------------------------------

def test_normalize_fills_the_defaults():
    cfg = config("max_batch_size: 2\nsequence_batching { }")
    sb = cfg.sequence_batching
    assert sb.max_sequence_idle_microseconds == 1_000_000
    assert sb.HasField("direct") and not sb.HasField("oldest")
    assert sb.direct.max_queue_delay_microseconds == 0
    kept = config("sequence_batching { max_sequence_idle_microseconds: 5 oldest { "
                  "max_candidate_sequences: 3 } }").sequence_batching
    assert kept.max_sequence_idle_microseconds == 5 and not kept.HasField("direct")


@pytest.mark.parametrize("text, message", [
    ("max_batch_size: 4\nsequence_batching { oldest { } }",
     "max_candidate_sequences must be > 0"),
    ("max_batch_size: 4\nsequence_batching { oldest { max_candidate_sequences: 4 "
     "preferred_batch_size: [ 5 ] } }",
     r"preferred_batch_size 5 must be between 1 and max_batch_size \(4\)"),
    ("max_batch_size: 0\nsequence_batching { oldest { max_candidate_sequences: 4 "
     "preferred_batch_size: [ 2 ] } }",
     r"preferred_batch_size 2 must be between 1 and max_batch_size \(1\)"),
    ("max_batch_size: 4\nsequence_batching { oldest { max_candidate_sequences: 4 "
     "preferred_batch_size: [ 0 ] } }", "preferred_batch_size 0"),
    ("max_batch_size: 4\nsequence_batching { direct { minimum_slot_utilization: 1.5 } }",
     "minimum_slot_utilization must be between 0 and 1"),
    ("max_batch_size: 4\nsequence_batching { direct { minimum_slot_utilization: -0.1 } }",
     "minimum_slot_utilization must be between 0 and 1"),
    ('max_batch_size: 4\nsequence_batching { state { input_name: "IN" output_name: "OUT" '
     'data_type: TYPE_FP32 dims: [ 1 ] initial_state { name: "init" data_type: TYPE_FP32 '
     'dims: [ 1 ] data_file: "../etc/passwd" } } }',
     "state 'IN' initial_state 'init' data_file '../etc/passwd' must be a file name inside "
     "the model directory, not a path"),
])
def test_normalize_refuses(text, message):
    with pytest.raises(ConfigError, match=message):
        config(text)


def test_normalize_accepts_a_plain_data_file_and_full_utilization():
    config('max_batch_size: 4\nsequence_batching { direct { minimum_slot_utilization: 1.0 } '
           'state { input_name: "IN" output_name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] '
           'initial_state { name: "init" data_type: TYPE_FP32 dims: [ 1 ] '
           'data_file: "init.bin" } } }')


def test_a_sequence_that_never_ran_on_a_dead_instance_lost_nothing(clock, req):
    """Pinned to the instance, but only its START is queued (promoted from the backlog as the
    instance ran another's END, or placed while it was busy): no state to lose, it moves."""
    b = make(clock, capacity=1, max_batch=1, instances=("a", "b"))
    send(b, req(1, S | E), req(2, S), req(3, S))    # 1 on "a", 2 on "b", 3 backlog
    assert cids(b.next_batches()) == [("a", [1]), ("b", [2])]
    assert pinned(b, "a") == [3]                    # 1's END left: 3 has its slot
    send(b, req(3))
    b.instance_gone("a")                            # while it ran 1's END
    assert b.take_failed() == []
    assert backlog(b) == [3] and len(b) == 2 and b.next_batches() == []
    b.instance_idle("a")                            # restarted
    assert ids(b.next_batches()) == [("a", [3])]
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [4])]


def test_a_fresh_sequence_moves_to_an_instance_with_room_and_is_due_at_once(clock, req):
    b = make(clock, capacity=2, max_batch=2, instances=("a", "b"))
    send(b, req(1, S), req(2, S))
    assert cids(b.next_batches()) == [("a", [1]), ("b", [2])]
    b.instance_idle("b")
    send(b, req(1), req(1, S))                      # 1: a request, then started again
    send(b, req(3, S))                              # placed on "a", busy
    assert pinned(b, "a") == [1, 3]
    b.instance_gone("a")                            # 1's START ran there: 1 lost its state
    assert [(r.req_id, "lost its state" in w) for r, w in b.take_failed()] == \
        [(3, True), (4, True)]
    assert pinned(b, "b") == [2, 3] and backlog(b) == []    # 3 never ran: it moves to "b"
    assert b.next_deadline_ns() == clock.now        # "b" is idle: due now (the shell wakes)
    assert cids(b.next_batches()) == [("b", [3])]


def test_lost_sequences_are_remembered_boundedly(clock, req, monkeypatch):
    monkeypatch.setattr("shmserve.engine.batching.sequences.LOST_KEPT", 2)
    b = make(clock, capacity=3, max_batch=3)
    send(b, req(1, S), req(2, S), req(3, S))
    b.next_batches()
    b.instance_gone("a")
    assert list(b.lost) == [2, 3]                   # the oldest loss is forgotten
    with pytest.raises(SequenceError) as e:
        b.enqueue(req(1))
    assert str(e.value) == START_ERR.format(1)
    with pytest.raises(SequenceError, match="lost its state"):
        b.enqueue(req(3))


def test_a_cancelled_start_that_never_ran_ends_its_sequence(clock, req):
    b = make(clock, capacity=1)
    send(b, req(1, S))                              # 1 runs on the only slot...
    assert ids(b.next_batches()) == [("a", [1])]
    send(b, req(1))
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [2])]
    send(b, req(1, E))                              # ...its END is queued behind a running one
    b.instance_idle("a")
    assert ids(b.next_batches()) == [("a", [3])]    # 1 ends; its slot is free
    send(b, req(7, S))                              # 7 takes it, waits for "a"
    assert pinned(b, "a") == [7]
    cancelled = b.cancel(0, 4)
    assert cancelled is not None and cancelled.sequence_id == 7
    assert 7 not in b.sequences and pinned(b, "a") == []
    with pytest.raises(SequenceError, match="must specify the START flag"):
        send(b, req(7))                             # its START never ran: it never began
