"""Running one gRPC call of the loop server (``grpc/loop.py``) and writing its answer: the handler
on the request (a unary call's message, or a streaming call's queue), the answer's messages as
the peer's windows and the transport allow, the status that ends the call. ``Answering`` is a
part of ``grpc_loop.Connection``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import grpc
from google.protobuf.message import Message as pb_message

from shmserve.frontend.grpc import call as grpc_call
from shmserve.frontend.grpc.call import CallContext, CallError, Compressed, MessageReader, failure_status
from shmserve.frontend.grpc.guard import WRITE_CHUNK, Guard
from shmserve.frontend.http2 import connection as http2
from shmserve.ipc import logs
from shmserve.ipc.compiled import trait

log = logging.getLogger("shmserve.grpc")

# literal fields, no dynamic table: the same bytes for every answer
RESPONSE_HEADERS = (b"\x88"                                  # :status 200 (static index 8)
                    + http2.encode_literal(b"content-type", b"application/grpc")
                    + http2.encode_literal(b"grpc-accept-encoding", grpc_call.ACCEPT_ENCODING))
_OK = grpc_call.trailers(grpc.StatusCode.OK)
END = object()             # a streaming call's queue: the client ended its requests


class Call:
    """One call of a connection: its stream, its handler and what it holds."""

    def __init__(self, stream_id: int, handler: Any, context: CallContext,
                 reader: MessageReader):
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
        self.request: bytes | bytearray | None = None
        self.cancel: Callable[[], None] | None = None  # what stops a callback-handled call's request if it ends first
        # grpc_guard's accounts: bytes held (a message in part, a stream's messages not yet
        # taken), the part's size, window owed to the call, when the part began
        self.held = 0
        self.partial = 0
        self.owed = 0
        self.since_ns = 0


class CallRequests:
    """A streaming call's requests as its handler reads them (``async for``): each message
    taken gives its share of the window back. (An iterator class, not an async generator:
    mypyc compiles the one, not the other.)"""

    def __init__(self, conn: Answering, call: Call):
        self.conn, self.call = conn, call
        self.deserialize = call.handler.request_deserializer
        self.ended = False

    def __aiter__(self) -> CallRequests:
        return self

    async def __anext__(self) -> Any:
        conn, call = self.conn, self.call
        queue = call.queue
        assert queue is not None
        while not self.ended:
            message, share = await queue.get()
            if share:
                conn.core.ack(call.stream_id, share)
                conn.flush()
            if message is END:
                self.ended = True
            elif message is not None:
                conn.count(call, -len(message))     # taken: no longer held
                if isinstance(message, Compressed):
                    message = await grpc_call.inflate(message, conn.server.max_message)
                return self.deserialize(message)
        raise StopAsyncIteration


@trait
class Answering(Guard):
    """The calls' half of ``grpc_loop.Connection`` (a trait: compiled, its methods are the
    connection's own); the limits it answers within are ``Guard``'s."""

    closing: bool

    async def run(self, call: Call, message: bytes | bytearray | Compressed | None = None) -> None:
        """Runs the call's handler on ``message`` (a unary request) or on the stream's requests,
        writes what it answers, and ends the call with its status."""
        handler = call.handler
        try:
            if isinstance(message, Compressed):
                message = await grpc_call.inflate(message, self.server.max_message)
            if message is not None:
                request = handler.request_deserializer(message)
            else:
                request = CallRequests(self, call)
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

    def run_now(self, call: Call, message: bytes | bytearray) -> None:
        """A unary call whose method has a callback handler: started here, no task."""
        now = call.now
        assert now is not None
        try:
            now(call.handler.request_deserializer(message), call, self.answer)
        except Exception as e:
            self.answer(call, None, e)

    def answer(self, call: Call, response: Any, error: BaseException | None) -> None:
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
        if len(payload) >= WRITE_CHUNK or self.write_paused:
            # a large answer, or one to a client that is behind, goes out as it reads
            call.task = asyncio.ensure_future(self._answer_rest(call, payload))
            return
        data = grpc_call.frame(payload)
        sent = core.send_data(sid, data)
        if sent == len(data):
            self.finish(call, grpc.StatusCode.OK)
        else:       # the peer's window is short of it: the rest waits for it in a task
            call.task = asyncio.ensure_future(self._answer_rest(call, data[sent:], framed=True))

    async def _answer_rest(self, call: Call, data: bytes, framed: bool = False) -> None:
        try:
            if framed:
                await self._send_data(call, data)
            else:
                await self._send_payload(call, data)
        except asyncio.CancelledError:
            return
        self.finish(call, grpc.StatusCode.OK)

    def serialize(self, call: Call, response: Any) -> bytes:
        payload = call.handler.response_serializer(response)
        if len(payload) > self.server.max_message:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Sent message larger than max ({len(payload)} vs. "
                            f"{self.server.max_message})")
        return payload

    async def send_message(self, call: Call, payload: bytes, flush: bool = True) -> None:
        if call.done:
            raise asyncio.CancelledError
        core, sid = self.core, call.stream_id
        if not call.sent_headers:
            call.sent_headers = True
            core.send_headers(sid, RESPONSE_HEADERS)
        if len(payload) < WRITE_CHUNK and not self.write_paused:     # the usual case, inline
            data = grpc_call.frame(payload)
            sent = core.send_data(sid, data)
            if sent != len(data):
                await self._send_data(call, data[sent:] if sent else data)
        else:
            await self._send_payload(call, payload)
        if flush:
            self.flush()

    async def _send_payload(self, call: Call, payload: bytes) -> None:
        """One message: framed in a copy when small, its prefix apart when large (the copy of
        a large message would double what it holds)."""
        if len(payload) < WRITE_CHUNK:
            await self._send_data(call, grpc_call.frame(payload))
        else:
            await self._send_data(call, grpc_call.frame_prefix(len(payload)))
            await self._send_data(call, payload)

    async def _send_data(self, call: Call, data: bytes) -> None:
        """Sends ``data`` on the call's stream as the peer's windows allow, WRITE_CHUNK bytes at
        a time while the client reads what is written (grpc_guard)."""
        core, sid = self.core, call.stream_id
        view = memoryview(data)
        while True:
            # send_data copies from any buffer: the view's slices copy nothing
            sent = 0 if self.write_paused else core.send_data(sid, view[:WRITE_CHUNK])
            if sent:
                view = view[sent:]
                if not view:
                    return
                self.flush()
                continue
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
        if call.held or call.owed or call.queue is not None:
            self.release(call)
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if self.closing and not self.calls and self.transport is not None:
            asyncio.get_running_loop().call_soon(self.close)
