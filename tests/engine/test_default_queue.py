"""DefaultQueue: a pure queue driven with a fake clock."""
import pytest

from shmserve.engine.batching.queues import DefaultQueue, QueuedRequest, QueueFull


class Clock:
    def __init__(self):
        self.now = 1_000

    def __call__(self):
        return self.now


def req(i, batch_size=1):
    return QueuedRequest(req_id=i, frontend=0, batch_size=batch_size, payload=f"p{i}".encode())


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def sched(clock):
    return DefaultQueue(clock=clock)


def test_fifo_one_request_per_batch(sched):
    for i in range(3):
        sched.enqueue(req(i, batch_size=4))
    sched.instance_idle("w")
    batches = sched.next_batches()
    assert [(k, [r.req_id for r in rs]) for k, rs in batches] == [("w", [0])]
    assert sched.next_batches() == []          # the instance is busy now
    sched.instance_idle("w")
    sched.instance_idle("v")
    batches = sched.next_batches()
    assert [(k, [r.req_id for r in rs]) for k, rs in batches] == [("v", [1]), ("w", [2])]
    assert len(sched) == 0
    assert sched.next_batches() == []          # idle instances but nothing queued
    assert sched.idle == []


def test_most_recently_idle_first(sched):
    for key in ("a", "b", "c"):
        sched.instance_idle(key)
    sched.enqueue(req(1))
    assert sched.next_batches()[0][0] == "c"
    sched.instance_idle("c")
    sched.instance_idle("a")                   # already idle: stays where it was
    sched.enqueue(req(2))
    sched.enqueue(req(3))
    assert [k for k, _ in sched.next_batches()] == ["c", "b"]
    assert sched.idle == ["a"]


def test_no_batch_without_idle_instance(sched):
    sched.enqueue(req(1))
    sched.enqueue(req(2))
    assert sched.next_batches() == []
    assert len(sched) == 2
    sched.instance_idle(7)
    assert [(k, rs[0].req_id) for k, rs in sched.next_batches()] == [(7, 1)]
    assert len(sched) == 1


def test_queue_full(clock):
    sched = DefaultQueue(max_queue_size=2, clock=clock)
    sched.enqueue(req(1))
    sched.enqueue(req(2))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        sched.enqueue(req(3))
    assert [r.req_id for r in sched.queue] == [1, 2]
    sched.instance_idle("w")
    sched.next_batches()
    sched.enqueue(req(4))                      # room again after one left the queue
    assert [r.req_id for r in sched.queue] == [2, 4]


def test_unbounded_queue_by_default(sched):
    for i in range(1000):
        sched.enqueue(req(i))
    assert len(sched) == 1000


def test_instance_gone(sched):
    sched.instance_idle("a")
    sched.instance_idle("b")
    sched.instance_gone("b")
    sched.instance_gone("never-seen")
    sched.enqueue(req(1))
    sched.enqueue(req(2))
    assert [(k, rs[0].req_id) for k, rs in sched.next_batches()] == [("a", 1)]
    assert len(sched) == 1


def test_drain(sched):
    for i in range(3):
        sched.enqueue(req(i))
    drained = sched.drain()
    assert [r.req_id for r in drained] == [0, 1, 2]
    assert len(sched) == 0
    sched.instance_idle("w")
    assert sched.next_batches() == []
    assert sched.drain() == []


def test_enqueued_ns_from_clock(sched, clock):
    a, b = req(1), req(2)
    sched.enqueue(a)
    clock.now = 5_000
    sched.enqueue(b)
    assert (a.enqueued_ns, b.enqueued_ns) == (1_000, 5_000)
    sched.instance_idle("w")
    (_, [got]), = sched.next_batches()
    assert got is a and got.payload == b"p1"


def test_rejected_request_is_not_stamped(clock):
    sched = DefaultQueue(max_queue_size=1, clock=clock)
    sched.enqueue(req(1))
    r = req(2)
    with pytest.raises(QueueFull):
        sched.enqueue(r)
    assert r.enqueued_ns == 0


def test_no_deadline(sched):
    sched.enqueue(req(1))
    assert sched.next_deadline_ns() is None
