"""Triton's decoupled example backends in-process: their config rules and their streams."""
import json
import threading

import numpy as np
import pytest

from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest, load_backend
from shmserve.workers.warmup import run_warmup


def _io(name, dtype, dims):
    return {"name": name, "data_type": dtype, "dims": list(dims)}


REPEAT_IN = [_io("IN", "TYPE_INT32", [-1]), _io("DELAY", "TYPE_UINT32", [-1]),
             _io("WAIT", "TYPE_UINT32", [1])]
REPEAT_OUT = [_io("OUT", "TYPE_INT32", [1]), _io("IDX", "TYPE_UINT32", [1])]
SQUARE_IN, SQUARE_OUT = [_io("IN", "TYPE_INT32", [1])], [_io("OUT", "TYPE_INT32", [1])]


def _spec(backend, inputs, outputs, decoupled=True, max_batch_size=0, parameters=None):
    cfg = {"name": "m", "backend": backend, "max_batch_size": max_batch_size, "input": inputs,
           "output": outputs, "parameters": parameters or {},
           "model_transaction_policy": {"decoupled": decoupled}}
    return InstanceSpec("m", 1, "/nonexistent", json.dumps(cfg), "m_0", "CPU", 0, backend)


class Stream:
    def __init__(self):
        self.items, self.done = [], threading.Event()

    def emit(self, resp, final):
        self.items.append(resp)
        if final:
            self.done.set()

    def responses(self):
        assert self.done.wait(10), "the stream did not end"
        assert self.items[-1] is None       # the FINAL flag alone, as Triton's examples send it
        return self.items[:-1]


def _request(inputs, types, cancel_key=None):
    s = Stream()
    return WorkRequest(inputs, types, [], cancel_key=cancel_key, emit=s.emit), s


def test_repeat_streams_each_element_with_its_index_then_final():
    backend = load_backend(_spec("repeat", REPEAT_IN, REPEAT_OUT))
    req, stream = _request({"IN": np.array([4, 2, 0, 1], np.int32),
                            "DELAY": np.array([1, 2, 3, 4], np.uint32),
                            "WAIT": np.array([5], np.uint32)},
                           {"IN": "INT32", "DELAY": "UINT32", "WAIT": "UINT32"})
    assert backend.execute([req]) == [None]
    got = [(r.outputs[0][2].tolist(), r.outputs[1][2].tolist()) for r in stream.responses()]
    assert got == [([4], [0]), ([2], [1]), ([0], [2]), ([1], [3])]
    backend.finalize()


def test_repeat_refuses_in_and_delay_of_different_shapes():
    backend = load_backend(_spec("repeat", REPEAT_IN, REPEAT_OUT))
    req, _ = _request({"IN": np.array([1, 2], np.int32), "DELAY": np.array([1], np.uint32),
                       "WAIT": np.array([0], np.uint32)},
                      {"IN": "INT32", "DELAY": "UINT32", "WAIT": "UINT32"})
    (resp,) = backend.execute([req])
    assert resp.error == "expected IN and DELAY shape to match, got [2] and [1]"
    assert resp.code == ErrorCode.INVALID_ARG


@pytest.mark.parametrize("backend,inputs,outputs,kw,message", [
    ("repeat", REPEAT_IN, REPEAT_OUT, {"max_batch_size": 8},
     "repeat backend only supports models with max_batch_size == 0"),
    ("repeat", REPEAT_IN[:2], REPEAT_OUT, {}, "expected 3 inputs, got 2"),
    ("repeat", [REPEAT_IN[1], REPEAT_IN[0], REPEAT_IN[2]], REPEAT_OUT, {},
     "expected first input tensor name to be IN, got DELAY"),
    ("repeat", REPEAT_IN, [REPEAT_OUT[0], _io("IDX", "TYPE_INT32", [1])], {},
     "expected IDX datatype to be UINT32, got TYPE_INT32"),
    ("repeat", [_io("IN", "TYPE_INT32", [2]), _io("DELAY", "TYPE_UINT32", [3]),
                REPEAT_IN[2]], REPEAT_OUT, {},
     "expected IN and DELAY shape to match, got [2] and [3]"),
    ("square", SQUARE_IN, [_io("OUT", "TYPE_INT32", [2])], {},
     "expected OUT shape to be [1], got [2]"),
    ("square", SQUARE_IN + SQUARE_OUT, SQUARE_OUT, {}, "expected 1 input, got 2"),
])
def test_configs_the_example_backends_refuse(backend, inputs, outputs, kw, message):
    with pytest.raises(BackendLoadError) as e:
        load_backend(_spec(backend, inputs, outputs, **kw))
    assert str(e.value).startswith(message)


def test_square_sends_in_responses_of_in_with_failures_and_empties_last():
    params = {"CUSTOM_FAIL_COUNT": {"string_value": "1"},
              "CUSTOM_EMPTY_COUNT": {"string_value": "2"},
              "CUSTOM_INFER_DELAY_NS": {"string_value": "not a number"}}    # ignored, as Triton
    backend = load_backend(_spec("square", SQUARE_IN, SQUARE_OUT, parameters=params))
    req, stream = _request({"IN": np.array([5], np.int32)}, {"IN": "INT32"})
    assert backend.execute([req]) == [None]
    got = stream.responses()
    assert [r.outputs[0][2].tolist() for r in got[:2]] == [[5], [5]]
    assert got[2].error == "simulated failure" and got[2].code == ErrorCode.UNKNOWN
    assert len(got) == 3        # the last two elements send nothing
    zero, stream0 = _request({"IN": np.array([0], np.int32)}, {"IN": "INT32"})
    backend.execute([zero])
    assert stream0.responses() == []


def test_square_reports_each_response_as_tritons_square_does():
    reports = []
    params = {"CUSTOM_FAIL_COUNT": {"string_value": "1"},
              "CUSTOM_EMPTY_COUNT": {"string_value": "2"},
              "CUSTOM_INFER_DELAY_NS": {"string_value": "2000000"},     # 2 ms
              "CUSTOM_OUTPUT_DELAY_NS": {"string_value": "1000000"}}    # 1 ms
    backend = load_backend(_spec("square", SQUARE_IN, SQUARE_OUT, parameters=params),
                           None, lambda *a: reports.append(a))
    req, stream = _request({"IN": np.array([5], np.int32)}, {"IN": "INT32"}, cancel_key=(1, 2))
    backend.execute([req])
    assert len(stream.responses()) == 3
    assert [r[:2] for r in reports] == [((1, 2), "success")] * 2 + [((1, 2), "fail")] + \
        [((1, 2), "empty")] * 2
    for _, kind, start, output_start, end in reports:
        if kind == "empty":
            assert output_start == 0 and end - start >= 2_000_000
        else:
            assert output_start - start >= 2_000_000 and end - output_start >= 1_000_000
    assert all(a[4] <= b[2] for a, b in zip(reports, reports[1:]))     # one after another


def test_square_reports_the_response_it_cancelled():
    reports, cancelled = [], {(1, 3)}
    backend = load_backend(_spec("square", SQUARE_IN, SQUARE_OUT),
                           lambda key: key in cancelled, lambda *a: reports.append(a))
    req, stream = _request({"IN": np.array([3], np.int32)}, {"IN": "INT32"}, cancel_key=(1, 3))
    backend.execute([req])
    assert stream.responses() == []
    assert [r[1] for r in reports] == ["cancel"]


def test_square_stops_once_its_client_has_left():
    cancelled = set()
    params = {"CUSTOM_INFER_DELAY_NS": {"string_value": "2000000"}}     # 2 ms per response
    spec = _spec("square", SQUARE_IN, SQUARE_OUT, parameters=params)
    backend = load_backend(spec, lambda key: key in cancelled)
    req, stream = _request({"IN": np.array([100000], np.int32)}, {"IN": "INT32"},
                           cancel_key=(1, 7))
    backend.execute([req])
    cancelled.add((1, 7))
    got = stream.responses()
    assert len(got) < 100000 and all(r.outputs[0][2].tolist() == [100000] for r in got)


def _warmup(value):
    return [{"name": "w", "inputs": {"IN": {"data_type": "TYPE_INT32", "dims": [1],
                                            "input_data_file": "in.bin"}}}], value


@pytest.mark.parametrize("fail,error", [("0", None), ("1", "warmup 'w' failed: simulated failure")])
def test_warmup_of_a_decoupled_model_waits_for_its_final_flag(tmp_path, fail, error):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "in.bin").write_bytes(np.array([3], np.int32).tobytes())
    spec = _spec("square", SQUARE_IN, SQUARE_OUT,
                 parameters={"CUSTOM_FAIL_COUNT": {"string_value": fail}})
    cfg = json.loads(spec.config_json)
    cfg["model_warmup"] = _warmup(3)[0]
    backend = load_backend(spec)
    if error is None:
        run_warmup(backend, json.dumps(cfg), str(tmp_path))
    else:
        with pytest.raises(BackendLoadError, match=error):
            run_warmup(backend, json.dumps(cfg), str(tmp_path))


PY_DECOUPLED = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            sender = r.get_response_sender()
            for _ in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([n], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_warmup_of_a_decoupled_python_model(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(PY_DECOUPLED)
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "in.bin").write_bytes(np.array([2], np.int32).tobytes())
    cfg = json.loads(_spec("python", SQUARE_IN, SQUARE_OUT).config_json)
    cfg["model_warmup"] = _warmup(2)[0]
    spec = InstanceSpec("m", 1, str(tmp_path), json.dumps(cfg), "m_0", "CPU", 0, "python")
    backend = load_backend(spec)
    run_warmup(backend, json.dumps(cfg), str(tmp_path))
    backend.finalize()
