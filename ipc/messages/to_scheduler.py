"""Messages the scheduler receives: from frontends (requests, cancels, queries, settings that it
passes on), from workers (readiness, finished batches, metrics), and from its own threads."""
from __future__ import annotations

import msgspec

from shmserve.ipc.messages.common import (
    CacheRecord,
    ControlAction,
    LeasedRecord,
    LogSettings,
    SequenceSlot,
    TraceChanges,
)
from shmserve.ipc.messages.to_frontend import InferResult


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


class ForgetSegments(msgspec.Struct, array_like=True, tag=23):
    """Client segments that were (re)registered or unregistered: drop cached mappings of them;
    and CUDA IPC handles no region uses any more: close them (cuIpcCloseMemHandle). The
    scheduler sends the handles of a dead worker's device arena too (engine/ensemble.py).

    It travels the same path as requests (through the scheduler), so a worker sees it before
    any request that was sent after it.
    """
    segments: list[str]
    cuda_handles: list[bytes] = []


class WorkerReady(msgspec.Struct, array_like=True, tag=30):
    spawn_id: int
    pid: int
    address: str
    config_json: str = ""       # the auto-completed config, when the worker was asked for it
    # the model decides its own readiness (a python model's is_ready()): a readiness check of
    # its version asks the worker (CheckReadiness)
    asks_model: bool = False


class ReadinessQuery(msgspec.Struct, array_like=True, tag=18):
    """A frontend asks whether a version whose model decides its own readiness is ready now."""
    frontend: int
    query_id: int
    model: str
    version: int


class ReadinessReport(msgspec.Struct, array_like=True, tag=37):
    """A worker's answer to CheckReadiness: what the model's is_ready() said (False for an
    exception or an answer that is not a boolean)."""
    spawn_id: int
    check: int
    ready: bool


class Pong(msgspec.Struct, array_like=True, tag=33):
    spawn_id: int
    seq: int


class WorkerLoadFailed(msgspec.Struct, array_like=True, tag=31):
    spawn_id: int
    reason: str


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


class LeaseEnded(msgspec.Struct, array_like=True, tag=35):
    """The worker read RevokeLease(lease_id): every leased request it accepted is done, and
    the scheduler may dispatch to it again. ``sequences``: a sequence model's live sequences
    (LendSequences), handed back; None for any other model."""
    spawn_id: int
    lease_id: int
    sequences: list[SequenceSlot] | None = None


class Wake(msgspec.Struct, array_like=True, tag=50):
    """The alarm thread's ring: a batch delay or timeout is due."""


class ProcessExited(msgspec.Struct, array_like=True, tag=51):
    """The exit watcher saw the worker process of this spawn end."""
    spawn_id: int
