"""Messages a frontend receives: from the scheduler (the model table, statistics, replies,
leases) and from workers (results, bounced leased requests)."""
from __future__ import annotations

from typing import Any

import msgspec

from shmserve.ipc.messages.common import (
    ChainHop,
    CustomMetrics,
    ErrorCode,
    LeasedRecord,
    ModelState,
    StateCause,
    Tensor,
)


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
    # its model decides its own readiness (is_ready()): a readiness check asks it
    # (ReadinessQuery) instead of reading the state alone
    asks_model: bool = False
    # a READY version's instance that is not running now (its worker ended; it restarts):
    # with --strict-readiness the version reads not ready until it runs again
    unhealthy: str = ""


class ModelInfo(msgspec.Struct, array_like=True):
    name: str
    config: bytes               # serialized inference.ModelConfig (normalized)
    versions: list[VersionInfo]
    # --model-control-mode=on_demand: a request for a version that is not READY is held by the
    # scheduler while the model loads (config b"": the model completes it when it first loads)
    on_demand: bool = False
    # an ensemble's class labels per output (label_filename, read when it loads): the step
    # that produces the output classifies with them (OutputSpec.labels)
    labels: dict[str, list[bytes]] = {}


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


class ReadinessReply(msgspec.Struct, array_like=True, tag=17):
    query_id: int
    ready: bool


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
    the frontend submits them to the scheduler with ``reason`` (SubmitRequest.lost).
    ``clean``: it was told to stop and exited 0, having run or handed back all it was sent:
    requests that went through it worker to worker are not lost (their answer comes from a
    later step's worker, or a bounce)."""
    spawn_id: int
    reason: str
    retry: bool = True
    clean: bool = False
