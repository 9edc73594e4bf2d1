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
