"""A ModelStreamInfer session (frontend/grpc/stream.py) in-process: what it does with the
requests still unanswered when the stream ends early."""
import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from shmserve.frontend.grpc.call import CallError
from shmserve.frontend.grpc.stream import StreamSession
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode


class View:
    decoupled = False


class Service:
    def infer_target(self, name, version):
        return View(), 1


class Context:
    async def abort(self, code, details=""):
        raise CallError(code, details)


def test_a_cancel_that_answers_at_once_does_not_break_the_error_status():
    """In error mode the first failed request ends the stream with its status; the request
    behind it is cancelled, and its cancel may answer it at once (one still held for its
    leased worker is): the stream still ends with the failure's status."""
    callbacks = {}
    cancelled = []

    def start(req, answer):
        callbacks[req.id] = answer

        def cancel():
            cancelled.append(req.id)
            answer(None, InferError(ErrorCode.CANCELLED, "the request was cancelled"))
        return cancel

    async def requests():
        for rid in ("a", "b"):
            yield pb.ModelInferRequest(model_name="m", id=rid)
        # both are in flight: the first fails
        callbacks["a"](None, InferError(ErrorCode.INVALID_ARG, "minus one is refused"))
        await asyncio.Event().wait()        # the client keeps the stream open

    async def main():
        session = StreamSession(Service(), Context(), True, 8, start, 1 << 20)
        async for _ in session.run(requests()):
            pass

    with pytest.raises(CallError) as e:
        asyncio.run(main())
    assert (e.value.code, e.value.details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "minus one is refused")
    assert cancelled == ["b"]
