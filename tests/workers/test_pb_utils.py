"""In-process tests of shmserve's triton_python_backend_utils replacement."""
import asyncio
import json
import logging
import re
import struct
import time

import ml_dtypes
import numpy as np
import pytest

from shmserve.workers.python_backend import pb_utils as pb

# (config string, enum number, wire name, numpy type)
TYPES = [
    ("TYPE_BOOL", 1, "BOOL", np.bool_), ("TYPE_UINT8", 2, "UINT8", np.uint8),
    ("TYPE_UINT16", 3, "UINT16", np.uint16), ("TYPE_UINT32", 4, "UINT32", np.uint32),
    ("TYPE_UINT64", 5, "UINT64", np.uint64), ("TYPE_INT8", 6, "INT8", np.int8),
    ("TYPE_INT16", 7, "INT16", np.int16), ("TYPE_INT32", 8, "INT32", np.int32),
    ("TYPE_INT64", 9, "INT64", np.int64), ("TYPE_FP16", 10, "FP16", np.float16),
    ("TYPE_FP32", 11, "FP32", np.float32), ("TYPE_FP64", 12, "FP64", np.float64),
    ("TYPE_STRING", 13, "BYTES", np.object_), ("TYPE_BF16", 14, "BF16", ml_dtypes.bfloat16),
]


def test_constants():
    assert pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
    assert pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
    assert pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert pb.TRITONSERVER_REQUEST_RELEASE_ALL == 1
    assert pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2
    assert (pb.TRITONSERVER_MEMORY_CPU, pb.TRITONSERVER_MEMORY_GPU, pb.TRITONSERVER_MEMORY_CPU_PINNED) == (0, 1, 2)


@pytest.mark.parametrize("config, num, wire, np_type", TYPES)
def test_dtype_mappings(config, num, wire, np_type):
    assert pb.triton_string_to_numpy(config) == np_type
    assert pb.triton_string_to_numpy(wire) == np_type
    assert pb.triton_to_numpy_type(num) == np_type
    assert pb.WIRE_TO_ENUM[wire] == num and pb.ENUM_TO_WIRE[num] == wire
    assert pb.numpy_to_triton_type(np_type) == num
    assert pb.numpy_to_triton_type(np.dtype(np_type)) == num


def test_dtype_mapping_edges():
    for t in (np.bytes_, np.str_, object, str, bytes, np.dtype("S5"), np.dtype("U3")):
        assert pb.numpy_to_triton_type(t) == 13
    assert pb.numpy_to_triton_type(np.dtype(">f4")) == 11
    assert pb.numpy_to_triton_type(np.intc) == 8
    assert pb.numpy_to_triton_type(np.complex64) is None
    assert pb.numpy_to_triton_type(np.uint16) == 3
    assert pb.triton_to_numpy_type(0) is None and pb.triton_to_numpy_type(99) is None
    with pytest.raises(KeyError):
        pb.triton_string_to_numpy("TYPE_NOPE")


def _reference_serialize(items):
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@pytest.mark.parametrize("items", [
    [b"abc", b"", "héllo wörld ✓", b"\x00\x01\x00", ""],
    [b""] * 5,
    [("s%d" % i).encode() * (i % 7) for i in range(1000)],  # many small: vectorised path
    [b"x" * 5000, b"", b"y" * 70000],  # few large: per-element copy path
])
def test_bytes_round_trip(items):
    arr = np.empty(len(items), dtype=np.object_)
    arr[:] = items
    ser = pb.serialize_byte_tensor(arr)
    assert ser.dtype == np.uint8 and ser.ndim == 1
    expected = [x.encode("utf-8") if isinstance(x, str) else x for x in items]
    assert ser.tobytes() == _reference_serialize(expected)
    out = pb.deserialize_bytes_tensor(ser)
    assert out.dtype == np.object_ and out.shape == (len(items),)
    assert list(out) == expected
    assert list(pb.deserialize_bytes_tensor(ser.tobytes())) == expected  # bytes input too


def test_bytes_row_major_and_str_arrays():
    arr = np.array([["a", "bb"], ["ccc", "é"]])
    assert pb.serialize_byte_tensor(arr).tobytes() == _reference_serialize([b"a", b"bb", b"ccc", "é".encode()])
    fortran = np.asfortranarray(np.array([[b"1", b"2"], [b"3", b"4"]], dtype=object))
    assert list(pb.deserialize_bytes_tensor(pb.serialize_byte_tensor(fortran))) == [b"1", b"2", b"3", b"4"]


def test_bytes_zero_elements():
    ser = pb.serialize_byte_tensor(np.empty((0, 3), dtype=np.object_))
    assert ser.dtype == np.uint8 and ser.size == 0
    out = pb.deserialize_bytes_tensor(b"")
    assert out.dtype == np.object_ and out.shape == (0,)


def test_bytes_errors():
    good = pb.serialize_byte_tensor(np.array([b"hello", b"world"], dtype=object)).tobytes()
    with pytest.raises(ValueError, match="truncated"):
        pb.deserialize_bytes_tensor(good[:-1])  # element body cut short
    with pytest.raises(ValueError, match="truncated"):
        pb.deserialize_bytes_tensor(good[:11])  # length prefix cut short
    with pytest.raises(ValueError, match="truncated"):
        pb.deserialize_bytes_tensor(b"\x05\x00\x00\x00ab")
    with pytest.raises(ValueError):
        pb.serialize_byte_tensor(np.arange(3, dtype=np.float32))


def test_tensor_basic():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb.Tensor("x", a)
    assert t.name() == "x" and t.as_numpy() is a
    assert t.triton_dtype() == 11 and t.datatype() == "FP32"
    assert t.shape() == [2, 3] and t.is_cpu()
    t2 = pb.Tensor("y", [[1, 2], [3, 4]])
    assert t2.as_numpy().dtype == np.int64 and t2.datatype() == "INT64"
    assert pb.Tensor("b", np.array([True, False])).triton_dtype() == 1
    with pytest.raises(ValueError):
        pb.Tensor("c", np.array([1j]))


def test_tensor_from_str_and_bytes_arrays():
    t = pb.Tensor("s", np.array([["a", "é"], ["", "xyz"]]))
    arr = t.as_numpy()
    assert t.datatype() == "BYTES" and t.triton_dtype() == 13
    assert arr.dtype == np.object_ and arr.shape == (2, 2)
    assert arr.tolist() == [[b"a", "é".encode()], [b"", b"xyz"]]
    t = pb.Tensor("b", np.array([b"ab", b"c"]))
    assert t.as_numpy().dtype == np.object_ and t.as_numpy().tolist() == [b"ab", b"c"]
    t = pb.Tensor("l", ["hi", "there"])
    assert t.as_numpy().tolist() == [b"hi", b"there"]
    t = pb.Tensor("o", np.array([b"keep", "as is"], dtype=object))
    assert t.datatype() == "BYTES" and t.as_numpy()[1] == "as is"


def test_tensor_bf16_and_datatype_kw():
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)  # 1.0 and 2.0 in bfloat16
    t = pb.Tensor("h", bits, datatype="BF16")
    assert t.triton_dtype() == 14 and t.datatype() == "BF16"
    assert t.as_numpy().dtype == ml_dtypes.bfloat16 and t.as_numpy().astype(np.float32).tolist() == [1.0, 2.0]
    assert pb.Tensor("b", np.array([1.5], dtype=ml_dtypes.bfloat16)).datatype() == "BF16"
    assert pb.Tensor("u", bits).datatype() == "UINT16"
    assert pb.Tensor("f", np.zeros(2, np.float32), datatype="FP32").datatype() == "FP32"
    with pytest.raises(ValueError, match="BF16"):
        pb.Tensor("bad", np.zeros(2, np.float32), datatype="BF16")
    with pytest.raises(ValueError):
        pb.Tensor("bad", np.zeros(2, np.float32), datatype="INT32")
    with pytest.raises(ValueError):
        pb.Tensor("bad", np.zeros(2, np.float32), datatype="FLOAT")


def test_tensor_dlpack():
    a = np.arange(4, dtype=np.int32)
    t = pb.Tensor("x", a)
    assert t.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(t), a)
    back = pb.Tensor.from_dlpack("y", t)
    assert back.name() == "y" and back.datatype() == "INT32"
    np.testing.assert_array_equal(back.as_numpy(), a)
    from_capsule = pb.Tensor.from_dlpack("z", t.to_dlpack())  # what torch.utils.dlpack.to_dlpack gives
    np.testing.assert_array_equal(from_capsule.as_numpy(), a)
    with pytest.raises(pb.TritonModelException):
        pb.Tensor("s", np.array([b"a"], dtype=object)).to_dlpack()


def test_tensor_worker_path():
    a = np.ones(3, np.uint16)
    t = pb.Tensor._from_worker("w", a, "BF16")
    assert t.as_numpy() is a and t.triton_dtype() == 14 and t.name() == "w"


def test_inference_request_accessors():
    x = pb.Tensor("x", np.zeros(2, np.float32))
    r = pb.InferenceRequest(model_name="m", requested_output_names=["y"], inputs=[x], request_id="r1",
                            correlation_id="seq-a", model_version=2, flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                            timeout=100, parameters={"k": 1, "s": "v", "b": True})
    assert r.inputs() == [x] and r.requested_output_names() == ["y"]
    assert r.request_id() == "r1" and r.correlation_id() == "seq-a"
    assert r.model_name() == "m" and r.model_version() == 2 and r.timeout() == 100
    assert r.flags() == 1
    r.set_flags(pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    assert r.flags() == 2
    assert json.loads(r.parameters()) == {"k": 1, "s": "v", "b": True}
    assert not r.is_cancelled()
    r.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert pb.get_input_tensor_by_name(r, "x") is x
    assert pb.get_input_tensor_by_name(r, "nope") is None

    need = dict(model_name="m", requested_output_names=[], inputs=[])
    d = pb.InferenceRequest(**need)
    assert d.parameters() == "{}" and d.correlation_id() == 0 and d.model_version() == -1 and d.inputs() == []
    with pytest.raises(pb.TritonModelException, match="Expect dict, got <class 'str'>"):
        pb.InferenceRequest(**need, parameters='{"a": "b"}')          # Triton takes a dict only
    with pytest.raises(pb.TritonModelException, match="values to have type bool/int/str, found "
                                                      "type <class 'list'>"):
        pb.InferenceRequest(**need, parameters={"a": [1]})
    with pytest.raises(pb.TritonModelException):
        pb.InferenceRequest(**{**need, "inputs": [np.zeros(1)]})


def test_inference_request_unsupported_paths():
    r = pb.InferenceRequest(model_name="other", requested_output_names=[], inputs=[])
    with pytest.raises(pb.TritonModelException, match="a request the model built has no "
                                                      "response sender"):
        r.get_response_sender()
    with pytest.raises(pb.TritonModelException, match="BLS"):
        r.exec()
    with pytest.raises(pb.TritonModelException, match="BLS"):
        asyncio.run(r.async_exec())
    for call in (lambda: pb.load_model("m"), lambda: pb.unload_model("m"), lambda: pb.is_model_ready("m")):
        with pytest.raises(pb.TritonModelException, match="can only be used by a model that "
                                                          "the server runs"):
            call()


def test_inference_request_worker_path():
    x = pb.Tensor("x", np.zeros(1, np.int8))
    r = pb.InferenceRequest._from_worker([x], ["y"], "id", 7, 1, '{"p": 1}', "m", 3)
    assert r.inputs() == [x] and r.requested_output_names() == ["y"] and r.request_id() == "id"
    assert r.correlation_id() == 7 and r.flags() == 1 and r.parameters() == '{"p": 1}'
    assert r.model_name() == "m" and r.model_version() == 3 and r.timeout() == 0
    assert pb.InferenceRequest._from_worker([], [], "", 0, 0, "", "m", 1).parameters() == "{}"


def test_inference_response():
    y = pb.Tensor("y", np.ones(2, np.float64))
    resp = pb.InferenceResponse(output_tensors=[y], parameters={"p": "q"})
    assert resp.output_tensors() == [y] and not resp.has_error() and resp.error() is None
    assert json.loads(resp.parameters()) == {"p": "q"}
    assert json.loads(pb.InferenceResponse(parameters={"i": -3, "b": False}).parameters()) == \
        {"i": -3, "b": False}
    for bad, words in (({"f": 0.5}, "values to have type bool/int/str, found type <class 'float'>"),
                       ({1: "x"}, "keys to have type str, found type <class 'int'>"),
                       ({"n": None}, "found type <class 'NoneType'>"),
                       ('{"p": "q"}', "Expect dict, got <class 'str'>"),
                       ([("p", "q")], "Expect dict, got <class 'list'>")):
        with pytest.raises(pb.TritonModelException, match=re.escape(words)):
            pb.InferenceResponse(parameters=bad)
    assert pb.get_output_tensor_by_name(resp, "y") is y
    assert pb.get_output_tensor_by_name(resp, "z") is None
    err = pb.InferenceResponse(error=pb.TritonError("boom", pb.TritonError.INVALID_ARG))
    assert err.has_error() and err.error().message() == "boom" and err.error().code() == 3
    assert err.output_tensors() == [] and err.parameters() == "{}"


def test_triton_error_codes():
    names = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
             "ALREADY_EXISTS", "CANCELLED"]
    assert [getattr(pb.TritonError, n) for n in names] == list(range(8))
    e = pb.TritonError("msg")
    assert e.code() == pb.TritonError.INTERNAL and e.message() == "msg" and str(e) == "msg"
    assert pb.TritonError("x", pb.TritonError.CANCELLED).code() == 7
    assert issubclass(pb.TritonModelException, Exception)
    assert pb.TritonModelException("why").message() == "why"


def test_config_helpers():
    cfg = {"name": "m", "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [3]}],
           "output": [{"name": "b", "data_type": "TYPE_STRING", "dims": [-1]}]}
    assert pb.get_input_config_by_name(cfg, "a")["dims"] == [3]
    assert pb.get_input_config_by_name(cfg, "b") is None
    assert pb.get_output_config_by_name(cfg, "b")["data_type"] == "TYPE_STRING"
    assert pb.get_output_config_by_name(cfg, "a") is None
    assert pb.get_input_config_by_name({}, "a") is None
    assert pb.using_decoupled_model_transaction_policy(cfg) is False
    assert pb.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}}) is True


def test_model_config_auto_complete():
    mc = pb.ModelConfig({"name": "m", "max_batch_size": 0,
                         "input": [{"name": "a", "data_type": "TYPE_INVALID", "dims": []}], "output": []})
    mc.set_max_batch_size(8)
    mc.set_dynamic_batching()
    mc.add_input({"name": "a", "data_type": "TYPE_FP32", "dims": [4]})  # fills in the partial entry
    mc.add_input({"name": "opt", "data_type": "TYPE_INT32", "dims": [1], "optional": True})
    mc.add_output({"name": "out", "data_type": "TYPE_FP32", "dims": [4]})
    mc.add_output({"name": "out", "data_type": "TYPE_FP32", "dims": [4]})  # identical: no-op
    mc.set_model_transaction_policy({"decoupled": False})
    d = mc.as_dict()
    assert d["max_batch_size"] == 8 and d["dynamic_batching"] == {}
    assert d["input"] == [{"name": "a", "data_type": "TYPE_FP32", "dims": [4]},
                          {"name": "opt", "data_type": "TYPE_INT32", "dims": [1], "optional": True}]
    assert d["output"] == [{"name": "out", "data_type": "TYPE_FP32", "dims": [4]}]
    assert d["model_transaction_policy"] == {"decoupled": False}
    assert pb.ModelConfig(json.dumps({"name": "j"})).as_dict() == {"name": "j"}  # Triton passes JSON text


def test_auto_complete_may_make_a_model_decoupled():
    """Every normalized config says decoupled: false, so that is no user's word against it."""
    mc = pb.ModelConfig({"name": "m", "model_transaction_policy": {"decoupled": False}})
    mc.set_model_transaction_policy({"decoupled": True})
    assert mc.as_dict()["model_transaction_policy"] == {"decoupled": True}


@pytest.mark.parametrize("action", [
    lambda mc: mc.add_input({"name": "a", "data_type": "TYPE_INT64", "dims": [4]}),   # type conflict
    lambda mc: mc.add_input({"name": "a", "data_type": "TYPE_FP32", "dims": [5]}),    # dims conflict
    lambda mc: mc.add_output({"name": "o", "data_type": "TYPE_FP16", "dims": [1]}),
    lambda mc: mc.add_input({"name": "n", "data_type": "TYPE_FP32"}),                 # missing dims
    lambda mc: mc.add_input({"name": "n", "data_type": "TYPE_FP32", "dims": [1], "bogus": 1}),
    lambda mc: mc.add_output({"name": "n", "data_type": "TYPE_FP32", "dims": [1], "optional": True}),
    lambda mc: mc.set_max_batch_size(2),                                              # lowers configured 4
    lambda mc: mc.set_max_batch_size(-1),
    lambda mc: (mc.as_dict()["model_transaction_policy"].update(decoupled=True),      # config says
                mc.set_model_transaction_policy({"decoupled": False})),               # True
    lambda mc: mc.set_model_transaction_policy({"other": 1}),
])
def test_model_config_conflicts(action):
    mc = pb.ModelConfig({"name": "m", "max_batch_size": 4,
                         "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [4]}],
                         "output": [{"name": "o", "data_type": "TYPE_FP32", "dims": [1]}],
                         "model_transaction_policy": {"decoupled": False}})
    with pytest.raises(ValueError):
        action(mc)


def test_model_config_dynamic_batching_vs_sequence():
    with pytest.raises(ValueError):
        pb.ModelConfig({"name": "m", "sequence_batching": {}}).set_dynamic_batching()


def test_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="shmserve.model"):
        pb.Logger.log_info("i")
        pb.Logger.log_warn("w")
        pb.Logger.log_error("e")
        pb.Logger.log_verbose("v")
        pb.Logger.log("x", pb.LogLevel.ERROR)
        pb.Logger.log("d")
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [("shmserve.model", logging.INFO, "i"), ("shmserve.model", logging.WARNING, "w"),
                   ("shmserve.model", logging.ERROR, "e"), ("shmserve.model", logging.DEBUG, "v"),
                   ("shmserve.model", logging.ERROR, "x"), ("shmserve.model", logging.INFO, "d")]
    assert all(r.filename == "test_pb_utils.py" for r in caplog.records)  # points at the caller
    assert {pb.LogLevel.INFO, pb.LogLevel.WARNING, pb.LogLevel.ERROR, pb.LogLevel.VERBOSE} == set(pb.LogLevel)


def test_metrics():
    c = pb.MetricFamily("test_pb_counter", "a counter", pb.MetricFamily.COUNTER)
    m = c.Metric(labels={"model": "m"})
    m.increment(2)
    m.increment(3)
    assert m.value() == 5
    assert c.Metric(labels={"model": "m"}) is m  # same labels, same metric
    with pytest.raises(pb.TritonModelException):
        m.increment(-1)
    with pytest.raises(pb.TritonModelException):
        m.set(1)
    gf = pb.MetricFamily("test_pb_gauge", "a gauge", pb.MetricFamily.GAUGE)
    g = gf.Metric()
    g.set(4)
    g.increment(-1.5)
    assert g.value() == 2.5
    hf = pb.MetricFamily("test_pb_hist", "a histogram", pb.MetricFamily.HISTOGRAM)
    h = hf.Metric(buckets=[1, 5])
    for v in (0.5, 1, 3, 10):
        h.observe(v)
    assert h._bucket_counts == [2, 1, 1] and h._count == 4 and h._sum == 14.5
    with pytest.raises(ValueError):
        pb.MetricFamily("test_pb_hist", "x", pb.MetricFamily.HISTOGRAM).Metric()  # buckets required
    with pytest.raises(ValueError):
        pb.MetricFamily("test_pb_counter", "x", pb.MetricFamily.GAUGE)  # same name, other kind


def _state(name):
    """The snapshot entry of one family (the registry is process-wide; other tests add theirs)."""
    from shmserve.workers.python_backend import metrics as pb_metrics
    pb_metrics.REGISTRY.dirty = True
    return next((f for f in pb_metrics.snapshot_if_dirty() if f.name == name), None)


def test_metric_snapshot_carries_every_kind():
    from shmserve.ipc.messages.common import MetricKind
    from shmserve.workers.python_backend import metrics as pb_metrics
    c = pb.MetricFamily("snap_counter", "c", pb.MetricFamily.COUNTER)
    c.Metric(labels={"a": "1"}).increment(2)
    c.Metric(labels={"a": "2"}).increment(np.float32(1.5))     # numpy scalars are fine
    gf = pb.MetricFamily("snap_gauge", "g", pb.MetricFamily.GAUGE)
    before = time.monotonic_ns()
    gf.Metric().set(-3)
    gf.Metric(labels={"k": "up"}).increment(2)
    hf = pb.MetricFamily("snap_hist", "h", pb.MetricFamily.HISTOGRAM)
    h = hf.Metric(labels={"m": "x"}, buckets=[1, 5, 10])
    for v in (0.5, 1, 3, 10, 11):
        h.observe(v)
    f = _state("snap_counter")
    assert f.kind == MetricKind.COUNTER and f.description == "c"
    assert {tuple(m.labels.items()): m.value for m in f.metrics} == {(("a", "1"),): 2.0,
                                                                     (("a", "2"),): 1.5}
    # a set() carries its time (the latest across instances wins on /metrics), an increment not
    assert [(m.value, m.set_ns >= before) for m in _state("snap_gauge").metrics] == [
        (-3.0, True), (2.0, False)]
    (hs,) = _state("snap_hist").metrics
    assert hs.labels == {"m": "x"} and hs.buckets == [1.0, 5.0, 10.0]
    assert hs.counts == [2, 1, 1, 1] and hs.sum == 25.5           # per bucket, +Inf last
    # the snapshot is a copy: encodable and not changed by later updates
    from shmserve.ipc import messages
    from shmserve.ipc.messages.common import CustomMetrics
    messages.encode(CustomMetrics(1, [_state("snap_hist")]))
    h.observe(100)
    assert hs.counts == [2, 1, 1, 1]
    # a family with no metric yet is still reported (it shows on /metrics with no samples)
    empty = pb.MetricFamily("snap_empty", "nothing yet", pb.MetricFamily.GAUGE)
    assert _state("snap_empty").metrics == [] and empty.name == "snap_empty"
    assert pb_metrics.snapshot_if_dirty() is None                 # nothing changed since


def test_metric_changes_mark_the_registry_dirty():
    from shmserve.workers.python_backend import metrics as pb_metrics
    gf = pb.MetricFamily("dirty_gauge", "g", pb.MetricFamily.GAUGE)
    g = gf.Metric()
    pb_metrics.snapshot_if_dirty()
    assert pb_metrics.snapshot_if_dirty() is None
    for change in (lambda: g.set(1), lambda: g.increment(1),
                   lambda: pb.MetricFamily("dirty_gauge", "g", pb.MetricFamily.GAUGE).Metric(
                       labels={"new": "labels"})):
        change()
        assert pb_metrics.snapshot_if_dirty() is not None
        assert pb_metrics.snapshot_if_dirty() is None
    g.value()                                                     # reading changes nothing
    pb.MetricFamily("dirty_gauge", "g", pb.MetricFamily.GAUGE).Metric()   # nor an existing one
    assert pb_metrics.snapshot_if_dirty() is None


def test_metric_family_rules_match_triton():
    first = pb.MetricFamily("same_name", "first description", pb.MetricFamily.COUNTER)
    second = pb.MetricFamily("same_name", "second description", pb.MetricFamily.COUNTER)
    m = first.Metric(labels={"k": "v"})
    assert second.Metric(labels={"k": "v"}) is m                  # one family, one metric
    assert _state("same_name").description == "first description"
    hf = pb.MetricFamily("empty_buckets", "h", pb.MetricFamily.HISTOGRAM)
    h = hf.Metric(buckets=[])
    h.observe(3)                                                  # only +Inf
    assert _state("empty_buckets").metrics[0].counts == [1]
    for v in (h.value, lambda: h.increment(1), lambda: h.set(1)):
        with pytest.raises(pb.TritonModelException):
            v()
    with pytest.raises(pb.TritonModelException):
        pb.MetricFamily("g_no_observe", "g", pb.MetricFamily.GAUGE).Metric().observe(1)


@pytest.mark.parametrize("make", [
    lambda: pb.MetricFamily("bad kind", "x", pb.MetricFamily.COUNTER),
    lambda: pb.MetricFamily("1starts_with_digit", "x", pb.MetricFamily.COUNTER),
    lambda: pb.MetricFamily("ok_kind", "x", 7),
    lambda: pb.MetricFamily("ok_labels", "x", pb.MetricFamily.GAUGE).Metric(labels={"a-b": "1"}),
    lambda: pb.MetricFamily("ok_labels", "x", pb.MetricFamily.GAUGE).Metric(labels={"__x": "1"}),
    lambda: pb.MetricFamily("ok_gauge", "x", pb.MetricFamily.GAUGE).Metric(buckets=[1]),
    lambda: pb.MetricFamily("ok_hist", "x", pb.MetricFamily.HISTOGRAM).Metric(buckets=[1, 1]),
    lambda: pb.MetricFamily("ok_hist", "x", pb.MetricFamily.HISTOGRAM).Metric(buckets=[float("inf")]),
    lambda: pb.MetricFamily("ok_hist", "x", pb.MetricFamily.HISTOGRAM).Metric(labels={"le": "1"},
                                                                              buckets=[1]),
])
def test_metric_argument_errors_are_both_kinds_of_exception(make):
    with pytest.raises(pb.TritonModelException):
        make()
    with pytest.raises(ValueError):
        make()


def test_is_cancelled_asks_the_worker_with_the_request_key():
    asked = []

    def poll(key):
        asked.append(key)
        return key == (0, 42)

    r = pb.InferenceRequest._from_worker([], [], "", 0, 0, "", "m", 1, (0, 42), poll)
    assert r.is_cancelled() and asked == [(0, 42)]
    other = pb.InferenceRequest._from_worker([], [], "", 0, 0, "", "m", 1, (1, 42), poll)
    assert not other.is_cancelled()
    assert not pb.InferenceRequest("m", [], []).is_cancelled()                # built by a model: no client


def test_response_sender_rules():
    sent = []
    emit = lambda response, final: sent.append((response, final))     # noqa: E731
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    r1, r2 = pb.InferenceResponse([]), pb.InferenceResponse([])
    s = pb.InferenceResponseSender(emit, True, lambda: False)
    s.send(r1)
    s.send(r2)
    s.send(flags=final)
    assert sent == [(r1, False), (r2, False), (None, True)]
    with pytest.raises(pb.TritonModelException, match="Response sender has been closed"):
        s.send(r1)
    for bad, words in (((None, 0), "must be provided when the response flags is set to zero"),
                       ((r1, 7), "Unsupported flag provided"),
                       (("text", 0), "Expected an 'InferenceResponse' object")):
        with pytest.raises(pb.TritonModelException, match=words):
            pb.InferenceResponseSender(emit, True, lambda: False).send(*bad)
    # a model that is not decoupled sends one answer, which leaves at once (as in Triton), and
    # then the FINAL flag, which adds nothing; an error after it does not replace it
    sent.clear()
    once = pb.InferenceResponseSender(emit, False, lambda: True)
    with pytest.raises(pb.TritonModelException, match="cannot send complete final before"):
        once.send(flags=final)
    once.send(r1)
    assert sent == [(r1, True)]
    with pytest.raises(pb.TritonModelException, match="cannot send more than one response"):
        once.send(r2)
    assert once._close() is True        # answered: execute()'s error is not sent after it
    assert sent == [(r1, True)] and once.is_cancelled()


def test_argument_types_are_checked_as_tritons_binding_checks_them():
    """Triton's argument_validation test: a wrong argument type is a TypeError, a list with a
    non-tensor in it a TritonModelException."""
    t = pb.Tensor("INPUT0", np.asarray([1, 2], np.int32))
    ok = dict(model_name="m", requested_output_names=["o"], inputs=[t])
    with pytest.raises(pb.TritonModelException):
        pb.InferenceRequest(**{**ok, "inputs": [None]})
    for change in ({"inputs": None}, {"model_name": None}, {"requested_output_names": [None]},
                   {"requested_output_names": None}, {"correlation_id": None},
                   {"request_id": None}, {"model_version": None}, {"flags": None}):
        with pytest.raises(TypeError):
            pb.InferenceRequest(**{**ok, **change})
    for missing in ok:
        with pytest.raises(TypeError):
            pb.InferenceRequest(**{k: v for k, v in ok.items() if k != missing})
    assert pb.InferenceRequest(**ok, correlation_id="id-5").correlation_id() == "id-5"
    pb.InferenceRequest(model_name="m", requested_output_names=[], inputs=[])
    with pytest.raises(pb.TritonModelException):
        pb.InferenceResponse(output_tensors=[None])
    with pytest.raises(TypeError):
        pb.InferenceResponse(output_tensors=None)
    pb.InferenceResponse([t])
    for name, array in ((None, np.zeros(2)), ("OUTPUT0", None), ("", None)):
        with pytest.raises(TypeError):
            pb.Tensor(name, array)
    for name in ("OUTPUT0", ""):
        with pytest.raises(pb.TritonModelException):
            pb.Tensor.from_dlpack(name, None)
    for call in (lambda: pb.Logger.log("x", None), lambda: pb.Logger.log("x", 1),
                 lambda: pb.Logger.log_info(None), lambda: pb.Logger.log_warn(None),
                 lambda: pb.Logger.log_error(None), lambda: pb.Logger.log_verbose(None)):
        with pytest.raises(TypeError):
            call()
    pb.Logger.log("level unspecified")
    assert pb.Logger.INFO is pb.LogLevel.INFO and pb.Logger.VERBOSE is pb.LogLevel.VERBOSE


def test_histogram_buckets_ascend_each_once_as_in_triton():
    """Triton's custom_metrics test: buckets are required, ascend, and appear once."""
    fam = pb.MetricFamily("ascending_hist", "h", pb.MetricFamily.HISTOGRAM)
    for bad in (None, [2.5, 0.1, 1.0], [1, 1, 2]):
        with pytest.raises(pb.TritonModelException):
            fam.Metric(labels={}, buckets=bad)
    fam.Metric(labels={}, buckets=[])
