"""The trace extension's core (frontend/observability/trace.py), in process: settings and their checks,
sampling, each model's own settings, and what goes to the file, when."""
import json

import numpy as np
import pytest

from shmserve.frontend.observability import trace
from shmserve.ipc import dtypes
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, ShmRef, Tensor, TraceChanges, TraceConfig
from shmserve.ipc.shm import ShmMapCache

ON = TraceConfig(["TIMESTAMPS"], rate=1, file="/t/trace.json")


class Files:
    """What the core would write: path -> records."""
    def __init__(self):
        self.written: dict[str, list[dict]] = {}

    def __call__(self, path, records):
        self.written[path] = records


def core(start=ON, suffix=""):
    files = Files()
    return trace.TraceCore(start, suffix, files), files


def run(c, model="m", n=1, request_id=""):
    """Send ``n`` requests of ``model`` through the core; the traces finished."""
    done = []
    for _ in range(n):
        t = c.sample(model, 1, request_id)
        if t is not None:
            t.stamp("REQUEST_START")
            t.compute([1, 2, 3, 4])
            c.finish(t)
            done.append(t)
    return done


def test_the_settings_render_as_triton_answers():
    c, _ = core(TraceConfig(file="/t/x.json"))
    assert c.settings() == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                            "log_frequency": "0", "trace_file": "/t/x.json",
                            "trace_mode": "triton"}
    assert not c.active


@pytest.mark.parametrize("doc, code, says", [
    ({"trace_rate": "abc"}, ErrorCode.INVALID_ARG, "Unable to parse 'trace_rate', got: abc"),
    ({"trace_rate": ""}, ErrorCode.INVALID_ARG, "Unable to parse 'trace_rate', got: "),
    ({"trace_rate": "0"}, ErrorCode.INVALID_ARG,
     "Attempting to set invalid trace setting :sample rate must be non-zero"),
    ({"trace_rate": "-3"}, ErrorCode.INVALID_ARG, "Expecting value >= 1, got:-3"),
    ({"trace_rate": 5}, ErrorCode.INVALID_ARG, "attempt to access JSON non-string as string"),
    ({"trace_count": "-2"}, ErrorCode.INVALID_ARG,
     "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ({"trace_count": "x"}, ErrorCode.INVALID_ARG, "Unable to parse 'trace_count', got: x"),
    ({"log_frequency": "-1"}, ErrorCode.INVALID_ARG, "Expecting value >= 0, got:-1"),
    ({"trace_level": "TIMESTAMPS"}, ErrorCode.INVALID_ARG,
     "attempt to access JSON non-array as array"),
    ({"trace_level": [1]}, ErrorCode.INVALID_ARG, "attempt to access JSON non-string as string"),
    ({"trace_level": ["BOGUS"]}, ErrorCode.INVALID_ARG, "invalid trace level 'BOGUS'"),
    ({"trace_mode": "opentelemetry"}, ErrorCode.INVALID_ARG,
     "trace mode 'opentelemetry' is not supported"),
    ({"trace_file": "/x"}, ErrorCode.UNSUPPORTED,
     "trace file location can not be updated through network protocol"),
    ({"trace_file": None}, ErrorCode.UNSUPPORTED, "can not be updated through network protocol"),
    ({"trace_ratee": "1"}, ErrorCode.INVALID_ARG, "unknown trace setting 'trace_ratee'"),
    ([1, 2], ErrorCode.INVALID_ARG, "the trace settings request must be a JSON object"),
])
def test_bad_changes_are_refused_naming_the_setting(doc, code, says):
    with pytest.raises(InferError) as e:
        trace.parse_changes(doc)
    assert e.value.code == code and says in e.value.message, e.value.message


def test_a_bad_change_changes_nothing():
    c, _ = core()
    before = c.settings()
    with pytest.raises(InferError):
        c.update(trace.parse_changes({"trace_rate": "7", "trace_count": "-5"}))
    assert c.settings() == before


def test_levels_off_and_empty_mean_off_and_repeats_count_once():
    assert trace.parse_changes({"trace_level": []}) == TraceChanges(level=["OFF"])
    assert trace.parse_changes({"trace_level": ["timestamps", "TIMESTAMPS", "TENSORS"]}) == \
        TraceChanges(level=["TIMESTAMPS", "TENSORS"])
    assert trace.parse_changes({"trace_rate": None, "trace_count": "3"}).given() == \
        {"rate": None, "count": 3}


def test_one_request_in_rate_is_traced_the_rate_th():
    c, _ = core(TraceConfig(["TIMESTAMPS"], rate=3, file="/t/x"))
    picked = [c.sample("m", 1, f"r{i}") for i in range(1, 10)]
    assert [t.request_id for t in picked if t] == ["r3", "r6", "r9"]
    assert [t.id for t in picked if t] == [1, 2, 3]


def test_the_count_runs_down_and_tracing_stops_at_zero():
    c, _ = core()
    c.update(trace.parse_changes({"trace_count": "2"}))
    assert len(run(c, n=5)) == 2
    assert c.settings()["trace_count"] == "0"
    assert c.sample("m", 1) is None


def test_a_model_of_its_own_counts_apart_and_null_drops_its_settings():
    c, _ = core()
    c.update(trace.parse_changes({"trace_count": "1", "trace_rate": "2"}), model="m")
    assert c.settings("m")["trace_count"] == "1" and c.settings("m")["trace_rate"] == "2"
    assert c.settings()["trace_rate"] == "1"        # the global ones are untouched
    assert len(run(c, "m", 6)) == 1
    assert c.settings("m")["trace_count"] == "0" and c.settings()["trace_count"] == "-1"
    assert len(run(c, "other", 3)) == 3             # other models follow the global settings
    c.update(trace.parse_changes({"trace_rate": "1"}), model="m")   # its count stays spent
    assert c.settings("m")["trace_count"] == "0" and run(c, "m", 2) == []
    c.update(trace.parse_changes({"trace_count": None, "trace_rate": None}), model="m")
    assert c.settings("m") == c.settings()
    assert len(run(c, "m", 2)) == 2


def test_a_model_can_be_traced_while_the_rest_is_not():
    c, _ = core(TraceConfig(file="/t/x"))
    c.update(trace.parse_changes({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}), "m")
    assert c.active
    assert run(c, "other", 2) == [] and len(run(c, "m", 2)) == 2
    c.update(trace.parse_changes({"trace_level": ["OFF"]}), "m")
    assert not c.active


def test_null_sets_a_global_setting_back_to_its_value_at_start():
    c, _ = core(TraceConfig(["TIMESTAMPS"], rate=10, file="/t/x"))
    c.update(trace.parse_changes({"trace_rate": "3", "trace_level": ["OFF"]}))
    c.update(trace.parse_changes({"trace_rate": None, "trace_level": None}))
    assert c.settings()["trace_rate"] == "10" and c.settings()["trace_level"] == ["TIMESTAMPS"]


def test_tracing_cannot_start_without_a_file():
    c, _ = core(TraceConfig())
    with pytest.raises(InferError) as e:
        c.update(trace.parse_changes({"trace_level": ["TIMESTAMPS"]}))
    assert e.value.message.startswith("Attempting to set invalid trace setting :trace file name is not given")
    with pytest.raises(InferError):
        c.update(trace.parse_changes({"trace_level": ["TIMESTAMPS"]}), "m")
    assert not c.active


def test_records_are_tritons_one_object_per_time():
    c, _ = core()
    t = run(c, request_id="abc")[0]
    assert t.records() == [
        {"id": 1, "model_name": "m", "model_version": 1, "request_id": "abc"},
        {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": t.stamps[0][1]}]},
        {"id": 1, "timestamps": [{"name": "COMPUTE_START", "ns": 1}]},
        {"id": 1, "timestamps": [{"name": "COMPUTE_INPUT_END", "ns": 2}]},
        {"id": 1, "timestamps": [{"name": "COMPUTE_OUTPUT_START", "ns": 3}]},
        {"id": 1, "timestamps": [{"name": "COMPUTE_END", "ns": 4}]}]
    assert "request_id" not in run(c)[0].records()[0]      # none given: no key, as Triton


def test_without_a_log_frequency_everything_is_written_once_at_the_stop():
    c, files = core()
    run(c, n=3)
    assert files.written == {}
    c.flush()
    assert list(files.written) == ["/t/trace.json"]
    assert len([r for r in files.written["/t/trace.json"] if "model_name" in r]) == 3


def test_a_log_frequency_writes_numbered_files_as_traces_come():
    c, files = core(TraceConfig(["TIMESTAMPS"], rate=1, log_frequency=2, file="/t/x.json"))
    run(c, n=5)
    assert sorted(files.written) == ["/t/x.json.0", "/t/x.json.1"]
    c.flush()           # the rest, at the stop
    assert sorted(files.written) == ["/t/x.json.0", "/t/x.json.1", "/t/x.json.2"]
    ids = [r["id"] for r in files.written["/t/x.json.1"] if "model_name" in r]
    assert ids == [3, 4]


def test_several_frontends_write_files_of_their_own():
    c, files = core(suffix=".frontend1")
    run(c)
    c.flush()
    assert list(files.written) == ["/t/trace.json.frontend1"]


def test_a_file_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    c = trace.TraceCore(TraceConfig(["TIMESTAMPS"], rate=1,
                                    file=str(tmp_path / "no" / "dir" / "t.json")))
    run(c)
    c.flush()
    assert "could not write 6 trace records" in caplog.text


def test_the_default_writer_writes_a_json_array(tmp_path):
    path = tmp_path / "t.json"
    c = trace.TraceCore(TraceConfig(["TIMESTAMPS"], rate=1, file=str(path)))
    run(c, n=2)
    c.flush()
    records = json.loads(path.read_text())
    assert [r["id"] for r in records if "model_name" in r] == [1, 2]


def test_grpc_settings_read_as_json_would():
    from tritonclient.grpc import service_pb2 as pb
    req = pb.TraceSettingRequest()
    req.settings["trace_level"].value.extend(["TIMESTAMPS", "TENSORS"])
    req.settings["trace_rate"].value.append("5")
    req.settings["trace_count"]     # a key without values: null
    assert trace.from_grpc(req.settings) == {"trace_level": ["TIMESTAMPS", "TENSORS"],
                                             "trace_rate": "5", "trace_count": None}


def test_tensors_are_written_as_triton_writes_them():
    c, _ = core(TraceConfig(["TENSORS"], rate=1, file="/t/x"))
    t = c.sample("m", 1, "abc")
    maps = ShmMapCache()
    t.tensor("TENSOR_QUEUE_INPUT", Tensor("X", "FP32", [1, 3],
                                          np.array([[0, 1.5, -2e-7]], np.float32).tobytes()), maps)
    t.tensor("TENSOR_QUEUE_INPUT", Tensor("B", "BOOL", [2], np.array([1, 0], bool).tobytes()), maps)
    t.tensor("TENSOR_BACKEND_OUTPUT", Tensor("S", "BYTES", [2],
                                             dtypes.serialize_bytes(np.array([b"a", b"bc"],
                                                                             object)).tobytes()),
             maps)
    t.tensor("TENSOR_BACKEND_OUTPUT", Tensor("I", "INT64", [2], None), maps)   # on a GPU
    t.stamp("REQUEST_START")
    # TENSORS alone: no head and no times, as Triton
    assert t.records() == [
        {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
         "tensor": {"name": "X", "data": "0,1.5,-2e-07", "shape": "1,3", "dtype": "FP32"}},
        {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
         "tensor": {"name": "B", "data": "1,0", "shape": "2", "dtype": "BOOL"}},
        {"id": 1, "activity": "TENSOR_BACKEND_OUTPUT",
         "tensor": {"name": "S", "data": "a,bc", "shape": "2", "dtype": "BYTES"}},
        {"id": 1, "activity": "TENSOR_BACKEND_OUTPUT",
         "tensor": {"name": "I", "data": "", "shape": "2", "dtype": "INT64"}}]
    both, _ = core(TraceConfig(["TIMESTAMPS", "TENSORS"], rate=1, file="/t/x"))
    t = both.sample("m", 1)
    t.tensor("TENSOR_QUEUE_INPUT", Tensor("I", "INT32", [1], np.array([7], np.int32).tobytes()),
             maps)
    assert [r.get("activity") for r in t.records()] == [None, "TENSOR_QUEUE_INPUT"]
    maps.close()


def test_a_tensor_that_cannot_be_read_is_written_empty_and_the_request_goes_on(caplog):
    c, _ = core(TraceConfig(["TENSORS"], rate=1, file="/t/x"))
    t = c.sample("m", 1)
    maps = ShmMapCache()
    t.tensor("TENSOR_QUEUE_INPUT", Tensor("X", "FP32", [1], None,
                                          ShmRef("shmserve_no_such_segment", 0, 4)), maps)
    assert t.records()[0]["tensor"]["data"] == ""
    assert "could not read tensor 'X'" in caplog.text
    maps.close()
