#!/usr/bin/env python3
"""Generate the ONNX models Triton's client examples ask for by name: ``simple_string`` (strings
that hold integers: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, as strings) and
``simple_int8`` (the same sum and difference on INT8, wrapping as int8 arithmetic does).

Both take [batch, 16] and have no weights, so the files are small and the same on every run.

Usage: python configs/make_simple_onnx.py [MODELS_DIR]   (default: configs/models)
"""
import os
import sys

import onnx
from onnx import TensorProto, helper

# ir_version 8 / opset 17: the newest pair that every onnxruntime >= 1.17 loads.
OPSET, IR_VERSION = 17, 8
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def sum_and_difference(name: str, io_type: int, math_type: int) -> onnx.ModelProto:
    """Inputs cast to ``math_type``, added and subtracted, the results cast back to ``io_type``."""
    dims = ["batch", 16]
    inputs = [helper.make_tensor_value_info(n, io_type, dims) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, io_type, dims) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Cast", ["INPUT0"], ["a"], to=math_type),
             helper.make_node("Cast", ["INPUT1"], ["b"], to=math_type),
             helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("Sub", ["a", "b"], ["difference"]),
             helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=io_type),
             helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=io_type)]
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs),
                              opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="shmserve configs/make_simple_onnx.py")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


MODELS = {
    "simple_string": (TensorProto.STRING, TensorProto.INT32),
    # onnxruntime's CPU Add has no int8 kernel; int32 math cast back to int8 wraps like int8
    "simple_int8": (TensorProto.INT8, TensorProto.INT32),
}


def main(models_dir: str = DEFAULT_DIR) -> None:
    for name, (io_type, math_type) in MODELS.items():
        path = os.path.join(models_dir, name, "1", "model.onnx")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        onnx.save(sum_and_difference(name, io_type, math_type), path)
        print(path)


if __name__ == "__main__":
    main(*sys.argv[1:2])
