"""A request's answers as an async generator: the streaming endpoints' side of
``FrontendService`` (gRPC's stream, HTTP's generate).

Apart from the service because the service is compiled (ipc/compiled.py) and mypyc builds no
async generators.
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests.catalog import ModelView
from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend.service import FrontendService
from shmserve.ipc.messages.to_frontend import InferResult


async def infer_stream(service: FrontendService, view: ModelView, version: int,
                       prepared: PreparedRequest) -> AsyncGenerator[InferResult, None]:
    """Submit and yield each answer as it comes (a decoupled model gives any number; the last
    has ``final``). The caller gives back each answer's output slots
    (``service.release_outputs(result, request.worker_slots(result, prepared))``) once they
    are sent; the inputs are released here after the last. If the caller stops early, the
    request is cancelled and what still comes is released as it arrives."""
    answers: asyncio.Queue = asyncio.Queue()
    req_id = service.submit(view, version, prepared, answers.put_nowait)
    final = False
    try:
        while not final:
            result = await answers.get()
            final = result.final
            if final:
                request.release(prepared, service.arena)
            yield result
    finally:
        if not final:
            service.abandon(req_id, prepared)
            while not answers.empty():
                service.drop(answers.get_nowait(), prepared)
