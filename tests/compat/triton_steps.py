"""A second round for tests/compat/diff_triton.py: both servers in explicit model control,
the same steps in the same order (loads and unloads, a sequence model, a decoupled model),
since each answer depends on what the steps before it did."""
from __future__ import annotations

import json
import os
import sys

from tritonclient.grpc import service_pb2

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from repo_builder import write_model  # noqa: E402
from triton_cases import NOBATCH, fp32, g_infer, grpc_tensor, infer_body, write_identity  # noqa: E402

ECHO_DECOUPLED = """
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


RAISES = """
class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("boom")
"""


def build_repo(root: str) -> None:
    write_identity(root)
    write_model(root, "raises", """
name: "raises"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", RAISES)
    write_model(root, "seq", """
name: "seq"
backend: "python"
max_batch_size: 0
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START
                                             fp32_false_true: [ 0, 1 ] } ] } ]
}
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", NOBATCH)
    write_model(root, "dec", """
name: "dec"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", ECHO_DECOUPLED)


# POSIX shared-memory segments the probe makes before the steps run (its own, unlinked after)
SHM_IN, SHM_OUT = "diff_triton_in", "diff_triton_out"


def _register(region: str, key: str, size: int):
    return ("POST", f"/v2/systemsharedmemory/region/{region}/register",
            json.dumps({"key": f"/{key}", "offset": 0, "byte_size": size}).encode(), {})


def _load(model: str, body=None):
    return ("POST", f"/v2/repository/models/{model}/load", body, {})


def _seq(params=None):
    doc = {"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    if params is not None:
        doc["parameters"] = params
    return ("POST", "/v2/models/seq/infer", json.dumps(doc).encode(), {})


def _dec(request_id: int):
    return g_infer("dec", [grpc_tensor("IN", "FP32", (1,))], [b"\0" * 4], id=str(request_id))[1]


def _g_seq(**params):
    rpc, req = g_infer("seq", [grpc_tensor("IN", "FP32", (1,))], [b"\0" * 4])
    for k, v in params.items():
        if isinstance(v, bool):
            req.parameters[k].bool_param = v
        elif isinstance(v, int):
            req.parameters[k].int64_param = v
        else:
            req.parameters[k].string_param = v
    return rpc, req


# (protocol, name, request): HTTP (method, path, body, headers); gRPC (rpc, message); stream
# (the messages sent on one ModelStreamInfer call)
STEPS = [
    ("HTTP", "load an unknown model", _load("nope")),
    ("HTTP", "unload an unknown model", ("POST", "/v2/repository/models/nope/unload", None, {})),
    ("HTTP", "infer on a model not loaded", ("POST", "/v2/models/identity_fp32/infer",
                                             infer_body([fp32()]), {})),
    ("HTTP", "load", _load("identity_fp32")),
    ("HTTP", "load with a config that is not JSON",
     _load("identity_fp32", b'{"parameters": {"config": "{bad"}}')),
    ("HTTP", "load with parameters not an object", _load("identity_fp32", b'{"parameters": 5}')),
    ("HTTP", "infer", ("POST", "/v2/models/identity_fp32/infer", infer_body([fp32()]), {})),
    ("HTTP", "unload", ("POST", "/v2/repository/models/identity_fp32/unload", None, {})),
    ("HTTP", "infer after unload", ("POST", "/v2/models/identity_fp32/infer",
                                    infer_body([fp32()]), {})),
    ("HTTP", "index", ("POST", "/v2/repository/index", b"{}", {})),
    ("HTTP", "load the sequence model", _load("seq")),
    ("HTTP", "load the decoupled model", _load("dec")),
    ("HTTP", "decoupled model over HTTP", ("POST", "/v2/models/dec/infer", json.dumps(
        {"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode(),
        {})),
    ("HTTP", "sequence without an id", _seq()),
    ("HTTP", "sequence start", _seq({"sequence_id": 5, "sequence_start": True})),
    ("HTTP", "sequence not started", _seq({"sequence_id": 6})),
    ("HTTP", "sequence id a string", _seq({"sequence_id": "abc", "sequence_start": True})),
    ("HTTP", "sequence id of the wrong type", _seq({"sequence_id": 1.5})),
    ("HTTP", "sequence end", _seq({"sequence_id": 5, "sequence_end": True})),
    ("HTTP", "sequence flag not a bool", _seq({"sequence_id": 7, "sequence_start": 1})),
    ("HTTP", "sequence stats", ("GET", "/v2/models/seq/stats", None, {})),
    ("HTTP", "load again", _load("identity_fp32")),
    ("HTTP", "register a region", _register("in", SHM_IN, 64)),
    ("HTTP", "register an output region", _register("out", SHM_OUT, 64)),
    ("HTTP", "register a name twice", _register("in", SHM_IN, 64)),
    ("HTTP", "register past the segment", _register("big", SHM_IN, 1 << 20)),
    ("HTTP", "regions", ("GET", "/v2/systemsharedmemory/status", None, {})),
    ("HTTP", "infer through regions", ("POST", "/v2/models/identity_fp32/infer", json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
            "shared_memory_region": "in", "shared_memory_byte_size": 64}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": 64}}]}).encode(), {})),
    ("HTTP", "output region too small", ("POST", "/v2/models/identity_fp32/infer", json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}],
        "outputs": [{"name": "OUTPUT0", "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": 32}}]}).encode(), {})),
    ("HTTP", "classification", ("POST", "/v2/models/identity_fp32/infer", infer_body(
        [fp32(data=[float(i) for i in range(16)])],
        [{"name": "OUTPUT0", "parameters": {"classification": 3}}]), {})),
    ("HTTP", "unregister", ("POST", "/v2/systemsharedmemory/region/in/unregister", None, {})),
    ("HTTP", "unregister all", ("POST", "/v2/systemsharedmemory/unregister", None, {})),
    ("HTTP", "regions after", ("GET", "/v2/systemsharedmemory/status", None, {})),
    ("HTTP", "stats after", ("GET", "/v2/models/identity_fp32/stats", None, {})),
    ("gRPC", "load an unknown model", ("RepositoryModelLoad",
                                       service_pb2.RepositoryModelLoadRequest(model_name="nope"))),
    ("gRPC", "decoupled model unary", g_infer("dec", [grpc_tensor("IN", "FP32", (1,))],
                                              [b"\0" * 4])),
    ("gRPC", "sequence without an id", _g_seq()),
    ("gRPC", "sequence not started", _g_seq(sequence_id=8)),
    ("gRPC", "sequence start", _g_seq(sequence_id=9, sequence_start=True)),
    ("HTTP", "load the model that raises", _load("raises")),
    ("stream", "a model that raises", [g_infer("raises", [grpc_tensor("IN", "FP32", (1,))],
                                               [b"\0" * 4], id="r9")[1]]),
    ("gRPC", "a model that raises", g_infer("raises", [grpc_tensor("IN", "FP32", (1,))],
                                            [b"\0" * 4])),
    ("stream", "decoupled model", [_dec(1), _dec(2)]),
    ("stream", "unknown model", [g_infer("nope")[1]]),
    ("stream", "a bad request among good ones", [_dec(3), g_infer(
        "dec", [grpc_tensor("IN", "FP32", (2,))], [b"\0" * 8])[1], _dec(4)]),
    ("stream", "sequence over a stream", [_g_seq(sequence_id=11, sequence_start=True)[1],
                                          _g_seq(sequence_id=11, sequence_end=True)[1]]),
    ("gRPC", "unload the sequence model", ("RepositoryModelUnload",
                                           service_pb2.RepositoryModelUnloadRequest(
                                               model_name="seq"))),
    ("gRPC", "index", ("RepositoryIndex", service_pb2.RepositoryIndexRequest())),
]
