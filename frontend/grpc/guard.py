"""What one gRPC connection on the loop server (``grpc/loop.py``) may hold, and for how long.

- Connections: each counts against the frontend's one budget (``connections``); past it a new
  one has its first call answered UNAVAILABLE, saying why, then GOAWAY. A TLS connection counts
  from its accept, before its handshake, which must end within the handshake time
  (``tls_accept``).
- Time: the HTTP/2 preface must arrive within HANDSHAKE_S (or --http-request-timeout-secs if
  shorter); a frame or header block, and a request message, once begun, within
  --http-request-timeout-secs; a connection with no call for --http-idle-timeout-secs gets
  GOAWAY (gRPC clients reconnect on their next call); one whose client takes none of the bytes
  written to it for that long is dropped.
- Writes: past WRITE_HIGH bytes waiting for the client, the connection is not read (so a flood
  of PINGs or SETTINGS that are answered but never read stays in the kernel) and answers wait.
- Requests held in part: a message not yet whole, and a stream's messages not yet taken by its
  handler, count against the connection's CONNECTION_SHARE and the process's ``Holdings``.
  Past its share a connection's window is given back only for its oldest incomplete message
  (that one can always complete, the others wait). Near the process's limit (7/8 of it) new
  streams are refused (REFUSED_STREAM, which clients may retry); past it a call that would
  hold more fails with RESOURCE_EXHAUSTED.
- Closing: after GOAWAY the connection stops writing but reads and drops what the client still
  sends for LINGER_S (at most LINGER_BYTES), so that a client still sending gets the GOAWAY
  rather than a reset (nginx's lingering close).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from shmserve.frontend.connections import Budget
from shmserve.frontend.http2 import connection as http2
from shmserve.ipc.compiled import trait

log = logging.getLogger("shmserve.grpc")

HANDSHAKE_S = 10.0              # TLS handshake, then the HTTP/2 preface and first frame
WRITE_HIGH = 1 << 20            # bytes waiting for the client past which it is not read
WRITE_CHUNK = 256 << 10         # an answer goes out in pieces this size, as the client reads
CONNECTION_SHARE = 64 << 20     # bytes of requests held in part by one connection
PROCESS_MIN = 256 << 20         # ... by the process: this, or one largest message and a share
LINGER_S = 2.0
LINGER_BYTES = 4 << 20
LINGER_REFUSED = 64             # refused connections lingering at once (their fds are reserve)
REFUSED_WAIT_S = 1.0            # a refused connection waits this long for a call to refuse
_AFTER_PREFACE = len(http2.PREFACE) + 9     # the preface and one whole frame (SETTINGS)


@dataclass
class GrpcLimits:
    request_timeout_s: float = 60.0     # --http-request-timeout-secs
    idle_timeout_s: float = 300.0       # --http-idle-timeout-secs
    budget: Budget | None = None

    @property
    def handshake_s(self) -> float:
        return min(HANDSHAKE_S, self.request_timeout_s)

    @property
    def period(self) -> float:
        return max(0.05, min(1.0, self.handshake_s / 4, self.idle_timeout_s / 4))


class Holdings:
    """Bytes of gRPC requests the process holds before their handlers take them. Past
    ``refuse_at`` new calls are refused, so that the calls under way have the rest. And the
    connections refused that linger now (each holds a descriptor of the reserve)."""

    __slots__ = ("limit", "refuse_at", "total", "refused_lingering")

    def __init__(self, max_message: int):
        self.limit = max(PROCESS_MIN, max_message + CONNECTION_SHARE)
        self.refuse_at = self.limit - self.limit // 8
        self.total = 0
        self.refused_lingering = 0

    def refusal(self) -> str:
        return (f"the server holds {self.limit} bytes of gRPC requests not yet read whole or "
                f"taken, its limit; try again later")


@trait
class Guard:
    """The limits above, as methods of ``grpc_loop.Connection`` (a trait: compiled, its
    methods are the connection's own)."""

    # what grpc_loop.Connection provides
    server: Any
    core: http2.Http2Server
    calls: dict[int, Any]
    transport: asyncio.Transport | None
    window: asyncio.Event
    peer: str
    # its own, set by _guard_init
    budgeted: bool
    refused: str
    opened_ns: int
    received: int
    handshaken: bool
    frame_mark: object
    frame_since_ns: int
    idle_mark: int
    idle_since_ns: int
    reading: bool
    write_paused: bool
    yielded: bool
    paused_since_ns: int
    lingering: bool
    lingered: int
    linger_timer: asyncio.TimerHandle | None
    held: int
    holdings: Holdings
    owing: int

    def flush(self) -> None:
        raise NotImplementedError

    def fail(self, call: Any, code: grpc.StatusCode, details: str) -> None:
        raise NotImplementedError

    def abandon(self, call: Any) -> None:
        raise NotImplementedError

    def refuse_stream(self, sid: int, headers: Any, end_stream: bool) -> None:
        raise NotImplementedError

    def _guard_init(self) -> None:
        self.budgeted = False           # counted in the budget (given back when lost)
        self.refused = ""               # why, when the budget had no room for it
        # (times in ns: a compiled trait cannot keep a float attribute, mypyc 2.4)
        self.opened_ns = time.monotonic_ns()
        self.received = 0               # bytes read, to tell one pending frame from the next
        self.handshaken = False
        self.frame_mark = None          # what was pending at the last sweep, and since when
        self.frame_since_ns = 0
        self.idle_mark = -1             # the last stream id seen idle, and since when
        self.idle_since_ns = 0
        self.reading = True
        self.write_paused = False
        self.yielded = False            # the core stopped a read to let others go first
        self.paused_since_ns = 0
        self.lingering = False
        self.lingered = 0
        self.linger_timer = None
        self.held = 0                   # bytes of requests held in part or not yet taken
        self.holdings = self.server.holdings
        self.owing = 0                  # calls whose window is owed (past the share)

    # ---- admission ------------------------------------------------------------------------------
    def admit(self, transport: Any) -> bool:
        """Counts the connection in the budget, or refuses it: False. A refused connection
        answers its client's first call UNAVAILABLE, saying why (a GOAWAY alone would have
        gRPC clients reconnect and retry until their deadline), then sends GOAWAY and closes
        (lingering); without a call, that is after REFUSED_WAIT_S. Past LINGER_REFUSED such
        connections at once, a refused one is closed at once."""
        budget = self.server.limits.budget
        if budget is not None and not self.budgeted:
            if not budget.take():
                if self.holdings.refused_lingering < LINGER_REFUSED:
                    self.holdings.refused_lingering += 1
                    self.refused = budget.refusal()     # its one call: refuse_stream
                    self.flush()
                    self.linger_timer = asyncio.get_running_loop().call_later(
                        REFUSED_WAIT_S, self.end, self.refused, http2.ENHANCE_YOUR_CALM)
                else:
                    transport.close()
                return False
            self.budgeted = True
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_HIGH // 4)
        return True

    def released(self) -> None:
        """The connection is gone: what it counted is given back."""
        if self.budgeted:
            self.budgeted = False
            self.server.limits.budget.give()
        elif self.refused:
            self.holdings.refused_lingering -= 1
        if self.linger_timer is not None:
            self.linger_timer.cancel()

    # ---- back-pressure --------------------------------------------------------------------------
    def pause_writing(self) -> None:
        self.write_paused = True
        self.paused_since_ns = time.monotonic_ns()
        self._flow()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._flow()
        self.window.set()               # answers waiting for the client to read go on

    def _flow(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        hold = (self.write_paused or self.yielded) and not self.lingering
        if hold and self.reading:
            t.pause_reading()
            self.reading = False
        elif not hold and not self.reading:
            t.resume_reading()
            self.reading = True

    # ---- requests held in part ------------------------------------------------------------------
    def count(self, call: Any, n: int) -> bool:
        """``call`` holds ``n`` more bytes (fewer, if negative); False if that failed it."""
        call.held += n
        self.held += n
        holdings = self.holdings
        holdings.total += n
        if n > 0 and holdings.total > holdings.limit:
            self.fail(call, grpc.StatusCode.RESOURCE_EXHAUSTED, holdings.refusal())
            return False
        return True

    def in_part(self, call: Any, length: int) -> int:
        """DATA of ``length`` flow-control bytes went into ``call``'s reader, which holds part of
        a message (or just completed one): counted, and how many of the bytes to give back now
        (the rest are owed to the call until its message is whole)."""
        size = len(call.reader.buffer)
        grown = size - call.partial
        call.partial = size
        if not size:
            call.since_ns = 0
        elif not call.since_ns:
            call.since_ns = time.monotonic_ns()
        if not self.count(call, grown):
            return length
        if grown > 0 and self.held > CONNECTION_SHARE and not self._oldest(call):
            if not call.owed:
                self.owing += 1
            call.owed += length
            return 0
        if not size and call.owed:
            length += call.owed
            call.owed = 0
            self.owing -= 1
        if grown < 0 and self.owing:
            self._repay()
        return length

    def _oldest(self, call: Any) -> bool:
        for c in self.calls.values():
            if c.partial:
                return c is call
        return True

    def _repay(self) -> None:
        """Give back the windows owed that the connection's share (or their being the oldest
        incomplete message) allows now."""
        within, first = self.held <= CONNECTION_SHARE, True
        for c in list(self.calls.values()):
            if c.owed and (within or (first and c.partial)):
                n, c.owed = c.owed, 0
                self.owing -= 1
                if c.queue is None:
                    self.core.ack(c.stream_id, n)
                else:
                    c.queue.put_nowait((None, n))
            if c.partial:
                first = False

    def release(self, call: Any) -> None:
        """``call`` ended: what it held and what was owed to it are given back."""
        if call.held:
            self.count(call, -call.held)
        call.partial = 0
        given = call.owed
        if call.owed:
            call.owed = 0
            self.owing -= 1
        queue = call.queue
        while queue is not None and not queue.empty():     # its stream's messages, not taken
            given += queue.get_nowait()[1]
        if given:
            self.core.ack(0, given)
        if self.owing:
            self._repay()

    # ---- closing --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop writing (what is written goes out first), read and drop what the client still
        sends for LINGER_S, then close."""
        t = self.transport
        if t is None or self.lingering:
            return
        for call in list(self.calls.values()):
            self.abandon(call)
        self.flush()
        self.lingering = True
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        if t.can_write_eof():
            t.write_eof()
        self._flow()
        self.linger_timer = asyncio.get_running_loop().call_later(LINGER_S, self.drop)

    def drop(self) -> None:
        t = self.transport
        if t is not None:
            t.abort() if t.get_write_buffer_size() else t.close()

    def lingered_on(self, data: bytes) -> None:
        self.lingered += len(data)
        if self.lingered > LINGER_BYTES:
            self.drop()

    def end(self, why: str, code: int = http2.NO_ERROR) -> None:
        log.debug("gRPC connection from %s closed: %s", self.peer, why)
        self.core.go_away(code, why)
        self.close()

    # ---- time -----------------------------------------------------------------------------------
    def check(self, now_ns: int, limits: GrpcLimits) -> None:
        """The sweep's look at this connection (every ``limits.period`` s; ``now_ns``: the
        monotonic clock)."""
        t, core = self.transport, self.core
        if t is None or self.lingering:
            return
        if self.write_paused:
            if now_ns - self.paused_since_ns > limits.idle_timeout_s * 1e9:
                log.info("gRPC client %s read nothing for %g s: dropped", self.peer,
                         limits.idle_timeout_s)
                t.abort()
            return
        pending = core.pending_bytes
        if not self.handshaken:
            if core.preface_seen and (self.received - pending >= _AFTER_PREFACE
                                      or core.block_stream):
                self.handshaken = True
            elif now_ns - self.opened_ns > limits.handshake_s * 1e9:
                self.end(f"no HTTP/2 preface within {limits.handshake_s:g} s")
                return
        if core.incomplete:
            # a header block is known by its stream, a frame by where it starts
            mark = ("block", core.block_stream) if core.block_stream else self.received - pending
            if mark != self.frame_mark:
                self.frame_mark, self.frame_since_ns = mark, now_ns
            elif now_ns - self.frame_since_ns > limits.request_timeout_s * 1e9:
                self.end(f"a frame did not arrive whole within {limits.request_timeout_s:g} s "
                         f"(--http-request-timeout-secs)")
                return
        else:
            self.frame_mark = None
        if self.held:
            for call in list(self.calls.values()):
                if call.since_ns and now_ns - call.since_ns > limits.request_timeout_s * 1e9:
                    self.fail(call, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"the request message did not arrive whole within "
                              f"{limits.request_timeout_s:g} s (--http-request-timeout-secs)")
        if self.calls:
            self.idle_mark = -1
        elif self.idle_mark != core.last_stream:
            self.idle_mark, self.idle_since_ns = core.last_stream, now_ns
        elif now_ns - self.idle_since_ns > limits.idle_timeout_s * 1e9:
            self.end(f"idle for {limits.idle_timeout_s:g} s (--http-idle-timeout-secs)")


async def sweeper(connections: set, limits: GrpcLimits) -> None:
    while True:
        await asyncio.sleep(limits.period)
        now_ns = time.monotonic_ns()
        for conn in list(connections):
            try:
                conn.check(now_ns, limits)
            except Exception:       # a bug must cost one connection's check, not every limit
                log.exception("checking the gRPC connection from %s", conn.peer)
