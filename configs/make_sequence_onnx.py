#!/usr/bin/env python3
"""Generate the ONNX sequence models (sequence_batching) of the example repository:

- ``simple_sequence``: Triton's example of that name. INPUT, START, READY (INT32 [batch, 1]) ->
  OUTPUT = READY * (INPUT + START);
- ``simple_dyna_sequence``: Triton's example of that name. INPUT, START, END, READY (INT32) and
  CORRID (UINT64) -> OUTPUT = READY * (INPUT + START + END * CORRID), CORRID cast to INT32;
- ``onnx_accumulator``: implicit state. INPUT, STATE_IN (INT32) -> OUTPUT = STATE_OUT =
  STATE_IN + INPUT, so that OUTPUT is the running sum of the sequence's inputs.

No weights, so the files are small and the same on every run.

Usage: python configs/make_sequence_onnx.py [MODELS_DIR]   (default: configs/models)
"""
import os
import sys

import onnx
from onnx import TensorProto, helper

# ir_version 8 / opset 17: the newest pair that every onnxruntime >= 1.17 loads.
OPSET, IR_VERSION = 17, 8
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
INT32, UINT64 = TensorProto.INT32, TensorProto.UINT64


def _model(name: str, inputs: list[tuple[str, int]], outputs: list[str],
           nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """Every tensor is [batch, 1]; the outputs are INT32."""
    dims = ["batch", 1]
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info(n, t, dims) for n, t in inputs],
        [helper.make_tensor_value_info(n, INT32, dims) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="shmserve configs/make_sequence_onnx.py")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def simple_sequence() -> onnx.ModelProto:
    return _model("simple_sequence", [("INPUT", INT32), ("START", INT32), ("READY", INT32)],
                  ["OUTPUT"],
                  [helper.make_node("Add", ["INPUT", "START"], ["sum"]),
                   helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"])])


def simple_dyna_sequence() -> onnx.ModelProto:
    return _model("simple_dyna_sequence",
                  [("INPUT", INT32), ("START", INT32), ("END", INT32), ("READY", INT32),
                   ("CORRID", UINT64)], ["OUTPUT"],
                  [helper.make_node("Cast", ["CORRID"], ["corrid"], to=INT32),
                   helper.make_node("Mul", ["END", "corrid"], ["end_corrid"]),
                   helper.make_node("Add", ["INPUT", "START"], ["sum0"]),
                   helper.make_node("Add", ["sum0", "end_corrid"], ["sum1"]),
                   helper.make_node("Mul", ["READY", "sum1"], ["OUTPUT"])])


def onnx_accumulator() -> onnx.ModelProto:
    return _model("onnx_accumulator", [("INPUT", INT32), ("STATE_IN", INT32)],
                  ["OUTPUT", "STATE_OUT"],
                  [helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
                   helper.make_node("Identity", ["STATE_OUT"], ["OUTPUT"])])


MODELS = {"simple_sequence": simple_sequence, "simple_dyna_sequence": simple_dyna_sequence,
          "onnx_accumulator": onnx_accumulator}


def main(models_dir: str = DEFAULT_DIR) -> None:
    for name, make in MODELS.items():
        path = os.path.join(models_dir, name, "1", "model.onnx")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        onnx.save(make(), path)
        print(path)


if __name__ == "__main__":
    main(*sys.argv[1:2])
