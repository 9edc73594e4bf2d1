"""HTTP/1.1 on uvloop with httptools: parsing, keep-alive, pipelining order, writing responses.

Knows nothing about inference: an *app* gets each complete request and answers through
``HttpConnection.respond``, or streams it (``start_stream``, ``send_chunk``, ``end_stream``).
Large bodies can be received straight into memory the app provides (a shared-memory slot), so
the only copy of a big tensor is the one from the socket.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable

import httptools

from shmserve.frontend.connections import Budget
from shmserve.ipc.compiled import mypyc_attr

_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("latin-1")


# the head lines every answer has, made once
_STATUS_LINES = {code: _status_line(code) for code in _REASONS}
_CONTENT_TYPES = {t: f"Content-Type: {t}\r\n".encode("latin-1")
                  for t in ("application/json", "application/octet-stream", "text/plain")}
# Responses up to this size are joined into one buffer and one write; a copy this small costs
# less than the extra send() syscall.
SMALL_RESPONSE = 64 * 1024
# After an error that ends the connection, what the client still sends is read and dropped for
# this long before the socket closes: closing with unread bytes makes the kernel send a reset,
# and a client still sending its request would see that instead of the error (nginx's
# lingering close)
LINGER_S = 2.0
# Non-empty chunks a chunked request body may have (Triton's kMaxChunkedChunks)
MAX_CHUNKS = 65536


@dataclass
class Limits:
    """What one client may hold (docs/security.md); each has a flag."""
    max_header_bytes: int = 64 * 1024       # request line plus header lines
    max_headers: int = 256
    max_connections: int = 4096
    request_timeout_s: float = 60.0         # from a request's first byte to its last
    idle_timeout_s: float = 300.0           # a keep-alive connection with nothing to do
    # back-pressure: a client that pipelines requests without reading the answers. Past either
    # bound the connection is not read from (and, past the first, no further request of it is
    # started) until the client catches up
    write_high_water: int = 1 << 20         # answer bytes buffered for the client
    max_pipelined: int = 32                 # received requests waiting for their turn
    connections: set = field(default_factory=set)   # the live ones, for the sweeper
    # the frontend's one budget of connections on all its ports (frontend/connections.py)
    budget: Budget | None = None


@mypyc_attr(allow_interpreted_subclasses=True)
class HttpApp:
    """What HttpConnection asks of the application behind it. The defaults suit an app that
    takes small bodies in memory; KServeHttpApp overrides them to receive into shared memory."""

    # keep each request's header names as sent (HttpRequest.raw_headers), for an app that
    # forwards headers to models (--http-header-forward-pattern); ``headers`` are lower-case
    raw_headers = False

    def check_body_size(self, req: "HttpRequest", n: int) -> str:
        """Why a body of ``n`` bytes is refused (a 413), or "" to accept it."""
        return ""

    def body_buffer(self, req: "HttpRequest", n: int):
        """Memory to receive the body into, or None for bytes in memory."""
        return None

    def release_body(self, req: "HttpRequest") -> None:
        pass

    def connection_lost(self, conn: "HttpConnection") -> None:
        pass

    def handle(self, conn: "HttpConnection", req: "HttpRequest") -> None:
        raise NotImplementedError


class HttpRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "body_slot", "keep_alive",
                 "http10", "chunked", "started", "raw_headers", "sized")

    def __init__(self, method: str, url: bytes, headers: dict[str, str]):
        self.method = method
        path, _, query = url.partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.headers = headers
        self.body: Any = b""
        self.body_slot: Any = None  # app-provided receive buffer (e.g. a shared-memory Slot)
        self.keep_alive = True
        self.http10 = False         # an HTTP/1.0 client: a streamed answer cannot be chunked
        self.chunked = False        # its streamed answer is being written chunk by chunk
        self.started = 0.0          # time.monotonic() at its first byte
        self.raw_headers: list[tuple[str, str]] = []    # as sent, when the app asks for them
        self.sized = False          # its Content-Length was checked against the limits


# (the tests' fakes of a connection are subclasses)
@mypyc_attr(allow_interpreted_subclasses=True)
class HttpConnection(asyncio.Protocol):
    """One client connection. Requests are answered strictly in arrival order."""

    def __init__(self, app, limits: Limits | None = None):
        self.app = app
        self.limits = limits or Limits()
        self.header_bytes = 0
        self.header_count = 0
        self.started = 0.0              # when the request being received began; 0 = none
        self.last_active = time.monotonic()
        self.parser = httptools.HttpRequestParser(self)
        # a request with both Transfer-Encoding and Content-Length (python's requests adds the
        # latter to a body it was given chunked by hand) is read by Transfer-Encoding alone, as
        # RFC 9112 §6.1 allows and Triton does, and its connection closes after the answer
        # (on_headers_complete), so that no other reading of the stream can follow it
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        # set by connection_made, the first call asyncio makes
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.url = b""
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.chunk_count = 0            # chunk headers of the request's chunked body
        self.request: HttpRequest | None = None
        self.received = 0
        self.queue: deque[HttpRequest] = deque()
        self.busy = False
        self.closed = False
        self.on_drained: list[Callable[[], None]] = []
        self.inflight = 0                   # request id the app is waiting on, if any
        self.reading = True                 # False while back-pressure holds the client
        self.budgeted = False               # counted in Limits.budget until connection_lost
        self.head_seen = 0                  # bytes read since the current request's head began
        self.lingering = False              # answered an error: what arrives is dropped
        self.dispatching = False            # inside _next: answers given meanwhile do not recurse

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def peer(self) -> str:
        """The client's address (host only), or "" for a unix socket."""
        name = self.transport.get_extra_info("peername") if self.transport else None
        return name[0] if isinstance(name, tuple) else ""

    def connection_made(self, transport):
        self.transport = transport
        live = self.limits.connections
        if len(live) >= self.limits.max_connections:
            self._fail(503, f"too many connections ({self.limits.max_connections}, "
                            f"--http-max-connections); try again later", linger=False)
            return
        budget = self.limits.budget
        if budget is not None:
            if not budget.take():
                self._fail(503, budget.refusal(), linger=False)
                return
            self.budgeted = True
        live.add(self)
        # any write that cannot complete at once pauses us, so we know when buffered data (which
        # may point into shared memory) has really left
        transport.set_write_buffer_limits(high=0)

    def connection_lost(self, exc):
        self.limits.connections.discard(self)
        if self.budgeted:
            self.budgeted = False
            self.limits.budget.give()  # type: ignore[union-attr]  # budgeted: there is one
        self.closed = True
        self._drained()
        self.app.connection_lost(self)

    def data_received(self, data: bytes):
        if self.lingering:
            return
        self.last_active = time.monotonic()
        if self.request is None:
            # a head is read: httptools hands a header over only once its line ends, joining
            # its pieces meanwhile (copies that grow with the line), so the limit is kept here
            # on what arrives rather than in on_header alone
            self.head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            # httptools wraps what a callback raises (HttpParserCallbackError, "User callback
            # error"); a body over the limit must still answer 413 with its own message
            cause = e.__context__
            if isinstance(cause, _BodyError):
                self._fail(cause.status, str(cause))
            else:
                self._fail(400, f"malformed HTTP request: {e}")
            return
        if self.request is None and self.started and self.head_seen > self.limits.max_header_bytes:
            self._fail(431, self._head_too_large())

    def pause_writing(self):
        pass        # every write that does not complete at once lands here (high-water mark 0)

    def resume_writing(self):
        self.last_active = time.monotonic()     # the client took its answers
        self._drained()
        self._next()

    # ---- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self):
        self.url = b""
        self.headers = {}
        self.raw: list[tuple[str, str]] | None = [] if self.app.raw_headers else None
        self.chunks = []
        self.chunk_count = 0
        self.received = 0
        self.header_bytes = self.header_count = 0
        self.started = self.last_active

    def on_url(self, url: bytes):
        self.url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes):
        # (called for every header of every request: the byte count is kept inline)
        limits = self.limits
        self.header_count += 1
        if self.header_count > limits.max_headers:
            raise _BodyError(431, f"request has more than {limits.max_headers} header "
                                  f"fields")
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > limits.max_header_bytes:
            raise _BodyError(431, self._head_too_large())
        key = name.decode("latin-1")
        text = value.decode("latin-1")
        self.headers[key.lower()] = text
        if self.raw is not None:
            self.raw.append((key, text))

    def _count_header_bytes(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > self.limits.max_header_bytes:
            raise _BodyError(431, self._head_too_large())

    def _head_too_large(self) -> str:
        return (f"request line and headers exceed {self.limits.max_header_bytes} bytes "
                f"(--http-max-header-size)")

    def on_headers_complete(self):
        self.head_seen = 0
        req = HttpRequest(self.parser.get_method().decode(), self.url, self.headers)
        if self.raw is not None:
            req.raw_headers = self.raw
        req.keep_alive = self.parser.should_keep_alive()
        req.http10 = self.parser.get_http_version() == "1.0"
        req.started = self.started
        length = self.headers.get("content-length")
        if length is not None and "transfer-encoding" in self.headers:
            length = None
            req.keep_alive = False
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise _BodyError(400, "invalid Content-Length") from None
            err = self.app.check_body_size(req, n)
            if err:
                raise _BodyError(413, err)
            req.sized = True
            req.body_slot = self.app.body_buffer(req, n)
        if self.headers.get("expect", "").lower() == "100-continue" and not self.closed:
            # the client (curl for bodies over 1 KiB) waits for this before sending its body;
            # a body over the limit was refused above instead
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.request = req

    def on_chunk_header(self):
        self.chunk_count += 1

    def on_body(self, body: bytes):
        req: HttpRequest = self.request  # type: ignore[assignment]  # on_headers_complete set it
        # Triton's bound, and its words: each chunk costs a callback and an object here, so a
        # body of a million 1-byte chunks would cost far more than its bytes (the last, empty
        # chunk has a header but no body)
        if self.chunk_count > MAX_CHUNKS:
            raise _BodyError(400, f"Chunked request body exceeds maximum of {MAX_CHUNKS} "
                                  f"non-empty chunks. Send fewer or larger HTTP chunks.")
        if req.body_slot is not None:
            n = len(body)
            view = req.body_slot.view
            if self.received + n > len(view):
                raise _BodyError(400, "request body is longer than its Content-Length")
            view[self.received:self.received + n] = body
            self.received += n
        else:
            self.received += len(body)
            if not req.sized:
                # chunked: its length is known only now (a Content-Length was checked before
                # its body, which the parser never lets run past it)
                err = self.app.check_body_size(req, self.received)
                if err:
                    raise _BodyError(413, err)
            self.chunks.append(body)

    def on_message_complete(self):
        self.started = 0.0
        self.head_seen = 0
        req: HttpRequest = self.request  # type: ignore[assignment]  # on_headers_complete set it
        self.request = None
        if req.body_slot is not None:
            req.body = req.body_slot.view[:self.received]
        elif self.chunks:
            req.body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.queue.append(req)
        self._next()

    # ---- answering -----------------------------------------------------------------------------
    def _next(self):
        """Start the queued requests, one at a time, while the client takes its answers."""
        if self.dispatching:
            return      # an answer given inside app.handle: the loop below goes on
        self.dispatching = True
        try:
            while self.queue and not self.busy and not self.closed and not self._behind():
                req = self.queue.popleft()
                self.busy = True
                self.app.handle(self, req)
        finally:
            self.dispatching = False
        self._flow()

    def _behind(self) -> bool:
        """The client has not taken enough of its answers for another to be made."""
        return self.transport.get_write_buffer_size() > self.limits.write_high_water

    def _flow(self) -> None:
        """Read from the client only while it keeps up: few requests waiting, few answer bytes
        unsent. Otherwise the kernel's buffers fill and TCP slows the client down."""
        if self.closed or self.transport is None:
            return
        hold = len(self.queue) >= self.limits.max_pipelined or self._behind()
        if hold and self.reading:
            self.transport.pause_reading()
            self.reading = False
        elif not hold and not self.reading:
            self.transport.resume_reading()
            self.reading = True
            if self.started:    # a request cut off by the pause: its time runs from now
                self.started = time.monotonic()

    def respond(self, req: HttpRequest, status: int, body: bytes = b"",
                content_type: str = "application/json", headers: tuple = (),
                parts: tuple = ()) -> None:
        """Write one response; ``parts`` are extra body buffers written after ``body``."""
        if not self.closed:
            length = len(body)
            if parts:
                length += sum(map(len, parts))
            head = _STATUS_LINES.get(status) or _status_line(status)
            head += b"Content-Length: %d\r\n" % length
            if content_type:
                head += _CONTENT_TYPES.get(content_type) or \
                    f"Content-Type: {content_type}\r\n".encode("latin-1")
            for k, v in headers:
                head += f"{k}: {v}\r\n".encode("latin-1")
            if not req.keep_alive:
                head += b"Connection: close\r\n"
            t = self.transport
            first = head + b"\r\n" + body
            if length <= SMALL_RESPONSE:
                # one write, one syscall; big parts (shared memory) are written as they are
                t.write(first + b"".join(parts) if parts else first)
            else:
                t.write(first)
                for p in parts:
                    t.write(p)
        self.respond_done(req)

    def respond_done(self, req: HttpRequest) -> None:
        """The answer to ``req`` is written: close if it asked to, else start the next one."""
        if not req.keep_alive and not self.closed:
            self.transport.close()
            self.closed = True
        self.busy = False
        self.last_active = time.monotonic()
        self._next()

    # ---- streamed answers (frontend/http/generate.py) -----------------------------------------------
    def start_stream(self, req: HttpRequest, status: int, content_type: str) -> None:
        """Begin an answer whose body follows in pieces (``send_chunk``, then ``end_stream``):
        chunked for HTTP/1.1, so the connection serves on; up to the close for HTTP/1.0."""
        if not self.closed:
            req.chunked = not req.http10
            req.keep_alive = req.keep_alive and req.chunked
            self.transport.write((f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
                                  f"Content-Type: {content_type}\r\n"
                                  + ("Transfer-Encoding: chunked\r\n" if req.chunked else "")
                                  + ("" if req.keep_alive else "Connection: close\r\n")
                                  + "\r\n").encode("latin-1"))

    def send_chunk(self, req: HttpRequest, data: bytes) -> None:
        if not self.closed and data:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if req.chunked else data)

    def end_stream(self, req: HttpRequest) -> None:
        """The streamed answer is complete: the next pipelined request may start."""
        if not self.closed and req.chunked:
            self.transport.write(b"0\r\n\r\n")
        self.respond_done(req)

    async def writable(self, timeout: float) -> bool:
        """Back-pressure on a streamed answer: at once while at most ``write_high_water`` bytes
        wait for the client, else once it has taken all. False when the connection is gone, or
        the client did not take it within ``timeout`` s (then the connection is aborted)."""
        if self.closed or not self._behind():
            return not self.closed
        drained = asyncio.get_running_loop().create_future()
        self.on_drained.append(lambda: None if drained.done() else drained.set_result(None))
        try:
            await asyncio.wait_for(drained, timeout)
        except asyncio.TimeoutError:
            if not self.closed:
                self.transport.abort()
                self.closed = True
        return not self.closed

    def after_sent(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything written so far has left the process."""
        if self.closed or self.transport.get_write_buffer_size() == 0:
            callback()
        else:
            self.on_drained.append(callback)

    def _drained(self):
        callbacks, self.on_drained = self.on_drained, []
        for cb in callbacks:
            cb()

    def _fail(self, status: int, message: str, linger: bool = True):
        """Answer ``status`` and end the connection. With ``linger``, the client may still be
        sending its request: its bytes are dropped for LINGER_S while the answer reaches it."""
        t = self.transport
        if t is not None and not self.closed:
            body = ('{"error":"%s"}' % message.replace('"', "'")).encode()
            t.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                .encode() + body)
            if linger and t.can_write_eof():
                t.write_eof()           # FIN once the answer is out; reading goes on
                self.lingering = True
                if not self.reading:
                    t.resume_reading()
                    self.reading = True
                asyncio.get_running_loop().call_later(LINGER_S, t.close)
            else:
                t.close()
        self.closed = True
        if self.request is not None and self.request.body_slot is not None:
            self.app.release_body(self.request)
            self.request = None


class _BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def sweep(limits: Limits, now: float) -> None:
    """Close what holds a connection without using it: a request that has not arrived whole in
    time (a slow or stalled client), or a keep-alive connection idle too long."""
    for conn in list(limits.connections):
        if conn.closed:
            limits.connections.discard(conn)
        elif not conn.reading:
            # held by back-pressure. With no request of it running, the client has not taken
            # its answers for that long: abort, as close would wait for them to be sent
            if not conn.busy and now - conn.last_active > limits.idle_timeout_s:
                conn.transport.abort()
                conn.closed = True
        elif conn.started and now - conn.started > limits.request_timeout_s:
            conn._fail(408, f"the request did not arrive within {limits.request_timeout_s:g} s "
                            f"(--http-request-timeout-secs)")
        elif not conn.started and not conn.busy and not conn.queue and \
                now - conn.last_active > limits.idle_timeout_s:
            conn.transport.close()
            conn.closed = True


async def _sweeper(limits: Limits) -> None:
    period = max(0.05, min(1.0, limits.request_timeout_s / 4, limits.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period)
        sweep(limits, time.monotonic())


async def serve(app, host: str, port: int, reuse_port: bool = False,
                limits: Limits | None = None) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    limits = limits or Limits()
    server = await loop.create_server(lambda: HttpConnection(app, limits), host, port,
                                      reuse_port=reuse_port or None, backlog=1024)
    task = loop.create_task(_sweeper(limits))
    _SWEEPERS.add(task)                 # the loop keeps only weak references to tasks
    task.add_done_callback(_SWEEPERS.discard)
    return server


_SWEEPERS: set[asyncio.Task] = set()
