"""gRPC on the frontend's event loop: HTTP/2 (``http2``) in an asyncio protocol, no gRPC threads.

grpc.aio hands every call across threads before a handler runs (its socket thread, a
completion-queue poller, the loop: docs/performance.md, "gRPC"), which caps a Python gRPC
frontend near 3,000 calls/s at concurrency 1 on the machines measured (bench/grpc_floor.py).
Here the loop reads the socket itself, like the HTTP/1.1 server beside it. The servicers are
grpc_service's, reached through the generic handlers that the generated ``add_*_to_server``
functions build, so both servers run the same handler code.

Flow control: a unary call's bytes are given back as they arrive (a message is bounded by
``max_message``); a streaming call's only when the handler takes the message, so a client that
sends faster than the stream is answered is held by HTTP/2's window.
"""
from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from types import SimpleNamespace
from typing import Callable

import grpc
from google.protobuf.message import Message as pb_message

from shmserve.ipc import logs

from . import grpc_call, http2
from .grpc_call import CallContext, CallError, MessageReader, failure_status

log = logging.getLogger("shmserve.grpc")

STREAM_WINDOW = 8 << 20         # what one stream may send ahead of being read
CONNECTION_WINDOW = 64 << 20
LOCAL_SETTINGS = {
    http2.MAX_CONCURRENT_STREAMS: 1 << 16,       # calls open at once on one connection
    http2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
    http2.MAX_FRAME_SIZE: (1 << 24) - 1,
    http2.MAX_HEADER_LIST_SIZE: 1 << 16,
}
# literal fields, no dynamic table: the same bytes for every answer
RESPONSE_HEADERS = (b"\x88"                                  # :status 200 (static index 8)
                    + http2.encode_literal(b"content-type", b"application/grpc")
                    + http2.encode_literal(b"grpc-accept-encoding", grpc_call.ACCEPT_ENCODING))
UNSUPPORTED_MEDIA = b"\x00" + http2.encode_int(7, 7) + b":status" + http2.encode_int(3, 7) + b"415"
_OK = grpc_call.trailers(grpc.StatusCode.OK)
_END = object()
_KEEPALIVE_PING = b"shmkeepa"
# the grpc.aio channel options the loop server implements (engine/compat_flags.py sets them)
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
                 now: dict | None = None):
        self.generic_handlers = list(generic_handlers)
        # unary methods served by a callback rather than a task, by path: ``now(request, call,
        # answer)`` starts the call and arranges ``answer(call, response, error)`` (the
        # servicer's model_infer_now); the generic handler still says how to (de)serialize
        self.now = dict(now or {})
        self.max_message = max_message
        self.keepalive = Keepalive(options or {})
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
        self.server = await loop.create_server(lambda: Connection(self), host or None, port,
                                               reuse_port=reuse_port or None, backlog=1024,
                                               ssl=tls)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self, grace: float | None = None) -> None:
        """Stops listening, tells every client with GOAWAY, lets calls run ``grace`` seconds."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.go_away()
        deadline = time.monotonic() + (grace or 0.0)
        while any(c.calls for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()


class Call:
    __slots__ = ("stream_id", "handler", "context", "reader", "task", "queue", "timer",
                 "done", "sent_headers", "now", "started", "request", "cancel")

    def __init__(self, stream_id: int, handler, context: CallContext, reader: MessageReader):
        self.stream_id = stream_id
        self.handler = handler
        self.context = context
        self.reader = reader
        self.task: asyncio.Task | None = None
        self.queue: asyncio.Queue | None = None     # a streaming call's requests
        self.timer: asyncio.TimerHandle | None = None
        self.done = False
        self.sent_headers = False
        self.now: Callable | None = None   # the method's callback handler (GrpcLoopServer.now), if any
        self.started = False    # its request came (``request`` until the stream ends)
        self.request: bytes | None = None
        self.cancel: Callable[[], None] | None = None  # what stops a callback-handled call's request if it ends first


class Connection(asyncio.Protocol):
    def __init__(self, server: GrpcLoopServer):
        self.server = server
        self.core = http2.Http2Server(self, LOCAL_SETTINGS, CONNECTION_WINDOW)
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.peer = ""
        self.window = asyncio.Event()       # set when the peer opens a flow-control window
        self.closing = False
        # the next keep-alive ping, or (ping_sent) the deadline of the one sent: one at a time,
        # so a connection open for days holds one handle, not one per ping
        self.ping_timer: asyncio.TimerHandle | None = None
        self.ping_sent = False
        self.age_timer: asyncio.TimerHandle | None = None     # GOAWAY at max age, then close

    # ---- transport ------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = grpc_call.peer_name(transport.get_extra_info("peername"))
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
        self.closing = True
        self.transport = None
        for timer in (self.ping_timer, self.age_timer):
            if timer is not None:
                timer.cancel()
        for call in list(self.calls.values()):
            self.abandon(call)
        self.window.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.core.receive(data)
        except http2.ConnectionError_ as e:
            log.debug("HTTP/2 error from %s: %s", self.peer, e)
            self.core.go_away(e.code, str(e))
            self.flush()
            self.close()
            return
        self.flush()

    def flush(self) -> None:
        out = self.core.out
        if out and self.transport is not None:
            self.transport.write(self.core.take())

    def go_away(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.core.go_away()
            self.flush()
            if not self.calls:
                self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

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
    def stream_headers(self, sid: int, headers, end_stream: bool) -> None:
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
                call.queue.put_nowait((_END, 0))
        elif end_stream:
            self.fail(call, grpc.StatusCode.INTERNAL, "a unary call ended without a request")

    def stream_data(self, sid: int, data: bytes, length: int, end: bool) -> None:
        call = self.calls.get(sid)
        if call is None or call.done:
            self.core.ack(sid, length)
            return
        try:
            messages = call.reader.feed(data) if data else ()
        except CallError as e:
            self.core.ack(sid, length)
            self.fail(call, e.code, e.details)
            return
        if call.queue is None:
            self.core.ack(sid, length)
            if messages:
                if call.task is not None or call.started:
                    return      # gRPC's servers read a unary call's first message only
                if call.now is not None:
                    call.started = True
                    call.request = messages[0]      # run at the end of the stream (below)
                else:
                    call.task = asyncio.ensure_future(self.run(call, messages[0]))
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
        last = len(messages) - 1
        for i, message in enumerate(messages):
            call.queue.put_nowait((message, length if i == last else 0))
        if not messages and length:
            call.queue.put_nowait((None, length))
        if end:
            if call.reader.pending():
                self.fail(call, grpc.StatusCode.INTERNAL, "the stream ended inside a message")
            else:
                call.queue.put_nowait((_END, 0))

    async def run(self, call: Call, message: bytes | None = None) -> None:
        """Runs the call's handler on ``message`` (a unary request) or on the stream's requests,
        writes what it answers, and ends the call with its status."""
        handler = call.handler
        try:
            if message is not None:
                request = handler.request_deserializer(message)
            else:
                request = self.requests(call)
            if handler.response_streaming:
                method = handler.stream_stream if handler.request_streaming \
                    else handler.unary_stream
                responses = method(request, call.context)
                if hasattr(responses, "__aiter__"):
                    async for response in responses:
                        await self.send_message(call, self.serialize(call, response))
                else:
                    for response in responses:
                        await self.send_message(call, self.serialize(call, response))
            else:
                method = handler.stream_unary if handler.request_streaming \
                    else handler.unary_unary
                response = method(request, call.context)
                if not isinstance(response, pb_message):
                    response = await response
                await self.send_message(call, self.serialize(call, response), flush=False)
        except asyncio.CancelledError:
            return
        except Exception as e:
            code, details = failure_status(e, call.context)
            if log.isEnabledFor(logging.DEBUG):     # --log-verbose: each failed call
                logs.written_before_answer(log, "gRPC call failed: %s: %s", code.name, details)
            self.finish(call, code, details)
            return
        self.finish(call, grpc.StatusCode.OK)

    def run_now(self, call: Call, message: bytes) -> None:
        """A unary call whose method has a callback handler: started here, no task."""
        now = call.now
        assert now is not None
        try:
            now(call.handler.request_deserializer(message), call, self.answer)
        except Exception as e:
            self.answer(call, None, e)

    def answer(self, call: Call, response, error: BaseException | None) -> None:
        """A callback handler's answer: the response, or the exception that ends the call
        (with the status ``run`` would give it)."""
        call.cancel = None
        if call.done:
            return
        if error is None:
            try:
                payload = self.serialize(call, response)
            except CallError as e:
                error = e
        if error is not None:
            code, details = failure_status(error, call.context)
            if log.isEnabledFor(logging.DEBUG):
                logs.written_before_answer(log, "gRPC call failed: %s: %s", code.name, details)
            self.finish(call, code, details)
            return
        core, sid = self.core, call.stream_id
        call.sent_headers = True
        core.send_headers(sid, RESPONSE_HEADERS)
        data = grpc_call.frame(payload)
        sent = core.send_data(sid, data)
        if sent == len(data):
            self.finish(call, grpc.StatusCode.OK)
        else:       # the peer's window is short of it: the rest waits for it in a task
            call.task = asyncio.ensure_future(self._answer_rest(call, data[sent:]))

    async def _answer_rest(self, call: Call, data: bytes) -> None:
        try:
            await self._send_data(call, data)
        except asyncio.CancelledError:
            return
        self.finish(call, grpc.StatusCode.OK)

    def serialize(self, call: Call, response) -> bytes:
        payload = call.handler.response_serializer(response)
        if len(payload) > self.server.max_message:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Sent message larger than max ({len(payload)} vs. "
                            f"{self.server.max_message})")
        return payload

    async def requests(self, call: Call):
        queue = call.queue
        assert queue is not None
        deserialize = call.handler.request_deserializer
        while True:
            message, share = await queue.get()
            if share:
                self.core.ack(call.stream_id, share)
                self.flush()
            if message is _END:
                return
            if message is not None:
                yield deserialize(message)

    async def send_message(self, call: Call, payload: bytes, flush: bool = True) -> None:
        if call.done:
            raise asyncio.CancelledError
        core, sid = self.core, call.stream_id
        if not call.sent_headers:
            call.sent_headers = True
            core.send_headers(sid, RESPONSE_HEADERS)
        await self._send_data(call, grpc_call.frame(payload))
        if flush:
            self.flush()

    async def _send_data(self, call: Call, data: bytes) -> None:
        """Sends ``data`` on the call's stream as the peer's windows allow."""
        core, sid = self.core, call.stream_id
        while True:
            sent = core.send_data(sid, data)
            if sent == len(data):
                return
            data = data[sent:]
            self.flush()
            self.window.clear()
            await self.window.wait()
            if call.done:
                raise asyncio.CancelledError

    def finish(self, call: Call, code: grpc.StatusCode, details: str = "") -> None:
        """Ends the call with its status (trailers, or headers and trailers in one frame)."""
        if call.done:
            return
        call.done = True
        self._forget(call)
        block = grpc_call.trailers(code, details) if code is not grpc.StatusCode.OK or details \
            else _OK
        if not call.sent_headers:
            block = RESPONSE_HEADERS + block
        self.core.send_headers(call.stream_id, block, end_stream=True)
        self.flush()

    def fail(self, call: Call, code: grpc.StatusCode, details: str) -> None:
        if call.task is not None:
            call.task.cancel()
        self._stop(call)
        self.finish(call, code, details)

    def expire(self, call: Call) -> None:
        call.timer = None
        self.fail(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def abandon(self, call: Call) -> None:
        """The client reset the stream or went away: stop the handler, answer nothing."""
        if log.isEnabledFor(logging.DEBUG):     # Triton's verbose line for it
            log.debug("Cancellation notification received for stream %d", call.stream_id)
        call.done = True
        call.context.cancelled_ = True
        self._forget(call)
        if call.task is not None:
            call.task.cancel()
        self._stop(call)

    @staticmethod
    def _stop(call: Call) -> None:
        """A callback-handled call ended before its answer: its request is dropped."""
        cancel, call.cancel = call.cancel, None
        if cancel is not None:
            cancel()

    def _forget(self, call: Call) -> None:
        self.calls.pop(call.stream_id, None)
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if self.closing and not self.calls and self.transport is not None:
            asyncio.get_running_loop().call_soon(self.close)
