#!/usr/bin/env python3
"""Generate the mlp_onnx benchmark model: INPUT0[batch,256] -> Gemm -> Relu -> Gemm -> OUTPUT0[batch,256].

The file is fully determined by the seed, so regenerating it never changes the bytes (and the
sha256 printed here can be compared across machines).

Usage: python configs/make_mlp_onnx.py [OUTPUT_PATH]
"""
import hashlib
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IN_DIM, HIDDEN, OUT_DIM = 256, 1024, 256
SEED = 0
# ir_version 8 / opset 17: the newest pair that every onnxruntime >= 1.17 loads.
OPSET, IR_VERSION = 17, 8
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "models", "mlp_onnx", "1", "model.onnx")


def _dense(rng, fan_in, fan_out, name):
    # Scale by 1/sqrt(fan_in) so activations stay O(1) through both layers.
    w = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
    b = (rng.standard_normal(fan_out) * 0.01).astype(np.float32)
    return numpy_helper.from_array(w, name + "_W"), numpy_helper.from_array(b, name + "_B")


def build_model() -> onnx.ModelProto:
    rng = np.random.default_rng(SEED)
    w1, b1 = _dense(rng, IN_DIM, HIDDEN, "fc1")
    w2, b2 = _dense(rng, HIDDEN, OUT_DIM, "fc2")
    nodes = [
        helper.make_node("Gemm", ["INPUT0", w1.name, b1.name], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["h1_relu"], name="relu"),
        helper.make_node("Gemm", ["h1_relu", w2.name, b2.name], ["OUTPUT0"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes, "mlp_onnx",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", IN_DIM])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", OUT_DIM])],
        initializer=[w1, b1, w2, b2],
    )
    # producer_version left empty: embedding onnx.__version__ would make the bytes depend on the
    # installed onnx release.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="shmserve-make_mlp_onnx", producer_version="")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT_PATH
    data = build_model().SerializeToString(deterministic=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Write-then-rename so a server polling the repository never sees a half-written file.
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    print(path)
    print("sha256", hashlib.sha256(data).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
