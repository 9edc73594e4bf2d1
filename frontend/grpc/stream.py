"""One ``ModelStreamInfer`` call: many requests on a bidirectional stream, answered as Triton
answers them.

- A model with one answer per request: answers are written in request order.
- A decoupled model: each answer is written as soon as it is made, between the others; the
  request ends with its FINAL answer, or with no message at all when the model ends it without
  one, unless the request asked for ``triton_enable_empty_final_response`` (then an empty
  answer marks the end).
- Every answer carries ``triton_final_response`` (whether it is the request's last).
- An error is an ``error_message`` on the stream, which stays open; with the header
  ``triton_grpc_error: true`` a failed answer instead ends the stream with its gRPC status
  (after the answers before it), while a refused request (``Refused``: unknown model, bad
  inputs) is still a message, as in Triton.
- At most ``max_inflight`` requests of a stream run or wait to be written at once: a client
  that sends without reading stops being read from (HTTP/2 flow control then holds it).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable

from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests import prepare as request
from shmserve.frontend.answer_stream import infer_stream
from shmserve.frontend.grpc import codec as grpc_codec
from shmserve.frontend.grpc.status import grpc_status
from shmserve.frontend.service import FrontendService
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode

log = logging.getLogger("shmserve.grpc")

_END = object()                 # the reader has read the last request


class Refused(InferError):
    """An InferError raised before the request was submitted (unknown model, bad inputs): the
    request was refused, as opposed to its answer failing. On a stream in Triton's
    ``triton_grpc_error`` mode the first still goes back as a message; the second ends it."""


def build_response(svc: FrontendService, result, prepared,
                   max_message: int) -> pb.ModelInferResponse:
    """An answer as a gRPC message: refused before it is built (a copy of every output byte)
    when it cannot fit one, with the code grpc gives a request past the limit."""
    views = svc.outputs(result, prepared)
    size = sum(len(b) for b in views if b is not None)
    if size > max_message:
        raise InferError(ErrorCode.RESOURCE_EXHAUSTED, (
            f"the response of model '{result.model}' holds {size} bytes of outputs, more than "
            f"a gRPC message may carry ({max_message} bytes, --grpc-max-message-size); ask for "
            f"fewer outputs or use shared memory"))
    return grpc_codec.build_response(result, prepared, views)


def _final_param(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


class StreamSession:
    def __init__(self, service: FrontendService, context, error_mode: bool, max_inflight: int,
                 start: Callable[..., Callable[[], None]],
                 max_message: int, forwarded: dict[str, str] | None = None):
        self.service = service
        self.forwarded = forwarded      # the stream's metadata that becomes parameters
        self.context = context
        self.error_mode = error_mode
        self.slots = asyncio.Semaphore(max_inflight)
        # one request, one answer, from a callback (InferenceService.start_infer)
        self.start = start
        self.max_message = max_message
        # (response or None, final, error to end the stream with or None)
        self.out: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        # the one-answer requests not yet answered or not yet passed on, in request order:
        # [request, its item once answered, what drops it until then]; answers go out in order
        self.waiting: deque[list] = deque()

    async def run(self, request_iterator):
        reader = asyncio.ensure_future(self.read(request_iterator))
        open_requests, reading = 0, True
        try:
            while reading or open_requests:
                item = await self.out.get()
                if item is _END:
                    reading = False
                    continue
                if isinstance(item, int):
                    open_requests += item       # the reader took one more request
                    continue
                response, final, failure = item
                if failure is not None:
                    await self.context.abort(grpc_status(failure.code), failure.message)
                if response is not None:
                    yield response
                if final:
                    open_requests -= 1
                    self.slots.release()        # written (or at least handed to the transport)
            await reader
        finally:
            reader.cancel()
            for task in self.tasks:     # the stream ended early: drop what it still runs
                task.cancel()
            # (a copy: a cancel may answer at once, which takes the slot off ``waiting``: a
            # request still held for its leased worker is answered as cancelled right there)
            for slot in list(self.waiting):
                cancel, slot[2] = slot[2], None
                if cancel is not None:
                    cancel()

    async def read(self, request_iterator):
        async for req in request_iterator:
            await self.slots.acquire()
            self.out.put_nowait(1)
            refusal: Refused | None
            try:
                view, version = self.service.infer_target(req.model_name, req.model_version)
            except InferError as e:
                view, version, refusal = None, 0, Refused(e.code, e.message)
            else:
                refusal = None
            if view is not None and view.decoupled:
                task = asyncio.ensure_future(self.streamed(req, view, version))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            else:
                self.ordered(req, refusal)
        self.out.put_nowait(_END)

    def _failed(self, req: pb.ModelInferRequest, e: InferError) -> tuple:
        if isinstance(e, Refused):      # as Triton: the request's id, to tell which it was
            return (pb.ModelStreamInferResponse(error_message=e.message, infer_response=pb.
                                                ModelInferResponse(id=req.id)), True, None)
        if self.error_mode:
            return None, True, e
        response = pb.ModelInferResponse(id=req.id, model_name=req.model_name,
                                         model_version=req.model_version)
        _final_param(response, True)
        return pb.ModelStreamInferResponse(error_message=e.message,
                                           infer_response=response), True, None

    def ordered(self, req: pb.ModelInferRequest, refusal: Refused | None) -> None:
        """A request with one answer: submitted now, answered from a callback (no task)."""
        slot: list = [req, None, None]
        self.waiting.append(slot)
        if refusal is not None:
            self._answered(slot, None, refusal)
            return
        try:
            slot[2] = self.start(req, lambda r, e: self._answered(slot, r, e))
        except Exception as e:      # noqa: BLE001 - refused (or a bug): one answer says so
            self._answered(slot, None, e)

    def _answered(self, slot: list, response, error: BaseException | None) -> None:
        slot[2] = None
        req = slot[0]
        if error is None:
            slot[1] = (pb.ModelStreamInferResponse(infer_response=_final_param(response, True)),
                       True, None)
        elif isinstance(error, InferError):
            slot[1] = self._failed(req, error)
        else:                       # a bug must cost one request, not the stream
            log.error("error answering a ModelStreamInfer request", exc_info=error)
            slot[1] = self._failed(req, InferError(
                ErrorCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"))
        waiting = self.waiting
        while waiting and waiting[0][1] is not None:
            self.out.put_nowait(waiting.popleft()[1])

    async def streamed(self, req: pb.ModelInferRequest, view, version: int) -> None:
        """A decoupled model's request: each answer goes out as it comes."""
        svc = self.service
        try:
            prepared = grpc_codec.parse_infer(view, req, svc.arena,
                                              svc.registry.for_peer(self.context.peer()),
                                              svc.limits, self.forwarded)
        except InferError as e:
            self.out.put_nowait(self._failed(req, Refused(e.code, e.message)))
            return
        empty_final = req.parameters["triton_enable_empty_final_response"].bool_param \
            if "triton_enable_empty_final_response" in req.parameters else False
        final = False
        try:
            async for result in infer_stream(svc, view, version, prepared):
                final = result.final
                self.out.put_nowait(self._answer(req, prepared, result, empty_final))
        except Exception as e:
            if not final:
                log.exception("error streaming the answers of a ModelStreamInfer request")
                self.out.put_nowait(self._failed(req, InferError(
                    ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")))

    def _answer(self, req, prepared, result, empty_final: bool) -> tuple:
        svc = self.service
        refs = request.worker_slots(result, prepared)
        try:
            if result.no_response:
                if not empty_final:
                    return None, True, None
                response = pb.ModelInferResponse(id=req.id, model_name=req.model_name,
                                                 model_version=req.model_version)
            else:
                response = build_response(svc, result, prepared, self.max_message)
            _final_param(response, result.final)
            return pb.ModelStreamInferResponse(infer_response=response), result.final, None
        except InferError as e:
            if self.error_mode:
                return None, True, e
            response = pb.ModelInferResponse(id=req.id, model_name=req.model_name,
                                             model_version=req.model_version)
            _final_param(response, result.final)
            return (pb.ModelStreamInferResponse(error_message=e.message, infer_response=response),
                    result.final, None)
        finally:
            svc.release_outputs(result, refs)
