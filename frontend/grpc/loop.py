"""gRPC on the frontend's event loop: HTTP/2 (``http2``) in an asyncio protocol, no gRPC threads.

grpc.aio hands every call across threads before a handler runs (its socket thread, a
completion-queue poller, the loop: docs/performance.md, "gRPC"), which caps a Python gRPC
frontend near 3,000 calls/s at concurrency 1 on the machines measured (bench/grpc_floor.py).
Here the loop reads the socket itself, like the HTTP/1.1 server beside it. The servicers are
grpc_service's, reached through the generic handlers that the generated ``add_*_to_server``
functions build, so both servers run the same handler code.

Flow control: a unary call's bytes are given back as they arrive, a streaming call's when the
handler takes the message, so a client that sends faster than the stream is answered is held by
HTTP/2's window. What a connection may hold beyond that (messages in part, answers its client
does not read, time) is ``grpc/guard.py``'s.
"""
from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from types import SimpleNamespace
from typing import Any

import grpc

from shmserve.frontend.grpc import call as grpc_call
from shmserve.frontend.grpc.answer import END, RESPONSE_HEADERS, Answering, Call
from shmserve.frontend.grpc.call import CallContext, CallError, Compressed, MessageReader
from shmserve.frontend.grpc.guard import GrpcLimits, Holdings, sweeper
from shmserve.frontend.http2 import connection as http2
from shmserve.frontend.http2.frames import Buffer
from shmserve.frontend.tls_accept import TlsAccept

log = logging.getLogger("shmserve.grpc")

STREAM_WINDOW = 8 << 20         # what one stream may send ahead of being read
CONNECTION_WINDOW = 64 << 20
LOCAL_SETTINGS = {
    # calls open at once on one connection (nginx 128, gRPC-go 100): one client cannot fill
    # --max-inflight-requests alone; more are refused (REFUSED_STREAM), and retried by clients
    http2.MAX_CONCURRENT_STREAMS: 256,
    http2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
    # the default: 16 MiB frames carried 4 MiB requests no faster, and pin more memory
    http2.MAX_FRAME_SIZE: 16384,
    # gRPC's own hard limit for metadata: larger blocks cost the loop ms to decode
    http2.MAX_HEADER_LIST_SIZE: 16384,
}
UNSUPPORTED_MEDIA = b"\x00" + http2.encode_int(7, 7) + b":status" + http2.encode_int(3, 7) + b"415"
_KEEPALIVE_PING = b"shmkeepa"
# the grpc.aio channel options the loop server implements (engine/launch/compat_flags.py sets them)
OPTIONS = frozenset(("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
                     "grpc.keepalive_permit_without_calls", "grpc.max_connection_age_ms",
                     "grpc.max_connection_age_grace_ms"))


class Keepalive:
    """Server-side keep-alive and connection age, as gRPC's channel options mean them: a PING
    every ``time_s`` (while calls are open, or always when ``without_calls``), the connection
    closed when its ACK is ``timeout_s`` late; GOAWAY once the connection is ``max_age_s`` old
    (±10%, so that clients do not all reconnect at once), closed ``grace_s`` later."""

    def __init__(self, options: dict[str, int]):
        ms = options.get
        self.time_s = ms("grpc.keepalive_time_ms", 0) / 1000
        self.timeout_s = ms("grpc.keepalive_timeout_ms", 20_000) / 1000
        self.without_calls = bool(ms("grpc.keepalive_permit_without_calls", 0))
        self.max_age_s = ms("grpc.max_connection_age_ms", 0) / 1000
        self.grace_s = ms("grpc.max_connection_age_grace_ms", 0) / 1000


class GrpcLoopServer:
    def __init__(self, generic_handlers, max_message: int, options: dict[str, int] | None = None,
                 now: dict | None = None, limits: GrpcLimits | None = None):
        self.generic_handlers = list(generic_handlers)
        # unary methods served by a callback rather than a task, by path: ``now(request, call,
        # answer)`` starts the call and arranges ``answer(call, response, error)`` (the
        # servicer's model_infer_now); the generic handler still says how to (de)serialize
        self.now = dict(now or {})
        self.max_message = max_message
        self.keepalive = Keepalive(options or {})
        self.limits = limits or GrpcLimits()
        self.holdings = Holdings(max_message)
        self.sweeper: asyncio.Task | None = None
        self.methods: dict[bytes, object] = {}
        self.connections: set[Connection] = set()
        self.server: asyncio.AbstractServer | None = None

    def method(self, path: bytes):
        handler = self.methods.get(path)
        if handler is None:
            details = SimpleNamespace(method=path.decode("latin-1"), invocation_metadata=())
            for generic in self.generic_handlers:
                handler = generic.service(details)
                if handler is not None:
                    self.methods[path] = handler
                    break
        return handler

    async def start(self, host: str, port: int, reuse_port: bool = False,
                    tls: ssl.SSLContext | None = None) -> int:
        loop = asyncio.get_running_loop()
        if tls is None:
            def factory() -> asyncio.Protocol:
                return Connection(self)
        else:       # the handshake is ours, to count and time it (tls_accept)
            def factory() -> asyncio.Protocol:
                return TlsAccept(lambda: Connection(self), tls, self.limits.budget,
                                 self.limits.handshake_s)
        self.server = await loop.create_server(factory, host or None, port,
                                               reuse_port=reuse_port or None, backlog=1024)
        self.sweeper = loop.create_task(sweeper(self.connections, self.limits))
        server: Any = self.server       # (uvloop's sockets are a list, not the tuple typed)
        return int(server.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None = None) -> None:
        """Stops listening, tells every client with GOAWAY, lets calls run ``grace`` seconds."""
        if self.server is not None:
            self.server.close()
        if self.sweeper is not None:
            self.sweeper.cancel()
        for conn in list(self.connections):
            conn.go_away()
        deadline = time.monotonic() + (grace or 0.0)
        while any(c.calls for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()


class Connection(Answering, asyncio.Protocol):
    """One gRPC connection: the HTTP/2 core's calls, its calls' answers (``Answering``) and its
    limits (``Guard``), compiled as one class."""

    def __init__(self, server: GrpcLoopServer):
        self.server = server
        self.core = http2.Http2Server(self, LOCAL_SETTINGS, CONNECTION_WINDOW)
        self.transport = None
        self.calls = {}
        self.peer = ""
        self.window = asyncio.Event()       # set when the peer opens a flow-control window
        self.closing = False
        # the next keep-alive ping, or (ping_sent) the deadline of the one sent: one at a time,
        # so a connection open for days holds one handle, not one per ping
        self.ping_timer: asyncio.TimerHandle | None = None
        self.ping_sent = False
        self.age_timer: asyncio.TimerHandle | None = None     # GOAWAY at max age, then close
        self._guard_init()

    # ---- transport ------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = grpc_call.peer_name(transport.get_extra_info("peername"))
        if not self.admit(transport):
            return
        self.server.connections.add(self)
        self.flush()
        ka, loop = self.server.keepalive, asyncio.get_running_loop()
        if ka.time_s > 0:
            self.ping_timer = loop.call_later(ka.time_s, self.keepalive)
        if ka.max_age_s > 0:
            age = ka.max_age_s * random.uniform(0.9, 1.1)
            self.age_timer = loop.call_later(age, self.age_out)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.released()
        self.closing = True
        self.transport = None
        for timer in (self.ping_timer, self.age_timer):
            if timer is not None:
                timer.cancel()
        for call in list(self.calls.values()):
            self.abandon(call)
        self.window.set()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.lingered_on(data)
            return
        self.received += len(data)
        try:
            self.core.receive(data)
        except http2.ConnectionError_ as e:
            log.debug("HTTP/2 error from %s: %s", self.peer, e)
            self.core.go_away(e.code, str(e))
            self.flush()
            self.close()
            return
        self.flush()
        if self.core.more:
            # the core decoded its share of header blocks for this turn: the rest of the read
            # waits for the next one, and nothing more is read meanwhile
            self.yielded = True
            self._flow()
            asyncio.get_running_loop().call_soon(self._go_on)

    def _go_on(self) -> None:
        if self.transport is None:
            return
        self.yielded = False
        self.data_received(b"")
        if not self.yielded:
            self._flow()

    def flush(self) -> None:
        out = self.core.out
        if out and self.transport is not None and not self.lingering:
            self.transport.write(self.core.take())

    def go_away(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.core.go_away()
            self.flush()
            if not self.calls:
                self.close()

    # ---- keep-alive and connection age ----------------------------------------------------------
    def keepalive(self) -> None:
        ka, loop = self.server.keepalive, asyncio.get_running_loop()
        if self.transport is None:
            return
        if self.calls or ka.without_calls:
            self.core.ping(_KEEPALIVE_PING)
            self.flush()
            self.ping_sent = True
            self.ping_timer = loop.call_later(ka.timeout_s, self.ping_unanswered)
        else:
            self.ping_timer = loop.call_later(ka.time_s, self.keepalive)

    def ping_acked(self, payload: bytes) -> None:
        if payload == _KEEPALIVE_PING and self.ping_sent and self.ping_timer is not None:
            self.ping_sent = False
            self.ping_timer.cancel()
            self.ping_timer = asyncio.get_running_loop().call_later(
                self.server.keepalive.time_s, self.keepalive)

    def ping_unanswered(self) -> None:
        log.info("gRPC client %s did not answer a keep-alive ping: closing", self.peer)
        self.ping_sent = False
        self.ping_timer = None
        self.core.go_away(http2.NO_ERROR, "keepalive watchdog timeout")
        self.flush()
        self.close()

    def age_out(self) -> None:
        self.go_away()
        grace = self.server.keepalive.grace_s
        if grace > 0:
            self.age_timer = asyncio.get_running_loop().call_later(grace, self.close)

    # ---- the HTTP/2 core's calls ----------------------------------------------------------------
    def window_opened(self) -> None:
        self.window.set()

    def peer_going_away(self) -> None:
        self.closing = True
        if not self.calls:
            self.close()

    def stream_reset(self, sid: int) -> None:
        call = self.calls.get(sid)
        if call is not None:
            self.abandon(call)

    # ---- calls ----------------------------------------------------------------------------------
    def stream_headers(self, sid: int, headers: Any, end_stream: bool) -> None:
        if self.refused:            # the budget had no room for this connection (Guard.admit)
            self.refuse_stream(sid, headers, end_stream)
            return
        path = content_type = encoding = timeout = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-timeout":
                timeout = value
        if not content_type.startswith(b"application/grpc"):
            self.core.send_headers(sid, UNSUPPORTED_MEDIA, end_stream=True)
            return
        holdings = self.holdings
        if holdings.total > holdings.refuse_at:     # the client may retry it (nothing ran)
            self.core.reset(sid, http2.REFUSED_STREAM)
            return
        seconds = grpc_call.timeout_seconds(timeout) if timeout else None
        deadline = None if seconds is None else time.monotonic() + seconds
        handler = self.server.method(path)
        call = Call(sid, handler, CallContext(headers, self.peer, deadline),
                    MessageReader(self.server.max_message, encoding))
        self.calls[sid] = call
        if handler is None:
            self.finish(call, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        if seconds is not None:
            call.timer = asyncio.get_running_loop().call_later(seconds, self.expire, call)
        if not handler.request_streaming and not handler.response_streaming:
            call.now = self.server.now.get(path)
        if handler.request_streaming:
            call.queue = asyncio.Queue()
            call.task = asyncio.ensure_future(self.run(call))
            if end_stream:
                call.queue.put_nowait((END, 0))
        elif end_stream:
            self.fail(call, grpc.StatusCode.INTERNAL, "a unary call ended without a request")

    def refuse_stream(self, sid: int, headers: Any, end_stream: bool) -> None:
        """The one call of a connection the budget had no room for (grpc_guard.admit)."""
        self.core.send_headers(sid, RESPONSE_HEADERS + grpc_call.trailers(
            grpc.StatusCode.UNAVAILABLE, self.refused), end_stream=True)
        self.end(self.refused, http2.ENHANCE_YOUR_CALM)

    def stream_data(self, sid: int, data: Buffer, length: int, end: bool) -> None:
        call = self.calls.get(sid)
        if call is None or call.done:
            self.core.ack(sid, length)
            return
        reader = call.reader
        try:
            messages = reader.feed(data) if data else ()
        except CallError as e:
            self.core.ack(sid, length)
            self.fail(call, e.code, e.details)
            return
        if reader.buffer or call.partial:       # a message in part (grpc_guard's share)
            length = self.in_part(call, length)
            if call.done:
                self.core.ack(sid, length)
                return
        if call.queue is None:
            self.core.ack(sid, length)
            if messages:
                if call.task is not None or call.started:
                    return      # gRPC's servers read a unary call's first message only
                message = messages[0]
                if call.now is not None and not isinstance(message, Compressed):
                    call.started = True
                    call.request = message          # run at the end of the stream (below)
                else:
                    call.task = asyncio.ensure_future(self.run(call, message))
            if end and call.request is not None:
                # a callback handler starts its request only once the call is whole: it is
                # not cancelled as easily as a task that has not run yet
                self.run_now(call, call.request)
                call.request = None
            elif end and call.task is None and not call.started:
                self.fail(call, grpc.StatusCode.INTERNAL,
                          "the stream ended inside a message" if call.reader.pending()
                          else "a unary call ended without a request")
            return
        # a streaming call: the window reopens as the handler takes each message
        if messages:
            # held until the handler takes them (grpc_guard)
            if not self.count(call, sum(map(len, messages))):
                self.core.ack(0, length)
                return
            last = len(messages) - 1
            for i, message in enumerate(messages):
                call.queue.put_nowait((message, length if i == last else 0))
        elif length:
            call.queue.put_nowait((None, length))
        if end:
            if call.reader.pending():
                self.fail(call, grpc.StatusCode.INTERNAL, "the stream ended inside a message")
            else:
                call.queue.put_nowait((END, 0))
