"""Every message that crosses a process boundary, with its one encode and one decode place.

Messages are msgspec Structs encoded as msgpack arrays (``array_like``) with an integer tag, so a
frame costs a few bytes of framing and decoding yields typed objects, not dicts.

A message travels as ZeroMQ multipart: frame 0 is the encoded message; ``SubmitRequest`` and
``ExecuteBatch`` are followed by one opaque frame per request holding the encoded ``InferPayload``.
The scheduler only decodes frame 0 and forwards the payload frames untouched, so tensor data that
rides inline is never decoded or re-encoded on the way to a worker.
"""
from __future__ import annotations

import enum
from typing import Any, Union

import msgspec


# ---- the vocabulary: every field that names a state, an action or an error class is an enum
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


# ---- frontend -> scheduler -------------------------------------------------------------------
class FrontendHello(msgspec.Struct, array_like=True, tag=1):
    frontend: int
    address: str
    leases: bool = True         # False: a worker's BLS client, which never takes a lease


class SubmitRequest(msgspec.Struct, array_like=True, tag=2):
    """Routing header; the payload frame follows. Holds what batching decides on."""
    req_id: int
    frontend: int
    model: str
    version: int
    batch_size: int
    received_ns: int = 0        # time.monotonic_ns() at the frontend (system-wide clock)
    priority: int = 0
    timeout_us: int = 0
    shape_key: str = ""         # equal keys may share a batch (variable-dim input shapes)
    # set when the request went straight to a leased worker that died holding it: why, and
    # whether that death allows a retry; the scheduler runs it again alone or fails it
    lost: str = ""
    lost_retry: bool = True
    # the frontend holds a lease for this version but could not use it (the worker's inbox
    # full, or gone): the scheduler must queue it rather than hand it back
    no_lease: bool = False
    # BLS: a python model's request (from its worker), and the models whose executions wait
    # for it; one that would wait for an instance its own chain holds is refused (deadlock)
    chain: list[str] = []
    # the sequence batcher routes by these (they are in the payload too, for the model)
    sequence_id: int | str = 0
    sequence_flags: int = 0
    trace: bool = False         # traced (frontend/trace.py): the worker reports its times


class LeasedDone(msgspec.Struct, array_like=True, tag=6):
    """Completion records of requests this frontend sent under leases (InferResult.done), for
    the scheduler's statistics. Sent every LEASED_FLUSH_S while there are any, and before any
    statistics query or control request, which travel the same socket: a query never misses a
    request its client already has the answer of."""
    records: list["LeasedRecord"]
    cache: list["CacheRecord"] = []     # response cache lookups and inserts (frontend)


class CancelRequest(msgspec.Struct, array_like=True, tag=5):
    """The client went away: the scheduler drops the request if it is still queued, and
    forwards this message to the worker running it (``request.is_cancelled()``)."""
    frontend: int
    req_id: int


class SequencesLost(msgspec.Struct, array_like=True, tag=9):
    """The leased worker that held these sequences of a model ended (LeaseLost): the scheduler
    tells their next requests why they must start again, as it does for the sequences it
    lent (the frontend alone knows the ones started under the lease)."""
    model: str
    version: int
    cids: list[int | str]


class StatsQuery(msgspec.Struct, array_like=True, tag=3):
    frontend: int
    query_id: int
    model: str = ""             # "" = every model
    version: int = -1           # -1 = every ready version


class ControlRequest(msgspec.Struct, array_like=True, tag=4):
    """Repository extension: load (or reload) / unload a model; answered when it is done."""
    frontend: int
    query_id: int
    action: ControlAction
    name: str
    config: str = ""            # load: JSON ModelConfig overriding config.pbtxt
    unload_dependents: bool = False
    # load: the model directory the frontend wrote a client's 'file:' parameters into (under
    # ServerSettings.model_upload_dir); the scheduler owns and removes it from here on
    upload_dir: str = ""


# ---- log settings: frontend -> scheduler -> every worker and other frontend --------------------
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


class SetTraceSettings(msgspec.Struct, array_like=True, tag=8):
    """A client changed trace settings at one frontend (``model`` "" for the global ones): the
    scheduler passes it on to every other frontend and answers the first with a ControlReply,
    as for SetLogSettings."""
    changes: TraceChanges
    model: str = ""
    frontend: int = -1
    query_id: int = 0


class SetLogSettings(msgspec.Struct, array_like=True, tag=7):
    """New log settings for every process. From the frontend a client asked (``query_id`` > 0):
    the scheduler applies them, passes them on to every connected worker and every other
    frontend (``query_id`` 0), then answers with a ControlReply. They travel the scheduler's
    sockets ahead of any request the client sends after its answer, so a worker reads them
    before such a request."""
    settings: LogSettings
    frontend: int = -1
    query_id: int = 0


# ---- scheduler -> frontend -------------------------------------------------------------------
class VersionInfo(msgspec.Struct, array_like=True):
    version: int
    state: ModelState
    reason: str = ""
    cause: StateCause = StateCause.NONE
    # which load of the version serves (its start, ns on the scheduler's clock): a reload
    # changes it even when the state stays READY (frontends drop cached answers then)
    loaded: int = 0
    # an ensemble whose steps run one after the other: its steps, with the versions serving
    # them now (a frontend that holds leases on them all sends it worker to worker)
    route: list["ChainHop"] = []


class ModelInfo(msgspec.Struct, array_like=True):
    name: str
    config: bytes               # serialized inference.ModelConfig (normalized)
    versions: list[VersionInfo]
    # --model-control-mode=on_demand: a request for a version that is not READY is held by the
    # scheduler while the model loads (config b"": the model completes it when it first loads)
    on_demand: bool = False


class ModelTable(msgspec.Struct, array_like=True, tag=10):
    """The scheduler's whole view of the repository; sent on every state change."""
    models: list[ModelInfo]
    startup_done: bool


class Duration(msgspec.Struct, array_like=True):
    count: int = 0
    ns: int = 0


class ResponseStatistics(msgspec.Struct, array_like=True):
    """The responses a backend reported at one index of their requests (Triton's
    response_stats: the first response of every request counts at "0", and so on)."""
    compute_infer: Duration = msgspec.field(default_factory=Duration)
    compute_output: Duration = msgspec.field(default_factory=Duration)
    success: Duration = msgspec.field(default_factory=Duration)
    fail: Duration = msgspec.field(default_factory=Duration)
    empty_response: Duration = msgspec.field(default_factory=Duration)
    cancel: Duration = msgspec.field(default_factory=Duration)


class BatchStatistics(msgspec.Struct, array_like=True):
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class ModelStatistics(msgspec.Struct, array_like=True):
    """One model version's counters, kept by the scheduler for the server's whole life."""
    name: str
    version: int
    last_inference: int = 0     # ms since the epoch
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = msgspec.field(default_factory=Duration)
    fail: Duration = msgspec.field(default_factory=Duration)
    queue: Duration = msgspec.field(default_factory=Duration)
    compute_input: Duration = msgspec.field(default_factory=Duration)
    compute_infer: Duration = msgspec.field(default_factory=Duration)
    compute_output: Duration = msgspec.field(default_factory=Duration)
    cache_hit: Duration = msgspec.field(default_factory=Duration)
    cache_miss: Duration = msgspec.field(default_factory=Duration)
    batch_stats: list[BatchStatistics] = []
    response_stats: dict[str, ResponseStatistics] = {}     # by response index ("0", "1", ..)
    failures: dict[str, int] = {}           # reason (REJECTED, CANCELED, BACKEND, OTHER) -> count
    pending: int = 0                        # queued, not yet handed to an instance
    load_seconds: float = 0.0
    latency_buckets: list[int] = []         # first-response histogram counts (ms buckets)
    latency_sum_ms: float = 0.0
    # --metrics-config summary_latencies: per duration kind, quantile values (µs) over the
    # latest observations, in the order of stats.SUMMARY_QUANTILES
    summaries: dict[str, list[float]] = {}


class WorkerGone(msgspec.Struct, array_like=True, tag=13):
    """A worker died. ``requests`` (of the frontend this goes to) are ones it answered in its
    last batches: an answer still in its ZeroMQ queue died with it, so each of them that the
    frontend still waits for is submitted again."""
    spawn_id: int
    requests: list[int]
    # decoupled models: sent to every frontend; a request it still streams ends with this error
    reason: str = ""


class ControlReply(msgspec.Struct, array_like=True, tag=12):
    query_id: int
    error: str = ""
    code: ErrorCode | None = None


class StatsReply(msgspec.Struct, array_like=True, tag=11):
    query_id: int
    models: list[ModelStatistics]
    ipc: dict[str, int]
    error: str = ""
    custom_metrics: list[CustomMetrics] = []     # python models' own metrics, per live worker
    leased: dict[str, int] = {}     # per model: requests frontends sent under leases (finished)
    on_demand: OnDemandStats | None = None      # --model-control-mode=on_demand only


class OnDemandModel(msgspec.Struct, array_like=True):
    """One model's on-demand counters (engine/residency.py), for /metrics."""
    name: str
    loads: int = 0
    evictions: int = 0          # unloaded to make room for another model under the budget
    idle_unloads: int = 0       # unloaded after --model-idle-unload-secs without requests
    memory_bytes: int = 0       # charged against the budget now (0: not resident)


class OnDemandStats(msgspec.Struct, array_like=True):
    budget_bytes: int                   # 0 = no budget
    resident_bytes: int                 # everything charged against the budget now
    models: list[OnDemandModel]         # the models ever loaded
    wait_bounds_us: list[float] = []    # histogram of the waits of requests held for a load
    wait_counts: list[int] = []         # per bound, then +Inf
    wait_sum_us: float = 0.0


# ---- scheduler -> worker ---------------------------------------------------------------------
class RequestRoute(msgspec.Struct, array_like=True):
    req_id: int
    frontend: int
    trace: bool = False         # answer with the execution's times (InferResult.compute_ns)


class ExecuteBatch(msgspec.Struct, array_like=True, tag=20):
    """One execution; one payload frame per route follows."""
    batch_id: int
    routes: list[RequestRoute]


class SequenceSlot(msgspec.Struct, array_like=True):
    """A live sequence pinned to an instance that is lent (engine/sequence_batcher.py): its
    correlation id, and when it last ran (CLOCK_MONOTONIC, system-wide: its idle time goes on
    counting in the other process)."""
    cid: int | str
    last_ns: int


class LendSequences(msgspec.Struct, array_like=True, tag=28):
    """Sent to a sequence model's worker before its lease is granted: the live sequences the
    scheduler had pinned to it, which its own sequence batcher takes over for the lease
    (workers/lease_sequences.py). LeaseEnded gives them back."""
    lease_id: int
    sequences: list[SequenceSlot]


class RevokeLease(msgspec.Struct, array_like=True, tag=25):
    """Leases up to ``lease_id`` end: a LeasedExecute of one of them that the worker reads
    after this goes back to its frontend (LeaseBounced). Answered by LeaseEnded."""
    lease_id: int


class Shutdown(msgspec.Struct, array_like=True, tag=21):
    pass


class Ping(msgspec.Struct, array_like=True, tag=24):
    """Sent to idle workers; one that does not answer in time is killed and restarted."""
    seq: int


# ---- frontend -> worker ----------------------------------------------------------------------
class ReleaseOutputs(msgspec.Struct, array_like=True, tag=22):
    refs: list[ShmRef]
    # slots of the worker's device arena (only the scheduler sends these: an ensemble's
    # intermediate tensors never reach a frontend)
    device: list[CudaRef] = []


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


class ChainExecute(msgspec.Struct, array_like=True, tag=27):
    """An ensemble request run worker to worker under leases (workers/chain.py); its payload
    frame follows: the ensemble tensors known so far, named as in the ensemble, and the
    client's outputs. ``head`` is the client's request (model: the ensemble); ``leases`` and
    ``workers`` the lease id and spawn id for each hop; ``held``: the slots of earlier hops'
    outputs (owner's address, slot), given back when the request ends; ``records``: the
    completion records of the hops run so far (statistics)."""
    head: SubmitRequest
    hops: list[ChainHop]
    leases: list[int]
    workers: list[int]
    at: int = 0
    held: list[tuple[str, ShmRef]] = []
    records: list["LeasedRecord"] = []
    cpu: int = -1


class LeasedExecute(msgspec.Struct, array_like=True, tag=26):
    """A request sent straight to a leased worker (no scheduler hop); its payload frame
    follows. The head is what the scheduler would have got, for its statistics. ``cpu``: the
    CPU the worker should wait for its next request on, the frontend's own while requests come
    one at a time (frontend/colocation.py); -1: anywhere."""
    lease_id: int
    head: SubmitRequest
    cpu: int = -1


# ---- frontend -> scheduler -> every worker -----------------------------------------------------
class ForgetSegments(msgspec.Struct, array_like=True, tag=23):
    """Client segments that were (re)registered or unregistered: drop cached mappings of them;
    and CUDA IPC handles no region uses any more: close them (cuIpcCloseMemHandle). The
    scheduler sends the handles of a dead worker's device arena too (engine/ensemble.py).

    It travels the same path as requests (through the scheduler), so a worker sees it before
    any request that was sent after it.
    """
    segments: list[str]
    cuda_handles: list[bytes] = []


# ---- worker -> scheduler ---------------------------------------------------------------------
class WorkerReady(msgspec.Struct, array_like=True, tag=30):
    spawn_id: int
    pid: int
    address: str
    config_json: str = ""       # the auto-completed config, when the worker was asked for it


class Pong(msgspec.Struct, array_like=True, tag=33):
    spawn_id: int
    seq: int


class WorkerLoadFailed(msgspec.Struct, array_like=True, tag=31):
    spawn_id: int
    reason: str


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


class ResponseReport(msgspec.Struct, array_like=True, tag=36):
    """A backend's account of one response it sent (or chose not to send) for a request of a
    decoupled model, as Triton's backends report response statistics; ``index``: how many
    the request had reported before. ``kind``: success, fail, empty or cancel."""
    spawn_id: int
    index: int
    kind: str
    start_ns: int
    output_start_ns: int        # 0: no output was computed (empty, cancel)
    end_ns: int


class BatchDone(msgspec.Struct, array_like=True, tag=32):
    spawn_id: int
    batch_id: int               # 0 for a LeasedExecute
    failed: list[int] = []      # positions in the batch of requests that failed
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    answers: list["InferResult"] = []   # the answers of an ensemble's steps in the batch


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


class LeaseEnded(msgspec.Struct, array_like=True, tag=35):
    """The worker read RevokeLease(lease_id): every leased request it accepted is done, and
    the scheduler may dispatch to it again. ``sequences``: a sequence model's live sequences
    (LendSequences), handed back; None for any other model."""
    spawn_id: int
    lease_id: int
    sequences: list[SequenceSlot] | None = None


# ---- a scheduler thread -> the scheduler's own inbox (inproc) ---------------------------------
class Wake(msgspec.Struct, array_like=True, tag=50):
    """The alarm thread's ring: a batch delay or timeout is due."""


class ProcessExited(msgspec.Struct, array_like=True, tag=51):
    """The exit watcher saw the worker process of this spawn end."""
    spawn_id: int


# ---- worker (or scheduler on a worker's behalf) -> frontend ----------------------------------
class InferResult(msgspec.Struct, array_like=True, tag=40):
    req_id: int
    model: str
    version: int
    outputs: list[Tensor] = []
    error: str = ""
    code: ErrorCode | None = None   # set with error
    worker: str = ""            # address to send ReleaseOutputs to when outputs use shm
    parameters: dict[str, Any] = {}
    # a leased request's completion record: the frontend passes these on to the scheduler in
    # bulk (LeasedDone), so that a leased request costs the scheduler no message of its own
    done: LeasedRecord | None = None
    # an ensemble run worker to worker: the completion records of its steps (``done`` is the
    # ensemble's own)
    steps: list[LeasedRecord] = []
    # decoupled models answer a request with any number of these; the last has final=True.
    # no_response: the model ended the request without a response (the FINAL flag alone).
    final: bool = True
    no_response: bool = False
    spawn_id: int = 0           # decoupled: the worker still answering (ends the stream if it dies)
    # a traced request (RequestRoute.trace): its execution's start, inputs read, outputs
    # start and end, in ns of CLOCK_MONOTONIC (frontend/trace.py)
    compute_ns: list[int] = []


class InferResults(msgspec.Struct, array_like=True, tag=41):
    """The answers of one batch that go to the same frontend, in one message."""
    results: list[InferResult]


class LeaseBounced(msgspec.Struct, array_like=True, tag=42):
    """Worker -> frontend: a LeasedExecute that came after its lease was revoked; not run.
    The frontend submits it to the scheduler."""
    spawn_id: int
    req_id: int


# ---- scheduler -> frontend: leases ---------------------------------------------------------------
class LeaseGranted(msgspec.Struct, array_like=True, tag=14):
    """The idle instance ``spawn_id`` of a model version takes this frontend's requests
    directly (LeasedExecute), up to ``depth`` at a time (0: no limit; the worker runs them in
    order), until the lease is revoked. ``returned``: requests of this frontend the scheduler
    held for the version (queued, or arrived after the grant); the frontend sends them under
    the lease, first. Sent again with the same id to return more. ``forwarded``: requests of
    this frontend the scheduler sent the worker itself under the lease (a sequence model's:
    on the scheduler's own channel they stay behind the sequences it lent; they count as sent
    under the lease from now on)."""
    lease_id: int
    model: str
    version: int
    spawn_id: int
    depth: int = 1
    returned: list[int] = []
    forwarded: list[int] = []
    # a sequence model's lease: the live sequences its worker took over, and how many it
    # holds at most (None: not a sequence model)
    sequences: list[int | str] | None = None
    slots: int = 0


class LeaseRevoked(msgspec.Struct, array_like=True, tag=15):
    """Stop using the lease (the scheduler needs the instance, or the model goes away)."""
    lease_id: int


class LeaseLost(msgspec.Struct, array_like=True, tag=16):
    """The worker ``spawn_id`` ended; leased requests sent to it and not answered are lost:
    the frontend submits them to the scheduler with ``reason`` (SubmitRequest.lost)."""
    spawn_id: int
    reason: str
    retry: bool = True


Message = Union[
    FrontendHello, SubmitRequest, SequencesLost, StatsQuery, ControlRequest, CancelRequest, ModelTable,
    StatsReply,
    ControlReply, ExecuteBatch,
    Shutdown, Ping, Pong, ReleaseOutputs, ForgetSegments, WorkerReady, WorkerLoadFailed,
    BatchDone, CustomMetrics, ResponseReport, InferResult, InferResults, Wake, ProcessExited, WorkerGone,
    RevokeLease, LendSequences, LeasedExecute, ChainExecute, LeasedDone, LeaseEnded, LeaseBounced, LeaseGranted,
    LeaseRevoked, LeaseLost,
    SetLogSettings, SetTraceSettings,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_payload_decoder = msgspec.msgpack.Decoder(InferPayload)

encode = _encoder.encode


def decode(frame) -> Message:
    return _decoder.decode(frame)


def decode_payload(frame) -> InferPayload:
    return _payload_decoder.decode(frame)


# ---- launcher -> scheduler and frontend, at spawn (JSON on the command line) ------------------
class GrpcTls(msgspec.Struct):
    """--grpc-use-ssl[-mutual]: the PEM files each frontend reads (paths, never the key
    itself: settings travel on command lines)."""
    server_cert: str
    server_key: str
    root_cert: str = ""         # CA certificates for client certificates (and mutual)
    mutual: bool = False        # clients must present a certificate that chains to root_cert


class ServerSettings(msgspec.Struct):
    model_repositories: list[str]
    run_dir: str
    segment_prefix: str
    launcher_pid: int
    server_id: str = "triton"
    server_version: str = "0.1.0"
    model_config_name: str = ""
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    allow_http: bool = True
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    allow_grpc: bool = True
    metrics_address: str = ""
    metrics_port: int = 8002
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True
    allow_gpu_metrics: bool = True
    metrics_interval_ms: int = 2000
    counter_latencies: bool = True
    histogram_latencies: bool = False
    summary_latencies: bool = False
    http_max_input_size: int = 1 << 26
    http_max_header_size: int = 64 * 1024
    http_max_connections: int = 4096
    http_request_timeout_secs: float = 60.0
    http_idle_timeout_secs: float = 300.0
    http_max_json_elements: int = 1 << 23     # tensor elements in a JSON request or JSON output
    grpc_max_message_size: int = 2 ** 31 - 1  # bytes of one gRPC message, either way
    max_request_tensor_bytes: int = 1 << 32   # all input tensors of one request together
    model_upload_max_bytes: int = 1 << 30     # all 'file:' parameters of one load together
    model_upload_dir: str = ""                # uploaded models' directories (<run_dir>/uploads)
    request_deadline_secs: float = 3600.0     # the frontend answers every request by then
    model_load_timeout_secs: float = 600.0    # a worker that is not ready by then is killed
    allow_client_shm: bool = True
    client_shm_from: str = "local"         # local (loopback and unix peers only) | any
    http_restricted_api: list[str] = []    # "<api>[,<api>]:<header>=<value>" (frontend/restricted.py)
    grpc_restricted_protocol: list[str] = []
    exit_timeout_secs: float = 30.0
    strict_readiness: bool = True
    exit_on_error: bool = False
    model_control_mode: str = "none"       # none | poll | explicit | on_demand
    model_memory_budget: int = 0           # on_demand: bytes all loaded models may use (0 = any)
    model_idle_unload_secs: float = 0.0    # on_demand: unload a model idle this long (0 = never)
    model_load_wait_secs: float = 120.0    # on_demand: how long a request waits for its load
    repository_poll_secs: float = 15.0
    load_models: list[str] = []
    auto_complete: bool = True
    execution_timeout_secs: float = 300.0
    max_inflight_requests: int = 10000
    instance_leases: bool = True           # lend idle instances to frontends (engine/leases.py)
    worker_start: str = "fork"             # fork (from the fork server, engine/forkserver.py) | spawn
    frontends: int = 1                     # frontend processes sharing the ports (SO_REUSEPORT)
    frontend_priority: str = "auto"        # auto | normal | realtime (frontend/priority.py)
    colocate: str = "auto"                 # auto | off (frontend/colocation.py)
    colocate_max_gap_us: int = 1000        # mean gap between requests, at most, to pair
    log_verbose: int = 0
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: LogFormat = LogFormat.DEFAULT
    log_file: str = ""                     # every process appends its log lines here ("" = stderr)
    port_file: str = ""
    # GPU -> bytes each worker's device arena may take on it (--cuda-memory-pool-byte-size)
    cuda_memory_pool: dict[int, int] = {}
    # gRPC server channel options from tritonserver's keep-alive, connection age and
    # compression flags (engine/compat_flags.py)
    grpc_options: dict[str, int] = {}
    grpc_server: str = "loop"              # loop (frontend/grpc_loop.py) | aio (grpc.aio)
    trace: TraceConfig = TraceConfig()     # --trace-config and the older --trace-* flags
    # --cache-config local,size=N (or --response-cache-byte-size N): the response cache's bytes,
    # shared out between the frontends (frontend/response_cache.py); 0: no cache
    response_cache_bytes: int = 0
    grpc_tls: GrpcTls | None = None        # --grpc-use-ssl and its certificate flags
    # headers / metadata whose names match become request parameters (frontend/header_forward.py)
    http_header_forward_pattern: str = ""
    grpc_header_forward_pattern: str = ""
    rate_limit: bool = False               # --rate-limit execution_count (engine/rate_limiter.py)
    rate_limit_resources: list[str] = []   # --rate-limit-resource <name>:<count>[:<device>]
    # --backend-config [onnxruntime,]default-max-batch-size=N: auto-complete's max_batch_size
    default_max_batch_size: int = 4


# ---- scheduler -> worker, at spawn (JSON on the command line) --------------------------------
class InstanceSpec(msgspec.Struct):
    """What a worker process is told to load."""
    model_name: str
    version: int
    model_dir: str
    config_json: str            # normalized config in Triton's JSON form
    instance_name: str
    kind: str                   # "CPU" or "GPU"
    device_id: int
    backend: str
    auto_complete: bool = False     # fill in the config from the model before loading it
    # what auto-complete gives a model that can batch (--backend-config default-max-batch-size)
    default_max_batch_size: int = 4
    instance_index: int = 0     # among the version's instances (the identity backend's delays)


class WorkerLabel(msgspec.Struct):
    """What a worker's command line shows (ps, /proc/<pid>/cmdline): which model and instance it
    serves. The full ``WorkerArgs`` travel in a file, since a config can outgrow the kernel's
    limit on one argument (128 KiB)."""
    model_name: str
    version: int
    instance_name: str
    spawn_id: int


class WorkerArgs(msgspec.Struct):
    spawn_id: int               # unique for the server's life; names the worker's sockets
    parent: int
    run_dir: str
    scheduler: str
    segment_prefix: str
    spec: InstanceSpec
    log_verbose: int = 0
    log: LogSettings = LogSettings()    # the scheduler's settings when it spawned the worker
    log_file: str = ""
    # --cuda-memory-pool-byte-size: GPU -> bytes of device memory the worker's device arena may
    # take there (workers/device_arena.py; a GPU not named gets the default)
    cuda_memory_pool: dict[int, int] = {}
    # pb_utils.load_model(files=...): where the worker writes them, and how much one load may
    # carry (the server's --model-upload-max-bytes; 0: refused)
    model_upload_dir: str = ""
    model_upload_max_bytes: int = 0


# ---- scheduler <-> fork server (engine/forkserver.py, workers/zygote.py) ------------------------
# Not inbox messages: they travel on the socket pair between the scheduler and its fork server,
# each a msgpack array, with ForkReply carrying the worker's "go" pipe as SCM_RIGHTS.
class ZygoteSettings(msgspec.Struct, array_like=True):
    """The fork server's command-line argument (after it comes a blank placeholder argument
    whose bytes a forked worker overwrites with its own command line)."""
    parent: int                 # the scheduler: workers are re-parented to it
    sock_fd: int                # its end of the socket pair


class ZygoteHello(msgspec.Struct, array_like=True, frozen=True):
    """Sent once the fork server has imported what workers need and can fork."""
    pid: int
    title_room: int             # bytes a worker's command line may take (arg_start..arg_end)
    threads: int                # threads of the fork server (forks only when 1)
    preloaded: list[str] = []   # modules imported for the workers (onnxruntime when fork-safe)
    notes: list[str] = []       # what it would have logged (the scheduler logs it, verbose)


class ForkRequest(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    label: str                  # the WorkerLabel JSON: argv[1] of `python -m shmserve.workers.main`
    args_path: str              # argv[2]: the WorkerArgs file
    parent: int                 # the scheduler's pid: the worker waits to be its child


class ForkReply(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    pid: int = 0                # the worker, already the scheduler's child; 0 when none
    error: str = ""             # why not (fork failed, or threads appeared: fork no more)
    refuse_for_good: bool = False
