"""Every IPC message survives encode/decode as the same typed object; garbage is refused."""
import msgspec
import pytest

from shmserve.ipc import messages as m
from shmserve.ipc.messages.common import (
    ChainHop,
    ControlAction,
    CustomMetrics,
    ErrorCode,
    InferPayload,
    LeasedRecord,
    LogFormat,
    LogSettings,
    MetricFamilyState,
    MetricKind,
    MetricSample,
    ModelState,
    OutputSpec,
    SequenceSlot,
    ShmRef,
    StateCause,
    Tensor,
    TraceChanges,
)
from shmserve.ipc.messages.to_frontend import (
    BatchStatistics,
    ControlReply,
    Duration,
    InferResult,
    InferResults,
    LeaseBounced,
    LeaseGranted,
    LeaseLost,
    LeaseRevoked,
    ModelInfo,
    ModelStatistics,
    ModelTable,
    ReadinessReply,
    ResponseStatistics,
    StatsReply,
    VersionInfo,
    WorkerGone,
)
from shmserve.ipc.messages.to_scheduler import (
    BatchDone,
    CancelRequest,
    ControlRequest,
    ForgetSegments,
    FrontendHello,
    LeasedDone,
    LeaseEnded,
    Pong,
    ProcessExited,
    ReadinessQuery,
    ReadinessReport,
    ResponseReport,
    SequencesLost,
    SetLogSettings,
    SetTraceSettings,
    StatsQuery,
    SubmitRequest,
    Wake,
    WorkerLoadFailed,
    WorkerReady,
)
from shmserve.ipc.messages.to_worker import (
    ChainExecute,
    CheckReadiness,
    ExecuteBatch,
    LeasedExecute,
    LendSequences,
    Ping,
    ReleaseOutputs,
    RequestRoute,
    RevokeLease,
    Shutdown,
)
from shmserve.ipc.spawn_args import InstanceSpec, ServerSettings, WorkerArgs

REF = ShmRef("shmserve_1_abc_0", 128, 4096)
TENSORS = [
    Tensor("INPUT0", "FP32", [2, 3], data=b"\x00" * 24),
    Tensor("INPUT1", "BYTES", [1], data=b"\x03\x00\x00\x00abc"),
    Tensor("BIG", "UINT8", [4096], shm=REF),
    Tensor("EMPTY", "INT64", [0, 4]),
]

MESSAGES = [
    FrontendHello(3, "ipc:///tmp/run/frontend-3"),
    SubmitRequest(req_id=42, frontend=3, model="simple", version=1, batch_size=8),
    SubmitRequest(1, 0, "mlp", 2, 4, received_ns=123, priority=2, timeout_us=500,
                    shape_key="INPUT0[7]"),
    StatsQuery(frontend=1, query_id=9),
    StatsQuery(1, 10, "simple", 1),
    ControlRequest(1, 11, "load", "mlp", config='{"max_batch_size": 8}'),
    ControlRequest(1, 12, "unload", "mlp", unload_dependents=True),
    ControlReply(11),
    WorkerGone(4, [1, 2, 3]),
    CancelRequest(1, 99),
    Ping(3),
    Pong(4, 3),
    Wake(),
    ProcessExited(7),
    SubmitRequest(5, 0, "simple", 1, 1, lost="the worker died", lost_retry=False),
    RevokeLease(3),
    LeasedExecute(3, SubmitRequest(6, 1, "simple", 1, 1, received_ns=77)),
    ChainExecute(SubmitRequest(6, 1, "pipe", 1, 2, received_ns=77),
                   [ChainHop(0, "pre", 1, {"X": "IN"}, {"Y": "t"}, 8, {"X": [4]}),
                    ChainHop(1, "post", 2, {"X": "t"}, {"Y": "OUT"})], [3, 4], [7, 8], 1,
                   [("unix://w7.pkt", REF)],
                   [LeasedRecord(7, "pre", 1, 2, 77, 99, 1, 2, 3)], cpu=1),
    LeaseEnded(4, 3),
    LeaseEnded(4, 3, [SequenceSlot(7, 123), SequenceSlot("s-1", 456)]),
    LendSequences(3, [SequenceSlot(7, 123)]),
    LeaseBounced(4, 6),
    LeaseGranted(3, "simple", 1, 4),
    LeaseGranted(3, "seq", 1, 4, 0, forwarded=[11, 12]),
    LeaseRevoked(3),
    LeaseLost(4, "exited unexpectedly", retry=False),
    SequencesLost("seq", 1, [7, "abc"]),
    BatchDone(4, 0, [0], 1, 2, 3),
    LeasedDone([LeasedRecord(4, "simple", 1, 2, 5, 9, 1, 2, 3),
                  LeasedRecord(4, "simple", 1, 1, 6, 9, failed=True, executed=0)]),
    InferResult(6, "simple", 1, done=LeasedRecord(4, "simple", 1, 1, 5, 9, 1, 2, 3)),
    ControlReply(12, "load failed", "INVALID_ARG"),
    ModelTable([
        ModelInfo("simple", b"\x0a\x06simple", [VersionInfo(1, "READY"),
                                                  VersionInfo(2, "UNAVAILABLE", "load failed: x")]),
        ModelInfo("broken", b"", [VersionInfo(-1, "UNAVAILABLE", "bad config")]),
    ], startup_done=True),
    ModelTable([], startup_done=False),
    StatsReply(9, [], {"sent_bytes": 10, "received_bytes": 1 << 40}),
    StatsReply(9, [ModelStatistics("simple", 1, inference_count=5, success=Duration(5, 900),
                                       batch_stats=[BatchStatistics(2, Duration(1, 2),
                                                                      Duration(1, 3),
                                                                      Duration(1, 4))],
                                       response_stats={"0": ResponseStatistics(
                                           success=Duration(1, 7))},
                                       failures={"REJECTED": 1})], {}, ""),
    StatsReply(10, [], {}, "requested model 'x' is not available"),
    ExecuteBatch(7, [RequestRoute(1, 0), RequestRoute(2, 5, trace=True)]),
    ExecuteBatch(8, []),
    Shutdown(),
    ReleaseOutputs([REF, ShmRef("seg", 0, 0)]),
    ForgetSegments(["shmtest_a", "shmtest_b"]),
    SetLogSettings(LogSettings(info=False, verbose=2, format=LogFormat.ISO8601), 0, 4),
    SetLogSettings(LogSettings()),
    SetTraceSettings(TraceChanges(level=["TIMESTAMPS"], rate=None), "simple", 1, 5),
    SetTraceSettings(TraceChanges()),
    SubmitRequest(7, 0, "simple", 1, 1, trace=True),
    InferResult(7, "simple", 1, compute_ns=[1, 2, 3, 4]),
    InferResults([InferResult(1, "a", 1), InferResult(2, "a", 1, error="x", code="INTERNAL")]),
    WorkerReady(spawn_id=4, pid=1234, address="ipc:///tmp/w4"),
    WorkerReady(spawn_id=4, pid=1234, address="ipc:///tmp/w4", asks_model=True),
    ReadinessQuery(frontend=1, query_id=3, model="m", version=2),
    CheckReadiness(check=7),
    ReadinessReport(spawn_id=4, check=7, ready=False),
    ReadinessReply(query_id=3, ready=True),
    WorkerLoadFailed(4, "ImportError: no module named foo"),
    BatchDone(4, 7),
    BatchDone(4, 8, failed=[0, 2], compute_input_ns=5, compute_infer_ns=6, compute_output_ns=7),
    InferResult(1, "simple", 1),
    InferResult(2, "simple", 3, outputs=TENSORS, worker="ipc:///tmp/w4",
                  parameters={"sequence_id": 5, "note": "é", "flag": True, "ratio": 0.5}),
    InferResult(3, "simple", 1, error="model raised", code=ErrorCode.INTERNAL),
    CustomMetrics(4, [MetricFamilyState("requests_total", "requests seen", MetricKind.COUNTER,
                                            [MetricSample({"model": "a"}, 3.0)]),
                        MetricFamilyState("latency", "s", MetricKind.HISTOGRAM,
                                            [MetricSample({}, buckets=[0.1, 1.0],
                                                            counts=[1, 2, 0], sum=1.5)])]),
    ResponseReport(4, 2, "fail", 100, 140, 160),
]


def test_vocabulary_decodes_to_enums():
    """States, actions and error codes arrive as enum members, never as bare strings, so a
    decision compares members; an unknown value is refused at the decode place."""
    out = m.decode(m.encode(ControlReply(1, "no", ErrorCode.NOT_FOUND)))
    assert out.code is ErrorCode.NOT_FOUND
    out = m.decode(m.encode(ControlRequest(1, 2, ControlAction.UNLOAD, "x")))
    assert out.action is ControlAction.UNLOAD
    info = m.decode(m.encode(ModelTable([ModelInfo("a", b"", [VersionInfo(
        1, ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)])], True)))
    v = info.models[0].versions[0]
    assert v.state is ModelState.UNAVAILABLE and v.cause is StateCause.UNLOADED
    with pytest.raises(msgspec.ValidationError):
        m.decode(msgspec.msgpack.encode([12, 1, "x", "NOT_A_CODE"]))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda x: type(x).__name__)
def test_message_round_trip(msg):
    frame = m.encode(msg)
    out = m.decode(frame)
    assert type(out) is type(msg)
    assert out == msg


def test_every_message_type_is_covered():
    assert {type(x) for x in MESSAGES} == set(m.Message.__args__)


def test_messages_are_tagged_arrays():
    assert m.encode(Shutdown()) == msgspec.msgpack.encode([21])
    assert m.encode(BatchDone(1, 2)) == msgspec.msgpack.encode([32, 1, 2, [], 0, 0, 0, []])


@pytest.mark.parametrize("payload", [
    InferPayload("", [], []),
    InferPayload("req-1", TENSORS, [OutputSpec("OUTPUT0"), OutputSpec("OUTPUT1", REF)],
                   {"delay_ms": 5, "s": "x", "b": False},
                   correlation_id=17, flags=3),
    InferPayload("req-2", TENSORS[:1], [], correlation_id="session-a"),
], ids=["empty", "full", "string-correlation"])
def test_payload_round_trip(payload):
    out = m.decode_payload(m.encode(payload))
    assert out == payload
    assert type(out.correlation_id) is type(payload.correlation_id)
    assert all(type(t) is Tensor for t in out.inputs)


def test_payload_defaults():
    out = m.decode_payload(msgspec.msgpack.encode(["id", [["X", "INT32", [1]]], [["Y"]]]))
    assert out == InferPayload("id", [Tensor("X", "INT32", [1])], [OutputSpec("Y")])
    assert out.parameters == {} and out.correlation_id == 0 and out.flags == 0
    assert out.inputs[0].data is None and out.inputs[0].shm is None


@pytest.mark.parametrize("frame", [
    b"",
    b"\xc1",                                         # a byte msgpack never uses
    b"not msgpack at all",
    msgspec.msgpack.encode([99, 1, 2]),              # unknown tag
    msgspec.msgpack.encode([2, 1, 2]),               # SubmitRequest with fields missing
    msgspec.msgpack.encode([2, "x", 0, "m", 1, 1]),  # wrong field type
    msgspec.msgpack.encode({"req_id": 1}),           # not an array
    b"\x94\x20",                                     # array of 4 holding one element
], ids=["empty", "c1", "text", "tag", "short", "type", "map", "truncated"])
def test_decode_garbage(frame):
    with pytest.raises(msgspec.DecodeError):
        m.decode(frame)


@pytest.mark.parametrize("frame", [
    b"\xc1",
    m.encode(Shutdown()),                          # a message is not a payload
    msgspec.msgpack.encode(["id", [["X", "INT32", "not a shape"]], []]),
])
def test_decode_payload_garbage(frame):
    with pytest.raises(msgspec.DecodeError):
        m.decode_payload(frame)


def test_payload_frame_is_not_a_message():
    with pytest.raises(msgspec.DecodeError):
        m.decode(m.encode(InferPayload("id", [], [])))


def test_spawn_settings_json_round_trip():
    settings = ServerSettings(["/models"], "/tmp/run", "shmserve_1_ab_", 1, http_port=0)
    assert msgspec.json.decode(msgspec.json.encode(settings), type=ServerSettings) == settings
    spec = InstanceSpec("simple", 1, "/models/simple", "{}", "simple_0", "CPU", 0, "python")
    args = WorkerArgs(3, 2, "/tmp/run", "ipc:///tmp/s", "shmserve_1_ab_", spec)
    assert msgspec.json.decode(msgspec.json.encode(args), type=WorkerArgs) == args
