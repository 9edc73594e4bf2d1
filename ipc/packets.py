"""A thread-free transport: AF_UNIX SOCK_SEQPACKET, read and written by the process's own thread.

A ZeroMQ hop moves every message through an I/O thread on each side, so one hop wakes three
threads; here the sender's ``sendmsg`` puts the message straight into the receiver's socket
buffer and the receiver's own thread reads it (bench/transport_hops.py measures both). The
interface is the one of ``channel.Inbox`` / ``channel.Outbox``: addresses are ``unix://<path>``,
and ``channel.inbox_for`` / ``channel.outbox_for`` pick the transport by the address.

Wire format (SEQPACKET keeps boundaries and order per connection): ``flags:u8`` then one or
more messages, each ``nframes:u16 len:u32 * nframes`` then its frames, the first being the
encoded message. ``send_many`` packs the messages a sender has at once into one packet (one
system call and one wake-up of the receiver for all of them). A message larger than
``MAX_PACKET`` (several inline tensors together) goes alone, as fragments: every packet but the
last carries ``MORE`` in its flags, and the receiver joins them.

Back-pressure: the receiver's socket buffer is the queue. A non-blocking send to a full peer
raises ``zmq.Again`` (the exception callers of ``channel.Outbox`` already handle); a blocking send
waits at most ``SEND_TIMEOUT_S`` for room and then raises ``PeerStalled``, so a stopped peer costs
bounded memory and a clear error instead of a sender blocked for ever. A peer that has gone
(its process died) makes sends raise ``PeerGone``; nothing is queued for it.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from collections import deque

import zmq

from shmserve.ipc import messages
from shmserve.ipc.counters import COUNTERS

# (defined where the interpreter builds them: compiled classes cannot subclass builtin errors)
from shmserve.ipc.errors import PeerGone, PeerStalled

SCHEME = "unix://"
MAX_PACKET = 128 * 1024          # fits the default AF_UNIX send buffer with room to spare
SEND_TIMEOUT_S = 10.0
SOCKET_BUFFER = 4 << 20          # asked for; the kernel caps it (net.core.[rw]mem_max)
MORE = 1
# sendmsg takes at most 1024 buffers (UIO_MAXIOV): a message is two plus its payloads
MAX_BATCH = 64
_NOBLOCK = NOBLOCK = int(zmq.NOBLOCK)
_RECV_SIZE = MAX_PACKET + 64


def is_packet_address(addr: str) -> bool:
    return addr.startswith(SCHEME)


def _path(addr: str) -> str:
    if not addr.startswith(SCHEME):
        raise ValueError(f"not a {SCHEME} address: {addr!r}")
    return addr[len(SCHEME):]


_LAST = b"\x00"        # the flags byte of a packet that ends its message(s)


_ALONE = struct.Struct("<HI")
_WITH_ONE = struct.Struct("<HII")


def _encode_frames(head: bytes, payloads) -> list:
    """One message's part of a packet: its frame count and lengths, then its frames."""
    # the two shapes nearly every message has, with prebuilt Structs: ~1 µs less a message
    if not payloads:
        return [_ALONE.pack(1, len(head)), head]
    if len(payloads) == 1:
        p = payloads[0]
        return [_WITH_ONE.pack(2, len(head), len(p)), head, p]
    n = 1 + len(payloads)
    prefix = struct.pack(f"<HI{n - 1}I", n, len(head), *[len(p) for p in payloads])
    return [prefix, head, *payloads]


def _decode_frames(body) -> list[tuple[bytes, list[bytes]]]:
    """The messages in ``body`` (a packet after its flags byte): (encoded message, payloads)."""
    mv = memoryview(body)
    end, pos = len(mv), 0
    out = []
    while pos < end:
        (n,) = struct.unpack_from("<H", mv, pos)
        lens = struct.unpack_from(f"<{n}I", mv, pos + 2)
        pos += 2 + 4 * n
        frames = []
        for ln in lens:
            frames.append(bytes(mv[pos:pos + ln]))
            pos += ln
        out.append((frames[0], frames[1:]))
    return out


class PacketInbox:
    """Binds a SEQPACKET listener; any number of peers connect to it. One epoll set holds the
    listener and every connection, and its fd (``fileno``) is readable whenever a message may be
    waiting, so an event loop (uvloop's add_reader) or a poller can wait on it."""

    def __init__(self, addr: str):
        self.address = addr
        path = _path(addr)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.epoll = select.epoll()
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self.conns: dict[int, socket.socket] = {}
        self.partial: dict[int, list[bytes]] = {}
        self.ready: deque = deque()
        self.timeout_s = -1.0
        self.buf = bytearray(_RECV_SIZE)

    def fileno(self) -> int:
        return self.epoll.fileno()

    def set_timeout(self, ms: int) -> None:
        """Make a blocking ``recv`` raise zmq.Again after ``ms`` milliseconds (-1: never)."""
        self.timeout_s = -1.0 if ms < 0 else ms / 1000.0

    def has_message(self) -> bool:
        """Whether ``recv(NOBLOCK)`` would return a message now (collects what is readable)."""
        while not self.ready and self._collect(0.0):
            pass
        return bool(self.ready)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for something readable; whether a message is ready."""
        if not self.ready:
            self._collect(timeout_s)
        return bool(self.ready)

    def take(self, look: bool = True):
        """(message, payload frames) if one has arrived, else None: ``recv(NOBLOCK)`` without
        an exception, for a loop that drains the inbox on every wake-up (the zmq.Again that
        ends such a drain cost about as much as reading a message). A look reads everything
        the sockets hold (an empty look at the epoll set ends it, not a read that fails);
        ``look=False``: only what an earlier look read. An event loop that watches ``fileno``
        needs one look per wake-up, since what arrives after it wakes the loop again."""
        ready = self.ready
        if not ready:
            if not look:
                return None
            while self._collect(0.0):
                pass
            if not ready:
                return None
        head, frames = ready.popleft()
        COUNTERS.received(len(head) + sum(len(f) for f in frames))
        return messages.decode(head), frames

    def recv(self, flags: int = 0):
        """Returns (message, payload frames as bytes); raises zmq.Again when nothing arrives
        (at once with NOBLOCK, else after the timeout)."""
        if flags & _NOBLOCK:
            got = self.take()
            if got is None:
                raise zmq.Again()
            return got
        ready = self.ready
        if not ready:
            if self.timeout_s < 0:
                while not ready:
                    self._collect(-1.0)
            else:
                # readiness without a message (a new peer, part of a fragmented message) must
                # not start the wait again: the timeout is for the whole receive
                deadline = time.monotonic() + self.timeout_s
                while not ready:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._collect(left):
                        break
            if not ready:
                raise zmq.Again()
        head, frames = ready.popleft()
        COUNTERS.received(len(head) + sum(len(f) for f in frames))
        return messages.decode(head), frames

    def _collect(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (-1: for ever) for readiness and read everything that
        is readable; False when the wait timed out with nothing new."""
        events = self.epoll.poll(timeout)
        if not events:
            return False
        listen_fd = self.listener.fileno()
        for fd, ev in events:
            if fd == listen_fd:
                self._accept()
            else:
                self._read(fd, ev)
        return True

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            except OSError:
                pass
            self.conns[conn.fileno()] = conn
            self.epoll.register(conn.fileno(), select.EPOLLIN)

    def _read(self, fd: int, ev: int) -> None:
        """Reads one whole message (its fragments, when it came in several) from ``fd``, not
        all that waits there: the epoll set is level-triggered, so the next look finds the
        rest, while a read that finds nothing raises an exception, which costs about four
        times an empty look. Most wake-ups bring one message."""
        conn = self.conns.get(fd)
        if conn is None:
            return
        buf = self.buf
        recv_into = conn.recv_into
        while True:
            try:
                n = recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if n == 0:                  # the peer closed its end
                self._drop(fd)
                return
            if buf[0] & MORE:
                self.partial.setdefault(fd, []).append(bytes(buf[1:n]))
                continue
            parts = self.partial.pop(fd, None)
            if parts is None:
                self.ready.extend(_decode_frames(memoryview(buf)[1:n]))
            else:
                parts.append(bytes(buf[1:n]))
                self.ready.extend(_decode_frames(b"".join(parts)))
            return

    def _drop(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        self.partial.pop(fd, None)
        if conn is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass
            conn.close()

    def refuse_new(self) -> None:
        """From now on every peer's send fails (PeerGone, so the sender knows this inbox took
        nothing more), while what was sent before stays to be read. A process that stops reads
        its inbox empty after this and loses nothing in between: no connection is refused
        once accepted, and a packet cannot arrive after the last read. (Unix sockets: a
        listener shut down refuses connect() and keeps the pending ones; a connection shut
        down for reading fails its peer's sends with EPIPE and keeps its queue.)"""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._accept()
        try:        # a shut-down listener reads as ready for ever
            self.epoll.unregister(self.listener.fileno())
        except (OSError, ValueError):
            pass
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def close(self) -> None:
        for fd in list(self.conns):
            self._drop(fd)
        path = _path(self.address)
        self.listener.close()
        self.epoll.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class PacketOutbox:
    """A connection to one ``PacketInbox``. Connects at construction; with ``wait_connected_s``
    it keeps trying that long for an inbox that is not bound yet."""

    def __init__(self, addr: str, wait_connected_s: float = 0.0):
        self.address = addr
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        except OSError:
            pass
        self._connect(_path(addr), wait_connected_s)
        self.sock.setblocking(False)
        self.gone = False

    def _connect(self, path: str, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        delay = 0.001
        while True:
            try:
                self.sock.connect(path)
                return
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() + delay > deadline:
                    self.sock.close()
                    raise PeerGone(f"nothing listens at {path}: {e.strerror}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def send(self, msg, payloads=(), flags: int = 0) -> None:
        """Send a message and optional payload frames (bytes-like, not copied on the way)."""
        parts = _encode_frames(messages.encode(msg), payloads)
        size = 1 + sum(len(p) for p in parts)
        COUNTERS.sent(size)
        if size <= MAX_PACKET:
            self._send_packet([_LAST, *parts], flags)
        else:
            self._send_fragments(parts, flags)

    def send_many(self, items: list, flags: int = 0) -> int:
        """Send (message, payloads) pairs in order, packed into as few packets as fit; returns
        how many went out: all, or fewer when the peer is full (``flags`` NOBLOCK, or stalled)
        or gone (``gone`` is then true). Whatever is not sent is not queued either."""
        sent = 0
        batch: list = [_LAST]
        size = count = 0
        try:
            for msg, payloads in items:
                parts = _encode_frames(messages.encode(msg), payloads)
                n = sum(len(p) for p in parts)
                if count and (1 + size + n > MAX_PACKET or count == MAX_BATCH):
                    self._send_packet(batch, flags)
                    sent += count
                    batch, size, count = [_LAST], 0, 0
                COUNTERS.sent(n)
                if 1 + n > MAX_PACKET:      # too big to share a packet: alone, in fragments
                    self._send_fragments(parts, flags)
                    sent += 1
                    continue
                batch += parts
                size += n
                count += 1
            if count:
                self._send_packet(batch, flags)
                sent += count
        except (zmq.Again, PeerGone):
            pass
        return sent

    def _send_fragments(self, parts: list, flags: int) -> None:
        # Rare (several inline tensors together): one join, then fragments. Once the first
        # fragment is out the rest must follow, so only the first may fail with Again.
        whole = memoryview(b"".join(parts))
        step = MAX_PACKET - 1
        for start in range(0, len(whole), step):
            last = start + step >= len(whole)
            try:
                self._send_packet([_LAST if last else b"\x01", whole[start:start + step]],
                                  flags if start == 0 else flags & ~_NOBLOCK)
            except PeerStalled:
                if start:       # half a message is out: the connection cannot be used again
                    self.gone = True
                    self.sock.close()
                raise

    def _send_packet(self, parts: list, flags: int) -> None:
        if self.gone:
            raise PeerGone(f"the inbox at {self.address} has gone")
        sock = self.sock
        while True:
            try:
                sock.sendmsg(parts)
                return
            except (BlockingIOError, InterruptedError):
                if flags & _NOBLOCK:
                    raise zmq.Again() from None
                if not _wait_writable(sock, SEND_TIMEOUT_S):
                    raise PeerStalled(f"the inbox at {self.address} has not read for "
                                      f"{SEND_TIMEOUT_S:g} s") from None
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN):
                    self.gone = True
                    raise PeerGone(f"the inbox at {self.address} has gone") from None
                raise

    def close(self) -> None:
        self.sock.close()


def _wait_writable(sock: socket.socket, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return bool(poller.poll(timeout_s * 1000))
