"""Every IPC message survives encode/decode as the same typed object; garbage is refused."""
import msgspec
import pytest

from shmserve.ipc import messages as m

REF = m.ShmRef("shmserve_1_abc_0", 128, 4096)
TENSORS = [
    m.Tensor("INPUT0", "FP32", [2, 3], data=b"\x00" * 24),
    m.Tensor("INPUT1", "BYTES", [1], data=b"\x03\x00\x00\x00abc"),
    m.Tensor("BIG", "UINT8", [4096], shm=REF),
    m.Tensor("EMPTY", "INT64", [0, 4]),
]

MESSAGES = [
    m.FrontendHello(3, "ipc:///tmp/run/frontend-3"),
    m.SubmitRequest(req_id=42, frontend=3, model="simple", version=1, batch_size=8),
    m.SubmitRequest(1, 0, "mlp", 2, 4, received_ns=123, priority=2, timeout_us=500,
                    shape_key="INPUT0[7]"),
    m.StatsQuery(frontend=1, query_id=9),
    m.StatsQuery(1, 10, "simple", 1),
    m.ControlRequest(1, 11, "load", "mlp", config='{"max_batch_size": 8}'),
    m.ControlRequest(1, 12, "unload", "mlp", unload_dependents=True),
    m.ControlReply(11),
    m.WorkerGone(4, [1, 2, 3]),
    m.CancelRequest(1, 99),
    m.Ping(3),
    m.Pong(4, 3),
    m.Wake(),
    m.ProcessExited(7),
    m.SubmitRequest(5, 0, "simple", 1, 1, lost="the worker died", lost_retry=False),
    m.RevokeLease(3),
    m.LeasedExecute(3, m.SubmitRequest(6, 1, "simple", 1, 1, received_ns=77)),
    m.ChainExecute(m.SubmitRequest(6, 1, "pipe", 1, 2, received_ns=77),
                   [m.ChainHop(0, "pre", 1, {"X": "IN"}, {"Y": "t"}, 8, {"X": [4]}),
                    m.ChainHop(1, "post", 2, {"X": "t"}, {"Y": "OUT"})], [3, 4], [7, 8], 1,
                   [("unix://w7.pkt", REF)],
                   [m.LeasedRecord(7, "pre", 1, 2, 77, 99, 1, 2, 3)], cpu=1),
    m.LeaseEnded(4, 3),
    m.LeaseEnded(4, 3, [m.SequenceSlot(7, 123), m.SequenceSlot("s-1", 456)]),
    m.LendSequences(3, [m.SequenceSlot(7, 123)]),
    m.LeaseBounced(4, 6),
    m.LeaseGranted(3, "simple", 1, 4),
    m.LeaseGranted(3, "seq", 1, 4, 0, forwarded=[11, 12]),
    m.LeaseRevoked(3),
    m.LeaseLost(4, "exited unexpectedly", retry=False),
    m.SequencesLost("seq", 1, [7, "abc"]),
    m.BatchDone(4, 0, [0], 1, 2, 3),
    m.LeasedDone([m.LeasedRecord(4, "simple", 1, 2, 5, 9, 1, 2, 3),
                  m.LeasedRecord(4, "simple", 1, 1, 6, 9, failed=True, executed=0)]),
    m.InferResult(6, "simple", 1, done=m.LeasedRecord(4, "simple", 1, 1, 5, 9, 1, 2, 3)),
    m.ControlReply(12, "load failed", "INVALID_ARG"),
    m.ModelTable([
        m.ModelInfo("simple", b"\x0a\x06simple", [m.VersionInfo(1, "READY"),
                                                  m.VersionInfo(2, "UNAVAILABLE", "load failed: x")]),
        m.ModelInfo("broken", b"", [m.VersionInfo(-1, "UNAVAILABLE", "bad config")]),
    ], startup_done=True),
    m.ModelTable([], startup_done=False),
    m.StatsReply(9, [], {"sent_bytes": 10, "received_bytes": 1 << 40}),
    m.StatsReply(9, [m.ModelStatistics("simple", 1, inference_count=5, success=m.Duration(5, 900),
                                       batch_stats=[m.BatchStatistics(2, m.Duration(1, 2),
                                                                      m.Duration(1, 3),
                                                                      m.Duration(1, 4))],
                                       response_stats={"0": m.ResponseStatistics(
                                           success=m.Duration(1, 7))},
                                       failures={"REJECTED": 1})], {}, ""),
    m.StatsReply(10, [], {}, "requested model 'x' is not available"),
    m.ExecuteBatch(7, [m.RequestRoute(1, 0), m.RequestRoute(2, 5, trace=True)]),
    m.ExecuteBatch(8, []),
    m.Shutdown(),
    m.ReleaseOutputs([REF, m.ShmRef("seg", 0, 0)]),
    m.ForgetSegments(["shmtest_a", "shmtest_b"]),
    m.SetLogSettings(m.LogSettings(info=False, verbose=2, format=m.LogFormat.ISO8601), 0, 4),
    m.SetLogSettings(m.LogSettings()),
    m.SetTraceSettings(m.TraceChanges(level=["TIMESTAMPS"], rate=None), "simple", 1, 5),
    m.SetTraceSettings(m.TraceChanges()),
    m.SubmitRequest(7, 0, "simple", 1, 1, trace=True),
    m.InferResult(7, "simple", 1, compute_ns=[1, 2, 3, 4]),
    m.InferResults([m.InferResult(1, "a", 1), m.InferResult(2, "a", 1, error="x", code="INTERNAL")]),
    m.WorkerReady(spawn_id=4, pid=1234, address="ipc:///tmp/w4"),
    m.WorkerLoadFailed(4, "ImportError: no module named foo"),
    m.BatchDone(4, 7),
    m.BatchDone(4, 8, failed=[0, 2], compute_input_ns=5, compute_infer_ns=6, compute_output_ns=7),
    m.InferResult(1, "simple", 1),
    m.InferResult(2, "simple", 3, outputs=TENSORS, worker="ipc:///tmp/w4",
                  parameters={"sequence_id": 5, "note": "é", "flag": True, "ratio": 0.5}),
    m.InferResult(3, "simple", 1, error="model raised", code=m.ErrorCode.INTERNAL),
    m.CustomMetrics(4, [m.MetricFamilyState("requests_total", "requests seen", m.MetricKind.COUNTER,
                                            [m.MetricSample({"model": "a"}, 3.0)]),
                        m.MetricFamilyState("latency", "s", m.MetricKind.HISTOGRAM,
                                            [m.MetricSample({}, buckets=[0.1, 1.0],
                                                            counts=[1, 2, 0], sum=1.5)])]),
    m.ResponseReport(4, 2, "fail", 100, 140, 160),
]


def test_vocabulary_decodes_to_enums():
    """States, actions and error codes arrive as enum members, never as bare strings, so a
    decision compares members; an unknown value is refused at the decode place."""
    out = m.decode(m.encode(m.ControlReply(1, "no", m.ErrorCode.NOT_FOUND)))
    assert out.code is m.ErrorCode.NOT_FOUND
    out = m.decode(m.encode(m.ControlRequest(1, 2, m.ControlAction.UNLOAD, "x")))
    assert out.action is m.ControlAction.UNLOAD
    info = m.decode(m.encode(m.ModelTable([m.ModelInfo("a", b"", [m.VersionInfo(
        1, m.ModelState.UNAVAILABLE, "unloaded", m.StateCause.UNLOADED)])], True)))
    v = info.models[0].versions[0]
    assert v.state is m.ModelState.UNAVAILABLE and v.cause is m.StateCause.UNLOADED
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
    assert m.encode(m.Shutdown()) == msgspec.msgpack.encode([21])
    assert m.encode(m.BatchDone(1, 2)) == msgspec.msgpack.encode([32, 1, 2, [], 0, 0, 0, []])


@pytest.mark.parametrize("payload", [
    m.InferPayload("", [], []),
    m.InferPayload("req-1", TENSORS, [m.OutputSpec("OUTPUT0"), m.OutputSpec("OUTPUT1", REF)],
                   {"delay_ms": 5, "s": "x", "b": False},
                   correlation_id=17, flags=3),
    m.InferPayload("req-2", TENSORS[:1], [], correlation_id="session-a"),
], ids=["empty", "full", "string-correlation"])
def test_payload_round_trip(payload):
    out = m.decode_payload(m.encode(payload))
    assert out == payload
    assert type(out.correlation_id) is type(payload.correlation_id)
    assert all(type(t) is m.Tensor for t in out.inputs)


def test_payload_defaults():
    out = m.decode_payload(msgspec.msgpack.encode(["id", [["X", "INT32", [1]]], [["Y"]]]))
    assert out == m.InferPayload("id", [m.Tensor("X", "INT32", [1])], [m.OutputSpec("Y")])
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
    m.encode(m.Shutdown()),                          # a message is not a payload
    msgspec.msgpack.encode(["id", [["X", "INT32", "not a shape"]], []]),
])
def test_decode_payload_garbage(frame):
    with pytest.raises(msgspec.DecodeError):
        m.decode_payload(frame)


def test_payload_frame_is_not_a_message():
    with pytest.raises(msgspec.DecodeError):
        m.decode(m.encode(m.InferPayload("id", [], [])))


def test_spawn_settings_json_round_trip():
    settings = m.ServerSettings(["/models"], "/tmp/run", "shmserve_1_ab_", 1, http_port=0)
    assert msgspec.json.decode(msgspec.json.encode(settings), type=m.ServerSettings) == settings
    spec = m.InstanceSpec("simple", 1, "/models/simple", "{}", "simple_0", "CPU", 0, "python")
    args = m.WorkerArgs(3, 2, "/tmp/run", "ipc:///tmp/s", "shmserve_1_ab_", spec)
    assert msgspec.json.decode(msgspec.json.encode(args), type=m.WorkerArgs) == args
