"""Turning a protocol's view of an infer request into one ``InferPayload``: the steps HTTP and
gRPC share (client shared-memory references, validation, output selection, reserved parameters)
and the clean-up after the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.messages import InferPayload, InferResult, OutputSpec, ShmRef, Tensor, parameter_problem
from shmserve.ipc.shm import ShmArena, ShmMapCache

from . import validation
from .catalog import ModelView
from .errors import invalid
from .shm_registry import ShmRegistry, SystemRegion

# request parameters that steer the protocol layer (the only 'triton_' keys a request may send)
PROTOCOL_PARAMS = ("binary_data_output", "triton_enable_empty_final_response")
# parameters the server consumes (docs/triton-compat.md §1, "Request-level parameters"); every
# other key reaches the model as a custom parameter, as in Triton
RESERVED_PARAMS = frozenset(("sequence_id", "sequence_start", "sequence_end", "priority",
                             "timeout", "headers", *PROTOCOL_PARAMS))
# TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END, what request.flags() returns
SEQUENCE_START, SEQUENCE_END = 1, 2


@dataclass(slots=True)
class OutputWanted:
    name: str
    binary: bool = False                  # HTTP: return as binary data
    region: str = ""                      # client region the output is written into
    ref: ShmRef | None = None


@dataclass
class PreparedRequest:
    payload: InferPayload
    batch_size: int
    outputs: dict[str, OutputWanted]
    request_id: str
    scratch: list[ShmRef] = field(default_factory=list)    # frontend arena slots to free
    regions: list[SystemRegion] = field(default_factory=list)  # client regions in use
    priority: int = 0
    timeout_us: int = 0
    shape_key: str = ""


def place_data(t: Tensor, data: bytes, arena: ShmArena, scratch: list[ShmRef]) -> None:
    """Small tensor bytes ride in the message; larger ones are copied into the frontend's arena
    (the slot is freed with the request)."""
    if len(data) > INLINE_LIMIT:
        slot = arena.alloc(len(data))
        slot.view[:] = data
        scratch.append(slot.ref)
        t.shm = slot.ref
    else:
        t.data = data


def input_from_region(registry: ShmRegistry, model: ModelView, t: Tensor, params: dict,
                      regions: list[SystemRegion]) -> None:
    what = f"input '{t.name}'"
    region, ref = registry.resolve(params.get("shared_memory_region"),
                                   params.get("shared_memory_byte_size"),
                                   params.get("shared_memory_offset", 0), what)
    validation.check_byte_size(model, t, ref.nbytes)
    t.shm = ref
    regions.append(region)


def output_wanted(registry: ShmRegistry, name: str, params: dict, binary_default: bool,
                  regions: list[SystemRegion]) -> OutputWanted:
    if "classification" in params:
        if "shared_memory_region" in params:
            raise invalid(f"output '{name}': classification cannot be written to shared memory")
        raise invalid(f"output '{name}': the classification extension is not supported on this "
                      f"server yet")
    if "shared_memory_region" in params:
        if params.get("binary_data") is True:
            raise invalid(f"output '{name}': binary_data cannot be combined with "
                          f"shared_memory_region")
        region, ref = registry.resolve(params["shared_memory_region"],
                                       params.get("shared_memory_byte_size"),
                                       params.get("shared_memory_offset", 0), f"output '{name}'")
        regions.append(region)
        return OutputWanted(name, False, region.name, ref)
    binary = params.get("binary_data", binary_default)
    return OutputWanted(name, binary is True)


def prepare(model: ModelView, tensors: list[Tensor], outputs: list[OutputWanted] | None,
            params: dict[str, Any], request_id: str, scratch: list[ShmRef],
            regions: list[SystemRegion], binary_default: bool = False) -> PreparedRequest:
    batch = validation.validate_inputs(model, tensors)
    if outputs is None:
        outputs = [OutputWanted(n, binary_default) for n in model.output_names]
    else:
        validation.check_outputs(model, [o.name for o in outputs])
    wanted = {}
    for o in outputs:
        if o.name in wanted:
            raise invalid(f"output '{o.name}' is requested more than once")
        wanted[o.name] = o
    priority = timeout_us = flags = 0
    correlation_id: int | str = 0
    model_params = params
    if params:
        for key in params:
            if key.startswith("triton_") and key not in PROTOCOL_PARAMS:
                raise invalid(f"parameter '{key}' is reserved: keys starting with 'triton_' "
                              f"cannot be set by a request")
        priority = _unsigned(params, "priority")
        timeout_us = _unsigned(params, "timeout")
        correlation_id, flags = _sequence(params)
        model_params = {k: v for k, v in params.items() if k not in RESERVED_PARAMS}
        _check_custom(model_params)
    payload = InferPayload(request_id, tensors, [OutputSpec(o.name, o.ref) for o in outputs],
                           model_params, correlation_id, flags)
    for r in regions:
        r.in_use += 1
    return PreparedRequest(payload, batch, wanted, request_id, scratch, regions, priority,
                           timeout_us, shape_key(model, tensors))


def _unsigned(params: dict, key: str) -> int:
    value = params.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise invalid(f"request parameter '{key}' must be an unsigned 64-bit integer, got "
                      f"{value!r}")
    return value


def _check_custom(params: dict) -> None:
    problem = parameter_problem(params)
    if problem:
        raise invalid(f"request parameter {problem}")


def _sequence(params: dict) -> tuple[int | str, int]:
    """The correlation id and START/END flags a request carries (request.correlation_id() and
    request.flags() in a python model). A model without a sequence batcher sees them as sent."""
    cid = params.get("sequence_id", 0)
    if isinstance(cid, bool) or not isinstance(cid, (int, str)) or \
            (isinstance(cid, int) and not 0 <= cid < 1 << 64):
        raise invalid(f"request parameter 'sequence_id' must be an unsigned 64-bit integer or a "
                      f"string, got {cid!r}")
    flags = 0
    for key, bit in (("sequence_start", SEQUENCE_START), ("sequence_end", SEQUENCE_END)):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise invalid(f"request parameter '{key}' must be a boolean, got {value!r}")
        if value:
            flags |= bit
    return cid, flags


def shape_key(model: ModelView, tensors: list[Tensor]) -> str:
    """Requests may share a batch only if the shapes of their variable-dim inputs agree (and,
    with optional inputs, the same inputs are present): this key says which ones can."""
    if not model.batch_sensitive:
        return ""
    parts = []
    for t in sorted(tensors, key=lambda t: t.name):
        if t.name in model.variable_inputs:
            parts.append(f"{t.name}{t.shape[1:] if model.max_batch_size else t.shape}")
        elif model.has_optional:
            parts.append(t.name)
    return ";".join(parts)


def release(prepared: PreparedRequest, arena: ShmArena) -> None:
    """The worker is done with the request's memory: free our slots, let go of client regions."""
    for ref in prepared.scratch:
        arena.free(ref)
    prepared.scratch = []
    for r in prepared.regions:
        r.in_use -= 1
    prepared.regions = []


def worker_slots(result: InferResult, prepared: PreparedRequest) -> list[ShmRef]:
    """Output slots of the worker's arena that the answer points at (to give back once sent)."""
    return [t.shm for t in result.outputs if t.shm is not None
            and not (t.name in prepared.outputs and prepared.outputs[t.name].region)]


def output_views(result: InferResult, prepared: PreparedRequest, maps: ShmMapCache) -> list:
    """Each output's bytes: inline bytes, a view of the worker's slot, or None when the output
    was written into the client's region. Raises ShmError if a slot cannot be mapped."""
    views = []
    for t in result.outputs:
        wanted = prepared.outputs.get(t.name)
        if wanted is not None and wanted.region:
            views.append(None)
        else:
            views.append(t.data if t.shm is None else maps.view(t.shm))
    return views
