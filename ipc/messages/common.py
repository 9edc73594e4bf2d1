"""What messages carry, whichever way they go: the enums that name states, actions and errors,
references to shared memory, tensors, the request payload that rides beside a message, and the
records that ride inside messages of more than one direction (completion records, pipeline hops,
sequence slots, python models' metrics)."""
from __future__ import annotations

import enum
from typing import Any

import msgspec


# (msgspec encodes an enum by its value, so the wire carries the same short strings as before)
class ErrorCode(str, enum.Enum):
    """Triton's error classes; each frontend maps them to HTTP and gRPC status codes."""
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    UNKNOWN = "UNKNOWN"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"   # the host ran out of something (/dev/shm is full)


class ModelState(str, enum.Enum):
    """State of one model version, as the repository index reports it."""
    UNKNOWN = "UNKNOWN"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class StateCause(str, enum.Enum):
    """Why a version is in the state it is in, where a client's decision depends on it (the
    readiness rule treats an unloaded version as not failed); the reason text is for people."""
    NONE = ""
    UNLOADED = "unloaded"
    LOAD_FAILED = "load_failed"
    CRASH_LOOP = "crash_loop"


class ControlAction(str, enum.Enum):
    LOAD = "load"
    UNLOAD = "unload"


class ShmRef(msgspec.Struct, array_like=True, frozen=True):
    """A byte range inside a POSIX shared-memory segment (``/dev/shm/<segment>``)."""
    segment: str
    offset: int
    nbytes: int


class CudaRef(msgspec.Struct, array_like=True, frozen=True):
    """A byte range inside a device allocation that a CUDA IPC handle (``cudaIpcMemHandle_t``,
    64 bytes) exports, on GPU ``device_id``: a client's CUDA shared-memory region, or a slot of
    a worker's device arena (an ensemble's intermediate tensor, workers/device_arena.py). The
    worker opens the handle (cached) and reads or writes ``nbytes`` at ``offset`` from its base."""
    handle: bytes
    device_id: int
    offset: int
    nbytes: int


class Tensor(msgspec.Struct, array_like=True):
    """Tensor metadata plus inline bytes, a shared-memory reference, or (a client's CUDA
    shared-memory region) a CUDA reference."""
    name: str
    datatype: str
    shape: list[int]
    data: bytes | None = None
    shm: ShmRef | None = None
    cuda: CudaRef | None = None


class OutputSpec(msgspec.Struct, array_like=True):
    name: str
    shm: ShmRef | None = None   # write the output here (a client's region) instead of returning it
    # classification extension: > 0 asks for the top K entries per batch item as BYTES
    # "<value>:<index>[:<label>]" instead of the tensor (never with shm; workers/classification.py)
    classification: int = 0
    cuda: CudaRef | None = None     # write the output into a client's CUDA region
    # the consumer takes device tensors (an ensemble's intermediate tensor that only later
    # steps read): an output the model leaves on a GPU may stay there, in a slot of the
    # worker's device arena (Tensor.cuda), instead of being copied to host memory
    device: bool = False
    # an ensemble output's class labels (its config's label_filename), for the step's worker
    # to classify with instead of the step model's own; sent only with a classification
    labels: list[bytes] | None = None


def parameter_problem(params: dict) -> str:
    """Request and response parameters are scalars the protocols can carry: a string, a bool,
    a 64-bit integer or a double. Says which one is not and why ("" when all are): anything
    else would fail later, while a message is encoded."""
    for key, value in params.items():
        if isinstance(value, (str, bool, float)):
            continue
        if isinstance(value, int):
            if -(1 << 63) <= value < 1 << 64:
                continue
            return f"'{key}' is out of the 64-bit integer range"
        return f"'{key}' must be a string, boolean, integer or number, got {type(value).__name__}"
    return ""


class InferPayload(msgspec.Struct, array_like=True):
    """What a worker needs to execute one request; opaque to the scheduler."""
    request_id: str
    inputs: list[Tensor]
    outputs: list[OutputSpec]   # the outputs to produce, in response order
    parameters: dict[str, Any] = {}     # the request's custom parameters
    correlation_id: int | str = 0       # sequence_id; 0 = none
    flags: int = 0                      # SEQUENCE_START 1 | SEQUENCE_END 2
    chain: list[str] = []               # BLS: the models whose executions made this request


# The frontend id of the scheduler itself, as the client of an ensemble's steps: workers send
# the answers of requests from it to the scheduler (engine/ensemble.py). Client frontends are
# numbered from 0; workers' BLS clients from 1 << 24 (workers/bls.py).
ENSEMBLE_FRONTEND = (1 << 24) - 1


BLS_FRONTEND_BASE = 1 << 24         # a worker's BLS client is this plus its spawn id


class LogFormat(str, enum.Enum):
    """How a log line starts (Triton's --log-format; docs/triton-compat.md §1.14)."""
    DEFAULT = "default"         # I1201 12:00:00.123456 <pid> <file>:<line>] <message>
    ISO8601 = "ISO8601"         # 2026-12-01T12:00:00Z I <pid> <file>:<line>] <message>


class LogSettings(msgspec.Struct, array_like=True, frozen=True):
    """What every process's log lines obey: --log-info/-warning/-error/-verbose/-format at
    start, the logging extension (GET/POST /v2/logging, gRPC LogSettings) after that. The log
    file is fixed at start (ServerSettings.log_file) and is not part of it."""
    info: bool = True
    warning: bool = True
    error: bool = True
    verbose: int = 0
    format: LogFormat = LogFormat.DEFAULT


class TraceConfig(msgspec.Struct, array_like=True, frozen=True):
    """Trace settings (--trace-config at start, the trace extension after it;
    frontend/trace.py)."""
    level: list[str] = msgspec.field(default_factory=lambda: ["OFF"])   # or TIMESTAMPS, TENSORS
    rate: int = 1000                # one request traced in this many
    count: int = -1                 # traces left to take; -1: no limit
    log_frequency: int = 0          # write every this many traces; 0: when the server stops
    file: str = ""
    mode: str = "triton"


class TraceChanges(msgspec.Struct, omit_defaults=True):
    """What a trace settings update asks for (checked): a field left UNSET is not changed,
    None sets it back (frontend/trace.py)."""
    level: list[str] | None | msgspec.UnsetType = msgspec.UNSET
    rate: int | None | msgspec.UnsetType = msgspec.UNSET
    count: int | None | msgspec.UnsetType = msgspec.UNSET
    log_frequency: int | None | msgspec.UnsetType = msgspec.UNSET
    mode: str | None | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, Any]:
        """The fields the update names (TraceConfig's field names) and their values."""
        return {f: v for f in self.__struct_fields__
                if (v := getattr(self, f)) is not msgspec.UNSET}


class SequenceSlot(msgspec.Struct, array_like=True):
    """A live sequence pinned to an instance that is lent (engine/sequence_batcher.py): its
    correlation id, and when it last ran (CLOCK_MONOTONIC, system-wide: its idle time goes on
    counting in the other process)."""
    cid: int | str
    last_ns: int


class ChainHop(msgspec.Struct, array_like=True):
    """One step of an ensemble whose steps run one after the other (engine/ensemble_plan.py
    ``chain``): the worker that ran a step hands the request to the next step's worker."""
    step: int                   # its index in the ensemble's config (for error messages)
    model: str
    version: int                # the version that serves it (resolved by the scheduler)
    inputs: dict[str, str]      # model input -> ensemble tensor
    outputs: dict[str, str]     # model output -> ensemble tensor
    max_batch_size: int = 0
    input_dims: dict[str, list[int]] = {}       # without the batch dimension


class MetricKind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class MetricSample(msgspec.Struct, array_like=True):
    """One labelled metric of a python model's family: its value, or a histogram's state."""
    labels: dict[str, str]
    value: float = 0.0                  # counter / gauge
    buckets: list[float] = []           # histogram upper bounds (without +Inf)
    counts: list[int] = []              # histogram: per bucket, the last one is +Inf
    sum: float = 0.0                    # histogram
    set_ns: int = 0                     # gauge: time.monotonic_ns() of its last set(), 0: never


class MetricFamilyState(msgspec.Struct, array_like=True):
    name: str
    description: str
    kind: MetricKind
    metrics: list[MetricSample] = []


class CustomMetrics(msgspec.Struct, array_like=True, tag=34):
    """The whole current state of a worker's pb_utils.MetricFamily objects (replaces the last)."""
    spawn_id: int
    families: list[MetricFamilyState] = []


class LeasedRecord(msgspec.Struct, array_like=True):
    """What a request a frontend sent under a lease adds to the statistics. Its worker fills
    it in (InferResult.done) from the request it ran; the frontend passes these on in bulk
    (LeasedDone). Flat and small: the scheduler decodes ~100 at a time at concurrency 1."""
    spawn_id: int
    model: str
    version: int
    batch_size: int
    received_ns: int            # when the frontend got the request
    finished_ns: int            # when it finished (statistics count to then, not to when
                                # the record reaches the scheduler)
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    failed: bool = False
    # the inferences of the execution this record counts (-1: its request's alone; 0: another
    # record of the same execution counts it; workers/lease_batch.py)
    executed: int = -1


class CacheRecord(msgspec.Struct, array_like=True):
    """What a frontend's response cache adds to a model version's statistics: a hit (answered
    from the cache: a success, not an inference), a miss (its lookup), or an insert after a
    miss (``count`` 0: its time joins the misses' duration, as in Triton)."""
    model: str
    version: int
    hit: bool
    cache_ns: int               # the lookup, or the insert
    total_ns: int = 0           # a hit: the request's duration, submit to answer
    count: int = 1
