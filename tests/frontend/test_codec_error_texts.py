"""Error texts clients compare, as the real Triton 2.51 gave them to the same requests
(tests/compat/diff_triton.py measures them), through shmserve's HTTP and gRPC codecs in
process. Where Triton answers a client's mistake with 500, shmserve keeps 400 and may add
what it knows in parentheses after Triton's words; the words come first, unchanged."""
import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.frontend.grpc import codec as grpc_codec
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.messages.to_frontend import ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.model_config import normalize

CONFIGS = {
    "identity_fp32": '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]''',
    "nobatch": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ 2, 3 ] } ]
        output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 2, 3 ] } ]''',
    "text": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_STRING, dims: [ -1 ] } ]
        output [ { name: "OUT", data_type: TYPE_STRING, dims: [ -1 ] } ]''',
}
NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
        "to be prepended to each input shape. If you want to specify the full shape including "
        "the batch dim in your input dims config, try setting max_batch_size to zero. See the "
        "model configuration docs for more info on max_batch_size.")
NO_ID = "[request id: <id_unknown>] "
F16 = [0.5] * 16


@pytest.fixture(scope="module")
def catalog():
    c = ModelCatalog()
    c.update(ModelTable([ModelInfo(n, normalize(text_format.Parse(t, mc.ModelConfig()), n)
                                   .SerializeToString(), [VersionInfo(1, "READY")])
                         for n, t in CONFIGS.items()], startup_done=True))
    return c


def fp32(shape=(1, 16), data=None, name="INPUT0", datatype="FP32", **extra):
    return {"name": name, "shape": list(shape), "datatype": datatype,
            "data": F16 if data is None else data, **extra}


def http_error(catalog, arena, model, doc, raw: bytes = b"") -> tuple:
    head = json.dumps(doc).encode()
    with pytest.raises(InferError) as e:
        http_codec.parse_infer(catalog.get(model), head + raw, len(head) if raw else None, None,
                               arena, ShmRegistry())
    return e.value.code, e.value.message


HTTP_CASES = [
    # (id, model, request document, raw bytes after it, code, Triton's text)
    ("input missing", "identity_fp32", {"inputs": []}, b"", ErrorCode.INVALID_ARG,
     f"{NO_ID}expected 1 inputs but got 0 inputs for model 'identity_fp32'. Got input(s) [], but "
     f"missing required input(s) ['INPUT0']. Please provide all required input(s)."),
    ("one input too many", "identity_fp32", {"inputs": [fp32(), fp32(name="EXTRA")]}, b"",
     ErrorCode.INVALID_ARG,
     f"{NO_ID}expected 1 inputs but got 2 inputs for model 'identity_fp32'. Got input(s) "
     f"['EXTRA','INPUT0'], but missing required input(s) ]. Please provide all required "
     f"input(s)."),
    ("only an unknown input", "identity_fp32", {"inputs": [fp32(name="EXTRA")]}, b"",
     ErrorCode.INVALID_ARG, "unexpected inference input 'EXTRA' for model 'identity_fp32'"),
    ("duplicate input", "identity_fp32", {"inputs": [fp32(), fp32()]}, b"", ErrorCode.INVALID_ARG,
     f"{NO_ID}input 'INPUT0' already exists in request"),
    ("wrong datatype, with id", "identity_fp32",
     {"id": "r1", "inputs": [fp32(datatype="INT32", data=[1] * 16)]}, b"", ErrorCode.INVALID_ARG,
     "[request id: r1] inference input 'INPUT0' data-type is 'INT32', but model 'identity_fp32' "
     "expects 'FP32'"),
    ("wrong dims", "identity_fp32", {"inputs": [fp32(shape=(1, 15), data=F16[:15])]}, b"",
     ErrorCode.INVALID_ARG,
     f"{NO_ID}unexpected shape for input 'INPUT0' for model 'identity_fp32'. Expected [-1,16], "
     f"got [1,15]. {NOTE}"),
    ("wrong dims, no batching", "nobatch",
     {"inputs": [{"name": "IN", "shape": [2, 4], "datatype": "INT32", "data": [1] * 8}]}, b"",
     ErrorCode.INVALID_ARG,
     f"{NO_ID}unexpected shape for input 'IN' for model 'nobatch'. Expected [2,3], got [2,4]. "),
    ("batch over max", "identity_fp32", {"inputs": [fp32(shape=(9, 16), data=F16 * 9)]}, b"",
     ErrorCode.INVALID_ARG, f"{NO_ID}inference request batch-size must be <= 8 for "
                            f"'identity_fp32'"),
    ("binary size short", "identity_fp32",
     {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                  "parameters": {"binary_data_size": 64}}]}, b"\0" * 60, ErrorCode.INVALID_ARG,
     "unexpected size for input 'INPUT0', expecting 4 additional bytes for model 'identity_fp32'"),
    ("BYTES element cut", "text",
     {"inputs": [{"name": "IN", "shape": [1], "datatype": "BYTES",
                  "parameters": {"binary_data_size": 6}}]}, b"\x05\0\0\0ab", ErrorCode.INVALID_ARG,
     "incomplete string data for inference input 'IN', expecting string of length 5 but only 2 "
     "bytes available"),
    ("BYTES fewer elements", "text",
     {"inputs": [{"name": "IN", "shape": [2], "datatype": "BYTES", "data": ["a"]}]}, b"",
     ErrorCode.INVALID_ARG,
     f"{NO_ID}expected 2 string elements for inference input 'IN' for model 'text', got 1"),
    ("unregistered region", "identity_fp32",
     {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
         "shared_memory_region": "nope", "shared_memory_byte_size": 64}}]}, b"",
     ErrorCode.NOT_FOUND, "Unable to find shared memory region: 'nope' (input 'INPUT0')"),
    ("data and binary_data_size", "identity_fp32",
     {"inputs": [fp32(parameters={"binary_data_size": 64})]}, b"", ErrorCode.INVALID_ARG,
     "Input must set only one of the following fields: 'data', 'binary_data_size' in "
     "'parameters', 'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size' "
     "(input 'INPUT0')"),
    ("string in FP32 data", "identity_fp32", {"inputs": [fp32(data=["x"] * 16)]}, b"",
     ErrorCode.INVALID_ARG, "Unable to parse 'data': attempt to access JSON non-number as double "
                            "(input 'INPUT0' of datatype FP32 must hold numbers)"),
    ("INT32 given floats", "nobatch",
     {"inputs": [{"name": "IN", "shape": [2, 3], "datatype": "INT32", "data": [1.5] * 6}]}, b"",
     ErrorCode.INVALID_ARG, "Unable to parse 'data': attempt to access JSON non-signed-integer as "
                            "signed-integer (input 'IN' of datatype INT32 must hold integers)"),
    ("sequence id a float", "identity_fp32",
     {"inputs": [fp32()], "parameters": {"sequence_id": 1.5}}, b"", ErrorCode.INVALID_ARG,
     "Unable to parse 'sequence_id': attempt to access JSON non-string as string (request "
     "parameter 'sequence_id' is an unsigned 64-bit integer or a string, got 1.5)"),
    ("sequence flag not a boolean", "identity_fp32",
     {"inputs": [fp32()], "parameters": {"sequence_start": 1}}, b"", ErrorCode.INVALID_ARG,
     "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean (request "
     "parameter 'sequence_start' is a boolean, got 1)"),
    ("BYTES given numbers", "text",
     {"inputs": [{"name": "IN", "shape": [2], "datatype": "BYTES", "data": [1, 2]}]}, b"",
     ErrorCode.INVALID_ARG, "Unable to parse JSON bytes array: attempt to access JSON non-string "
                            "as string (input 'IN' of datatype BYTES must hold JSON strings)"),
]


@pytest.mark.parametrize("model, doc, raw, code, text", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_http_infer_errors_read_as_tritons(catalog, arena, model, doc, raw, code, text):
    assert http_error(catalog, arena, model, doc, raw) == (code, text)


def tensor(name="INPUT0", datatype="FP32", shape=(1, 16)):
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(shape))


def grpc_request(model="identity_fp32", inputs=None, raw=None, request_id=""):
    req = pb.ModelInferRequest(model_name=model, id=request_id)
    req.inputs.extend(inputs if inputs is not None else [tensor()])
    req.raw_input_contents.extend(raw if raw is not None else [b"\0" * 64])
    return req


def with_contents(field: str, n: int):
    t = tensor()
    getattr(t.contents, field).extend([0] * n)
    return grpc_request(inputs=[t], raw=[])


GRPC_CASES = [
    ("raw too short", grpc_request(raw=[b"\0" * 60]),
     f"{NO_ID}input byte size mismatch for input 'INPUT0' for model 'identity_fp32'. Expected 64, "
     f"got 60"),
    ("contents too short", with_contents("fp32_contents", 15),
     f"{NO_ID}input byte size mismatch for input 'INPUT0' for model 'identity_fp32'. Expected 64, "
     f"got 60"),
    ("contents of another type", with_contents("int_contents", 16),
     "unexpected explicit tensor data for input tensor 'INPUT0' for model 'identity_fp32' of type "
     "'INT32', expected datatype 'FP32'"),
    ("no data", grpc_request(raw=[]),
     "unable to find data for input tensor 'INPUT0' for model 'identity_fp32' in request."),
    ("unknown datatype, with id", grpc_request(inputs=[tensor(datatype="FP99")], request_id="r1"),
     "[request id: r1] inference input 'INPUT0' data-type is '<invalid>', but model "
     "'identity_fp32' expects 'FP32'"),
    ("BYTES length prefix cut", grpc_request("text", [tensor("IN", "BYTES", (1,))], [b"\x05\0"]),
     f"{NO_ID}incomplete string length indicator for inference input 'IN' for model 'text', "
     f"expecting 4 bytes but only 2 bytes available. Please make sure the string length "
     f"indicator is in one buffer."),
    ("BYTES more elements", grpc_request("text", [tensor("IN", "BYTES", (1,))],
                                         [b"\x01\0\0\0a\x01\0\0\0b"]),
     f"{NO_ID}unexpected number of string elements 2 for inference input 'IN' for model 'text', "
     f"expecting 1"),
]


@pytest.mark.parametrize("req, text", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_infer_errors_read_as_tritons(catalog, arena, req, text):
    with pytest.raises(InferError) as e:
        grpc_codec.parse_infer(catalog.get(req.model_name), req, arena, ShmRegistry())
    assert (e.value.code, e.value.message) == (ErrorCode.INVALID_ARG, text)
