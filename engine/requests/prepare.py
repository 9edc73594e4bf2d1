"""Turning a protocol's view of an infer request into one ``InferPayload``: the steps HTTP and
gRPC share (client shared-memory references, validation, output selection, reserved parameters)
and the clean-up after the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmserve.engine.batching import queues as batching
from shmserve.engine.requests import validation
from shmserve.engine.requests.catalog import ModelView
from shmserve.ipc import dtypes
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.errors import invalid, shm_error
from shmserve.ipc.messages.common import CudaRef, InferPayload, OutputSpec, ShmRef, Tensor, parameter_problem
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache

if TYPE_CHECKING:
    # the frontend's registry of client regions, handed in by the caller (a BLS call has none)
    from shmserve.frontend.shm.regions import Region
    from shmserve.frontend.shm.registry import ShmRegistry

# request parameters that steer the protocol layer (the only 'triton_' keys a request may send)
PROTOCOL_PARAMS = ("binary_data_output", "triton_enable_empty_final_response")
# Triton's words for a request parameter it keeps for itself
RESERVED_WORDS = ("parameter keys starting with 'triton_' are reserved for Triton usage and "
                  "should not be specified.")
# parameters the server consumes (docs/triton-compat.md §1, "Request-level parameters"); every
# other key reaches the model as a custom parameter, as in Triton
RESERVED_PARAMS = frozenset(("sequence_id", "sequence_start", "sequence_end", "priority",
                             "timeout", "headers", *PROTOCOL_PARAMS))
# TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END, what request.flags() returns
SEQUENCE_START, SEQUENCE_END = 1, 2
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on one request's tensors (docs/security.md), each from a flag."""
    max_tensor_bytes: int = 1 << 32         # --max-request-tensor-bytes
    max_json_elements: int = 1 << 23        # --http-max-json-elements


DEFAULT_LIMITS = RequestLimits()


class TensorBudget:
    """What one request's inputs add up to, counted from each input's shape as soon as it is
    read, so that a request past a limit is refused before anything is made for it."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits
        self.bytes = 0
        self.json_elements = 0

    def declare(self, t: Tensor) -> int:
        """Count an input by its shape and datatype; returns its element count. Raises a 400
        naming it when a dim or the count does not fit int64, or when the request's inputs pass
        --max-request-tensor-bytes. A BYTES element counts its 4-byte length prefix."""
        count = shape_elements(t.shape, f"input '{t.name}'")
        size = dtypes.ELEMENT_SIZE[t.datatype] or 4
        if count * size > INT64_MAX:
            raise invalid(f"byte size overflow for input '{t.name}': element count ({count}) * "
                          f"data type size ({size}) exceeds maximum allowed size ({INT64_MAX})")
        self._add(t, count * size)
        return count

    def data(self, t: Tensor, nbytes: int) -> None:
        """The bytes a BYTES input really holds, once known (its shape counted 4 per element)."""
        if dtypes.ELEMENT_SIZE.get(t.datatype) == 0:
            self._add(t, max(0, nbytes - 4 * dtypes.element_count(t.shape)))

    def _add(self, t: Tensor, nbytes: int) -> None:
        self.bytes += nbytes
        limit = self.limits.max_tensor_bytes
        if self.bytes > limit:
            raise invalid(f"input '{t.name}' with shape {t.shape} and datatype {t.datatype} "
                          f"brings the request's input tensors to {self.bytes} bytes, more than "
                          f"the limit of {limit} bytes (--max-request-tensor-bytes)")

    def json(self, name: str, count: int) -> None:
        """An input whose ``count`` elements came as JSON (HTTP)."""
        self.json_elements += count
        limit = self.limits.max_json_elements
        if self.json_elements > limit:
            raise invalid(f"input '{name}' brings the request's JSON tensor data to "
                          f"{self.json_elements} elements, more than the limit of {limit} "
                          f"(--http-max-json-elements); send it as binary data instead (the "
                          f"'binary_data_size' parameter)")


def shape_elements(shape: list[int], what: str) -> int:
    """The element count of ``shape``; a 400 naming ``what`` if it does not fit int64 (in
    Triton's words)."""
    if any(d > INT64_MAX for d in shape):
        raise invalid(f"invalid shape for {what}: shape {shape} contains one or more invalid "
                      f"dimensions (a dim larger than a 64-bit integer holds)")
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > INT64_MAX:
            raise invalid(f"invalid shape for {what}: shape {shape} causes total element count "
                          f"to exceed maximum size of {INT64_MAX}")
    return count


def check_json_outputs(model_name: str, shapes: list[tuple[str, list[int]]],
                       limit: int) -> None:
    """Outputs to be returned as JSON hold at most ``limit`` elements in all: a 400 naming the
    output that passes it, which asks for binary data instead."""
    total = 0
    for name, shape in shapes:
        count = shape_elements(shape, f"output '{name}'")
        total += count
        if total > limit:
            others = f" ({total} with the other JSON outputs)" if total != count else ""
            raise invalid(f"output '{name}' of model '{model_name}' has {count} elements"
                          f"{others}, more than can be returned as JSON (the limit is {limit}, "
                          f"--http-max-json-elements); request it as binary data: set its "
                          f"parameter 'binary_data' (or the request parameter "
                          f"'binary_data_output') to true")


# These two are made for every request: plain classes, whose __init__ mypyc compiles (a
# dataclass's generated __init__ stays interpreted, 0.2 us a request here)
class OutputWanted:
    __slots__ = ("name", "binary", "region", "ref", "classification")

    def __init__(self, name: str, binary: bool = False, region: str = "",
                 ref: ShmRef | CudaRef | None = None, classification: int = 0) -> None:
        self.name = name
        self.binary = binary                # HTTP: return as binary data
        self.region = region                # client region the output is written into
        self.ref = ref                      # where in it (a system or a CUDA region)
        self.classification = classification    # > 0: the top K entries instead (§1.9)


class PreparedRequest:
    __slots__ = ("payload", "batch_size", "outputs", "request_id", "scratch", "regions",
                 "priority", "timeout_us", "shape_key", "trace")

    def __init__(self, payload: InferPayload, batch_size: int, outputs: dict[str, OutputWanted],
                 request_id: str, scratch: list[ShmRef] | None = None,
                 regions: list[Region] | None = None, priority: int = 0, timeout_us: int = 0,
                 shape_key: str = "", trace: Any = None) -> None:
        self.payload = payload
        self.batch_size = batch_size
        self.outputs = outputs
        self.request_id = request_id
        self.scratch: list[ShmRef] = [] if scratch is None else scratch    # arena slots to free
        self.regions: list[Region] = [] if regions is None else regions    # client regions in use
        self.priority = priority
        self.timeout_us = timeout_us
        self.shape_key = shape_key
        self.trace = trace      # a Trace (frontend/observability/trace.py) when it is traced


def place_data(t: Tensor, data: bytes, arena: ShmArena, scratch: list[ShmRef]) -> None:
    """Small tensor bytes ride in the message; larger ones are copied into the frontend's arena
    (the slot is freed with the request)."""
    if len(data) > INLINE_LIMIT:
        try:
            slot = arena.alloc(len(data))
        except ShmError as e:       # /dev/shm full: 507 / RESOURCE_EXHAUSTED, not a crash
            raise shm_error(e) from None
        slot.view[:] = data
        scratch.append(slot.ref)
        t.shm = slot.ref
    else:
        t.data = data


def input_from_region(registry: ShmRegistry, model: ModelView, t: Tensor, params: dict,
                      regions: list[Region], request_id: str = "") -> int:
    """Point ``t`` at its bytes in a client's region (system or CUDA); returns their size."""
    what = f"input '{t.name}'"
    region, ref = registry.resolve(params.get("shared_memory_region"),
                                   params.get("shared_memory_byte_size"),
                                   params.get("shared_memory_offset", 0), what)
    validation.check_byte_size(model, t, ref.nbytes, None, request_id)
    if isinstance(ref, CudaRef):
        t.cuda = ref
    else:
        t.shm = ref
    regions.append(region)
    return ref.nbytes


def output_wanted(registry: ShmRegistry, name: str, params: dict, binary_default: bool,
                  regions: list[Region]) -> OutputWanted:
    classes = 0
    if "classification" in params:
        if "shared_memory_region" in params:
            raise invalid(f"output '{name}': classification cannot be written to shared memory")
        asked = params["classification"]     # any JSON value until checked
        if not isinstance(asked, int) or isinstance(asked, bool) or \
                not 0 < asked < 1 << 64:
            raise invalid(f"output '{name}': invalid value for 'classification' parameter, "
                          f"expected a positive integer, got {asked!r}")
        classes = asked
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
    return OutputWanted(name, binary is True, classification=classes)


def prepare(model: ModelView, tensors: list[Tensor], outputs: list[OutputWanted] | None,
            params: dict[str, Any], request_id: str, scratch: list[ShmRef],
            regions: list[Region], binary_default: bool = False,
            limits: RequestLimits = DEFAULT_LIMITS, json_outputs: bool = True,
            forwarded: dict[str, str] | None = None,
            protocol_params: tuple[str, ...] = PROTOCOL_PARAMS) -> PreparedRequest:
    """``json_outputs``: whether outputs not asked for as binary come back as JSON (HTTP);
    ``forwarded``: headers that become string parameters (engine/requests/header_forward.py; a
    header overrides a request parameter of the same name); ``protocol_params``: the
    ``triton_`` keys the protocol itself takes (gRPC's triton_enable_empty_final_response;
    HTTP takes none)."""
    if forwarded:
        params = {**params, **forwarded}
    batch = validation.validate_inputs(model, tensors, request_id)
    if outputs is None:
        outputs = [OutputWanted(n, binary_default) for n in model.output_names]
    else:
        validation.check_outputs(model, [o.name for o in outputs])
        _check_classification(model, outputs)
    wanted = {}
    for o in outputs:
        if o.name in wanted:
            raise invalid(f"output '{o.name}' already exists in request for model "
                          f"'{model.name}'")
        wanted[o.name] = o
    if json_outputs:
        _json_outputs_fit(model, batch, outputs, limits.max_json_elements)
    priority = timeout_us = flags = 0
    correlation_id: int | str = 0
    model_params = params
    if params:
        for key in params:
            if key.startswith("triton_") and key not in protocol_params:
                raise invalid(RESERVED_WORDS)
        priority = _unsigned(params, "priority")
        timeout_us = _unsigned(params, "timeout")
        correlation_id, flags = _sequence(params)
        model_params = {k: v for k, v in params.items() if k not in RESERVED_PARAMS}
        _check_custom(model_params)
    if model.sequence and not model.iterative:
        _check_sequence(model, batch, correlation_id)
    payload = InferPayload(request_id, tensors,
                           [_output_spec(o, model.labels) for o in outputs],
                           model_params, correlation_id, flags)
    for r in regions:
        r.in_use += 1
    return PreparedRequest(payload, batch, wanted, request_id, scratch, regions, priority,
                           timeout_us, shape_key(model, tensors))


def _output_spec(o: OutputWanted, labels: dict[str, list[bytes]]) -> OutputSpec:
    if isinstance(o.ref, CudaRef):
        return OutputSpec(o.name, None, o.classification, o.ref)
    if o.classification and o.name in labels:   # an ensemble's output, with its own labels
        return OutputSpec(o.name, o.ref, o.classification, labels=labels[o.name])
    return OutputSpec(o.name, o.ref, o.classification)


def _check_sequence(model: ModelView, batch: int, correlation_id: int | str) -> None:
    """What the sequence batcher needs of every request, in Triton's words; whether the
    sequence is live is the scheduler's to say."""
    if correlation_id == 0 or correlation_id == "":
        raise invalid(f"inference request to model '{model.name}' must specify a non-zero or "
                      f"non-empty correlation ID")
    if isinstance(correlation_id, str) and model.integer_corrid:
        # refused here, before the sequence takes a slot its worker would refuse it in
        raise invalid(f"inference request to model '{model.name}' has the string correlation "
                      f"ID '{correlation_id}', but the model's CORRID control is "
                      f"{model.integer_corrid}: use an unsigned integer sequence_id")
    if model.max_batch_size > 0 and batch != 1:
        raise invalid(f"inference request to model '{model.name}' must specify batch-size 1 "
                      f"due to requirements of sequence batcher")


def _check_classification(model: ModelView, outputs: list[OutputWanted]) -> None:
    """Classification ranks numbers: an output of another datatype is refused before the model
    runs, with Triton's words (it says so only after the execution)."""
    for o in outputs:
        if o.classification:
            datatype = model.outputs[o.name].datatype
            if datatype not in dtypes.CLASSIFIABLE:
                raise invalid(f"output '{o.name}': class result not available for output due "
                              f"to unsupported type '{datatype}'")


def _json_outputs_fit(model: ModelView, batch: int, outputs: list[OutputWanted],
                      limit: int) -> None:
    """JSON outputs whose config dims are all fixed show their size before the model runs: one
    past --http-max-json-elements is refused now rather than after the execution (the others
    are checked on the answer, before it is encoded)."""
    lead = [batch] if model.max_batch_size > 0 else []
    shapes = []
    for o in outputs:
        spec = model.outputs.get(o.name)
        if not o.binary and not o.region and spec is not None and -1 not in spec.dims:
            if o.classification:        # K strings per batch item, at most one per entry
                count = shape_elements(list(spec.dims), f"output '{o.name}'")
                shapes.append((o.name, lead + [min(o.classification, count)]))
            else:
                shapes.append((o.name, lead + list(spec.dims)))
    if shapes:
        check_json_outputs(model.name, shapes, limit)


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
    return batching.shape_key(tensors, model.variable_inputs, model.has_optional,
                              model.max_batch_size > 0)


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
    views: list[Any] = []
    for t in result.outputs:
        wanted = prepared.outputs.get(t.name)
        if wanted is not None and wanted.region:
            views.append(None)
        else:
            views.append(t.data if t.shm is None else maps.view(t.shm))
    return views
