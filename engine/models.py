"""Runtime records of loaded model versions and their instances (state only, no sockets)."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shmserve.engine.batching.dynamic import DynamicBatcher, batcher_config
from shmserve.engine.batching.queues import DEFAULT_MAX_QUEUE, DefaultQueue, QueuedRequest, RequestQueue
from shmserve.engine.batching.sequences import SequenceBatcher, sequence_config
from shmserve.engine.ensemble.plan import EnsemblePlan
from shmserve.engine.states import InstanceState, KillReason, ModelState
from shmserve.engine.stats import VersionStats
from shmserve.ipc.messages.common import StateCause
from shmserve.ipc.model_config import ModelConfig

# Restart backoff grows only with deaths that had no finished execution between them (the
# crash-loop detector's rule): a worker that served and then died restarts at once, so one
# poison request cannot stall a model; the second death in a row waits BACKOFF_FIRST_S, and
# each further one twice as long, up to the cap.
BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 10.0
# An instance that dies this many times in a row without finishing a single execution in
# between is in a crash loop: its version goes UNAVAILABLE with the reason, until a reload.
# (Deaths of an instance that keeps serving between them, e.g. the odd OOM kill, restart it.)
CRASH_LOOP_DEATHS = 5
# Idle workers are pinged this often; one that has not answered within PING_TIMEOUT_S is killed.
PING_INTERVAL_S = 2.0
# How many answered requests an instance remembers for WorkerGone (a few batches' worth).
ANSWERED_KEPT = 256
PING_TIMEOUT_S = 5.0
# Workers are checked this often for a stopped process (SIGSTOP, SIGTSTP, a tracer); one seen
# stopped for STOPPED_KILL_S is killed, busy or idle: a stopped busy worker would otherwise hold
# its requests until the execution timeout. (A debugger that stops a worker longer loses it.)
STOP_CHECK_INTERVAL_S = 1.0
STOPPED_KILL_S = 3.0


@dataclass(eq=False)
class Instance:
    name: str                   # e.g. simple_0_1: group name, then index in the group (simple_0
                                # for a group's only instance)
    kind: str                   # "CPU" or "GPU"
    device_id: int
    state: InstanceState = InstanceState.STARTING
    spawn_id: int = -1          # of the worker process now serving it; -1 = none yet
    connected: bool = False     # the worker said where its inbox is (WorkerReady)
    batch: list[QueuedRequest] | None = None
    # (frontend, request) of its last answered batches: their answers may still sit in the
    # worker's ZeroMQ queue when it dies, so the frontends are told (WorkerGone)
    answered: deque = field(default_factory=lambda: deque(maxlen=ANSWERED_KEPT))
    batch_id: int = 0
    restart_at: float = 0.0
    deaths_in_a_row: int = 0    # deaths since the last execution that finished
    busy_since: float = 0.0
    kill_reason: KillReason = KillReason.NONE    # why the scheduler killed its worker
    exit_detail: str = ""       # why its worker exited, when we know better than its status
    ping_seq: int = 0           # last ping sent; 0 = none outstanding
    ping_sent: float = 0.0
    spawned_at: float = 0.0     # when its worker was started (the load timeout counts from it)
    stopped_since: float = 0.0  # when its worker was first seen stopped; 0 = running
    group: int = 0              # its instance_group's index in the config (rate limiter)


@dataclass(eq=False)
class ModelVersion:
    name: str
    version: int
    path: str                   # model directory (the version is a subfolder)
    config: ModelConfig
    config_json: str
    state: ModelState = ModelState.LOADING
    reason: str = ""
    cause: StateCause = StateCause.NONE
    instances: list[Instance] = field(default_factory=list)
    queue: RequestQueue = field(init=False, repr=False)     # built from the config
    stats: VersionStats = field(init=False, repr=False)
    load_started: float = 0.0           # seconds on the core's clock
    summaries: bool = False             # keep latency windows for summary metrics
    auto_complete: bool = False         # the config is completed by the first worker to load
    execution_timeout_s: float = 0.0    # 0 = never; a batch running longer kills its worker
    retry_on_death: bool = True         # re-run once what a dead worker held (stateless models)
    clock: object = None                # the core's clock (ns) for its queue; None = monotonic
    ensemble: EnsemblePlan | None = None    # an ensemble's steps (it has no instances)
    labels: dict[str, list[bytes]] = field(default_factory=dict)    # an ensemble's, per output
    asks_model: bool = False    # its model decides its own readiness (is_ready())

    def __post_init__(self):
        self.build_queue()
        self.stats = VersionStats(self.name, self.version, summaries=self.summaries)

    def configure_timeout(self, default_s: float) -> None:
        retry = self.config.parameters.get("retry_on_worker_death")
        # a decoupled model may have streamed part of its answer before it died, and a
        # sequence model's state died with it: never re-run
        self.retry_on_death = not self.config.model_transaction_policy.decoupled and \
            not self.config.HasField("sequence_batching") and (
            retry is None or retry.string_value.strip().lower() not in ("false", "no", "off", "0"))
        param = self.config.parameters.get("execution_timeout_ms")
        self.execution_timeout_s = default_s
        if param is not None and param.string_value.strip():
            ms = float(param.string_value)
            if not math.isfinite(ms) or ms < 0:     # "nan" and "inf" parse as floats
                raise ValueError(param.string_value)
            self.execution_timeout_s = ms / 1000.0

    def build_queue(self) -> None:
        kw: dict[str, Any] = {"clock": self.clock} if self.clock is not None else {}
        if self.config.HasField("dynamic_batching"):
            self.queue = DynamicBatcher(batcher_config(self.config), DEFAULT_MAX_QUEUE, **kw)
        elif self.config.HasField("sequence_batching") and \
                not self.config.sequence_batching.iterative_sequence:
            self.queue = SequenceBatcher(sequence_config(self.config), DEFAULT_MAX_QUEUE, **kw)
        else:       # an iterative sequence is one request: its steps happen in the worker
            self.queue = DefaultQueue(max_queue_size=DEFAULT_MAX_QUEUE, **kw)

    def set_state(self, state: ModelState, reason: str = "",
                  cause: StateCause = StateCause.NONE) -> None:
        self.state, self.reason, self.cause = state, reason, cause

    @property
    def batching(self) -> bool:
        """Whether its queue has deadlines of its own (delays, queue timeouts, idle sequences)."""
        return self.config.HasField("dynamic_batching") or \
            self.config.HasField("sequence_batching")

    def all_started(self) -> bool:
        return all(i.state in (InstanceState.IDLE, InstanceState.BUSY, InstanceState.LEASED)
                   for i in self.instances)

    def busy(self) -> bool:
        """Executing, or lent to a frontend (which may be sending it requests)."""
        return any(i.state in (InstanceState.BUSY, InstanceState.LEASED) for i in self.instances)


def restart_delay(deaths_in_a_row: int) -> float:
    """Seconds to wait before restarting an instance after this many deaths in a row."""
    if deaths_in_a_row <= 1:
        return 0.0
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** (deaths_in_a_row - 2))
