"""KServe v2 gRPC infer messages (tritonclient's generated ``service_pb2``) to and from our
request records. Validation is the shared path in ``request``/``validation``."""
from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests import validation
from shmserve.engine.requests.catalog import ModelView
from shmserve.engine.requests.prepare import DEFAULT_LIMITS, PreparedRequest, RequestLimits, TensorBudget
from shmserve.frontend.shm.regions import Region
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import dtypes
from shmserve.ipc.errors import invalid
from shmserve.ipc.messages.common import ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena

# typed contents field per datatype (FP16/BF16 only travel raw, docs/triton-compat.md §2.2)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def parameters_to_dict(params) -> dict[str, Any]:
    if not params:          # the common case, three times a request: no map iteration
        return {}
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


def set_parameter(target, key: str, value) -> None:
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


# the datatype Triton names for data given in a contents field
_FIELD_TYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
               "uint_contents": "UINT32", "uint64_contents": "UINT64",
               "fp32_contents": "FP32", "fp64_contents": "FP64", "bytes_contents": "BYTES"}


def _typed_contents(model: ModelView, t: Tensor, contents, count: int, request_id: str) -> bytes:
    field = _CONTENTS_FIELD.get(t.datatype)
    if field is None:
        raise invalid(f"input '{t.name}' of datatype {t.datatype} must be sent in "
                      f"raw_input_contents")
    for other, type_name in _FIELD_TYPE.items():
        if other != field and len(getattr(contents, other)):
            raise invalid(f"unexpected explicit tensor data for input tensor '{t.name}' for "
                          f"model '{model.name}' of type '{type_name}', expected datatype "
                          f"'{t.datatype}'")
    values = getattr(contents, field)
    if len(values) != count:
        if t.datatype != "BYTES":       # Triton counts the bytes the values would take
            validation.check_byte_size(model, t, len(values) * dtypes.ELEMENT_SIZE[t.datatype],
                                       None, request_id)
        raise invalid(f"unexpected number of elements for input '{t.name}' for model "
                      f"'{model.name}': shape {t.shape} needs {count}, got {len(values)}")
    if t.datatype == "BYTES":
        return dtypes.serialize_bytes(np.array(list(values), dtype=object)).tobytes()
    try:
        return np.array(values, dtype=dtypes.WIRE_TO_NUMPY[t.datatype]).tobytes()
    except OverflowError as e:
        raise invalid(f"input '{t.name}' holds a value that is not a valid {t.datatype}: {e}") from None


def _has_contents(contents) -> bool:
    return any(len(getattr(contents, f)) for f in set(_CONTENTS_FIELD.values()))


def parse_infer(model: ModelView, req: pb.ModelInferRequest, arena: ShmArena,
                registry: ShmRegistry, limits: RequestLimits = DEFAULT_LIMITS,
                forwarded: dict[str, str] | None = None) -> PreparedRequest:
    """``forwarded``: metadata that becomes parameters (--grpc-header-forward-pattern)."""
    scratch: list[ShmRef] = []
    try:
        return _parse(model, req, arena, registry, scratch, TensorBudget(limits), forwarded)
    except BaseException:
        for ref in scratch:
            arena.free(ref)
        raise


def _parse(model: ModelView, req, arena: ShmArena, registry: ShmRegistry,
           scratch: list[ShmRef], budget: TensorBudget,
           forwarded: dict[str, str] | None = None) -> PreparedRequest:
    raw = req.raw_input_contents
    next_raw = 0
    tensors: list[Tensor] = []
    regions: list[Region] = []
    for inp in req.inputs:
        name = inp.name
        if inp.datatype not in dtypes.ELEMENT_SIZE:
            spec = model.inputs.get(name)
            if spec is not None:        # Triton's core finds it: the model's type, not this one
                raise invalid(f"{validation.request_tag(req.id)}inference input '{name}' "
                              f"data-type is '<invalid>', but model '{model.name}' expects "
                              f"'{spec.datatype}'")
            raise invalid(f"input '{name}' has invalid datatype '{inp.datatype}'")
        shape = list(inp.shape)
        if any(d < 0 for d in shape):
            raise invalid(f"input '{name}': 'shape' must be a list of non-negative integers")
        t = Tensor(name, inp.datatype, shape)
        count = budget.declare(t)
        tparams = parameters_to_dict(inp.parameters)
        typed = inp.HasField("contents") and _has_contents(inp.contents)
        if "shared_memory_region" in tparams:
            if typed:
                raise invalid(f"input '{name}' must set only one of contents and the "
                              f"'shared_memory_region' parameter")
            budget.data(t, request.input_from_region(registry, model, t, tparams, regions,
                                                     req.id))
            tensors.append(t)
            continue
        if typed:
            if raw:
                raise invalid(f"contents field must not be specified when using "
                              f"raw_input_contents for '{name}' for model '{model.name}'")
            data = _typed_contents(model, t, inp.contents, count, req.id)
        else:
            if next_raw >= len(raw):
                raise invalid(f"unable to find data for input tensor '{name}' for model "
                              f"'{model.name}' in request.")
            data = raw[next_raw]
            next_raw += 1
            validation.check_byte_size(model, t, len(data), data, req.id)
        budget.data(t, len(data))
        request.place_data(t, data, arena, scratch)
        tensors.append(t)
    if next_raw != len(raw):
        raise invalid(f"expected {next_raw} raw_input_contents entries for model "
                      f"'{model.name}', got {len(raw)}")
    wanted = None
    if req.outputs:
        wanted = [request.output_wanted(registry, o.name, parameters_to_dict(o.parameters),
                                        True, regions) for o in req.outputs]
    return request.prepare(model, tensors, wanted, parameters_to_dict(req.parameters), req.id,
                           scratch, regions, True, budget.limits, json_outputs=False,
                           forwarded=forwarded)


def build_response(result: InferResult, prepared: PreparedRequest, views: list) -> pb.ModelInferResponse:
    """Outputs always travel in raw_output_contents, one entry per output (empty for outputs
    written into a client's region), as Triton does and as tritonclient reads them."""
    resp = pb.ModelInferResponse(model_name=result.model, model_version=str(result.version),
                                 id=prepared.request_id)
    for t, buf in zip(result.outputs, views):
        resp.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        wanted = prepared.outputs.get(t.name)
        if wanted is not None and wanted.region:
            resp.raw_output_contents.append(b"")     # the bytes are in the client's region
        else:
            resp.raw_output_contents.append(bytes(buf))
    for key, value in result.parameters.items():
        set_parameter(resp.parameters, key, value)
    return resp
