"""The dynamic batching rule (engine/batching/rule.py), and the two places that batch by it giving
the same batches for the same requests: the scheduler's queue (DynamicBatcher, fake clock) and
a leased worker's inbox (LeasedBatcher, over a real SEQPACKET inbox, with no delay so that
nothing waits)."""
from collections import deque

import pytest

from shmserve.engine.batching.dynamic import BatcherConfig, DynamicBatcher
from shmserve.engine.batching.queues import QueuedRequest
from shmserve.engine.batching.rule import BatchRule
from shmserve.ipc import channel, packets
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute
from shmserve.workers.leases.batch import LeasedBatcher


def grown(rule, sizes, keys=None, alone=()):
    g = rule.grow()
    joined = 0
    for i, size in enumerate(sizes):
        if not g.add(size, (keys or {}).get(i, ""), i in alone):
            break
        joined += 1
    return g, joined


def test_requests_join_while_they_fit_the_largest_preferred_size():
    rule = BatchRule.of(8, (2, 4, 16, 0), 0)
    assert rule.preferred == (2, 4) and rule.limit == 4
    g, joined = grown(rule, [1, 1, 1, 1, 1])
    assert joined == 4 and g.total == 4 and g.best == 4 and g.closed


def test_a_batch_is_cut_back_to_its_longest_preferred_prefix_until_the_delay_runs_out():
    rule = BatchRule.of(8, (2, 4), 1000)        # 1 ms
    g, joined = grown(rule, [1, 1, 1])
    assert joined == 3 and g.best == 2 and not g.closed
    assert g.due(10_000) == 2                   # a preferred size goes at once, cut back
    assert g.due(1_000_000) == 3                # the oldest waited out the delay: all of it


def test_without_a_preferred_size_a_batch_waits_for_the_delay_unless_it_cannot_grow():
    rule = BatchRule.of(4, (), 1000)
    g, _ = grown(rule, [1, 1])
    assert g.due(999_999) == 0 and g.due(1_000_000) == 2
    g, _ = grown(rule, [2, 2])
    assert g.closed and g.due(0) == 2           # full
    g, joined = grown(rule, [1, 1], keys={1: "other shape"})
    assert joined == 1 and g.closed and g.due(0) == 1


def test_no_delay_sends_what_there_is_and_a_retry_runs_alone():
    rule = BatchRule.of(8, (), 0)
    assert grown(rule, [1, 1])[0].due(0) == 2
    g, joined = grown(rule, [1, 1], alone={0})
    assert joined == 1 and g.closed and g.due(0) == 1
    g, joined = grown(rule, [1, 1], alone={1})
    assert joined == 1 and g.due(0) == 1


SCENARIOS = {
    "max batch": dict(max_batch=4, preferred=(), sizes=[1, 2, 1, 3, 1]),
    "preferred prefix": dict(max_batch=8, preferred=(2, 4), sizes=[1, 1, 1, 2, 1, 1, 1]),
    "shapes": dict(max_batch=8, preferred=(), sizes=[1, 1, 1, 1], keys=["a", "a", "b", "a"]),
    "too large to join": dict(max_batch=5, preferred=(3,), sizes=[2, 2, 1, 3]),
}


def scheduler_batches(max_batch, preferred, sizes, keys=None):
    clock = lambda: 1_000_000      # noqa: E731 - nothing waits: no delay
    b = DynamicBatcher(BatcherConfig(max_batch_size=max_batch, preferred=preferred), clock=clock)
    for i, size in enumerate(sizes):
        b.enqueue(QueuedRequest(req_id=i, frontend=0, batch_size=size, payload=b"",
                                shape_key=(keys or [""] * len(sizes))[i]))
    out = []
    while len(b):
        b.instance_idle("w")
        out += [[r.req_id for r in rs] for _, rs in b.next_batches()]
    return out


def worker_batches(tmp_path, max_batch, preferred, sizes, keys=None):
    address = f"{packets.SCHEME}{tmp_path / 'w.pkt'}"
    inbox, out = packets.PacketInbox(address), packets.PacketOutbox(address)
    try:
        for i, size in enumerate(sizes):
            out.send(LeasedExecute(1, SubmitRequest(i, 0, "m", 1, size, 1,
                                                    shape_key=(keys or [""] * len(sizes))[i])),
                     [b""])
        batcher = LeasedBatcher({"max_batch_size": max_batch, "dynamic_batching": {
            "preferred_batch_size": list(preferred), "max_queue_delay_microseconds": 0}})
        backlog: deque = deque()
        got = []
        while backlog or inbox.has_message():
            first, frames = backlog.popleft() if backlog else inbox.recv(channel.NOBLOCK)
            got.append([m.head.req_id for m, _ in
                        batcher.gather(first, frames, inbox, backlog, 0)])
        return got
    finally:
        out.close()
        inbox.close()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_scheduler_and_a_leased_worker_form_the_same_batches(tmp_path, name):
    case = SCENARIOS[name]
    expected = scheduler_batches(**case)
    assert worker_batches(tmp_path, **case) == expected
    assert sorted(i for b in expected for i in b) == list(range(len(case["sizes"])))
