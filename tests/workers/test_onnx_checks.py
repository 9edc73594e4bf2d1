"""workers/backends/onnx_checks.py: a config against its ONNX graph, as Triton's onnxruntime
backend compares them at load (its error texts), on small graphs built with the onnx package;
and what auto-complete builds from a graph always passes."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from serverproc import REPO_ROOT

from shmserve.ipc import model_config
from shmserve.ipc.errors import BackendLoadError
from shmserve.workers.backends import autocomplete, onnx_checks
from shmserve.workers.backends.base import InstanceSpec

onnx = pytest.importorskip("onnx", reason="the onnx package builds the test models ([test] extra)")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

F32, STR = TensorProto.FLOAT, TensorProto.STRING


def _graph(tmp_path, inputs, outputs, nodes, initializers=()) -> str:
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    return path


def _identity(tmp_path, shape, elem=F32) -> str:
    return _graph(tmp_path, [helper.make_tensor_value_info("IN", elem, shape)],
                  [helper.make_tensor_value_info("OUT", elem, shape)],
                  [helper.make_node("Identity", ["IN"], ["OUT"])])


def _session(path: str) -> ort.InferenceSession:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def _io(name, dtype="TYPE_FP32", dims=(4,), **kw) -> dict:
    return {"name": name, "data_type": dtype, "dims": list(dims), **kw}


def _cfg(inputs, outputs, mbs=8, **kw) -> dict:
    return {"name": "m", "max_batch_size": mbs, "input": inputs, "output": outputs, **kw}


def _refused(path: str, cfg: dict) -> str:
    with pytest.raises(BackendLoadError) as e:
        onnx_checks.check(cfg, _session(path))
    return str(e.value)


def test_the_example_models_load_under_the_checks():
    from shmserve.workers.backends.onnx import OnnxBackend
    names = []
    for config in sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "models", "*",
                                                "config.pbtxt"))):
        d = os.path.dirname(config)
        name = os.path.basename(d)
        cfg = model_config.normalize(model_config.read_config(d, name), name)
        if cfg.backend != "onnxruntime":
            continue
        OnnxBackend(InstanceSpec(name, 1, d, model_config.config_to_json(cfg), f"{name}_0",
                                 "CPU", 0, "onnxruntime"))
        names.append(name)
    # reshape (densenet_onnx), strings, sequence controls and states among them
    assert {"densenet_onnx", "simple_string", "simple_dyna_sequence",
            "onnx_accumulator"} <= set(names)


@pytest.mark.parametrize("shape,cfg", [
    (["batch", 4], _cfg([_io("IN")], [_io("OUT")])),
    (["batch", "n"], _cfg([_io("IN", dims=[-1])], [_io("OUT", dims=[-1])])),
    (["batch", "n"], _cfg([_io("IN", dims=[7])], [_io("OUT", dims=[7])])),     # -1 takes 7
    (["batch", 4], _cfg([_io("IN", dims=[2, 2], reshape={"shape": [4]})],
                        [_io("OUT", dims=[4])])),
    ([1, 4], _cfg([_io("IN", dims=[1, 4])], [_io("OUT", dims=[1, 4])], mbs=0)),
    (["batch", 4], _cfg([_io("IN", dims=[1, 4])], [_io("OUT", dims=[1, 4])], mbs=0)),
    ([], _cfg([_io("IN", dims=[1])], [_io("OUT", dims=[1])], mbs=0)),         # scalar
    ([], _cfg([_io("IN", dims=[1], reshape={"shape": []})],
              [_io("OUT", dims=[1], reshape={"shape": []})], mbs=0)),
])
def test_configs_that_agree_pass(tmp_path, shape, cfg):
    onnx_checks.check(cfg, _session(_identity(tmp_path, shape)))


@pytest.mark.parametrize("shape,cfg,text", [
    (["batch", 4], _cfg([_io("IN", "TYPE_INT32")], [_io("OUT")]),
     "unable to load model 'm', configuration expects datatype TYPE_INT32 for input 'IN', "
     "model provides TYPE_FP32"),
    (["batch", 4], _cfg([_io("IN")], [_io("OUT", "TYPE_FP64")]),
     "configuration expects datatype TYPE_FP64 for output 'OUT', model provides TYPE_FP32"),
    (["batch", 4], _cfg([_io("IN", "TYPE_INVALID")], [_io("OUT")]),
     "unsupported datatype TYPE_INVALID for input 'IN' for model 'm'"),
    (["batch", 4], _cfg([_io("IN", dims=[-1])], [_io("OUT")]),      # -1 where the model has 4
     "model 'm', tensor 'IN': the model expects 2 dimensions (shape [-1,4]) but the model "
     "configuration specifies 2 dimensions (an initial batch dimension because max_batch_size > "
     "0 followed by the explicit tensor shape, making complete shape [-1,-1])"),
    (["batch", 4], _cfg([_io("IN", dims=[4])], [_io("OUT", dims=[2, 2])]),
     "tensor 'OUT': the model expects 2 dimensions (shape [-1,4]) but the model configuration "
     "specifies 3 dimensions"),
    (["batch", 4], _cfg([_io("IN", dims=[4], reshape={"shape": [2, 2]})], [_io("OUT")]),
     "making complete shape [-1,2,2])"),        # the reshape shape is what is compared
    ([2, 4], _cfg([_io("IN")], [_io("OUT")]),
     "model 'm', tensor 'IN': for the model to support batching the shape should have at least "
     "1 dimension and the first dimension must be -1; but shape expected by the model is [2,4]"),
    (["batch", 4], _cfg([_io("IN", dims=[4, 5])], [_io("OUT", dims=[-1, 4])], mbs=0),
     "model 'm', tensor 'IN': the model expects 2 dimensions (shape [-1,4]) but the model "
     "configuration specifies 2 dimensions (shape [4,5])"),
    ([], _cfg([_io("IN", dims=[2])], [_io("OUT", dims=[1])], mbs=0),
     "unable to load model 'm', scalar tensor 'IN', should only provide 1 in the model "
     "configuration when the model doesn't support batching. Model configuration provided: [2]."),
    (["batch", 4], _cfg([_io("IN"), _io("IN2")], [_io("OUT")]),
     "unable to load model 'm', unexpected inference input 'IN2', allowed inputs are: IN"),
    (["batch", 4], _cfg([_io("IN")], [_io("OUT2")]),
     "unable to load model 'm', unexpected inference output 'OUT2', allowed outputs are: OUT"),
    (["batch", 4], _cfg([_io("IN", optional=True)], [_io("OUT")]),
     "unable to load model 'm', optional input 'IN' is not supported for models that support "
     "batching"),
    (["batch", 4], _cfg([_io("IN", dims=[-1], allow_ragged_batch=True)], [_io("OUT")]),
     "configuration expects model provides input with shape [-1] for ragged input 'IN', model "
     "provides [-1,4]"),
    (["batch", 4], _cfg([], [_io("OUT")]),
     "unable to load model 'm', configuration expects 0 inputs, model provides 1 (model input(s) "
     "the configuration does not declare: 'IN')"),
])
def test_contradictions_are_refused_in_tritons_words(tmp_path, shape, cfg, text):
    assert text in _refused(_identity(tmp_path, shape), cfg)


def test_strings(tmp_path):
    path = _identity(tmp_path, ["batch", 16], STR)
    onnx_checks.check(_cfg([_io("IN", "TYPE_STRING", [16])], [_io("OUT", "TYPE_STRING", [16])]),
                      _session(path))
    assert "configuration expects datatype TYPE_INT32 for input 'IN', model provides " \
           "TYPE_STRING" in _refused(path, _cfg([_io("IN", "TYPE_INT32", [16])],
                                               [_io("OUT", "TYPE_STRING", [16])]))


def test_a_ragged_input_needs_a_model_shape_of_minus_1(tmp_path):
    cfg = _cfg([_io("IN", dims=[1], allow_ragged_batch=True)], [_io("OUT", dims=[])])
    onnx_checks.check(cfg, _session(_identity(tmp_path, ["n"])))


def _with_bias(tmp_path) -> str:
    """Y = X + B; B an overridable initializer [4]."""
    return _graph(tmp_path, [helper.make_tensor_value_info("X", F32, ["N", 4]),
                             helper.make_tensor_value_info("B", F32, [4])],
                  [helper.make_tensor_value_info("Y", F32, ["N", 4])],
                  [helper.make_node("Add", ["X", "B"], ["Y"])],
                  [numpy_helper.from_array(np.ones(4, np.float32), "B")])


def test_an_input_with_an_initializer_may_be_left_out_or_declared(tmp_path):
    path = _with_bias(tmp_path)
    y = _io("Y", dims=[-1, 4])
    onnx_checks.check(_cfg([_io("X", dims=[-1, 4])], [y], mbs=0), _session(path))
    onnx_checks.check(_cfg([_io("X", dims=[-1, 4]), _io("B", optional=True)], [y], mbs=0),
                      _session(path))
    assert "tensor 'B': the model expects 1 dimensions (shape [4]) but the model configuration " \
           "specifies 1 dimensions (shape [5])" in _refused(
               path, _cfg([_io("X", dims=[-1, 4]), _io("B", dims=[5], optional=True)], [y], mbs=0))
    assert "model input(s) the configuration does not declare: 'X'" in _refused(
        path, _cfg([_io("B", optional=True)], [y], mbs=0))


def test_sequence_controls_and_states_count_as_declared(tmp_path):
    path = _graph(tmp_path, [helper.make_tensor_value_info(n, TensorProto.INT32, ["b", 1])
                             for n in ("IN", "START", "S_IN")],
                  [helper.make_tensor_value_info(n, TensorProto.INT32, ["b", 1])
                   for n in ("OUT", "S_OUT")],
                  [helper.make_node("Add", ["IN", "START"], ["t"]),
                   helper.make_node("Add", ["t", "S_IN"], ["OUT"]),
                   helper.make_node("Identity", ["OUT"], ["S_OUT"])])
    seq = {"control_input": [{"name": "START", "control": [
               {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}],
           "state": [{"input_name": "S_IN", "output_name": "S_OUT", "data_type": "TYPE_INT32",
                      "dims": [1]}]}
    io = ([_io("IN", "TYPE_INT32", [1])], [_io("OUT", "TYPE_INT32", [1])])
    onnx_checks.check(_cfg(*io, sequence_batching=seq), _session(path))
    assert "configuration expects 2 inputs, model provides 3 (model input(s) the configuration " \
           "does not declare: 'S_IN')" in _refused(
               path, _cfg(*io, sequence_batching={**seq, "state": []}))


@pytest.mark.parametrize("shape,elem", [(["batch", 4], F32), (["batch", "n", 3], F32), ([], F32),
                                        ([2, 3], F32), (["batch", 16], STR)])
@pytest.mark.parametrize("default_mbs", [4, 0])
def test_what_auto_complete_builds_passes(tmp_path, shape, elem, default_mbs):
    path = _identity(tmp_path, shape, elem)
    cfg = autocomplete.complete_onnx({"name": "m", "max_batch_size": 0}, path, default_mbs)
    onnx_checks.check(json.loads(json.dumps(cfg)), _session(path))
    partial = autocomplete.complete_onnx(
        {"name": "m", "max_batch_size": 0, "output": cfg["output"]}, path, default_mbs)
    onnx_checks.check(partial, _session(path))
