"""Sequence models through Worker.execute, in-process: the example models of configs/models
(simple_sequence, simple_dyna_sequence, onnx_accumulator, sequence_accumulator) and test models
that echo every control to a python model, keep implicit state in a python model, and grow a
variable-dim state in onnxruntime. Batches are made as the scheduler makes them (one request
per sequence, in order); answers are read from what the worker sends its frontend."""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from bare_worker import BareWorker
from google.protobuf import json_format, text_format
from onnx import TensorProto, helper
from serverproc import REPO_ROOT
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.ipc import channel, dtypes, packets
from shmserve.ipc.exec_record import ExecutionRecord
from shmserve.ipc.messages import encode
from shmserve.ipc.messages.common import ErrorCode, InferPayload, OutputSpec, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, InferResults
from shmserve.ipc.messages.to_scheduler import BatchDone, WorkerLoadFailed
from shmserve.ipc.messages.to_worker import ExecuteBatch, RequestRoute
from shmserve.ipc.shm import ShmMapCache
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.answers import Answers
from shmserve.workers.leases.chain import Chains
from shmserve.workers.worker import Worker

START, END = 1, 2
EXAMPLES = os.path.join(REPO_ROOT, "configs", "models")


def config_json(text: str) -> str:
    """config.pbtxt as the scheduler hands it to a worker: Triton's JSON form, every field."""
    cfg = text_format.Parse(text, mc.ModelConfig())
    if not cfg.default_model_filename:
        cfg.default_model_filename = "model.py" if cfg.backend == "python" else "model.onnx"
    return json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                                always_print_fields_with_no_presence=True))


def execution_record() -> ExecutionRecord:
    """What the worker writes while it executes (ipc/exec_record.py), in a file already
    removed: nobody reads it here."""
    with tempfile.TemporaryDirectory() as d:
        return ExecutionRecord(os.path.join(d, "exec"))


def unread_inbox() -> packets.PacketInbox:
    """The worker's inbox, for its address only: nothing here sends to it (its socket's file is
    removed at once, so no one could)."""
    with tempfile.TemporaryDirectory() as d:
        return packets.PacketInbox(channel.worker_address(d, 1))


def make_worker(model_dir: str) -> Worker:
    """A Worker with everything execute() and load() use, and no sockets: its answers to
    frontends and its messages to the scheduler are recorded (``sent``)."""
    with open(os.path.join(model_dir, "config.pbtxt")) as f:
        cfg_json = config_json(f.read())
    cfg = json.loads(cfg_json)
    w = BareWorker()
    w.chains, w.bls = Chains(w), None   # no ensemble runs worker to worker, no BLS
    w.args = SimpleNamespace(spawn_id=1)
    w.args_path = ""
    w.inbox = unread_inbox()
    w.spec = InstanceSpec(cfg["name"], 1, model_dir, cfg_json, f"{cfg['name']}_0", "CPU", 0,
                          cfg["backend"])
    w.maps = ShmMapCache()
    w.arena = None                      # every answer here is small enough to ride inline
    w.backlog, w.running, w.running_chain, w.cancelled = deque(), None, [], set()
    w.streams, w.stream_cancelled, w.responses_reported = {}, set(), {}
    w.out_lock, w.tell_lock = threading.Lock(), threading.Lock()
    w.record = execution_record()
    w.main_thread = threading.get_ident()
    w.senders = cfg["backend"] == "python"
    w.metrics_due = 0.0
    w.backend, w.sequence = None, None
    w.answers = Answers(cfg["name"], 1, "ipc://unused", w.arena, w.maps, None, None)
    w.use_config(cfg_json)
    w.sent = []
    w.answer = lambda fid, msg: w.sent.append(msg)
    w.tell = lambda msg, payloads=(): w.sent.append(msg)
    return w


def load_worker(model_dir: str) -> Worker:
    w = make_worker(model_dir)
    assert w.load(), w.sent
    return w


def load_failure(model_dir: str) -> str:
    """Why the model fails to load, as the scheduler hears it."""
    w = make_worker(model_dir)
    assert not w.load()
    failed = [m for m in w.sent if isinstance(m, WorkerLoadFailed)]
    assert len(failed) == 1
    return failed[0].reason


def payload(i: int, cid, flags: int, value, outputs=("OUTPUT",), shape=(1, 1)) -> bytes:
    data = np.full(shape, value, np.int32).tobytes()
    return encode(InferPayload(f"r{i}", [Tensor("INPUT", "INT32", list(shape), data)],
                               [OutputSpec(o) for o in outputs], {}, cid, flags))


def execute(w: Worker, requests, **kw) -> list[InferResult]:
    """One batch of (correlation id, flags, INPUT value); the answers in request order."""
    w.sent.clear()
    frames = [payload(i, cid, flags, value, **kw) for i, (cid, flags, value) in enumerate(requests)]
    w.execute(ExecuteBatch(1, [RequestRoute(i, 0) for i in range(len(requests))]), frames)
    results = []
    for msg in w.sent:
        if isinstance(msg, InferResults):
            results.extend(msg.results)
        elif isinstance(msg, InferResult):
            results.append(msg)
    return sorted(results, key=lambda r: r.req_id)


def value(res: InferResult, name: str = "OUTPUT"):
    assert not res.error, res.error
    t = next(t for t in res.outputs if t.name == name)
    if t.datatype == "BYTES":
        return dtypes.deserialize_bytes(t.data).reshape(t.shape).tolist()
    return np.frombuffer(t.data, dtypes.WIRE_TO_NUMPY[t.datatype]).reshape(t.shape).tolist()


def outputs(res: InferResult) -> list[str]:
    return [t.name for t in res.outputs]


@pytest.fixture(scope="module")
def simple_sequence():
    w = load_worker(os.path.join(EXAMPLES, "simple_sequence"))
    yield w
    w.backend.finalize()


def test_simple_sequence(simple_sequence):
    w = simple_sequence
    # OUTPUT = READY * (INPUT + START): READY is 1 for every request
    got = execute(w, [(1, START, 10), (2, START, 20)])
    assert [value(r) for r in got] == [[[11]], [[21]]]
    got = execute(w, [(2, 0, 5), (1, END, 7), (3, START | END, 0)])
    assert [value(r) for r in got] == [[[5]], [[7]], [[1]]]
    assert outputs(got[0]) == ["OUTPUT"]


def test_the_scheduler_hears_of_an_execution_before_the_frontend_has_its_answers(simple_sequence):
    # the scheduler reads workers' messages first: a statistics query a client sends once it
    # has its answer then counts the execution
    execute(simple_sequence, [(101, START | END, 10), (102, START | END, 20)])
    kinds = [type(m) for m in simple_sequence.sent]
    assert kinds[0] is BatchDone and kinds[1:] == [InferResults], kinds


def test_simple_dyna_sequence_with_its_corrid():
    w = load_worker(os.path.join(EXAMPLES, "simple_dyna_sequence"))
    # OUTPUT = READY * (INPUT + START + END * CORRID), CORRID as INT32
    got = execute(w, [(1000, START, 1), (7, 0, 2), (2 ** 32 + 9, END, 3), (5, START | END, 4)])
    assert [value(r) for r in got] == [[[2]], [[2]], [[12]], [[10]]]
    # a string id where the model takes an integer: that request fails, the others run
    got = execute(w, [("abc", START, 1), (8, END, 2)])
    assert got[0].code == ErrorCode.INVALID_ARG and "must be an unsigned integer, not a string" in got[0].error
    assert value(got[1]) == [[10]]
    [done] = [m for m in w.sent if isinstance(m, BatchDone)]
    assert done.failed == [0]                       # BatchDone counts the failure
    w.backend.finalize()


def test_onnx_accumulator_keeps_the_sum_as_implicit_state():
    w = load_worker(os.path.join(EXAMPLES, "onnx_accumulator"))
    assert w.sequence.capacity == 8
    got = execute(w, [(1, START, 3), (2, START, 100)])
    assert [value(r) for r in got] == [[[3]], [[100]]]
    assert all(outputs(r) == ["OUTPUT"] for r in got)       # STATE_OUT stays in the worker
    got = execute(w, [(2, 0, 1), (1, 0, 4), (3, START, -5)])
    assert [value(r) for r in got] == [[[101]], [[7]], [[-5]]]
    got = execute(w, [(1, END, 1)])
    assert value(got[0]) == [[8]] and 1 not in w.sequence.held
    got = execute(w, [(1, START, 2)])               # the id again: a new sequence
    assert value(got[0]) == [[2]]
    assert sorted(w.sequence.held) == [1, 2, 3]
    w.backend.finalize()


def test_sequence_accumulator_python_model():
    w = load_worker(os.path.join(EXAMPLES, "sequence_accumulator"))
    got = execute(w, [(1, START, 3), ("text-id", START, 10)])
    assert [value(r) for r in got] == [[[3]], [[10]]]
    got = execute(w, [("text-id", 0, 5), (1, 0, 4)])
    assert [value(r) for r in got] == [[[15]], [[7]]]
    got = execute(w, [(1, END, 1), ("text-id", START, 1)])      # START resets
    assert [value(r) for r in got] == [[[8]], [[1]]]
    assert dict(w.backend.model.sums) == {"text-id": [[1]]}     # END dropped 1
    w.backend.finalize()


ECHO_CONFIG = """
name: "echo_controls"
backend: "python"
max_batch_size: 4
sequence_batching {
  control_input [
    { name: "S", control [ { kind: CONTROL_SEQUENCE_START, bool_false_true: [ false, true ] } ] },
    { name: "E", control [ { kind: CONTROL_SEQUENCE_END, fp32_false_true: [ -1.5, 2.5 ] } ] },
    { name: "R", control [ { kind: CONTROL_SEQUENCE_READY, int32_false_true: [ 0, 7 ] } ] },
    { name: "C", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "ACC_IN", output_name: "ACC_OUT", data_type: TYPE_INT32, dims: [ 1 ],
            initial_state [ { name: "start", data_type: TYPE_INT32, dims: [ 1 ], data_file: "hundred" } ] } ]
}
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "OUT_S", data_type: TYPE_BOOL, dims: [ 1 ] },
  { name: "OUT_E", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "OUT_R", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "OUT_C", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "ACC_OUT", data_type: TYPE_INT32, dims: [ 1 ] }
]
"""

ECHO_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(r, name).as_numpy()
            acc = get("ACC_IN") + get("INPUT")
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT_S", get("S")), pb_utils.Tensor("OUT_E", get("E")),
                pb_utils.Tensor("OUT_R", get("R")), pb_utils.Tensor("OUT_C", get("C")),
                pb_utils.Tensor("OUTPUT", acc), pb_utils.Tensor("ACC_OUT", acc)]))
        return out
'''


@pytest.fixture
def echo(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(ECHO_MODEL)
    (tmp_path / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "hundred").write_bytes(np.array([100], "<i4").tobytes())
    w = load_worker(str(tmp_path))
    yield w
    w.backend.finalize()


def test_every_control_reaches_a_python_model(echo):
    want = ("OUT_S", "OUT_E", "OUT_R", "OUT_C", "OUTPUT")
    got = execute(echo, [(11, START, 1), ("seq-b", START | END, 2)], outputs=want)
    assert [[value(r, n) for n in want] for r in got] == [
        [[[True]], [[-1.5]], [[7]], [[b"11"]], [[101]]],
        [[[True]], [[2.5]], [[7]], [[b"seq-b"]], [[102]]]]
    assert all(outputs(r) == list(want) for r in got)       # ACC_OUT not asked for: not sent
    got = execute(echo, [(11, 0, 5)], outputs=want + ("ACC_OUT",))
    assert [value(got[0], n) for n in want + ("ACC_OUT",)] == [
        [[False]], [[-1.5]], [[7]], [[b"11"]], [[106]], [[106]]]
    got = execute(echo, [(11, END, 1)], outputs=("OUTPUT",))
    assert value(got[0]) == [[107]] and not echo.sequence.held


def test_a_python_model_that_forgets_its_state_output_fails_the_request(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(ECHO_MODEL.replace(
        ', pb_utils.Tensor("ACC_OUT", acc)', ""))
    (tmp_path / "config.pbtxt").write_text(ECHO_CONFIG.replace("data_file: \"hundred\"", "zero_data: true"))
    w = load_worker(str(tmp_path))
    got = execute(w, [(1, START, 1)])
    assert got[0].code == ErrorCode.INTERNAL
    assert got[0].error == "model 'echo_controls' did not produce requested output 'ACC_OUT'"
    w.backend.finalize()


def copy_simple_sequence(tmp_path, edit) -> None:
    src = os.path.join(EXAMPLES, "simple_sequence")
    (tmp_path / "1").mkdir(exist_ok=True)
    with open(os.path.join(src, "1", "model.onnx"), "rb") as f:
        (tmp_path / "1" / "model.onnx").write_bytes(f.read())
    with open(os.path.join(src, "config.pbtxt")) as f:
        (tmp_path / "config.pbtxt").write_text(edit(f.read()))


END_CONTROL = '{ name: "END", control [ { kind: CONTROL_SEQUENCE_END, int32_false_true: [ 0, 1 ] } ] },'


@pytest.mark.parametrize("edit,reason", [
    (lambda text: text.replace('{ name: "READY"', END_CONTROL + '\n    { name: "READY"'),
     "configuration specified sequence control or state input 'END', but model does not provide "
     "that input"),
    (lambda text: text.replace("int32_false_true", "fp32_false_true"),
     "unable to load model 'simple_sequence', sequence input 'START', the model expects data-type "
     "INT32 but the model configuration specifies data-type FP32"),
])
def test_an_onnx_model_must_have_the_sequence_tensors(tmp_path, edit, reason):
    copy_simple_sequence(tmp_path, edit)
    assert load_failure(str(tmp_path)) == reason


def test_an_onnx_model_must_produce_its_state_outputs(tmp_path):
    copy_simple_sequence(tmp_path, lambda text: text.replace(
        "  control_input [", "  state [ { input_name: \"INPUT\", output_name: \"NOPE\", "
        "data_type: TYPE_INT32, dims: [ 1 ] } ]\n  control_input ["))
    assert load_failure(str(tmp_path)) == ("configuration specified state output 'NOPE', but model "
                                           "does not provide that output")


def test_a_bad_initial_state_fails_the_load(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(ECHO_MODEL)
    (tmp_path / "config.pbtxt").write_text(ECHO_CONFIG)     # initial_state/hundred is missing
    reason = load_failure(str(tmp_path))
    assert reason.startswith("initial_state of state input 'ACC_IN': cannot read ") and \
        reason.endswith("initial_state/hundred: No such file or directory")


def growing_state_model(path: str) -> None:
    """STATE_OUT = [STATE_IN, INPUT] (the state grows by one column a request), OUTPUT = its
    row sum: the state's shape differs between sequences at different steps."""
    i32 = TensorProto.INT32
    nodes = [helper.make_node("Concat", ["STATE_IN", "INPUT"], ["STATE_OUT"], axis=1),
             helper.make_node("ReduceSum", ["STATE_OUT", "axes"], ["OUTPUT"], keepdims=1)]
    graph = helper.make_graph(
        nodes, "growing",
        [helper.make_tensor_value_info("INPUT", i32, ["b", 1]),
         helper.make_tensor_value_info("STATE_IN", i32, ["b", "n"])],
        [helper.make_tensor_value_info("OUTPUT", i32, ["b", 1]),
         helper.make_tensor_value_info("STATE_OUT", i32, ["b", "m"])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


GROWING_CONFIG = """
name: "growing"
backend: "onnxruntime"
max_batch_size: 8
sequence_batching {
  state [ { input_name: "STATE_IN", output_name: "STATE_OUT", data_type: TYPE_INT32, dims: [ -1 ] } ]
}
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


def test_variable_dim_states_of_different_shapes_share_a_batch(tmp_path):
    (tmp_path / "1").mkdir()
    growing_state_model(str(tmp_path / "1" / "model.onnx"))
    (tmp_path / "config.pbtxt").write_text(GROWING_CONFIG)
    w = load_worker(str(tmp_path))
    assert [value(r) for r in execute(w, [(1, START, 5)])] == [[[5]]]
    # 1's state is [1, 2], 2's [1, 1], 3's [1, 1]: equal shapes run together, the rest apart
    got = execute(w, [(1, 0, 6), (2, START, 1), (3, START, 2)])
    assert [value(r) for r in got] == [[[11]], [[1]], [[2]]]
    assert w.sequence.held[1]["STATE_IN"].tolist() == [[0, 5, 6]]
    got = execute(w, [(2, 0, 10), (1, END, 1), (3, 0, 3)])
    assert [value(r) for r in got] == [[[11]], [[12]], [[5]]]
    w.backend.finalize()
