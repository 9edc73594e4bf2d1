"""The requests tests/compat/diff_triton.py sends to Triton and to shmserve, and the small
repository both serve for it."""
from __future__ import annotations

import json
import os
import sys

from tritonclient.grpc import service_pb2

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from repo_builder import write_model  # noqa: E402

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


def write_identity(root: str) -> None:
    """identity_fp32, the model most cases address: FP32 [16] in and out, batches up to 8."""
    write_model(root, "identity_fp32", """
name: "identity_fp32"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
""", IDENTITY)


def build_repo(root: str) -> None:
    write_identity(root)
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


def binary(name: str, shape: list, datatype: str, size, raw: bytes) -> tuple[bytes, dict]:
    """A body with one input in the binary extension: its JSON head says ``size`` bytes follow,
    ``raw`` are the bytes that do."""
    head = json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype,
                                   "parameters": {"binary_data_size": size}}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


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
    ("binary size short", "POST", ID, *binary("INPUT0", [1, 16], "FP32", 64, b"\0" * 60)),
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
    ("trace rate not a number", "POST", "/v2/trace/setting", b'{"trace_rate": "abc"}', {}),
    ("trace rate zero", "POST", "/v2/trace/setting", b'{"trace_rate": "0"}', {}),
    ("trace rate not a string", "POST", "/v2/trace/setting", b'{"trace_rate": 5}', {}),
    ("trace count below -1", "POST", "/v2/trace/setting", b'{"trace_count": "-2"}', {}),
    ("trace level not a list", "POST", "/v2/trace/setting", b'{"trace_level": "OFF"}', {}),
    ("trace file", "POST", "/v2/trace/setting", b'{"trace_file": "/tmp/x.json"}', {}),
    ("trace setting, unknown model", "GET", "/v2/models/nope/trace/setting", None, {}),
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
    ("BYTES binary malformed", "POST", "/v2/models/text/infer",
     *binary("IN", [1], "BYTES", 6, b"\x05\0\0\0ab")),
    ("unknown version ready", "GET", "/v2/models/identity_fp32/versions/9/ready", None, {}),
    ("shape not a list", "POST", ID, infer_body([fp32(shape=16)]), {}),
    ("datatype not a string", "POST", ID, infer_body([fp32(datatype=5)]), {}),
    ("input not an object", "POST", ID, infer_body([5]), {}),
    ("outputs not a list", "POST", ID, infer_body([fp32()], {}), {}),
    ("binary_data_size not int", "POST", ID, *binary("INPUT0", [1, 16], "FP32", "64", b"\0" * 64)),
    ("BYTES fewer elements", "POST", "/v2/models/text/infer",
     infer_body([{"name": "IN", "shape": [2], "datatype": "BYTES", "data": ["a"]}]), {}),
    ("data and binary_data_size", "POST", ID,
     infer_body([fp32(parameters={"binary_data_size": 64})]), {}),
]


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


GOOD_HTTP = [
    ("server metadata", "GET", "/v2", None),
    ("model metadata", "GET", "/v2/models/identity_fp32", None),
    ("model config", "GET", "/v2/models/identity_fp32/config", None),
    ("model stats", "GET", "/v2/models/identity_fp32/stats", None),
    ("repository index", "POST", "/v2/repository/index", b"{}"),
    ("shm status", "GET", "/v2/systemsharedmemory/status", None),
    ("log settings", "GET", "/v2/logging", None),
    ("trace settings", "GET", "/v2/trace/setting", None),
    ("model trace settings", "GET", "/v2/models/identity_fp32/trace/setting", None),
    ("infer, JSON", "POST", ID, infer_body([fp32()], id="r7")),
    ("infer, JSON, nobatch", "POST", NB,
     infer_body([{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [1] * 6}])),
    ("infer, BYTES", "POST", "/v2/models/text/infer",
     infer_body([{"name": "IN", "shape": [2], "datatype": "BYTES", "data": ["a", "bc"]}])),
    ("infer, binary output", "POST", ID,
     infer_body([fp32()], [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])),
]


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
