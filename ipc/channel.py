"""ZeroMQ sockets between shmserve processes, with byte counters.

Each process binds one PULL ``Inbox``; peers reach it through a PUSH ``Outbox`` connected to that
address. Counters record every frame that crosses a socket, so tests and metrics can prove that
tensor bytes above the inline limit travel through shared memory instead.
"""
from __future__ import annotations

import os
import select
import time

import zmq

from shmserve.ipc import messages, packets
from shmserve.ipc.counters import COUNTERS, IpcCounters  # noqa: F401  (re-exported)

# Tensors up to this size ride inside messages; larger ones go through shared memory.
INLINE_LIMIT = 64 * 1024
# Bounded queues: a stalled peer produces back-pressure (zmq.Again) instead of unbounded memory.
HIGH_WATER_MARK = 20000

# pyzmq's Socket adds a Python layer over its Cython core, and its send_multipart/recv_multipart
# combine flags as enum.IntFlag values: a two-frame message sent and received costs 3.8 us that
# way against 2.4 us here (bench/zmq_options.py, encode and decode included in both). The hot
# paths call the core directly with plain int flags.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_set = zmq.backend.Socket.set
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_RCVTIMEO = int(zmq.RCVTIMEO)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# callers pass this rather than zmq.NOBLOCK, an IntFlag, for the same reason
NOBLOCK = int(zmq.NOBLOCK)



_context: zmq.Context | None = None


def context() -> zmq.Context:
    global _context
    if _context is None or _context.closed:
        _context = zmq.Context(io_threads=1)
    return _context


# Every socket lives in the run directory, under a name of at most SOCKET_NAME_MAX characters
# ("frontend-3.pkt", "w123456.pkt"); a Unix socket's path holds at most UNIX_PATH_MAX.
SOCKET_NAME_MAX = 24
UNIX_PATH_MAX = 107


def run_dir_too_long(run_dir: str) -> str:
    """Why sockets cannot live in ``run_dir`` ("" when they can)."""
    room = UNIX_PATH_MAX - SOCKET_NAME_MAX - 1
    if len(run_dir) <= room:
        return ""
    return (f"the run directory '{run_dir}' is {len(run_dir)} characters long, and Unix socket "
            f"paths hold {UNIX_PATH_MAX}: its sockets need it to be at most {room}; set TMPDIR "
            f"to a shorter directory")


def address(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


def frontend_address(run_dir: str, frontend_id: int) -> str:
    """A frontend's inbox: workers' answers and the scheduler's replies arrive there over the
    thread-free transport (ipc/packets.py); only frontends -> scheduler stays on ZeroMQ."""
    return f"{packets.SCHEME}{os.path.join(run_dir, f'frontend-{frontend_id}.pkt')}"


def frontend_segment_prefix(server_prefix: str, frontend_id: int, incarnation: int = 0) -> str:
    """Names of a frontend's shared-memory arena. A frontend started in the place of one that
    died (its ``incarnation``: 1, 2, ...) takes other names: workers keep mappings of the dead
    one's segments by name for a while, and must never take a new segment for one of them."""
    return f"{server_prefix}f{frontend_id}_" if not incarnation else \
        f"{server_prefix}f{frontend_id}r{incarnation}_"


# Request ids of a frontend started in the place of one that died (incarnation k) start at
# k << FRONTEND_ID_BITS: an answer meant for the dead one can never be taken for one of its own
FRONTEND_ID_BITS = 40


def worker_segment_prefix(server_prefix: str, spawn_id: int) -> str:
    """Names of a worker's shared-memory arena (output slots)."""
    return f"{server_prefix}w{spawn_id}_"


def segment_worker(server_prefix: str, segment: str) -> int | None:
    """The spawn id of the worker whose arena holds ``segment``; None for any other segment."""
    if not segment.startswith(server_prefix):
        return None
    spawn_id, sep, _ = segment[len(server_prefix):].partition("_")
    if not sep or spawn_id[:1] != "w" or not spawn_id[1:].isdigit():
        return None
    return int(spawn_id[1:])


def worker_address(run_dir: str, spawn_id: int) -> str:
    """A worker's inbox (the scheduler's batches and pings, frontends' released outputs), on
    the thread-free transport."""
    return f"{packets.SCHEME}{os.path.join(run_dir, f'w{spawn_id}.pkt')}"


def scheduler_worker_address(run_dir: str) -> str:
    """Where workers send the scheduler their completions, readiness and pongs (packets; what
    frontends send it stays on ZeroMQ)."""
    return f"{packets.SCHEME}{os.path.join(run_dir, 'scheduler.pkt')}"


def inbox_for(addr: str):
    """The inbox for an address: ``unix://`` is ipc.packets, ``ipc://``/``inproc://`` ZeroMQ."""
    return packets.PacketInbox(addr) if packets.is_packet_address(addr) else Inbox(addr)


def outbox_for(addr: str, wait_connected_s: float = 0.0):
    """The outbox for an address (see ``inbox_for``). A packet outbox connects at once and
    raises ``packets.PeerGone`` when nothing listens there."""
    if packets.is_packet_address(addr):
        return packets.PacketOutbox(addr, wait_connected_s)
    return Outbox(addr, wait_connected_s)


class Inbox:
    def __init__(self, addr: str):
        self.address = addr
        self.socket = context().socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(addr)

    def fileno(self) -> int:
        return self.socket.getsockopt(zmq.FD)

    def bind_also(self, addr: str) -> None:
        """A second endpoint (e.g. inproc for the process's own threads) into the same queue."""
        self.socket.bind(addr)

    def recv(self, flags: int = 0):
        """Returns (message, payload frames as bytes). Raises zmq.Again with NOBLOCK when empty,
        or when a receive timeout (``set_timeout``) passes.

        Frames are copied out of ZeroMQ: every frame here is at most INLINE_LIMIT plus a header,
        and for those a copy is cheaper than the zmq.Frame object that a zero-copy receive
        builds (bench/zmq_options.py measures both)."""
        sock = self.socket
        head = _recv(sock, flags)
        size = len(head)
        frames = []
        while _get(sock, _RCVMORE):
            f = _recv(sock, 0)
            size += len(f)
            frames.append(f)
        COUNTERS.received(size)
        return messages.decode(head), frames

    def set_timeout(self, ms: int) -> None:
        """Make a blocking ``recv`` raise zmq.Again after ``ms`` milliseconds (-1: never)."""
        _set(self.socket, _RCVTIMEO, ms)

    def close(self) -> None:
        self.socket.close(0)


class Outbox:
    def __init__(self, addr: str, wait_connected_s: float = 0.0):
        """``wait_connected_s``: return only once the connection is up (or that long passed).
        ZeroMQ connects in its I/O thread and queues messages until then; a process that may
        die right after sending (a worker running model code next) must not leave its first
        answers in that queue, where they die with it."""
        self.address = addr
        self.socket = context().socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.LINGER, 0)
        if wait_connected_s <= 0:
            self.socket.connect(addr)
            return
        monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            self.socket.connect(addr)
            if monitor.poll(int(wait_connected_s * 1000)):
                monitor.recv_multipart()
        finally:
            self.socket.disable_monitor()
            monitor.close(0)

    def send(self, msg, payloads=(), flags: int = 0) -> None:
        """Send a message and optional payload frames (bytes, forwarded as they are)."""
        head = messages.encode(msg)
        size = len(head)
        sock = self.socket
        if payloads:
            more = flags | _SNDMORE
            _send(sock, head, more)
            last = len(payloads) - 1
            for i, p in enumerate(payloads):
                size += len(p)
                _send(sock, p, more if i < last else flags)
        else:
            _send(sock, head, flags)
        COUNTERS.sent(size)

    def close(self) -> None:
        self.socket.close(0)


class SchedulerInbox:
    """The scheduler's inbox: a ZeroMQ PULL socket (frontends, and the process's own threads
    over inproc) and a packet listener (workers) behind one blocking ``recv``.

    Workers' messages are taken first: what a worker wrote before it exited is in the socket
    before the exit watcher's ProcessExited can be read, so its last BatchDone or
    WorkerLoadFailed is handled before its death. ZeroMQ's descriptor is edge-triggered: the
    loop sleeps only after a receive found its queue empty and ZMQ_EVENTS agrees."""

    def __init__(self, zmq_addr: str, packet_addr: str):
        self.zmq = Inbox(zmq_addr)
        self.packets = packets.PacketInbox(packet_addr)
        self.address = zmq_addr
        self.worker_address = packet_addr
        self.epoll = select.epoll()
        self.epoll.register(self.zmq.fileno(), select.EPOLLIN)
        self.epoll.register(self.packets.fileno(), select.EPOLLIN)
        self.timeout_s = -1.0

    def bind_also(self, addr: str) -> None:
        self.zmq.bind_also(addr)

    def set_timeout(self, ms: int) -> None:
        """Make a blocking ``recv`` raise zmq.Again after ``ms`` milliseconds (-1: never)."""
        self.timeout_s = -1.0 if ms < 0 else ms / 1000.0

    def recv(self, flags: int = 0):
        pkt, zsock, zrecv = self.packets, self.zmq.socket, self.zmq.recv
        deadline = None
        while True:
            if pkt.has_message():
                return pkt.recv(NOBLOCK)
            try:
                return zrecv(NOBLOCK)
            except zmq.Again:
                pass
            if flags & NOBLOCK:
                raise zmq.Again()
            if _get(zsock, _EVENTS) & _POLLIN:  # type: ignore[operator]  # an int option
                continue
            if self.timeout_s < 0:
                self.epoll.poll(-1)
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            if now >= deadline:
                raise zmq.Again()
            self.epoll.poll(deadline - now)

    def close(self) -> None:
        self.epoll.close()
        self.packets.close()
        self.zmq.close()


def term_context() -> None:
    """End this process's ZeroMQ context if it has one (without starting one to end it)."""
    if _context is not None and not _context.closed:
        _context.term()
