"""Leased requests of a dynamic-batching model batch in the worker's inbox (workers/leases/batch.py),
over a real SEQPACKET inbox."""
import threading
import time
from collections import deque

import pytest

from shmserve.ipc import channel, packets
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute, RevokeLease
from shmserve.workers.leases.batch import LeasedBatcher


@pytest.fixture
def link(tmp_path):
    addr = f"{packets.SCHEME}{tmp_path / 'w.pkt'}"
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    yield inbox, out
    out.close()
    inbox.close()


def config(max_batch=8, delay_us=0, preferred=(), batching=True):
    cfg = {"max_batch_size": max_batch}
    if batching:
        cfg["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us,
                                   "preferred_batch_size": list(preferred)}
    return cfg


def leased(req_id, batch=1, key="", lease=1, received_ns=None):
    received = time.monotonic_ns() if received_ns is None else received_ns
    return LeasedExecute(lease, SubmitRequest(req_id, 0, "m", 1, batch, received,
                                              shape_key=key))


def gather(batcher, inbox, backlog=None, revoked_upto=0):
    first, frames = inbox.recv(channel.NOBLOCK)
    backlog = deque() if backlog is None else backlog
    got = batcher.gather(first, frames, inbox, backlog, revoked_upto)
    return [m.head.req_id for m, _ in got], [f for _, fs in got for f in fs], backlog


def test_requests_waiting_behind_the_first_join_it_up_to_the_max_batch_size(link):
    inbox, out = link
    for i in range(1, 6):
        out.send(leased(i, batch=2), [f"payload{i}".encode()])
    ids, frames, backlog = gather(LeasedBatcher(config(max_batch=7)), inbox)
    assert ids == [1, 2, 3] and frames == [b"payload1", b"payload2", b"payload3"]
    # the one that did not fit is next, then the rest, in arrival order
    assert [m.head.req_id for m, _ in backlog] == [4]
    ids, _, _ = gather(LeasedBatcher(config(max_batch=7)), FakeBacklogInbox(backlog, inbox))
    assert ids == [4, 5]


class FakeBacklogInbox:
    """The worker reads its backlog before its inbox; so does this test's next gather."""

    def __init__(self, backlog, inbox):
        self.backlog, self.inbox = backlog, inbox

    def recv(self, flags=0):
        return self.backlog.popleft() if self.backlog else self.inbox.recv(flags)

    def has_message(self):
        return self.inbox.has_message()

    def wait(self, timeout_s):
        return self.inbox.wait(timeout_s)


@pytest.mark.parametrize("second", [
    leased(2, key="4x3"),                       # another shape
    RevokeLease(1),                             # the lease ends: it must run after this batch
    leased(2, lease=2),                         # another lease
])
def test_a_request_that_cannot_join_ends_the_batch_and_stays_first(link, second):
    inbox, out = link
    out.send(leased(1, key="4x2"), [b"a"])
    out.send(second, [b"b"] if isinstance(second, LeasedExecute) else [])
    out.send(leased(3, key="4x2"), [b"c"])
    ids, _, backlog = gather(LeasedBatcher(config()), inbox)
    assert ids == [1]
    assert backlog[0][0] == second and inbox.has_message()


def test_a_revoked_lease_takes_nothing_more(link):
    inbox, out = link
    out.send(leased(1, lease=3), [b"a"])
    out.send(leased(2, lease=3), [b"b"])
    ids, _, backlog = gather(LeasedBatcher(config()), inbox, revoked_upto=3)
    assert ids == [1] and [m.head.req_id for m, _ in backlog] == [2]


def test_the_largest_preferred_batch_size_caps_the_batch(link):
    inbox, out = link
    for i in range(1, 6):
        out.send(leased(i), [b"x"])
    ids, _, _ = gather(LeasedBatcher(config(max_batch=8, preferred=(2, 4))), inbox)
    assert ids == [1, 2, 3, 4]


def test_a_model_without_dynamic_batching_never_batches(link):
    inbox, out = link
    assert LeasedBatcher(config(batching=False)).limit == 0
    assert LeasedBatcher({"max_batch_size": 0, "dynamic_batching": {}}).limit == 0


def test_a_batch_that_is_not_full_waits_up_to_the_delay_for_more(link):
    inbox, out = link
    out.send(leased(1), [b"a"])
    later = threading.Timer(0.05, lambda: out.send(leased(2), [b"b"]))
    later.start()
    try:
        # 10 s of delay from when the first reached the frontend: the batch (of 2, full) goes
        # as soon as the second arrives
        ids, _, _ = gather(LeasedBatcher(config(max_batch=2, delay_us=10_000_000)), inbox)
    finally:
        later.join(10)
    assert ids == [1, 2]


def test_no_wait_once_the_oldest_request_waited_its_delay(link):
    inbox, out = link
    old = time.monotonic_ns() - 120 * 10**9             # reached the frontend 2 minutes ago
    out.send(leased(1, received_ns=old), [b"a"])
    t0 = time.monotonic()
    ids, _, _ = gather(LeasedBatcher(config(delay_us=60 * 10**6)), inbox)
    assert ids == [1] and time.monotonic() - t0 < 30     # not another minute of delay


def test_a_batch_of_a_preferred_size_goes_without_waiting_for_the_delay(link):
    inbox, out = link
    for i in range(1, 5):
        out.send(leased(i), [b"x"])
    t0 = time.monotonic()
    # a minute of delay and room for 8: four is a preferred size and nothing more is waiting
    ids, _, backlog = gather(LeasedBatcher(config(max_batch=8, delay_us=60 * 10**6,
                                                  preferred=(4, 8))), inbox)
    assert ids == [1, 2, 3, 4] and not backlog and time.monotonic() - t0 < 30


def test_past_a_preferred_size_the_batch_is_cut_back_to_it_and_the_rest_runs_next(link):
    inbox, out = link
    for i in range(1, 4):
        out.send(leased(i), [f"p{i}".encode()])
    # as the scheduler's batcher: the longest prefix of a preferred size goes at once
    ids, frames, backlog = gather(LeasedBatcher(config(max_batch=8, delay_us=60 * 10**6,
                                                       preferred=(2, 8))), inbox)
    assert ids == [1, 2] and frames == [b"p1", b"p2"]
    assert [m.head.req_id for m, _ in backlog] == [3]


def test_once_the_delay_has_passed_a_batch_is_not_cut_back(link):
    inbox, out = link
    old = time.monotonic_ns() - 120 * 10**9
    for i in range(1, 4):
        out.send(leased(i, received_ns=old), [b"x"])
    ids, _, backlog = gather(LeasedBatcher(config(max_batch=8, delay_us=1000,
                                                  preferred=(2, 8))), inbox)
    assert ids == [1, 2, 3] and not backlog


def test_without_a_delay_a_batch_is_cut_back_to_a_preferred_size_too(link):
    inbox, out = link
    for i in range(1, 4):
        out.send(leased(i), [b"x"])
    # the scheduler's batcher sends the longest preferred prefix when the delay is 0 as well
    ids, _, backlog = gather(LeasedBatcher(config(max_batch=8, preferred=(2, 8))), inbox)
    assert ids == [1, 2] and [m.head.req_id for m, _ in backlog] == [3]
