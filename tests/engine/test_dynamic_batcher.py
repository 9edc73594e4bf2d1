"""DynamicBatcher (docs/triton-compat.md §5.2): a pure queue driven with a fake clock, no processes, no sleeps."""
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.batching.dynamic import BatcherConfig, DynamicBatcher, QueuePolicy, batcher_config
from shmserve.engine.batching.queues import QueuedRequest, QueueFull
from shmserve.ipc.model_config import normalize

US = 1_000      # ns per microsecond
T0 = 1_000_000


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now

    def advance_us(self, us):
        self.now += us * US


def req(i, batch_size=1, priority=0, timeout_us=0, shape_key=""):
    return QueuedRequest(req_id=i, frontend=0, batch_size=batch_size, payload=f"p{i}".encode(),
                         priority=priority, timeout_us=timeout_us, shape_key=shape_key)


def ids(batches):
    return [[r.req_id for r in rs] for _, rs in batches]


@pytest.fixture
def clock():
    return Clock()


def make(clock, max_queue_size=0, **kw):
    kw.setdefault("max_batch_size", 8)
    return DynamicBatcher(BatcherConfig(**kw), max_queue_size=max_queue_size, clock=clock)


def fill(b, *reqs):
    for r in reqs:
        b.enqueue(r)


# ---- delay ------------------------------------------------------------------------------------

def test_zero_delay_sends_whatever_is_pending(clock):
    b = make(clock, preferred=(8,))
    fill(b, req(1), req(2), req(3, batch_size=2))
    assert b.next_deadline_ns() is None            # nothing to wait for
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[1, 2, 3]]
    assert len(b) == 0 and b.idle == []


def test_zero_delay_single_request_goes_alone(clock):
    b = make(clock, preferred=(4,))
    b.instance_idle("w")
    b.enqueue(req(1))
    assert ids(b.next_batches()) == [[1]]


def test_delay_waits_for_the_oldest_request(clock):
    b = make(clock, preferred=(8,), max_queue_delay_us=100)
    b.instance_idle("w")
    b.enqueue(req(1))
    clock.advance_us(40)
    b.enqueue(req(2))
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 100 * US   # the oldest's wait, not the newest's
    clock.now = T0 + 100 * US - 1
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 100 * US
    clock.now = T0 + 100 * US
    assert ids(b.next_batches()) == [[1, 2]]
    assert b.next_deadline_ns() is None
    assert len(b) == 0


def test_delay_due_but_no_instance_then_instance_frees(clock):
    b = make(clock, preferred=(8,), max_queue_delay_us=100)
    b.enqueue(req(1))
    clock.advance_us(500)
    assert b.next_batches() == []                  # due, but nothing to run it on
    assert b.next_deadline_ns() is None            # the shell waits for an instance, not a timer
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[1]]


def test_enqueued_and_dispatched_ns_come_from_the_clock(clock):
    b = make(clock, preferred=(8,), max_queue_delay_us=100)
    r1, r2 = req(1), req(2)
    b.enqueue(r1)
    clock.advance_us(30)
    b.enqueue(r2)
    assert (r1.enqueued_ns, r2.enqueued_ns) == (T0, T0 + 30 * US)
    clock.advance_us(70)
    b.instance_idle("w")
    (key, batch), = b.next_batches()
    assert key == "w" and batch == [r1, r2]
    assert r1.dispatched_ns == r2.dispatched_ns == T0 + 100 * US


# ---- preferred sizes --------------------------------------------------------------------------

def test_preferred_size_sends_immediately_despite_delay(clock):
    b = make(clock, preferred=(2, 4), max_queue_delay_us=1_000_000)
    b.instance_idle("w")
    b.enqueue(req(1))
    assert b.next_batches() == []
    b.enqueue(req(2))
    assert ids(b.next_batches()) == [[1, 2]]


def test_largest_reachable_preferred_size_is_chosen(clock):
    b = make(clock, preferred=(2, 4), max_queue_delay_us=100)
    fill(b, *(req(i) for i in range(5)))
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[0, 1, 2, 3]]
    assert len(b) == 1
    # the leftover single request waits for its delay again
    b.instance_idle("w")
    assert b.next_batches() == []
    assert b.next_deadline_ns() == T0 + 100 * US


def test_preferred_size_counts_request_batch_sizes(clock):
    b = make(clock, preferred=(4,), max_queue_delay_us=1_000)
    b.instance_idle("w")
    b.enqueue(req(1, batch_size=3))
    assert b.next_batches() == []
    b.enqueue(req(2, batch_size=1))
    assert ids(b.next_batches()) == [[1, 2]]


def test_preferred_sizes_above_max_batch_size_are_ignored(clock):
    b = make(clock, max_batch_size=4, preferred=(0, 2, 16))
    assert b.rule.preferred == (2,)


# ---- max_batch_size ---------------------------------------------------------------------------

def test_max_batch_size_is_never_exceeded(clock):
    b = make(clock, max_batch_size=4)
    fill(b, *(req(i) for i in range(6)))
    b.instance_idle("a")
    b.instance_idle("b")
    batches = b.next_batches()
    assert ids(batches) == [[0, 1, 2, 3], [4, 5]]
    assert [k for k, _ in batches] == ["b", "a"]


def test_full_batch_goes_without_waiting_for_the_delay(clock):
    b = make(clock, max_batch_size=4, max_queue_delay_us=1_000_000)
    b.instance_idle("w")
    fill(b, req(1), req(2, batch_size=2))
    assert b.next_batches() == []
    b.enqueue(req(3))
    assert ids(b.next_batches()) == [[1, 2, 3]]


def test_a_request_counts_its_own_batch_size(clock):
    b = make(clock, max_batch_size=8, max_queue_delay_us=1_000_000)
    fill(b, req(1, batch_size=5), req(2, batch_size=2), req(3, batch_size=2))
    b.instance_idle("w")
    # 5 + 2 = 7; the next request (2) does not fit, which closes the batch: sent at once
    (_, batch), = b.next_batches()
    assert [r.req_id for r in batch] == [1, 2]
    assert sum(r.batch_size for r in batch) == 7
    assert len(b) == 1
    b.instance_idle("w")
    assert b.next_batches() == []                  # the leftover waits for its delay
    clock.advance_us(1_000_000)
    assert ids(b.next_batches()) == [[3]]


def test_request_that_does_not_fit_starts_the_next_batch(clock):
    b = make(clock, max_batch_size=8)
    fill(b, req(1, batch_size=3), req(2, batch_size=6), req(3, batch_size=2))
    for k in "abc":
        b.instance_idle(k)
    assert ids(b.next_batches()) == [[1], [2, 3]]


# ---- shapes -----------------------------------------------------------------------------------

def test_incompatible_shape_closes_the_batch(clock):
    b = make(clock, max_queue_delay_us=1_000_000)
    fill(b, req(1, shape_key="a"), req(2, shape_key="a"), req(3, shape_key="b"),
         req(4, shape_key="a"))
    b.instance_idle("w")
    # closed at the first incompatible request and sent without waiting for the delay
    assert ids(b.next_batches()) == [[1, 2]]
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[3]]          # also closed, by request 4
    b.instance_idle("w")
    assert b.next_batches() == []                  # the last one may still grow: it waits
    assert b.next_deadline_ns() == T0 + 1_000_000 * US
    b.enqueue(req(5, shape_key="a"))
    clock.advance_us(1_000_000)
    assert ids(b.next_batches()) == [[4, 5]]


def test_shape_mismatch_at_the_head_only_blocks_joining(clock):
    b = make(clock)
    fill(b, req(1, shape_key="x"), req(2, shape_key="y"), req(3, shape_key="x"))
    b.instance_idle("a")
    b.instance_idle("b")
    b.instance_idle("c")
    assert ids(b.next_batches()) == [[1], [2], [3]]     # FIFO: no reordering around a mismatch


# ---- instances --------------------------------------------------------------------------------

def test_n_idle_instances_take_n_batches_at_once(clock):
    b = make(clock, max_batch_size=2)
    fill(b, *(req(i) for i in range(7)))
    assert b.next_batches() == []                  # no idle instance: nothing goes
    assert len(b) == 7
    for k in ("a", "b", "c"):
        b.instance_idle(k)
    batches = b.next_batches()
    assert ids(batches) == [[0, 1], [2, 3], [4, 5]]
    assert [k for k, _ in batches] == ["c", "b", "a"]
    assert len(b) == 1 and b.idle == []


def test_instance_idle_twice_and_gone(clock):
    b = make(clock, max_batch_size=1)
    b.instance_idle("a")
    b.instance_idle("a")
    b.instance_idle("b")
    b.instance_gone("b")
    b.instance_gone("never-seen")
    assert b.idle == ["a"]
    fill(b, req(1), req(2))
    assert [(k, [r.req_id for r in rs]) for k, rs in b.next_batches()] == [("a", [1])]


# ---- priorities -------------------------------------------------------------------------------

def test_level_one_is_served_before_level_two(clock):
    b = make(clock, max_batch_size=1, priority_levels=2, default_priority_level=2)
    fill(b, req(1, priority=2), req(2, priority=2), req(3, priority=1), req(4, priority=1))
    for k in "abcd":
        b.instance_idle(k)
    assert ids(b.next_batches()) == [[3], [4], [1], [2]]


def test_a_batch_walks_level_one_then_level_two(clock):
    b = make(clock, priority_levels=2, default_priority_level=2)
    fill(b, req(1, priority=2), req(2, priority=1), req(3, priority=2), req(4, priority=1))
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[2, 4, 1, 3]]


@pytest.mark.parametrize("priority", [0, 3, 99])
def test_priority_zero_or_above_levels_uses_the_default_level(clock, priority):
    b = make(clock, max_batch_size=1, priority_levels=2, default_priority_level=1)
    assert b.level_of(priority) == 0
    b2 = make(clock, max_batch_size=1, priority_levels=2, default_priority_level=2)
    assert b2.level_of(priority) == 1
    fill(b2, req(1, priority=priority), req(2, priority=1), req(3, priority=2))
    for k in "abc":
        b2.instance_idle(k)
    assert ids(b2.next_batches()) == [[2], [1], [3]]   # FIFO within the default level


def test_without_priority_levels_everything_is_one_fifo(clock):
    b = make(clock, max_batch_size=1)
    fill(b, req(1, priority=5), req(2, priority=1), req(3))
    assert list(b.levels) == [0]
    for k in "abc":
        b.instance_idle(k)
    assert ids(b.next_batches()) == [[1], [2], [3]]


MAX_UINT64 = 2**64 - 1


def test_the_whole_uint64_range_of_levels_costs_only_what_waits(clock):
    """Triton's L0_model_queue declares 2^64 - 1 levels with default level 2^32: a level's
    queue exists while requests wait at it, and goes once they have left."""
    b = make(clock, preferred=(4,), max_queue_delay_us=10_000, priority_levels=MAX_UINT64,
             default_priority_level=2**32)
    fill(b, req(1, batch_size=2), req(2, priority=2**32), req(3, batch_size=2, priority=1),
         req(4, priority=MAX_UINT64))
    assert sorted(b.levels) == [0, 2**32 - 1, MAX_UINT64 - 1]
    b.instance_idle("w")
    # level 1 first, then the default level in arrival order: a preferred batch of 4
    assert ids(b.next_batches()) == [[3, 1]]
    assert sorted(b.levels) == [2**32 - 1, MAX_UINT64 - 1]      # level 1 emptied and went
    b.cancel(0, 2)
    b.cancel(0, 4)
    assert b.levels == {} and b.order == [] and len(b) == 0


def test_levels_emptied_by_timeouts_or_a_full_queue_go(clock):
    b = make(clock, priority_levels=1000, default_priority_level=1,
             level_policies=((7, QueuePolicy(max_queue_size=1, timeout_us=10)),))
    fill(b, req(1, priority=7))
    with pytest.raises(QueueFull):
        b.enqueue(req(2, priority=7))
    clock.advance_us(20)
    assert [r.req_id for r in b.take_expired()] == [1]
    assert b.levels == {} and b.order == []


# ---- queue sizes ------------------------------------------------------------------------------

def test_per_level_max_queue_size(clock):
    b = make(clock, priority_levels=2, default_priority_level=2,
             level_policies=((1, QueuePolicy(max_queue_size=2)),))
    fill(b, req(1, priority=1), req(2, priority=1))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        b.enqueue(req(3, priority=1))
    for i in range(4, 10):                         # level 2 uses the unbounded default policy
        b.enqueue(req(i, priority=2))
    assert len(b) == 8
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[1, 2, 4, 5, 6, 7, 8, 9]]
    b.enqueue(req(10, priority=1))                 # room again


def test_default_policy_max_queue_size(clock):
    b = make(clock, default_policy=QueuePolicy(max_queue_size=1))
    b.enqueue(req(1))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        b.enqueue(req(2))


def test_global_max_queue_size(clock):
    b = make(clock, max_queue_size=3, max_batch_size=2, priority_levels=2,
             default_priority_level=1)
    fill(b, req(1, priority=1), req(2, priority=2), req(3, priority=2))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        b.enqueue(req(4, priority=1))
    assert len(b) == 3
    b.instance_idle("w")
    assert ids(b.next_batches()) == [[1, 2]]
    b.enqueue(req(5))
    assert len(b) == 2


def test_rejected_request_leaves_no_trace(clock):
    b = make(clock, default_policy=QueuePolicy(max_queue_size=1, timeout_us=10))
    b.enqueue(req(1))
    r2 = req(2)
    with pytest.raises(QueueFull):
        b.enqueue(r2)
    assert r2.enqueued_ns == 0 and r2.deadline_ns == 0
    assert [r.req_id for r in b.drain()] == [1]


# ---- queue timeouts ---------------------------------------------------------------------------

def test_reject_timeout(clock):
    b = make(clock, default_policy=QueuePolicy(timeout_us=100))
    r1 = req(1)
    b.enqueue(r1)
    assert r1.deadline_ns == T0 + 100 * US
    assert b.next_deadline_ns() == T0 + 100 * US
    clock.now = T0 + 100 * US - 1
    assert b.take_expired() == []
    assert len(b) == 1
    clock.now = T0 + 100 * US
    assert b.take_expired() == [r1]
    assert len(b) == 0
    assert b.take_expired() == []
    b.instance_idle("w")
    assert b.next_batches() == []
    assert b.next_deadline_ns() is None


def test_reject_takes_only_the_expired_ones(clock):
    b = make(clock, max_batch_size=4, max_queue_delay_us=1_000,
             default_policy=QueuePolicy(timeout_us=100))
    fill(b, req(1))
    clock.advance_us(60)
    fill(b, req(2))
    assert b.next_deadline_ns() == T0 + 100 * US   # the timeout comes before the delay
    clock.advance_us(40)
    assert [r.req_id for r in b.take_expired()] == [1]
    assert b.next_deadline_ns() == T0 + 160 * US   # now request 2's timeout
    clock.advance_us(60)
    assert [r.req_id for r in b.take_expired()] == [2]
    assert len(b) == 0


def test_next_deadline_is_the_delay_when_it_comes_first(clock):
    b = make(clock, max_queue_delay_us=50, default_policy=QueuePolicy(timeout_us=100))
    b.enqueue(req(1))
    assert b.next_deadline_ns() == T0 + 100 * US   # no idle instance: only the timeout matters
    b.instance_idle("i0")
    assert b.next_deadline_ns() == T0 + 50 * US


def test_a_due_batch_reports_now_while_an_instance_is_idle(clock):
    b = make(clock, max_batch_size=8, preferred=(8,), max_queue_delay_us=50)
    b.enqueue(req(1))
    clock.advance_us(80)            # the delay passed while no instance was idle
    b.instance_idle("i0")
    assert b.next_deadline_ns() == clock()          # the shell must dispatch right away
    assert [r.req_id for _, batch in b.next_batches() for r in batch] == [1]
    assert b.next_deadline_ns() is None


def test_expired_delay_sends_everything_not_only_the_preferred_prefix(clock):
    b = make(clock, max_batch_size=8, preferred=(2, 4), max_queue_delay_us=50)
    for i in range(3):
        b.enqueue(req(i, batch_size=1))
    clock.advance_us(60)
    b.instance_idle("i0")
    (_, batch), = b.next_batches()
    assert len(batch) == 3


def test_batch_stops_growing_past_the_largest_preferred_size(clock):
    b = make(clock, max_batch_size=8, preferred=(4,), max_queue_delay_us=10_000)
    b.instance_idle("i0")
    b.enqueue(req(1, batch_size=3))
    b.enqueue(req(2, batch_size=3))       # 6 would pass the preferred 4: the 3 goes alone
    (_, batch), = b.next_batches()
    assert [r.req_id for r in batch] == [1]


def test_delay_timeout_moves_behind_unexpired_requests_but_executes(clock):
    b = make(clock, max_batch_size=1,
             default_policy=QueuePolicy(timeout_us=100, delay_on_timeout=True))
    b.enqueue(req(1))
    clock.advance_us(50)
    b.enqueue(req(2))
    clock.advance_us(50)
    assert b.take_expired() == []                  # DELAY: nothing is failed
    assert len(b) == 2
    assert [r.req_id for r in b.levels[0].delayed] == [1]
    b.enqueue(req(3))                              # still ahead of the delayed one
    for k in "abc":
        b.instance_idle(k)
    assert ids(b.next_batches()) == [[2], [3], [1]]
    assert len(b) == 0


def test_delayed_request_does_not_pass_a_higher_level(clock):
    b = make(clock, max_batch_size=1, priority_levels=2, default_priority_level=2,
             level_policies=((1, QueuePolicy(timeout_us=10, delay_on_timeout=True)),))
    fill(b, req(1, priority=1), req(2, priority=1), req(3, priority=2))
    clock.advance_us(10)
    assert b.take_expired() == []
    for k in "abc":
        b.instance_idle(k)
    # both level-1 requests expired: still level 1, so still before level 2
    assert ids(b.next_batches()) == [[1], [2], [3]]


def test_timeout_override(clock):
    allow = QueuePolicy(timeout_us=1_000, allow_override=True)
    b = make(clock, default_policy=allow)
    shorter, longer, none = req(1, timeout_us=100), req(2, timeout_us=5_000), req(3)
    fill(b, shorter, longer, none)
    assert shorter.deadline_ns == T0 + 100 * US     # shorter than the default: wins
    assert longer.deadline_ns == T0 + 1_000 * US    # longer: the default stays
    assert none.deadline_ns == T0 + 1_000 * US


def test_timeout_override_with_no_default(clock):
    b = make(clock, default_policy=QueuePolicy(timeout_us=0, allow_override=True))
    r1, r2 = req(1, timeout_us=300), req(2)
    fill(b, r1, r2)
    assert r1.deadline_ns == T0 + 300 * US
    assert r2.deadline_ns == 0
    clock.advance_us(300)
    assert b.take_expired() == [r1]


def test_request_timeout_ignored_without_allow_override(clock):
    b = make(clock, default_policy=QueuePolicy(timeout_us=1_000))
    r1 = req(1, timeout_us=100)
    b.enqueue(r1)
    assert r1.deadline_ns == T0 + 1_000 * US
    b2 = make(clock)
    r2 = req(2, timeout_us=100)
    b2.enqueue(r2)
    assert r2.deadline_ns == 0
    clock.advance_us(10_000)
    assert b2.take_expired() == []
    assert b2.next_deadline_ns() is None


def test_per_level_policy_timeouts(clock):
    b = make(clock, priority_levels=2, default_priority_level=2,
             default_policy=QueuePolicy(timeout_us=500),
             level_policies=((1, QueuePolicy(timeout_us=100)),))
    r1, r2 = req(1, priority=1), req(2, priority=2)
    fill(b, r1, r2)
    assert (r1.deadline_ns, r2.deadline_ns) == (T0 + 100 * US, T0 + 500 * US)


# ---- drain ------------------------------------------------------------------------------------

def test_drain_empties_everything(clock):
    b = make(clock, priority_levels=2, default_priority_level=1,
             default_policy=QueuePolicy(timeout_us=10, delay_on_timeout=True))
    fill(b, req(1, priority=2), req(2, priority=1))
    clock.advance_us(10)
    b.take_expired()                               # both now delayed
    b.enqueue(req(3, priority=2))
    drained = b.drain()
    assert sorted(r.req_id for r in drained) == [1, 2, 3]
    assert len(b) == 0
    assert all(len(level) == 0 for level in b.levels)
    b.instance_idle("w")
    assert b.next_batches() == []
    assert b.drain() == []


# ---- batcher_config ---------------------------------------------------------------------------

BASE = '''
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''


def config(text):
    return normalize(text_format.Parse(BASE + text, mc.ModelConfig()), "m")


def test_batcher_config_defaults():
    bc = batcher_config(config("dynamic_batching { }"))
    assert bc == BatcherConfig(max_batch_size=8, preferred=(8,), max_queue_delay_us=0,
                               preserve_ordering=False, priority_levels=0,
                               default_priority_level=0, default_policy=QueuePolicy(),
                               level_policies=())


def test_batcher_config_maps_everything(clock):
    bc = batcher_config(config('''
dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 500
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    timeout_action: DELAY
    default_timeout_microseconds: 100
    allow_timeout_override: true
    max_queue_size: 7
  }
  priority_queue_policy { key: 1 value { timeout_action: REJECT max_queue_size: 3
                                         default_timeout_microseconds: 50 } }
  priority_queue_policy { key: 3 value { timeout_action: DELAY } }
}'''))
    assert bc.max_batch_size == 8
    assert bc.preferred == (2, 4)
    assert bc.max_queue_delay_us == 500
    assert bc.preserve_ordering is True
    assert (bc.priority_levels, bc.default_priority_level) == (3, 2)
    assert bc.default_policy == QueuePolicy(max_queue_size=7, timeout_us=100, allow_override=True,
                                            delay_on_timeout=True)
    assert dict(bc.level_policies) == {
        1: QueuePolicy(max_queue_size=3, timeout_us=50, allow_override=False,
                       delay_on_timeout=False),
        3: QueuePolicy(delay_on_timeout=True),
    }
    assert all(type(k) is int for k, _ in bc.level_policies)
    # the batcher gives each level its own policy, the default where none is set
    b = DynamicBatcher(bc, clock=clock)
    assert [b._level(i).policy for i in range(3)] == [dict(bc.level_policies)[1], bc.default_policy,
                                             dict(bc.level_policies)[3]]
    assert b.delay_ns == 500 * US
    assert b.level_of(0) == 1


def test_batcher_config_max_batch_size_at_least_one():
    cfg = config("dynamic_batching { }")
    cfg.max_batch_size = 0
    assert batcher_config(cfg).max_batch_size == 1


# ---- the remembered scan ------------------------------------------------------------------------

def test_every_queue_change_is_seen_by_the_next_scan(clock):
    """The head-of-queue scan is remembered between next_batches and next_deadline_ns; enqueue,
    cancel, requeue and expiry must each make the next question see the new queue."""
    b = make(clock, preferred=(4,), max_queue_delay_us=500,
             default_policy=QueuePolicy(timeout_us=300))
    b.instance_idle("w")
    fill(b, req(1), req(2), req(3))
    assert b.next_batches() == [] and b.next_deadline_ns() == T0 + 300 * US
    clock.advance_us(10)
    b.enqueue(req(4))                               # reaches the preferred size
    assert b.next_deadline_ns() == clock.now
    cancelled = b.cancel(0, 4)
    assert cancelled is not None and b.next_batches() == []     # back under the preferred size
    b.requeue(cancelled)
    assert ids(b.next_batches()) == [[4, 1, 2, 3]]
    fill(b, req(5))
    clock.advance_us(400)                           # past the queue timeout of 300 us
    assert [r.req_id for r in b.take_expired()] == [5]
    b.instance_idle("w")
    assert b.next_batches() == [] and b.next_deadline_ns() is None
