#!/usr/bin/env python3
"""Send the same bad (and a few good) requests to the real Triton and to shmserve, and print
where their answers differ: HTTP status and error text, gRPC status code and details.

Not part of the test suite (CI has no Triton); what it finds becomes e2e tests in our own
words. Needs a tritonserver install as ../shared/tools/triton-bench sets one up.

Usage: python tests/compat/diff_triton.py [--tools DIR] [--all]
  --tools  the triton-bench tools folder (sbs_server.py), default ../shared/tools/triton-bench
  --all    print the cases that agree too (same, or Triton's words first: see verdict())
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from repo_builder import write_model  # noqa: E402
from serverproc import Server  # noqa: E402

IDENTITY = """
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
"""
NOBATCH = IDENTITY.replace("OUTPUT0", "OUT").replace("INPUT0", "IN")
BROKEN = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model does not load")
    def execute(self, requests):
        return []
"""


def build_repo(root: str) -> None:
    write_model(root, "identity_fp32", """
name: "identity_fp32"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
""", IDENTITY)
    write_model(root, "nobatch", """
name: "nobatch"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2, 3 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2, 3 ] } ]
""", NOBATCH)
    write_model(root, "text", """
name: "text"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
""", NOBATCH)
    write_model(root, "broken", """
name: "broken"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", BROKEN)


F16 = [0.5] * 16


def infer_body(inputs, outputs=None, **extra) -> bytes:
    body = {"inputs": inputs, **extra}
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


def fp32(shape=(1, 16), data=None, name="INPUT0", datatype="FP32", **extra):
    return {"name": name, "shape": list(shape) if isinstance(shape, tuple) else shape, "datatype": datatype,
            "data": F16 if data is None else data, **extra}


ID = "/v2/models/identity_fp32/infer"
NB = "/v2/models/nobatch/infer"
# (case, method, path, body, headers)
HTTP_CASES = [
    ("good infer", "POST", ID, infer_body([fp32()]), {}),
    ("unknown model", "POST", "/v2/models/nope/infer", infer_body([fp32()]), {}),
    ("unknown version", "POST", "/v2/models/identity_fp32/versions/9/infer",
     infer_body([fp32()]), {}),
    ("version not digits", "POST", "/v2/models/identity_fp32/versions/x/infer",
     infer_body([fp32()]), {}),
    ("body not JSON", "POST", ID, b"{nope", {}),
    ("body a JSON list", "POST", ID, b"[]", {}),
    ("empty body", "POST", ID, b"", {}),
    ("no inputs", "POST", ID, b"{}", {}),
    ("inputs not a list", "POST", ID, b'{"inputs": {}}', {}),
    ("input without name", "POST", ID,
     infer_body([{"shape": [1, 16], "datatype": "FP32", "data": F16}]), {}),
    ("input without shape", "POST", ID,
     infer_body([{"name": "INPUT0", "datatype": "FP32", "data": F16}]), {}),
    ("input without datatype", "POST", ID,
     infer_body([{"name": "INPUT0", "shape": [1, 16], "data": F16}]), {}),
    ("input without data", "POST", ID,
     infer_body([{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32"}]), {}),
    ("unknown input", "POST", ID, infer_body([fp32(), fp32(name="EXTRA")]), {}),
    ("input missing", "POST", ID, infer_body([]), {}),
    ("wrong datatype", "POST", ID, infer_body([fp32(datatype="INT32", data=[1] * 16)]), {}),
    ("unknown datatype", "POST", ID, infer_body([fp32(datatype="FP99")]), {}),
    ("too few elements", "POST", ID, infer_body([fp32(data=F16[:15])]), {}),
    ("too many elements", "POST", ID, infer_body([fp32(data=F16 + [1.0])]), {}),
    ("wrong dims", "POST", ID, infer_body([fp32(shape=(1, 15), data=F16[:15])]), {}),
    ("wrong rank", "POST", ID, infer_body([fp32(shape=(16,))]), {}),
    ("batch over max", "POST", ID, infer_body([fp32(shape=(9, 16), data=F16 * 9)]), {}),
    ("negative dim", "POST", ID, infer_body([fp32(shape=(-1, 16))]), {}),
    ("shape not ints", "POST", ID, infer_body([fp32(shape=("a", 16))]), {}),
    ("string in FP32 data", "POST", ID, infer_body([fp32(data=["x"] * 16)]), {}),
    ("nested data", "POST", ID, infer_body([fp32(data=[F16])]), {}),
    ("duplicate input", "POST", ID, infer_body([fp32(), fp32()]), {}),
    ("unknown output", "POST", ID, infer_body([fp32()], [{"name": "NOPE"}]), {}),
    ("output without name", "POST", ID, infer_body([fp32()], [{}]), {}),
    ("id not a string", "POST", ID, infer_body([fp32()], id=5), {}),
    ("parameters not an object", "POST", ID, infer_body([fp32()], parameters=[1]), {}),
    ("binary_data not bool", "POST", ID,
     infer_body([fp32()], [{"name": "OUTPUT0", "parameters": {"binary_data": "yes"}}]), {}),
    ("unregistered shm input", "POST", ID, infer_body([{
        "name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
            "shared_memory_region": "nope", "shared_memory_byte_size": 64}}]), {}),
    ("unregistered shm output", "POST", ID, infer_body([fp32()], [{
        "name": "OUTPUT0", "parameters": {"shared_memory_region": "nope",
                                          "shared_memory_byte_size": 64}}]), {}),
    ("header length past body", "POST", ID, infer_body([fp32()]),
     {"Inference-Header-Content-Length": "100000"}),
    ("header length not a number", "POST", ID, infer_body([fp32()]),
     {"Inference-Header-Content-Length": "abc"}),
    ("binary size short", "POST", ID, None, "binary-short"),
    ("nobatch with batch dim", "POST", NB,
     infer_body([{"name": "IN", "shape": [1, 2, 3], "datatype": "INT32", "data": [1] * 6}]), {}),
    ("nobatch good", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [1] * 6}]), {}),
    ("INT32 out of range", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [2**40] * 6}]), {}),
    ("INT32 given floats", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [1.5] * 6}]), {}),
    ("BYTES given numbers", "POST", "/v2/models/text/infer",
     infer_body([{"name": "IN", "shape": [2], "datatype": "BYTES", "data": [1, 2]}]), {}),
    ("failed model infer", "POST", "/v2/models/broken/infer",
     infer_body([{"name": "IN", "shape": [1], "datatype": "FP32", "data": [1.0]}]), {}),
    ("failed model ready", "GET", "/v2/models/broken/ready", None, {}),
    ("failed model metadata", "GET", "/v2/models/broken", None, {}),
    ("unknown model ready", "GET", "/v2/models/nope/ready", None, {}),
    ("unknown model metadata", "GET", "/v2/models/nope", None, {}),
    ("unknown model config", "GET", "/v2/models/nope/config", None, {}),
    ("unknown model stats", "GET", "/v2/models/nope/stats", None, {}),
    ("unknown version metadata", "GET", "/v2/models/identity_fp32/versions/9", None, {}),
    ("load, mode none", "POST", "/v2/repository/models/identity_fp32/load", None, {}),
    ("unload, mode none", "POST", "/v2/repository/models/identity_fp32/unload", None, {}),
    ("index, bad body", "POST", "/v2/repository/index", b"{nope", {}),
    ("unknown path", "GET", "/v2/nope", None, {}),
    ("wrong method", "PUT", "/v2/health/ready", None, {}),
    ("GET infer", "GET", ID, None, {}),
    ("shm register, no key", "POST", "/v2/systemsharedmemory/region/r1/register",
     b'{"offset": 0, "byte_size": 64}', {}),
    ("shm register, missing key", "POST", "/v2/systemsharedmemory/region/r1/register",
     b'{"key": "/no_such_key_here", "offset": 0, "byte_size": 64}', {}),
    ("shm register, bad JSON", "POST", "/v2/systemsharedmemory/region/r1/register", b"{", {}),
    ("shm status, unknown region", "GET", "/v2/systemsharedmemory/region/nope/status", None, {}),
    ("shm unregister, unknown region", "POST", "/v2/systemsharedmemory/region/nope/unregister",
     None, {}),
    ("cuda shm register, bad handle", "POST", "/v2/cudasharedmemory/region/c1/register",
     b'{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64}', {}),
    ("trace setting unknown", "POST", "/v2/trace/setting", b'{"nope": ["1"]}', {}),
    ("log setting unknown", "POST", "/v2/logging", b'{"nope": true}', {}),
    ("log setting wrong type", "POST", "/v2/logging", b'{"log_info": "yes"}', {}),
    ("wrong datatype, with id", "POST", ID,
     infer_body([fp32(datatype="INT32", data=[1] * 16)], id="r1"), {}),
    ("only an unknown input", "POST", ID, infer_body([fp32(name="EXTRA")]), {}),
    ("FP32 given bools", "POST", ID, infer_body([fp32(data=[True] * 16)]), {}),
    ("binary_data_output not bool", "POST", ID,
     infer_body([fp32()], parameters={"binary_data_output": 1}), {}),
    ("nobatch wrong dims", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 4], "datatype": "INT32", "data": [1] * 8}]), {}),
    ("BYTES binary malformed", "POST", "/v2/models/text/infer", None, "bytes-bad"),
    ("unknown version ready", "GET", "/v2/models/identity_fp32/versions/9/ready", None, {}),
    ("shape not a list", "POST", ID, infer_body([fp32(shape=16)]), {}),
    ("datatype not a string", "POST", ID, infer_body([fp32(datatype=5)]), {}),
    ("input not an object", "POST", ID, infer_body([5]), {}),
    ("outputs not a list", "POST", ID, infer_body([fp32()], {}), {}),
    ("binary_data_size not int", "POST", ID, None, "binary-size-str"),
    ("BYTES fewer elements", "POST", "/v2/models/text/infer",
     infer_body([{"name": "IN", "shape": [2], "datatype": "BYTES", "data": ["a"]}]), {}),
    ("data and binary_data_size", "POST", ID,
     infer_body([fp32(parameters={"binary_data_size": 64})]), {}),
]


def http_call(url: str, method: str, path: str, body, headers) -> tuple:
    u = urllib.parse.urlparse(url)
    if headers == "binary-short":
        head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 64}}]}).encode()
        body = head + b"\0" * 60
        headers = {"Inference-Header-Content-Length": str(len(head))}
    if headers == "bytes-bad":
        head = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": 6}}]}).encode()
        body = head + b"\x05\0\0\0ab"
        headers = {"Inference-Header-Content-Length": str(len(head))}
    if headers == "binary-size-str":
        head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                       "parameters": {"binary_data_size": "64"}}]}).encode()
        body = head + b"\0" * 64
        headers = {"Inference-Header-Content-Length": str(len(head))}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        text = json.loads(data).get("error", "") if data else ""
    except (ValueError, AttributeError):
        text = data[:120].decode("latin-1")
    return r.status, text


def grpc_tensor(name="INPUT0", datatype="FP32", shape=(1, 16)):
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype,
                                                          shape=list(shape))


RAW16 = b"\0" * 64


def g_infer(model="identity_fp32", inputs=None, raw=None, outputs=(), version="", **kw):
    req = service_pb2.ModelInferRequest(model_name=model, model_version=version, **kw)
    for t in (inputs if inputs is not None else [grpc_tensor()]):
        req.inputs.append(t)
    for r in (raw if raw is not None else [RAW16]):
        req.raw_input_contents.append(r)
    for o in outputs:
        req.outputs.append(service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=o))
    return ("ModelInfer", req)


def _contents_and_raw():
    t = grpc_tensor()
    t.contents.fp32_contents.extend([0.0] * 16)
    return g_infer(inputs=[t])


def _contents_only(n: int):
    t = grpc_tensor()
    t.contents.fp32_contents.extend([0.0] * n)
    return g_infer(inputs=[t], raw=[])


def _wrong_contents():
    t = grpc_tensor()
    t.contents.int_contents.extend([0] * 16)
    return g_infer(inputs=[t], raw=[])


def _shm_input():
    t = grpc_tensor()
    t.parameters["shared_memory_region"].string_param = "nope"
    t.parameters["shared_memory_byte_size"].int64_param = 64
    return g_infer(inputs=[t], raw=[])


GRPC_CASES = [
    ("good infer", g_infer()),
    ("unknown model", g_infer(model="nope")),
    ("unknown version", g_infer(version="9")),
    ("version not digits", g_infer(version="x")),
    ("unknown input", g_infer(inputs=[grpc_tensor(), grpc_tensor("EXTRA")], raw=[RAW16, RAW16])),
    ("input missing", g_infer(inputs=[], raw=[])),
    ("wrong datatype", g_infer(inputs=[grpc_tensor(datatype="INT32")])),
    ("unknown datatype", g_infer(inputs=[grpc_tensor(datatype="FP99")])),
    ("raw too short", g_infer(raw=[RAW16[:60]])),
    ("raw too long", g_infer(raw=[RAW16 + b"\0" * 4])),
    ("more raw than inputs", g_infer(raw=[RAW16, RAW16])),
    ("fewer raw than inputs", g_infer(raw=[])),
    ("contents and raw", _contents_and_raw()),
    ("contents too short", _contents_only(15)),
    ("wrong dims", g_infer(inputs=[grpc_tensor(shape=(1, 15))], raw=[RAW16[:60]])),
    ("wrong rank", g_infer(inputs=[grpc_tensor(shape=(16,))])),
    ("batch over max", g_infer(inputs=[grpc_tensor(shape=(9, 16))], raw=[RAW16 * 9])),
    ("negative dim", g_infer(inputs=[grpc_tensor(shape=(-1, 16))])),
    ("duplicate input", g_infer(inputs=[grpc_tensor(), grpc_tensor()], raw=[RAW16, RAW16])),
    ("unknown output", g_infer(outputs=["NOPE"])),
    ("unregistered shm input", _shm_input()),
    ("nobatch with batch dim", g_infer("nobatch", [grpc_tensor("IN", "INT32", (1, 2, 3))],
                                       [b"\0" * 24])),
    ("BYTES raw malformed", g_infer("text", [grpc_tensor("IN", "BYTES", (1,))],
                                    [b"\x05\0\0\0ab"])),
    ("failed model infer", g_infer("broken", [grpc_tensor("IN", "FP32", (1,))], [b"\0" * 4])),
    ("failed model ready", ("ModelReady", service_pb2.ModelReadyRequest(name="broken"))),
    ("failed model metadata", ("ModelMetadata", service_pb2.ModelMetadataRequest(name="broken"))),
    ("unknown model ready", ("ModelReady", service_pb2.ModelReadyRequest(name="nope"))),
    ("unknown model metadata", ("ModelMetadata", service_pb2.ModelMetadataRequest(name="nope"))),
    ("unknown model config", ("ModelConfig", service_pb2.ModelConfigRequest(name="nope"))),
    ("unknown model stats", ("ModelStatistics",
                             service_pb2.ModelStatisticsRequest(name="nope"))),
    ("unknown version metadata", ("ModelMetadata", service_pb2.ModelMetadataRequest(
        name="identity_fp32", version="9"))),
    ("load, mode none", ("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(
        model_name="identity_fp32"))),
    ("unload, mode none", ("RepositoryModelUnload", service_pb2.RepositoryModelUnloadRequest(
        model_name="identity_fp32"))),
    ("shm register, missing key", ("SystemSharedMemoryRegister",
                                   service_pb2.SystemSharedMemoryRegisterRequest(
                                       name="r1", key="/no_such_key_here", byte_size=64))),
    ("shm status, unknown region", ("SystemSharedMemoryStatus",
                                    service_pb2.SystemSharedMemoryStatusRequest(name="nope"))),
    ("shm unregister, unknown region", ("SystemSharedMemoryUnregister",
                                        service_pb2.SystemSharedMemoryUnregisterRequest(
                                            name="nope"))),
    ("cuda shm register, bad handle", ("CudaSharedMemoryRegister",
                                       service_pb2.CudaSharedMemoryRegisterRequest(
                                           name="c1", raw_handle=b"AAAA", byte_size=64))),
    ("log setting unknown", ("LogSettings", service_pb2.LogSettingsRequest(settings={
        "nope": service_pb2.LogSettingsRequest.SettingValue(bool_param=True)}))),
    ("wrong datatype, with id", g_infer(inputs=[grpc_tensor(datatype="INT32")], id="r1")),
    ("only an unknown input", g_infer(inputs=[grpc_tensor("EXTRA")])),
    ("typed contents of the wrong type", _wrong_contents()),
    ("version not digits, metadata", ("ModelMetadata", service_pb2.ModelMetadataRequest(
        name="identity_fp32", version="x"))),
    ("unknown version ready", ("ModelReady", service_pb2.ModelReadyRequest(
        name="identity_fp32", version="9"))),
    ("ready, version not digits", ("ModelReady", service_pb2.ModelReadyRequest(
        name="identity_fp32", version="x"))),
    ("BYTES raw fewer elements", g_infer("text", [grpc_tensor("IN", "BYTES", (2,))],
                                         [b"\x01\0\0\0a"])),
    ("BYTES raw more elements", g_infer("text", [grpc_tensor("IN", "BYTES", (1,))],
                                        [b"\x01\0\0\0a\x01\0\0\0b"])),
    ("nobatch wrong dims", g_infer("nobatch", [grpc_tensor("IN", "INT32", (2, 4))],
                                   [b"\0" * 32])),
    ("BYTES length prefix cut", g_infer("text", [grpc_tensor("IN", "BYTES", (1,))], [b"\x05\0"])),
    ("trace setting unknown", ("TraceSetting", service_pb2.TraceSettingRequest(settings={
        "nope": service_pb2.TraceSettingRequest.SettingValue(value=["1"])}))),
]


# ---- answers to good requests: their shape ---------------------------------------------------
# Values that differ between any two servers (names, versions, counters, times) are compared by
# type only; everything else must be equal.
VOLATILE = {"name", "version", "count", "ns", "last_inference", "inference_count",
            "execution_count", "extensions"}

GOOD_HTTP = [
    ("server metadata", "GET", "/v2", None),
    ("model metadata", "GET", "/v2/models/identity_fp32", None),
    ("model config", "GET", "/v2/models/identity_fp32/config", None),
    ("model stats", "GET", "/v2/models/identity_fp32/stats", None),
    ("repository index", "POST", "/v2/repository/index", b"{}"),
    ("shm status", "GET", "/v2/systemsharedmemory/status", None),
    ("log settings", "GET", "/v2/logging", None),
    ("infer, JSON", "POST", ID, infer_body([fp32()], id="r7")),
    ("infer, JSON, nobatch", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [1] * 6}])),
    ("infer, BYTES", "POST", "/v2/models/text/infer",
     infer_body([{"name": "IN", "shape": [2], "datatype": "BYTES", "data": ["a", "bc"]}])),
    ("infer, binary output", "POST", ID,
     infer_body([fp32()], [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])),
]


def http_good(url: str, method: str, path: str, body) -> tuple:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        data = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()
                   if k.lower() in ("content-type", "inference-header-content-length")}
    finally:
        conn.close()
    hlen = headers.get("inference-header-content-length")
    head = data[:int(hlen)] if hlen else data
    try:
        doc = json.loads(head) if head else None
    except ValueError:
        doc = head.decode("latin-1")
    return r.status, headers, doc, data[int(hlen):] if hlen else b""


def shape_diff(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ: keys one has and the other lacks, types, and values of
    keys not in VOLATILE."""
    key = path.rsplit(".", 1)[-1].split("[")[0]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only Triton has it" for k in a if k not in b]
        out += [f"{path}.{k}: only shmserve has it" for k in b if k not in a]
        for k in a:
            if k in b:
                out += shape_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) and key not in VOLATILE:
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in shape_diff(x, y, f"{path}[{i}]")]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} {a!r} against {type(b).__name__} {b!r}"]
    if a != b and key not in VOLATILE and not key.endswith("_ns"):
        return [f"{path}: {a!r} against {b!r}"]
    return []


def _good_infer():
    rpc, req = g_infer(id="r7")
    req.outputs.add(name="OUTPUT0")
    return rpc, req


GOOD_GRPC = [
    ("server metadata", ("ServerMetadata", service_pb2.ServerMetadataRequest())),
    ("model metadata", ("ModelMetadata", service_pb2.ModelMetadataRequest(name="identity_fp32"))),
    ("model config", ("ModelConfig", service_pb2.ModelConfigRequest(name="identity_fp32"))),
    ("model stats", ("ModelStatistics", service_pb2.ModelStatisticsRequest(name="identity_fp32"))),
    ("repository index", ("RepositoryIndex", service_pb2.RepositoryIndexRequest())),
    ("shm status", ("SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest())),
    ("infer", _good_infer()),
    ("infer, nobatch", g_infer("nobatch", [grpc_tensor("IN", "INT32", (2, 3))], [b"\0" * 24])),
]


def run_good(http_url: str, grpc_url: str) -> dict:
    from google.protobuf.json_format import MessageToDict
    out = {("HTTP", name): http_good(http_url, m, p, b) for name, m, p, b in GOOD_HTTP}
    with grpc.insecure_channel(grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for name, (rpc, req) in GOOD_GRPC:
            try:
                resp = getattr(stub, rpc)(req, timeout=30)
                out[("gRPC", name)] = ("OK", {}, MessageToDict(
                    resp, preserving_proto_field_name=True), b"")
            except grpc.RpcError as e:
                out[("gRPC", name)] = (e.code().name, {}, e.details(), b"")
    return out


def grpc_call(stub, rpc: str, req) -> tuple:
    try:
        getattr(stub, rpc)(req, timeout=30)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details()


def wait_ready(url: str, deadline_s: float = 120.0) -> None:
    u = urllib.parse.urlparse(url)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            conn.request("GET", "/v2/models/identity_fp32/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def run_cases(http_url: str, grpc_url: str) -> dict:
    out = {}
    for name, method, path, body, headers in HTTP_CASES:
        out[("HTTP", name)] = http_call(http_url, method, path, body, headers)
    with grpc.insecure_channel(grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for name, (rpc, req) in GRPC_CASES:
            out[("gRPC", name)] = grpc_call(stub, rpc, req)
    return out


def verdict(theirs: tuple, ours: tuple) -> str:
    """same; words: shmserve's text starts with Triton's and the status is Triton's, or 400
    where Triton answers a client's mistake with 500 (INVALID_ARGUMENT for gRPC's INTERNAL);
    DIFF otherwise."""
    if theirs == ours:
        return "same"
    status_ok = theirs[0] == ours[0] or (theirs[0], ours[0]) in (
        (500, 400), ("INTERNAL", "INVALID_ARGUMENT"))
    if status_ok and theirs[1] and ours[1].startswith(theirs[1]):
        return "words"
    return "DIFF"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", default=os.path.join(ROOT, "..", "shared", "tools", "triton-bench"))
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tools))
    import sbs_server
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        build_repo(repo)
        http, grpc_port, metrics = (sbs_server.free_port() for _ in range(3))
        cmd, env = sbs_server.command_for("triton", repo, http, grpc_port, metrics)
        with open(os.path.join(tmp, "triton.log"), "wb") as log:
            tri = subprocess.Popen(cmd + ["--exit-on-error=false"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{http}")
            theirs = run_cases(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}")
            theirs_good = run_good(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}")
        finally:
            os.killpg(tri.pid, signal.SIGTERM)
            tri.wait(timeout=60)
        ours_srv = Server(repo, "--exit-on-error=false", wait_ready=False)
        try:
            wait_ready(ours_srv.base)
            ours = run_cases(ours_srv.base, ours_srv.grpc_url)
            ours_good = run_good(ours_srv.base, ours_srv.grpc_url)
        finally:
            ours_srv.stop()
    counts = {"same": 0, "words": 0, "DIFF": 0}
    for key, t in theirs.items():
        o = ours[key]
        kind = verdict(t, o)
        counts[kind] += 1
        if a.all or kind == "DIFF":
            print(f"{kind} {key[0]} {key[1]}\n   triton:   {t[0]} {t[1]!r}\n"
                  f"   shmserve: {o[0]} {o[1]!r}")
    alike = 0
    for name, (ts, th, tdoc, traw) in theirs_good.items():
        os_, oh, odoc, oraw = ours_good[name]
        diffs = ([f"status {ts} against {os_}"] if ts != os_ else []) + \
            ([f"headers {th} against {oh}"] if th != oh else []) + shape_diff(tdoc, odoc) + \
            ([f"binary part {len(traw)} bytes against {len(oraw)}"] if traw != oraw else [])
        alike += not diffs
        if diffs or a.all:
            print(f"{'same' if not diffs else 'DIFF'} {name[0]} answer: {name[1]}")
            for d in diffs:
                print(f"   {d}")
    print(f"{len(theirs_good)} good requests: {alike} answered alike (shape, types, fixed values)")
    print(f"{len(theirs)} requests: {counts['same']} answered the same, {counts['words']} with "
          f"Triton's words first (and 400 where Triton says 500), {counts['DIFF']} otherwise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
