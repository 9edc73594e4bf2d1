"""The ONNX sequence examples (configs/make_sequence_onnx.py), run by onnxruntime directly: their
graphs compute what their configs say, batched, and the committed files are what the script
builds."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import onnxruntime as ort
import pytest
from serverproc import REPO_ROOT

MODELS = os.path.join(REPO_ROOT, "configs", "models")
NAMES = ("simple_sequence", "simple_dyna_sequence", "onnx_accumulator")


def session(name: str) -> ort.InferenceSession:
    return ort.InferenceSession(os.path.join(MODELS, name, "1", "model.onnx"),
                                providers=["CPUExecutionProvider"])


def column(*values, dtype=np.int32) -> np.ndarray:
    return np.array(values, dtype=dtype).reshape(-1, 1)


def test_simple_sequence_graph():
    s = session("simple_sequence")
    assert {i.name: (i.type, i.shape[1:]) for i in s.get_inputs()} == {
        n: ("tensor(int32)", [1]) for n in ("INPUT", "START", "READY")}
    inp, start, ready = column(5, -3, 7, 100), column(1, 0, 1, 0), column(1, 1, 0, 1)
    (out,) = s.run(["OUTPUT"], {"INPUT": inp, "START": start, "READY": ready})
    assert out.dtype == np.int32 and out.tolist() == (ready * (inp + start)).tolist()
    assert out.tolist() == [[6], [-3], [0], [100]]


def test_simple_dyna_sequence_graph():
    s = session("simple_dyna_sequence")
    assert {i.name: i.type for i in s.get_inputs()} == {
        "INPUT": "tensor(int32)", "START": "tensor(int32)", "END": "tensor(int32)",
        "READY": "tensor(int32)", "CORRID": "tensor(uint64)"}
    inp, start, end = column(1, 2, 3, 4, 5), column(1, 0, 0, 1, 0), column(0, 0, 1, 1, 1)
    ready = column(1, 1, 1, 1, 0)
    corrid = column(1000, 7, 2 ** 32 + 9, 5, 3, dtype=np.uint64)
    (out,) = s.run(["OUTPUT"], {"INPUT": inp, "START": start, "END": end, "READY": ready,
                                "CORRID": corrid})
    # CORRID is cast to INT32: its low 32 bits
    assert out.dtype == np.int32 and out.tolist() == [[2], [2], [12], [10], [0]]


def test_onnx_accumulator_graph():
    s = session("onnx_accumulator")
    assert [i.name for i in s.get_inputs()] == ["INPUT", "STATE_IN"]
    assert [o.name for o in s.get_outputs()] == ["OUTPUT", "STATE_OUT"]
    state = column(0, 10)
    for step in (column(3, 1), column(4, -20)):
        out, state = s.run(["OUTPUT", "STATE_OUT"], {"INPUT": step, "STATE_IN": state})
        assert out.tolist() == state.tolist()
    assert state.tolist() == [[7], [-9]]


def test_the_committed_files_are_what_the_script_builds(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_sequence_onnx", os.path.join(REPO_ROOT, "configs", "make_sequence_onnx.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(tmp_path))
    for name in NAMES:
        with open(tmp_path / name / "1" / "model.onnx", "rb") as built, \
                open(os.path.join(MODELS, name, "1", "model.onnx"), "rb") as committed:
            assert built.read() == committed.read(), name


@pytest.mark.parametrize("name", NAMES)
def test_the_configs_name_the_graphs_tensors(name):
    """Every config input, output, control and state is a graph tensor of that datatype."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc
    with open(os.path.join(MODELS, name, "config.pbtxt")) as f:
        cfg = text_format.Parse(f.read(), mc.ModelConfig())
    s = session(name)
    ins = {i.name: i.type for i in s.get_inputs()}
    outs = {o.name: o.type for o in s.get_outputs()}
    types = {mc.TYPE_INT32: "tensor(int32)", mc.TYPE_UINT64: "tensor(uint64)"}
    want_in = {t.name: types[t.data_type] for t in cfg.input}
    want_out = {t.name: types[t.data_type] for t in cfg.output}
    for ci in cfg.sequence_batching.control_input:
        for c in ci.control:
            want_in[ci.name] = types[c.data_type] if c.kind == c.CONTROL_SEQUENCE_CORRID else \
                "tensor(int32)"
    for st in cfg.sequence_batching.state:
        want_in[st.input_name] = want_out[st.output_name] = types[st.data_type]
    assert ins == want_in and outs == want_out
    assert cfg.max_batch_size == 8
