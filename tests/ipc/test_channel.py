"""Inbox and Outbox over real ZeroMQ sockets (ipc://, two sockets in this process)."""
from __future__ import annotations

import time

import pytest
import zmq

from shmserve.ipc import channel
from shmserve.ipc.messages.to_scheduler import BatchDone, Wake
from shmserve.ipc.messages.to_worker import ExecuteBatch, RequestRoute


@pytest.fixture
def pair(tmp_path):
    addr = channel.address(str(tmp_path), "inbox")
    inbox = channel.Inbox(addr)
    outbox = channel.Outbox(addr)
    yield inbox, outbox
    outbox.close()
    inbox.close()


def recv_within(inbox: channel.Inbox, seconds: float = 10.0):
    inbox.set_timeout(int(seconds * 1000))
    try:
        return inbox.recv()
    finally:
        inbox.set_timeout(-1)


def test_payload_frames_arrive_whole_and_in_order(pair):
    inbox, outbox = pair
    routes = [RequestRoute(i, 0) for i in range(3)]
    payloads = [b"first", b"", b"x" * 70_000]
    before = channel.COUNTERS.as_dict()
    outbox.send(ExecuteBatch(7, routes), payloads)
    msg, frames = recv_within(inbox)
    assert msg == ExecuteBatch(7, routes)
    assert frames == payloads
    after = channel.COUNTERS.as_dict()
    assert after["received_messages"] - before["received_messages"] == 1
    assert after["received_bytes"] - before["received_bytes"] == \
        after["sent_bytes"] - before["sent_bytes"] > sum(map(len, payloads))


def test_a_message_without_payload_has_no_frames_and_does_not_swallow_the_next(pair):
    inbox, outbox = pair
    outbox.send(Wake())
    outbox.send(BatchDone(3, 9, [1], 10, 20, 30), [b"tail"], flags=channel.NOBLOCK)
    first, frames = recv_within(inbox)
    assert first == Wake() and frames == []
    second, frames = recv_within(inbox)
    assert second == BatchDone(3, 9, [1], 10, 20, 30) and frames == [b"tail"]


def test_empty_inbox_raises_again_without_blocking_and_after_its_timeout(pair):
    inbox, _ = pair
    with pytest.raises(zmq.Again):
        inbox.recv(channel.NOBLOCK)
    inbox.set_timeout(50)
    started = time.monotonic()
    with pytest.raises(zmq.Again):
        inbox.recv()
    assert time.monotonic() - started >= 0.04   # it waited (about) its timeout, not forever


def test_a_workers_arena_segment_names_its_worker_and_no_other_segment_does():
    prefix = "shmserve_41_ab12_"
    seg = channel.worker_segment_prefix(prefix, 17) + "3"
    assert channel.segment_worker(prefix, seg) == 17
    assert channel.segment_worker(prefix, channel.worker_segment_prefix(prefix, 0) + "0") == 0
    for other in [channel.frontend_segment_prefix(prefix, 2) + "1",       # a frontend's arena
                  channel.frontend_segment_prefix(prefix, 2, 1) + "1",
                  "shmserve_99_ab12_w17_3",                               # another server's
                  "clientregion", prefix + "w_3", prefix + "wx7_3", prefix + "w17"]:
        assert channel.segment_worker(prefix, other) is None, other
