#!/usr/bin/env python3
"""Generate the classifier_onnx example model: a tiny image classifier that names an image's
average colour, for Triton's image_client.py / grpc_image_client.py and the classification
extension.

IMAGE[batch,3,224,224] (RGB, NCHW, pixels scaled to [-1, 1] as image_client's "-s INCEPTION"
does) -> GlobalAveragePool -> Flatten -> Gemm -> Softmax -> PROBABILITIES[batch,12], one class
per colour of ``COLORS`` (labels.txt lists them in the same order).

The Gemm ranks the colours by their distance to the image's mean colour m: -|m - p|^2 is
2 p.m - |p|^2 - |m|^2, and the last term is the same for every class, so the weights are 2 p
and the bias -|p|^2 (both times ``SHARPNESS``, which only makes the softmax more decided). No
random numbers: the file is the same on every machine.

The same classifier is also written as ``densenet_onnx``, with the names and shapes of Triton's
densenet_onnx example (input ``data_0`` [3,224,224], output ``fc6_1``, no batching, reshaped by
its config), because Triton's grpc_client.py asks for that model by name. It is not DenseNet.

Usage: python configs/make_classifier_onnx.py [OUTPUT_PATH]
"""
import hashlib
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# name, RGB 0-255 (the order is the class index and the order of labels.txt)
COLORS = [
    ("black", (0, 0, 0)), ("white", (255, 255, 255)), ("gray", (128, 128, 128)),
    ("red", (255, 0, 0)), ("green", (0, 255, 0)), ("blue", (0, 0, 255)),
    ("yellow", (255, 255, 0)), ("cyan", (0, 255, 255)), ("magenta", (255, 0, 255)),
    ("orange", (255, 165, 0)), ("purple", (128, 0, 128)), ("brown", (165, 42, 42)),
]
SIZE = 224
SHARPNESS = 4.0
# ir_version 8 / opset 17: the newest pair that every onnxruntime >= 1.17 loads.
OPSET, IR_VERSION = 17, 8
MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
MODEL_DIR = os.path.join(MODELS, "classifier_onnx")
DEFAULT_PATH = os.path.join(MODEL_DIR, "1", "model.onnx")
# the densenet_onnx stand-in: same graph, Triton's example's tensor names
DENSENET_DIR = os.path.join(MODELS, "densenet_onnx")
DENSENET_NAMES = ("data_0", "fc6_1")


def weights() -> tuple[np.ndarray, np.ndarray]:
    """W [3, classes] and b [classes] of the Gemm, in float32."""
    protos = np.array([rgb for _, rgb in COLORS], dtype=np.float64) / 127.5 - 1.0
    w = (2.0 * SHARPNESS * protos.T).astype(np.float32)
    b = (-SHARPNESS * (protos ** 2).sum(axis=1)).astype(np.float32)
    return w, b


def build_model(image: str = "IMAGE", probabilities: str = "PROBABILITIES") -> onnx.ModelProto:
    w, b = weights()
    init = [numpy_helper.from_array(w, "fc_W"), numpy_helper.from_array(b, "fc_B")]
    nodes = [
        helper.make_node("GlobalAveragePool", [image], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["mean_rgb"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["mean_rgb", "fc_W", "fc_B"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], [probabilities], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes, "classifier_onnx",
        [helper.make_tensor_value_info(image, TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(probabilities, TensorProto.FLOAT,
                                       ["batch", len(COLORS)])],
        initializer=init,
    )
    # producer_version left empty: embedding onnx.__version__ would make the bytes depend on the
    # installed onnx release.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="shmserve-make_classifier_onnx", producer_version="")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def labels_text() -> str:
    return "".join(name + "\n" for name, _ in COLORS)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Write-then-rename so a server polling the repository never sees a half-written file.
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT_PATH
    data = build_model().SerializeToString(deterministic=True)
    _write(path, data)
    print(path)
    print("sha256", hashlib.sha256(data).hexdigest())
    if not argv:        # the example repository's labels match the model's classes
        _write(os.path.join(MODEL_DIR, "labels.txt"), labels_text().encode())
        stand_in = build_model(*DENSENET_NAMES).SerializeToString(deterministic=True)
        _write(os.path.join(DENSENET_DIR, "1", "model.onnx"), stand_in)
        _write(os.path.join(DENSENET_DIR, "labels.txt"), labels_text().encode())
        print(os.path.join(DENSENET_DIR, "1", "model.onnx"))
        print("sha256", hashlib.sha256(stand_in).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
