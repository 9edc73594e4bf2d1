"""The SOCK_SEQPACKET transport: boundaries, fragments, many peers, back-pressure, peers that go."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest
import zmq
from packet_reader import PacketReader

from shmserve.ipc import packets
from shmserve.ipc.messages.to_scheduler import Pong
from shmserve.ipc.messages.to_worker import Ping


@pytest.fixture
def addr(tmp_path):
    return f"{packets.SCHEME}{tmp_path}/inbox"


def test_messages_keep_their_boundaries_and_order(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    for i in range(500):
        out.send(Ping(i), (bytes([i % 256]) * (i * 7),) if i % 3 else ())
    inbox.set_timeout(2000)
    for i in range(500):
        msg, frames = inbox.recv()
        assert msg == Ping(i)
        assert frames == ([bytes([i % 256]) * (i * 7)] if i % 3 else [])
    with pytest.raises(zmq.Again):
        inbox.recv(zmq.NOBLOCK)
    out.close()
    inbox.close()


def test_large_messages_go_as_fragments_and_arrive_whole(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    big = [os.urandom(100_000), os.urandom(packets.MAX_PACKET * 3 + 17), b""]
    out.send(Ping(1), big)
    out.send(Ping(2), (b"x",))
    inbox.set_timeout(2000)
    # the reader may run while fragments are still arriving: it must wait for the rest
    assert inbox.recv() == (Ping(1), big)
    assert inbox.recv() == (Ping(2), [b"x"])


def test_memoryview_payloads_are_sent_as_they_are(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    data = bytearray(range(256)) * 4
    out.send(Ping(3), (memoryview(data)[10:900],))
    inbox.set_timeout(2000)
    assert inbox.recv() == (Ping(3), [bytes(data[10:900])])


def test_many_peers_feed_one_inbox(addr):
    inbox = packets.PacketInbox(addr)
    outs = [packets.PacketOutbox(addr) for _ in range(20)]
    for k, out in enumerate(outs):
        for i in range(10):
            out.send(Pong(k, i))
    inbox.set_timeout(2000)
    got: dict[int, list[int]] = {}
    for _ in range(200):
        msg, _ = inbox.recv()
        got.setdefault(msg.spawn_id, []).append(msg.seq)
    assert got == {k: list(range(10)) for k in range(20)}   # in order per peer


def test_recv_times_out_and_fileno_signals_readiness(addr):
    import select
    inbox = packets.PacketInbox(addr)
    inbox.set_timeout(50)
    t0 = time.monotonic()
    with pytest.raises(zmq.Again):
        inbox.recv()
    assert time.monotonic() - t0 < 5
    out = packets.PacketOutbox(addr)
    out.send(Ping(9))
    readable, _, _ = select.select([inbox.fileno()], [], [], 2.0)
    assert readable == [inbox.fileno()]
    assert inbox.has_message()
    assert inbox.recv(zmq.NOBLOCK)[0] == Ping(9)


def test_a_stalled_reader_bounds_memory_and_gives_a_clear_error(addr, monkeypatch):
    inbox = packets.PacketInbox(addr)   # never read
    out = packets.PacketOutbox(addr)
    inbox.has_message()                 # accept the connection
    sent = 0
    payload = b"p" * 4096
    with pytest.raises(zmq.Again):
        for _ in range(1_000_000):
            out.send(Ping(sent), (payload,), zmq.NOBLOCK)
            sent += 1
    # the kernel's socket buffers are the only queue: a few MiB at most, not a million messages
    assert 0 < sent * len(payload) < 64 << 20
    monkeypatch.setattr(packets, "SEND_TIMEOUT_S", 0.2)
    with pytest.raises(packets.PeerStalled, match="has not read"):
        out.send(Ping(-1), (payload,))
    # nothing sent before the stall is lost
    inbox.set_timeout(2000)
    for i in range(sent):
        assert inbox.recv()[0] == Ping(i)


def test_send_many_packs_messages_into_one_packet_each_whole(addr):
    reader = PacketReader(addr)
    out = packets.PacketOutbox(addr)
    items = [(Ping(i), (bytes([i]) * i, b"") if i % 2 else ()) for i in range(10)]
    assert out.send_many(items) == 10
    # one packet holds all ten, each whole
    assert reader.packet() == [(Ping(i), [bytes([i]) * i, b""] if i % 2 else [])
                               for i in range(10)]
    out.close()
    reader.close()


def test_send_many_splits_at_the_packet_limit_and_sends_big_ones_alone(addr):
    reader = PacketReader(addr)
    out = packets.PacketOutbox(addr)
    third = b"t" * (packets.MAX_PACKET // 3)
    huge = os.urandom(packets.MAX_PACKET * 2 + 5)
    items = [(Ping(0), (third,)), (Ping(1), (third,)), (Ping(2), (third,)),
             (Ping(3), (huge,)), (Ping(4), ())]
    items += [(Ping(5 + i), ()) for i in range(packets.MAX_BATCH + 1)]
    assert out.send_many(items) == len(items)
    got = [reader.packet() for _ in range(5)]
    assert [msg for p in got for msg in p] == [(msg, list(payloads)) for msg, payloads in items]
    # two thirds fit one packet; the huge one goes alone (in fragments); then the small ones,
    # at most MAX_BATCH to a packet
    assert [len(p) for p in got] == [2, 1, 1, packets.MAX_BATCH, 2]
    out.close()
    reader.close()


def test_send_many_to_a_full_peer_says_how_many_went_and_loses_none_of_them(addr):
    inbox = packets.PacketInbox(addr)   # not read until the end
    out = packets.PacketOutbox(addr)
    inbox.has_message()
    payload = b"p" * 60_000         # two to a packet
    items = [(Ping(i), (payload,)) for i in range(2000)]
    sent = out.send_many(items, zmq.NOBLOCK)
    assert 0 < sent < len(items)
    assert not out.gone
    # the rest can go once the reader has made room, in order after the first ones
    inbox.set_timeout(2000)
    got = [inbox.recv()[0] for _ in range(sent)]
    assert got == [Ping(i) for i in range(sent)]
    assert out.send_many(items[sent:sent + 3], zmq.NOBLOCK) == 3
    assert [inbox.recv()[0] for _ in range(3)] == [Ping(sent + i) for i in range(3)]


def test_send_many_to_a_gone_peer_sends_none_and_says_so(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    inbox.has_message()
    inbox.close()
    for _ in range(10):     # the first send may still land in a buffer being torn down
        if out.send_many([(Ping(1), ()), (Ping(2), ())], zmq.NOBLOCK) == 0:
            break
    assert out.gone
    assert out.send_many([(Ping(3), ())]) == 0


def test_sending_to_a_closed_inbox_raises_peer_gone(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    inbox.has_message()
    inbox.close()
    with pytest.raises(packets.PeerGone):
        for i in range(10):        # the first send may still land in a buffer being torn down
            out.send(Ping(i))
    with pytest.raises(packets.PeerGone):
        packets.PacketOutbox(addr)


def test_connect_waits_for_an_inbox_bound_later(addr):
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_bind_late_and_echo, args=(addr, 0.3))
    proc.start()
    try:
        out = packets.PacketOutbox(addr, wait_connected_s=10.0)
        reply_addr = addr + ".reply"
        replies = packets.PacketInbox(reply_addr)
        out.send(Ping(5), (reply_addr.encode(),))
        replies.set_timeout(10_000)
        assert replies.recv()[0] == Pong(0, 5)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _bind_late_and_echo(addr: str, delay: float) -> None:
    time.sleep(delay)       # the point of the test: the sender starts before this inbox exists
    inbox = packets.PacketInbox(addr)
    inbox.set_timeout(10_000)
    msg, frames = inbox.recv()
    packets.PacketOutbox(frames[0].decode()).send(Pong(0, msg.seq))


def test_the_timeout_is_for_the_whole_receive(addr):
    """Readiness without a message (here: new peers, one every 0.1 s) must not start the wait
    again: a worker pinged every 2 s with a 1 s timeout never timed out, so never trimmed its
    arena. With the bug this receive would last as long as the peers keep coming."""
    inbox = packets.PacketInbox(addr)
    inbox.set_timeout(500)
    done = threading.Event()
    peers = []

    def connect_peers():                # for about 3 s, then stop
        for _ in range(30):
            time.sleep(0.1)
            peers.append(packets.PacketOutbox(addr))
        done.set()

    t = threading.Thread(target=connect_peers)
    t.start()
    try:
        with pytest.raises(zmq.Again):
            inbox.recv()
        still_coming = not done.is_set()
    finally:
        t.join(10)
    assert still_coming                 # it timed out while peers were still arriving
    for p in peers:
        p.close()


def test_take_returns_what_has_arrived_and_none_without_an_exception(addr):
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    assert inbox.take() is None
    out.send_many([(Ping(1), (b"a",)), (Ping(2), ())])
    deadline = time.monotonic() + 2
    got = []
    while len(got) < 2 and time.monotonic() < deadline:
        item = inbox.take()
        if item is not None:
            got.append(item)
    assert got == [(Ping(1), [b"a"]), (Ping(2), [])]
    assert inbox.take() is None
    with pytest.raises(zmq.Again):
        inbox.recv(zmq.NOBLOCK)
    out.close()
    inbox.close()


class _CountingSocket(socket.socket):
    """The accepted connection itself (same fd), counting the reads that found nothing."""
    empty_reads = 0

    def recv_into(self, *args):
        try:
            return super().recv_into(*args)
        except BlockingIOError:
            _CountingSocket.empty_reads += 1
            raise


def test_a_look_reads_every_message_whole_without_a_read_that_finds_nothing(addr):
    """A look reads one whole message from each ready socket and polls the epoll set again
    until it is empty: no read that fails (Python raises for it), and a look without it
    (``look=False``) returns only what an earlier look read."""
    inbox = packets.PacketInbox(addr)
    out = packets.PacketOutbox(addr)
    out.send(Ping(0))
    deadline = time.monotonic() + 2
    while not inbox.has_message():      # the first look accepts the peer
        assert time.monotonic() < deadline
    assert inbox.take(False) == (Ping(0), [])
    [(fd, conn)] = inbox.conns.items()
    inbox.conns[fd] = _CountingSocket(fileno=conn.detach())
    _CountingSocket.empty_reads = 0
    big = os.urandom(packets.MAX_PACKET * 2 + 5)         # fragments: still one message
    out.send(Ping(1), (big,))
    out.send(Ping(2))
    out.send(Ping(3))
    assert inbox.take(False) is None                    # in the socket, not looked at yet
    assert inbox.take() == (Ping(1), [big])             # the look read all three
    assert len(inbox.ready) == 2
    assert inbox.take(False) == (Ping(2), [])
    assert inbox.take(False) == (Ping(3), [])
    assert inbox.take() is None
    assert _CountingSocket.empty_reads == 0
    out.close()
    inbox.close()


def test_an_inbox_that_refuses_new_keeps_what_came_and_fails_every_later_send(addr):
    """A worker that stops (workers/worker.py bounce_leased): what peers sent before is read,
    accepted or not yet; every send after fails at its sender, so nothing is lost unseen."""
    inbox = packets.PacketInbox(addr)
    early = packets.PacketOutbox(addr)
    early.send(Ping(1))
    inbox.has_message()                 # accepts ``early``
    late = packets.PacketOutbox(addr)   # connected, not accepted yet
    late.send(Ping(2))
    inbox.refuse_new()
    with pytest.raises(packets.PeerGone):
        early.send(Ping(3))
    with pytest.raises(packets.PeerGone):
        late.send(Ping(4))
    with pytest.raises(packets.PeerGone):
        packets.PacketOutbox(addr)      # no new connection
    got = []
    while inbox.has_message():
        got.append(inbox.recv(zmq.NOBLOCK)[0])
    assert sorted(m.seq for m in got) == [1, 2]
    inbox.set_timeout(50)
    with pytest.raises(zmq.Again):      # and it does not spin: nothing more, a quiet wait
        inbox.recv()
    for box in (early, late):
        box.close()
    inbox.close()
