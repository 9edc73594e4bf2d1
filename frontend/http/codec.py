"""KServe v2 infer requests and responses over HTTP: JSON tensors and the binary extension.

The request body is either a bytes object (small bodies) or a slot of the frontend's shared-memory
arena that the body was received straight into (large bodies). Binary inputs inside an arena slot
are passed on as references to their byte range, so their bytes are copied exactly once: from the
socket into shared memory.
"""
from __future__ import annotations

import struct
from typing import Any, TypeGuard

import msgspec
import numpy as np

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests import validation
from shmserve.engine.requests.catalog import ModelView
from shmserve.engine.requests.prepare import DEFAULT_LIMITS, PreparedRequest, RequestLimits, TensorBudget
from shmserve.frontend.shm.regions import Region
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import dtypes
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.errors import InferError, invalid
from shmserve.ipc.messages.common import ErrorCode, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode

_U32 = struct.Struct("<I")


def unparsable(field: str, problem: str, detail: str = "") -> InferError:
    """A request field of the wrong JSON type, in the words of Triton's JSON reader (which
    clients see and compare), then what shmserve knows about it. Triton answers these with 500;
    they are the client's mistakes, so here they are 400."""
    text = f"Unable to parse '{field}': {problem}"
    return invalid(f"{text} ({detail})" if detail else text)


MISSING = "attempt to access non-existing object member"
NOT_STRING = "attempt to access JSON non-string as string"
NOT_ARRAY = "attempt to access JSON non-array as array"
NOT_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
NOT_BOOL = "attempt to access JSON non-boolean as boolean"
ONE_SOURCE = ("Input must set only one of the following fields: 'data', 'binary_data_size' in "
              "'parameters', 'shared_memory_region' in 'parameters'")

# what Triton's reader says of a JSON value that is not of the datatype's kind
_DATA_PROBLEM = {"BOOL": NOT_BOOL, "FP32": "attempt to access JSON non-number as double",
                 "FP64": "attempt to access JSON non-number as double"}
for _t in ("INT8", "INT16", "INT32", "INT64"):
    _DATA_PROBLEM[_t] = "attempt to access JSON non-signed-integer as signed-integer"
for _t in ("UINT8", "UINT16", "UINT32", "UINT64"):
    _DATA_PROBLEM[_t] = NOT_UNSIGNED


def _member(obj: dict, field: str, kind: type, problem: str, detail: str = ""):
    """``obj[field]``, which must be there and of ``kind``."""
    value = obj.get(field)
    if value is None:
        raise unparsable(field, f"{MISSING} '{field}'", detail)
    if not isinstance(value, kind):
        raise unparsable(field, problem, detail)
    return value


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if data and isinstance(data[0], list):
        out = []
        for item in data:
            out.extend(_flatten(item))
        return out
    return data


def _json_tensor(model: ModelView, name: str, datatype: str, shape: list[int], data: Any,
                 count: int, request_id: str) -> bytes:
    """The bytes of an input sent as JSON ``data``; ``count`` is its shape's element count,
    already within the request's limits."""
    if datatype in ("FP16", "BF16"):
        raise invalid(f"receiving input '{name}' of datatype {datatype} via JSON is not "
                      f"supported. Please use the binary data format for input data")
    _check_depth(name, data)
    flat = _flatten(data)
    if datatype == "BYTES":
        # Triton reads strings whatever their number; its core then counts them
        if not all(isinstance(x, str) for x in flat):
            raise invalid(f"Unable to parse JSON bytes array: {NOT_STRING} (input '{name}' of "
                          f"datatype BYTES must hold JSON strings)")
        if len(flat) != count:
            raise validation.string_count_error(model, name, count, len(flat), request_id)
        return dtypes.serialize_bytes(np.array(flat, dtype=object)).tobytes()
    # Triton's two texts, exactly (its QA greps the whole body)
    if len(flat) < count:
        raise invalid("Failed to parse 'data' field: shape does not match true shape")
    if len(flat) > count:
        raise invalid("Unable to parse 'data': Shape does not match true shape of 'data' field")
    if datatype == "BOOL":
        if not all(isinstance(x, bool) for x in flat):
            raise unparsable("data", NOT_BOOL, f"input '{name}' of datatype BOOL must hold JSON "
                                               f"true/false values")
    else:
        if any(isinstance(x, (bool, str, list, dict)) or x is None for x in flat):
            raise unparsable("data", _DATA_PROBLEM[datatype],
                             f"input '{name}' of datatype {datatype} must hold numbers")
    try:
        arr = np.array(flat, dtype=dtypes.WIRE_TO_NUMPY[datatype])
    except (OverflowError, ValueError, TypeError) as e:
        raise invalid(f"input '{name}' holds a value that is not a valid {datatype}: {e}") from None
    if datatype not in ("FP32", "FP64") and any(isinstance(x, float) for x in flat):
        raise unparsable("data", _DATA_PROBLEM[datatype],
                         f"input '{name}' of datatype {datatype} must hold integers")
    return arr.tobytes()


# Triton's HTTP_MAX_JSON_NESTING_DEPTH: how deep a tensor's JSON 'data' may nest
MAX_DATA_DEPTH = 100


def _check_depth(name: str, data: Any) -> None:
    """Nested data is read along its first elements (as ``_flatten`` recurses): its depth must
    stay under Triton's limit."""
    depth = 0
    while isinstance(data, list):
        if depth >= MAX_DATA_DEPTH - 1:
            raise invalid(f"JSON nesting depth exceeds maximum allowed limit "
                          f"({MAX_DATA_DEPTH}) in the 'data' of input '{name}'")
        depth += 1
        data = data[0] if data else None


def _shape(name: str, value: Any) -> list[int]:
    if value is None:
        raise unparsable("shape", f"{MISSING} 'shape'", f"input '{name}'")
    if not isinstance(value, list):
        raise unparsable("shape", NOT_ARRAY, f"input '{name}': the shape is an array of "
                                             f"non-negative integers")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        # a 500, as Triton answers it (its JSON reader fails there; Triton's own HTTP tests
        # expect the 500), with its words and then which input and shape
        raise InferError(ErrorCode.INTERNAL, f"Unable to parse 'shape': attempt to access JSON "
                         f"non-unsigned-integer as unsigned-integer (input '{name}' has shape "
                         f"{value}; the dims must be non-negative integers)")
    return value


def _plain_dims(value: Any) -> TypeGuard[list[int]]:
    """A list of non-negative ints (JSON's, not bools): the shape every request sends."""
    if type(value) is not list:
        return False
    for d in value:
        if type(d) is not int or d < 0:
            return False
    return True


def _sequence_types(params: dict) -> None:
    """The sequence parameters' JSON types, in the words of Triton's reader (request.prepare
    checks their values for every protocol)."""
    cid = params.get("sequence_id", 0)
    if isinstance(cid, bool) or not isinstance(cid, (int, str)):
        raise unparsable("sequence_id", NOT_STRING, f"request parameter 'sequence_id' is an "
                                                   f"unsigned 64-bit integer or a string, got {cid!r}")
    for key in ("sequence_start", "sequence_end"):
        if not isinstance(params.get(key, False), bool):
            raise unparsable(key, NOT_BOOL, f"request parameter '{key}' is a boolean, got "
                                            f"{params[key]!r}")


def parse_infer(model: ModelView, body, header_len: int | None, body_ref: ShmRef | None,
                arena: ShmArena, registry: ShmRegistry,
                limits: RequestLimits = DEFAULT_LIMITS,
                forwarded: dict[str, str] | None = None) -> PreparedRequest:
    """Parse and validate; raises InferError with a message that names the problem.
    ``forwarded``: headers that become parameters (--http-header-forward-pattern)."""
    mv = memoryview(body)
    budget = TensorBudget(limits)
    if header_len == 0:
        return _parse_raw(model, mv, body_ref, arena, budget, forwarded)
    if header_len is None:
        header_len = len(mv)
    elif header_len < 0 or header_len > len(mv):
        raise invalid(header_size_error(header_len, len(mv)))
    try:
        doc = _json_decode(mv[:header_len])
    except msgspec.DecodeError as e:
        raise invalid(f"failed to parse the request JSON buffer: {e}") from None
    except RecursionError:
        raise invalid(f"JSON nesting depth exceeds maximum allowed limit ({MAX_DATA_DEPTH}): "
                      f"{TOO_DEEP}") from None
    if not isinstance(doc, dict):
        raise unparsable("inputs", f"{MISSING} 'inputs'", "the request JSON must be an object")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise unparsable("id", NOT_STRING, "the request 'id' is a string")
    inputs = _member(doc, "inputs", list, NOT_ARRAY)
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("failed to get request params.: attempt to get members for non-object "
                      "(the request 'parameters' must be a JSON object)")
    if not isinstance(params.get("binary_data_output", False), bool):
        raise unparsable("binary_data_output", NOT_BOOL, "a request parameter")
    if params:
        _sequence_types(params)
    scratch: list[ShmRef] = []
    try:
        return _parse(model, mv, header_len, body_ref, arena, registry, doc, inputs, params,
                      request_id, scratch, budget, forwarded)
    except BaseException:
        for ref in scratch:     # the request fails: nobody else will free what it copied in
            arena.free(ref)
        raise


def _parse(model: ModelView, mv: memoryview, header_len: int, body_ref: ShmRef | None,
           arena: ShmArena, registry: ShmRegistry, doc: dict, inputs: list, params: dict,
           request_id: str, scratch: list[ShmRef], budget: TensorBudget,
           forwarded: dict[str, str] | None = None) -> PreparedRequest:
    cursor = header_len
    tensors: list[Tensor] = []
    regions: list[Region] = []
    for item in inputs:
        if not isinstance(item, dict):
            raise invalid(f"{ONE_SOURCE}. But no field is set (each entry of 'inputs' is an "
                          f"object)")
        tparams = item.get("parameters") or {}
        if not isinstance(tparams, dict):
            raise invalid(f"input '{item.get('name')}': 'parameters' must be a JSON object")
        sources = ("data" in item) + ("binary_data_size" in tparams) + \
            ("shared_memory_region" in tparams)
        if sources != 1:
            given = " ".join(f"'{f}'" for f, there in (
                ("data", "data" in item), ("binary_data_size", "binary_data_size" in tparams),
                ("shared_memory_region", "shared_memory_region" in tparams)) if there)
            problem = f"But set {given}" if given else "But no field is set"
            raise invalid(f"{ONE_SOURCE}. {problem} (input '{item.get('name')}')")
        # (the checks of every input of every request: the usual case first, inline; what
        # fails it goes through the full check, which says what is wrong)
        got = item.get("name")
        name: str = got if type(got) is str else \
            _member(item, "name", str, NOT_STRING, "an entry of 'inputs'")
        got = item.get("datatype")
        datatype: str = got if type(got) is str else \
            _member(item, "datatype", str, NOT_STRING, f"input '{name}'")
        if datatype not in dtypes.ELEMENT_SIZE:
            raise invalid(f"invalid datatype for input {name} (got '{datatype}')")
        got = item.get("shape")
        shape = got if _plain_dims(got) else _shape(name, got)
        t = Tensor(name, datatype, shape)
        count = budget.declare(t)
        if "shared_memory_region" in tparams:
            budget.data(t, request.input_from_region(registry, model, t, tparams, regions,
                                                     request_id))
        elif "binary_data_size" in tparams:
            bsize = tparams["binary_data_size"]
            if not isinstance(bsize, int) or isinstance(bsize, bool) or bsize < 0:
                raise unparsable("binary_data_size", NOT_UNSIGNED, f"input '{name}'")
            if cursor + bsize > len(mv):
                raise invalid(f"unexpected size for input '{name}', expecting "
                              f"{cursor + bsize - len(mv)} additional bytes for model "
                              f"'{model.name}'")
            chunk = mv[cursor:cursor + bsize]
            budget.data(t, bsize)
            validation.check_byte_size(model, t, bsize, chunk, request_id)
            if body_ref is not None and bsize > INLINE_LIMIT:
                t.shm = ShmRef(body_ref.segment, body_ref.offset + cursor, bsize)
            else:
                t.data = bytes(chunk)
            cursor += bsize
        else:
            budget.json(name, count)
            data = _json_tensor(model, name, datatype, shape, item["data"], count, request_id)
            budget.data(t, len(data))
            request.place_data(t, data, arena, scratch)
        tensors.append(t)
    if cursor != len(mv):
        raise invalid(f"unexpected additional input data for model '{model.name}': "
                      f"{len(mv) - cursor} bytes after the last binary input")
    binary_default = params.get("binary_data_output", False) is True
    outputs = doc.get("outputs")
    wanted = None
    if outputs is not None:
        if not isinstance(outputs, list):
            raise unparsable("outputs", NOT_ARRAY)
        wanted = []
        for o in outputs:
            if not isinstance(o, dict):
                raise unparsable("name", f"{MISSING} 'name'", "each entry of 'outputs' is an "
                                                              "object")
            _member(o, "name", str, NOT_STRING, "an entry of 'outputs'")
            oparams = o.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise invalid(f"output '{o['name']}': 'parameters' must be a JSON object")
            if not isinstance(oparams.get("binary_data", False), bool):
                raise unparsable("binary_data", NOT_BOOL, f"output '{o['name']}'")
            # binary_data_output is the default of the outputs not listed: a listed output
            # is JSON unless its own binary_data says otherwise (Triton's rule)
            wanted.append(request.output_wanted(registry, o["name"], oparams, False, regions))
    return request.prepare(model, tensors, wanted, params, request_id, scratch, regions,
                           binary_default, budget.limits, forwarded=forwarded,
                           protocol_params=("binary_data_output",))


def _parse_raw(model: ModelView, mv: memoryview, body_ref: ShmRef | None, arena: ShmArena,
               budget: TensorBudget, forwarded: dict[str, str] | None = None) -> PreparedRequest:
    """Inference-Header-Content-Length: 0 — the whole body is the data of the only input (for a
    BYTES input, its one element, without the length the binary extension puts before each)."""
    if len(model.inputs) != 1:
        raise invalid(f"Raw request must only have 1 input (found 1) to be deduced but got "
                      f"{len(model.inputs)} inputs in '{model.name}' model configuration "
                      f"(Inference-Header-Content-Length: 0 sends the data of exactly one input)")
    spec = next(iter(model.inputs.values()))
    dims = list(spec.dims)
    if spec.datatype == "BYTES":
        if dims != [1]:
            raise invalid(f"For BYTE datatype raw input '{spec.name}', the model must have input "
                          f"shape [1] (model '{model.name}' has dims {dims})")
        shape = dims
    else:
        variable = [i for i, d in enumerate(dims) if d == -1]
        if len(variable) > 1:
            raise invalid(f"The shape of the raw input '{spec.name}' can not be deduced because "
                          f"there are more than one variable-sized dimension (dims {dims} of "
                          f"model '{model.name}')")
        size = dtypes.ELEMENT_SIZE[spec.datatype]
        fixed = size * dtypes.element_count([d for d in dims if d != -1])
        if variable:
            if fixed == 0 or len(mv) % fixed:
                raise invalid(f"raw binary request: {len(mv)} bytes do not fit input "
                              f"'{spec.name}' with dims {dims}")
            dims[variable[0]] = len(mv) // fixed
        shape = dims
    if model.max_batch_size > 0:
        shape = [1] + shape
    t = Tensor(spec.name, spec.datatype, shape)
    budget.declare(t)
    scratch: list[ShmRef] = []
    if spec.datatype == "BYTES":
        data = _U32.pack(len(mv)) + mv      # the element as the binary extension carries it
        budget.data(t, len(data))
        validation.check_byte_size(model, t, len(data), data)
        request.place_data(t, data, arena, scratch)
    else:
        budget.data(t, len(mv))
        validation.check_byte_size(model, t, len(mv), mv)
        if body_ref is not None and len(mv) > INLINE_LIMIT:
            t.shm = body_ref
        else:
            t.data = bytes(mv)
    try:
        return request.prepare(model, [t], None, {}, "", scratch, [], True, budget.limits,
                               forwarded=forwarded)
    except BaseException:
        for ref in scratch:
            arena.free(ref)
        raise


def _as_json(wanted) -> bool:
    return wanted is None or not (wanted.region or wanted.binary)


def _json_data(t: Tensor, buf) -> list:
    if t.datatype in ("FP16", "BF16"):
        raise invalid(f"output '{t.name}' of datatype {t.datatype} cannot be returned as JSON; "
                      f"request it with binary_data")
    if t.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in dtypes.deserialize_bytes(buf)]
    return np.frombuffer(buf, dtype=dtypes.WIRE_TO_NUMPY[t.datatype]).tolist()


def render_response(result: InferResult, prepared: PreparedRequest, views: list,
                    max_json_elements: int = DEFAULT_LIMITS.max_json_elements,
                    ) -> tuple[bytes, list, int]:
    """JSON header, binary parts in output order, and the JSON length (for the header field).

    ``views`` holds each output's bytes (inline bytes or a shared-memory view), or None for an
    output that was written into a client's region. Outputs to be returned as JSON are checked
    against ``max_json_elements`` before any is encoded (a 400 that asks for binary data).
    """
    request.check_json_outputs(result.model, [
        (t.name, t.shape) for t in result.outputs if _as_json(prepared.outputs.get(t.name))],
        max_json_elements)
    outputs, parts = [], []
    for t, buf in zip(result.outputs, views):
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        wanted = prepared.outputs.get(t.name)
        if wanted is not None and wanted.region:
            pass    # the bytes are in the client's region; Triton adds no parameters here
        elif wanted is not None and wanted.binary:
            out["parameters"] = {"binary_data_size": len(buf)}
            if len(buf):
                parts.append(buf)
        else:
            out["data"] = _json_data(t, buf)
        outputs.append(out)
    doc: dict[str, Any] = {}
    if prepared.request_id:
        doc["id"] = prepared.request_id
    doc["model_name"] = result.model
    doc["model_version"] = str(result.version)
    if result.parameters:
        doc["parameters"] = result.parameters
    doc["outputs"] = outputs
    header = _json_encode(doc)
    return header, parts, len(header)


encode_json = _json_encode
json_output = _json_data        # an output's elements as JSON values (frontend/http/generate.py)
TOO_DEEP = "failed to parse the request JSON buffer: it is nested too deeply"


def header_size_error(header_len: int, body_len: int) -> str:
    """An Inference-Header-Content-Length that does not fit the body, in Triton's words."""
    why = "negative" if header_len < 0 else \
        f"larger than the request body of {body_len} bytes"
    return (f"inference header size should be in range (0, {body_len}), got: {header_len} "
            f"(Inference-Header-Content-Length is {why})")


def decode_json(data):
    """JSON of a request body; raises msgspec.DecodeError, or InferError when it nests too
    deeply to decode (which msgspec reports as a RecursionError)."""
    try:
        return _json_decode(data)
    except RecursionError:
        raise invalid(TOO_DEEP) from None
