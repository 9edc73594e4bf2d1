"""Triton's generate extension (docs/triton-compat.md §1.15): ``POST .../generate`` answers one
JSON object, ``POST .../generate_stream`` one Server-Sent Event per response of the model.

The request is a flat JSON object. A top-level key that names a model input becomes that input,
of the input's datatype, its shape deduced from the model's (``deduce_shape``); any other key
becomes a request parameter the model reads (``request.parameters()``), "id" included (it is also
the request id). ``"parameters": {...}`` is mapped the same way, one level down. The answer holds
"id" (when given), "model_name", "model_version", the response's parameters and each output by
name: a one-element output as its scalar, any other as a flat array. ``map_request`` and
``render_answer`` are pure; ``GenerateEndpoints`` runs them on a connection.

Streaming: the status line goes out with the first response (an error there sets it, as in
Triton), then each response is written as it comes. While more than the connection's
``write_high_water`` bytes wait for a slow client, no further response is taken from the model:
they wait in the request's queue in the frontend (their outputs in the worker's memory) until the
client has taken what was written; one that takes nothing for ``--http-idle-timeout-secs`` is cut
off. A client that leaves (or is cut off) cancels the request: the model's
``request.is_cancelled()`` turns true.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests import validation
from shmserve.engine.requests.catalog import ModelView
from shmserve.engine.requests.header_forward import HeaderForward
from shmserve.engine.requests.prepare import PreparedRequest, RequestLimits, TensorBudget
from shmserve.frontend.answer_stream import infer_stream
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.http.server import HttpConnection, HttpRequest
from shmserve.frontend.service import FrontendService
from shmserve.ipc import dtypes
from shmserve.ipc.errors import InferError, http_status, invalid
from shmserve.ipc.messages.common import ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena

log = logging.getLogger("shmserve.http")

SSE_TYPE = "text/event-stream; charset=utf-8"
# Triton's words for a /generate whose model does not answer exactly once
NOT_ONE = ("generate expects model to produce exactly 1 response, use generate stream for model "
           "that generates various number of responses")
_INVALID_PARAM = "' has invalid type. It should be either 'int', 'bool', or 'string'."
INT64_MIN, INT64_MAX, UINT64_END = -(1 << 63), (1 << 63) - 1, 1 << 64


class _Object:
    """A JSON object as its (key, value) pairs, in order and with repeated keys kept: Triton
    reads the members in order (its errors name the first bad one) and a repeated input is an
    error there, not the last one winning."""
    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]):
        self.pairs = pairs


def _no_constant(name: str):
    raise ValueError(f"invalid JSON value {name}")


def parse_json(body) -> _Object:
    try:
        doc = json.loads(bytes(body), object_pairs_hook=_Object, parse_constant=_no_constant)
    except RecursionError:
        raise invalid(http_codec.TOO_DEEP) from None
    except ValueError as e:       # JSONDecodeError, bad UTF-8, NaN
        raise invalid(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(doc, _Object):
        raise invalid("attempt to get members for non-object (the generate request must be a "
                      "JSON object)")
    return doc


@dataclass
class Mapped:
    """What a generate request asks for: inputs (bytes not yet placed), parameters, id."""
    inputs: list[tuple[Tensor, bytes]] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""


def map_request(model: ModelView, doc: _Object, max_input_size: int) -> Mapped:
    """Triton's mapping of a generate request onto the model's inputs and the request's
    parameters; raises InferError (400) with Triton's words for what it refuses."""
    out = Mapped()
    first = _first_values(doc)
    if "id" in first:
        if not isinstance(first["id"], str):
            raise invalid("Unable to parse 'id': attempt to access JSON non-string as string")
        out.request_id = first["id"]
    _map_object(model, doc, first, max_input_size, out, nested=True)
    return out


def _first_values(doc: _Object) -> dict[str, Any]:
    first: dict[str, Any] = {}
    for k, v in doc.pairs:
        first.setdefault(k, v)
    return first


def _map_object(model: ModelView, doc: _Object, first: dict, max_input_size: int, out: Mapped,
                nested: bool) -> None:
    consumed = 0        # input bytes of this level, as Triton counts them (each level apart)
    for key, _ in doc.pairs:
        value = first[key]      # a repeated key reads its first value, as Triton's lookup does
        if nested and key == "parameters":
            if key in model.inputs:
                raise invalid("Keyword 'parameters' for nested schema also given as input "
                              "tensor name")
            if not isinstance(value, _Object):
                raise invalid("Expected JSON object for keyword: 'parameters': attempt to "
                              "access JSON non-object as object")
            try:
                _map_object(model, value, _first_values(value), max_input_size, out, False)
            except InferError as e:
                raise InferError(e.code, f"Converting keyword: 'parameters': {e.message}") \
                    from None
        elif key in model.inputs:
            consumed += _map_input(model, key, value, consumed, max_input_size, out)
        else:
            out.parameters.setdefault(key, _parameter(key, value))


def _parameter(key: str, value: Any) -> Any:
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        # an integer past int64 is a double to Triton's JSON reader
        return value if INT64_MIN <= value <= INT64_MAX else float(value)
    if isinstance(value, float):
        return value
    raise invalid(f"parameter '{key}{_INVALID_PARAM}")


def deduce_shape(name: str, shape: list[int], count: int) -> list[int]:
    """Triton's shape for ``count`` elements of an input whose (metadata) shape is ``shape``:
    the fixed dims take their share, the innermost variable dim the rest, other variable dims
    (the batch dim among them) 1."""
    shape = list(shape)
    refused = invalid(f"The schema can not convert input '{name}' to tensor with proper shape")
    for d in shape:
        if d != -1:
            if d <= 0 or count % d:
                raise refused
            count //= d
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == -1:
            shape[i], count = count, 1
    if count != 1:
        raise refused
    return shape


def _map_input(model: ModelView, name: str, value: Any, consumed: int, max_input_size: int,
               out: Mapped) -> int:
    """Add one input; returns its byte size."""
    spec = model.inputs[name]
    datatype = spec.datatype
    count = len(value) if isinstance(value, list) else 1
    leaves = _leaves(name, value)
    if datatype == "BYTES":
        if not all(isinstance(x, str) for x in leaves):
            raise invalid("Unable to parse JSON bytes array: attempt to access JSON non-string "
                          "as string")
        encoded = [x.encode("utf-8", "surrogatepass") for x in leaves]
        nbytes = sum(len(b) + 4 for b in encoded)
    else:
        nbytes = count * dtypes.ELEMENT_SIZE[datatype]
    if nbytes == 0:
        _add(model, out, Tensor(name, datatype, []), b"")
        return 0
    if nbytes + consumed > max_input_size:
        raise invalid(f"request size of {consumed} bytes with input '{name}' of size {nbytes} "
                      f"bytes exceeds the maximum allowed input size of {max_input_size}. Use "
                      f"--http-max-input-size to increase the limit.")
    lead = [-1] if model.max_batch_size > 0 else []
    shape = deduce_shape(name, lead + list(spec.dims), count)
    if datatype == "BYTES":
        data = b"".join(len(b).to_bytes(4, "little") + b for b in encoded)
    else:
        data = _numbers(name, datatype, leaves, count)
    _add(model, out, Tensor(name, datatype, shape), data)
    return nbytes


def _add(model: ModelView, out: Mapped, t: Tensor, data: bytes) -> None:
    if any(seen.name == t.name for seen, _ in out.inputs):
        raise invalid(f"input '{t.name}' already exists in request for model '{model.name}'")
    out.inputs.append((t, data))


def _leaves(name: str, value: Any, depth: int = 0) -> list:
    if not isinstance(value, list):
        return [value]
    if depth >= http_codec.MAX_DATA_DEPTH - 1:
        raise invalid(f"JSON nesting depth exceeds maximum allowed limit "
                      f"({http_codec.MAX_DATA_DEPTH}) in input '{name}'")
    flat: list = []
    for item in value:
        flat.extend(_leaves(name, item, depth + 1))
    return flat


# what Triton's JSON reader says of a value of the wrong kind, by datatype
_NOT_BOOL = "attempt to access JSON non-boolean as boolean"
_NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"
_NOT_INT = "attempt to access JSON non-signed-integer as signed-integer"
_NOT_NUMBER = "attempt to access JSON non-number as double"


def _numbers(name: str, datatype: str, leaves: list, count: int) -> bytes:
    if datatype in ("FP16", "BF16"):
        raise invalid(f"receiving {datatype} data via JSON is not supported. Please use the "
                      f"binary data format for input {name}")
    for i, x in enumerate(leaves):
        if i >= count:
            raise invalid("Unable to parse 'data': Shape does not match true shape of 'data' "
                          "field")
        number = isinstance(x, (int, float)) and not isinstance(x, bool)
        if datatype == "BOOL":
            ok, why = isinstance(x, bool), _NOT_BOOL
        elif datatype.startswith("UINT"):
            ok, why = number and isinstance(x, int) and 0 <= x < UINT64_END, _NOT_UINT
        elif datatype.startswith("INT"):
            ok, why = number and isinstance(x, int) and INT64_MIN <= x <= INT64_MAX, _NOT_INT
        else:
            ok, why = number, _NOT_NUMBER
        if not ok:
            raise invalid(f"Unable to parse 'data': {why}")
    if len(leaves) < count:
        raise invalid("Failed to parse 'data' field: shape does not match true shape")
    try:
        arr = np.array(leaves, dtype=dtypes.WIRE_TO_NUMPY[datatype])
    except (OverflowError, ValueError) as e:
        # Triton casts such a value silently (its reader has a FIXME for it); shmserve refuses
        # it, as its /infer does
        raise invalid(f"input '{name}' holds a value that is not a valid {datatype}: {e}") \
            from None
    return arr.tobytes()


def prepare(model: ModelView, mapped: Mapped, arena: ShmArena,
            limits: RequestLimits) -> PreparedRequest:
    """The request as any infer request: bounded by the request limits, checked against the
    config, its larger inputs in shared memory. The parameters all reach the model (Triton's
    generate reads none of them itself: no priority, timeout or sequence here)."""
    budget = TensorBudget(limits)
    tensors: list[Tensor] = []
    scratch: list[ShmRef] = []
    # names, datatypes and shapes first: a shape Triton could not deduce is named as such
    validation.validate_inputs(model, [t for t, _ in mapped.inputs])
    try:
        for t, data in mapped.inputs:
            count = budget.declare(t)
            budget.json(t.name, count)
            budget.data(t, len(data))
            validation.check_byte_size(model, t, len(data), data)
            request.place_data(t, data, arena, scratch)
            tensors.append(t)
        for key in mapped.parameters:
            if key.startswith("triton_") and key not in request.PROTOCOL_PARAMS:
                raise invalid(request.RESERVED_WORDS)
        prepared = request.prepare(model, tensors, None, {}, mapped.request_id, scratch, [],
                                   limits=limits)
    except BaseException:
        for ref in scratch:
            arena.free(ref)
        raise
    prepared.payload.parameters = mapped.parameters
    return prepared


def render_answer(result: InferResult, request_id: str, views: list,
                  max_json_elements: int) -> bytes:
    """One response as Triton's generate writes it: keys in sorted order; the reserved keys,
    then the response's parameters, then the outputs (a name already taken is skipped)."""
    request.check_json_outputs(result.model, [(t.name, t.shape) for t in result.outputs],
                               max_json_elements)
    doc: dict[str, Any] = {}
    if request_id:
        doc["id"] = request_id
    doc["model_name"] = result.model
    doc["model_version"] = str(result.version)
    for k, v in result.parameters.items():
        doc.setdefault(k, v)
    for t, buf in zip(result.outputs, views):
        if t.name not in doc:
            data = http_codec.json_output(t, buf)
            doc[t.name] = data[0] if len(data) == 1 else data
    return http_codec.encode_json(dict(sorted(doc.items())))


def error_json(message: str) -> bytes:
    return http_codec.encode_json({"error": message})


class GenerateEndpoints:
    """The two routes' work (``KServeHttpApp.generate`` and ``generate_stream`` call in)."""

    def __init__(self, service: FrontendService, max_input_size: int,
                 forward: HeaderForward | None = None):
        self.service = service
        self.max_input_size = max_input_size
        self.forward = forward          # --http-header-forward-pattern
        self.running: dict[HttpConnection, asyncio.Task] = {}

    def connection_lost(self, conn: HttpConnection) -> None:
        task = self.running.pop(conn, None)
        if task is not None:
            task.cancel()       # closing the answer stream cancels the request

    def start(self, conn: HttpConnection, req: HttpRequest, model: str, version: str,
              stream: bool) -> None:
        """Check and map the request (a refusal raises InferError: a JSON error answer), then
        run it: /generate_stream when ``stream``, else /generate."""
        svc = self.service
        view, v = svc.infer_target(model, version)
        if req.headers.get("content-encoding", "identity").lower() != "identity":
            raise invalid("Unsupported content-encoding, only 'identity' is supported.")
        mapped = map_request(view, parse_json(req.body), self.max_input_size)
        if self.forward is not None and self.forward.regex is not None:
            mapped.parameters = {**mapped.parameters, **self.forward.params(req.raw_headers)}
        prepared = prepare(view, mapped, svc.arena, svc.limits)
        run = self._stream if stream else self._one
        task = asyncio.get_running_loop().create_task(run(conn, req, view, v, prepared))
        self.running[conn] = task
        task.add_done_callback(lambda t: self._done(conn, t))

    def _done(self, conn: HttpConnection, task: asyncio.Task) -> None:
        # the next pipelined request of the connection may have started its task already
        if self.running.get(conn) is task:
            del self.running[conn]

    def _render(self, result: InferResult, prepared: PreparedRequest) -> tuple[int, bytes]:
        """Status and JSON of one response; its output slots are given back here."""
        svc = self.service
        refs = request.worker_slots(result, prepared)
        try:
            views = svc.outputs(result, prepared)
            return 200, render_answer(result, prepared.request_id, views,
                                      svc.limits.max_json_elements)
        except InferError as e:
            return http_status(e.code), error_json(e.message)
        finally:
            svc.release_outputs(result, refs)

    async def _one(self, conn, req, view: ModelView, version: int,
                   prepared: PreparedRequest) -> None:
        """/generate: exactly one response, else Triton's error (sent as soon as a second
        response shows it, and the request is cancelled)."""
        answers: list[tuple[int, bytes]] = []
        try:
            async with aclosing(infer_stream(self.service, view, version, prepared)) as results:
                async for result in results:
                    if not result.no_response:
                        if answers:     # one too many: give its slots back, cancel the rest
                            self.service.release_outputs(
                                result, request.worker_slots(result, prepared))
                            answers.append((500, b""))
                            break
                        answers.append(self._render(result, prepared))
        except Exception as e:
            log.exception("error answering a generate request")
            answers = [(500, error_json(f"internal error: {type(e).__name__}: {e}"))]
        if len(answers) != 1:
            answers = [(500, error_json(NOT_ONE))]
        conn.respond(req, *answers[0])

    async def _stream(self, conn, req, view: ModelView, version: int,
                      prepared: PreparedRequest) -> None:
        started = False
        try:
            async with aclosing(infer_stream(self.service, view, version, prepared)) as answers:
                async for result in answers:
                    status, body = (200, b"") if result.no_response else \
                        self._render(result, prepared)
                    if not started:
                        conn.start_stream(req, status, SSE_TYPE)
                        started = True
                    if body:
                        conn.send_chunk(req, b"data: " + body + b"\n\n")
                        if not await conn.writable(conn.limits.idle_timeout_s):
                            break       # the client is gone or stalled: cancel the request
        except Exception as e:
            log.exception("error streaming a generate request")
            message = error_json(f"internal error: {type(e).__name__}: {e}")
            if not started:
                return conn.respond(req, 500, message)
            conn.send_chunk(req, b"data: " + message + b"\n\n")
        if not started:         # no answer at all (cannot happen: the last one is final)
            conn.start_stream(req, 200, SSE_TYPE)
        conn.end_stream(req)

