"""Per-request tensor limits in-process, through both codecs: bytes by shape and datatype
(--max-request-tensor-bytes), int64 element counts, JSON elements in and out
(--http-max-json-elements). tests/e2e/test_request_limits.py checks them on a real server."""
import json

import pytest
from test_http_codec import CONFIGS, _info
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.engine.requests.prepare import RequestLimits, TensorBudget
from shmserve.frontend.grpc import codec as grpc_codec
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import Tensor
from shmserve.ipc.messages.to_frontend import InferResult, ModelTable

LIMITS = RequestLimits(max_tensor_bytes=1000, max_json_elements=10)


@pytest.fixture(scope="module")
def catalog():
    c = ModelCatalog()
    c.update(ModelTable([_info(n, t) for n, t in CONFIGS.items()], startup_done=True))
    return c


def _refused(call, *words):
    with pytest.raises(InferError) as e:
        call()
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value.message


def test_budget_counts_shapes_bytes_and_overflow():
    b = TensorBudget(LIMITS)
    assert b.declare(Tensor("A", "FP32", [10, 20])) == 200      # 800 bytes
    _refused(lambda: b.declare(Tensor("B", "INT8", [201])), "input 'B'", "1001 bytes",
             "--max-request-tensor-bytes")
    b = TensorBudget(LIMITS)
    assert b.declare(Tensor("Z", "FP64", [0, 1 << 62, 1 << 62])) == 0     # no elements
    _refused(lambda: b.declare(Tensor("O", "INT8", [1 << 62, 4])), "invalid shape for input 'O'",
             "causes total element count to exceed maximum size of 9223372036854775807")
    _refused(lambda: b.declare(Tensor("D", "INT8", [1 << 64])), "invalid shape for input 'D'",
             "contains one or more invalid dimensions")
    # the element count fits int64 but its bytes do not (Triton's test_buffer_size_overflow)
    _refused(lambda: b.declare(Tensor("F", "FP32", [4, (1 << 60) + 2])),
             "byte size overflow for input 'F': element count (4611686018427387912) * data type "
             "size (4) exceeds maximum allowed size (9223372036854775807)")
    b = TensorBudget(LIMITS)
    assert b.declare(Tensor("S", "BYTES", [200])) == 200          # 4 bytes an element
    b.data(Tensor("S", "BYTES", [200]), 900)
    _refused(lambda: b.data(Tensor("S", "BYTES", [200]), 1001), "input 'S'")


def test_http_json_and_binary_inputs(catalog, arena):
    def parse(doc, tail=b""):
        head = json.dumps(doc).encode()
        return http_codec.parse_infer(catalog.get("blob"), head + tail,
                                      len(head) if tail else None, None, arena, ShmRegistry(),
                                      LIMITS)
    def u_v(n_u: int, n_v: int) -> dict:
        return {"inputs": [{"name": "U", "shape": [n_u], "datatype": "UINT8", "data": [1] * n_u},
                           {"name": "V", "shape": [n_v], "datatype": "UINT8", "data": [1] * n_v}],
                "parameters": {"binary_data_output": True}}
    request.release(parse(u_v(9, 1)), arena)
    _refused(lambda: parse(u_v(11, 0)), "input 'U'", "--http-max-json-elements", "binary")
    _refused(lambda: parse(u_v(6, 6)), "input 'V'", "12 elements")
    _refused(lambda: parse({"inputs": [
        {"name": "U", "shape": [600], "datatype": "UINT8", "parameters": {"binary_data_size": 600}},
        {"name": "V", "shape": [600], "datatype": "UINT8", "parameters": {"binary_data_size": 600}}
    ]}, b"\0" * 1200), "input 'V'", "--max-request-tensor-bytes")


def test_grpc_inputs(catalog, arena):
    req = pb.ModelInferRequest()
    req.inputs.add(name="U", datatype="UINT8", shape=[1 << 40])
    req.raw_input_contents.append(b"\0")
    _refused(lambda: grpc_codec.parse_infer(catalog.get("blob"), req, arena, ShmRegistry(),
                                            LIMITS), "input 'U'", "--max-request-tensor-bytes")


def test_json_outputs_past_the_limit_ask_for_binary(catalog, arena):
    doc = {"inputs": [{"name": "U", "shape": [4], "datatype": "UINT8", "data": [1] * 4},
                      {"name": "V", "shape": [0], "datatype": "UINT8", "data": []}]}
    prepared = http_codec.parse_infer(catalog.get("blob"), json.dumps(doc).encode(), None, None,
                                      arena, ShmRegistry(), LIMITS)
    request.release(prepared, arena)
    result = InferResult(1, "blob", 1, outputs=[Tensor("W", "UINT8", [11], b"\0" * 11)])
    _refused(lambda: http_codec.render_response(result, prepared, [b"\0" * 11], 10),
             "output 'W'", "11 elements", "--http-max-json-elements", "'binary_data'")
    prepared.outputs["W"].binary = True
    header, parts, _ = http_codec.render_response(result, prepared, [b"\0" * 11], 10)
    assert parts == [b"\0" * 11]


def test_fixed_json_outputs_are_refused_before_the_model_runs(catalog, arena):
    """'multi' returns OUT0 [2, 2] (fixed: 4 elements) and OUT1 [-1] (known only after)."""
    doc = {"inputs": [{"name": "A", "shape": [2, 2], "datatype": "FP32",
                       "parameters": {"binary_data_size": 16}},
                      {"name": "B", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    limits = RequestLimits(max_json_elements=3)

    def parse():
        head = json.dumps(doc).encode()
        return http_codec.parse_infer(catalog.get("multi"), head + b"\0" * 16, len(head),
                                      None, arena, ShmRegistry(), limits)
    _refused(parse, "output 'OUT0'", "4 elements")
    doc["outputs"] = [{"name": "OUT0", "parameters": {"binary_data": True}}, {"name": "OUT1"}]
    request.release(parse(), arena)


def test_grpc_outputs_are_never_json(catalog, arena):
    """gRPC returns every output raw: the JSON bound does not apply, whatever 'binary_data'
    says."""
    req = pb.ModelInferRequest()
    req.inputs.add(name="A", datatype="FP32", shape=[2, 2])
    req.raw_input_contents.append(b"\0" * 16)
    req.inputs.add(name="B", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(b"\1\0\0\0x")
    req.outputs.add(name="OUT0").parameters["binary_data"].bool_param = False
    prepared = grpc_codec.parse_infer(catalog.get("multi"), req, arena, ShmRegistry(),
                                      RequestLimits(max_json_elements=3))
    request.release(prepared, arena)
