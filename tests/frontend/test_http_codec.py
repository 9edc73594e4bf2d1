"""parse_infer / render_response against ModelViews built the way the frontend builds them."""
import json
import re

import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.engine.requests.prepare import OutputWanted, PreparedRequest, RequestLimits
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import dtypes
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.model_config import normalize

CONFIGS = {
    # no batching; fixed, variable and optional inputs; a BYTES input and output
    "multi": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "A", data_type: TYPE_FP32, dims: [ 2, 2 ] },
                { name: "B", data_type: TYPE_STRING, dims: [ -1 ] },
                { name: "C", data_type: TYPE_INT32, dims: [ -1 ], optional: true } ]
        output [ { name: "OUT0", data_type: TYPE_FP32, dims: [ 2, 2 ] },
                 { name: "OUT1", data_type: TYPE_STRING, dims: [ -1 ] } ]''',
    "batched": '''
        backend: "python"
        max_batch_size: 4
        input [ { name: "X", data_type: TYPE_INT64, dims: [ 3 ] },
                { name: "Y", data_type: TYPE_BOOL, dims: [ 1 ] } ]
        output [ { name: "Z", data_type: TYPE_INT64, dims: [ 3 ] } ]''',
    "blob": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "U", data_type: TYPE_UINT8, dims: [ -1 ] },
                { name: "V", data_type: TYPE_UINT8, dims: [ -1 ] } ]
        output [ { name: "W", data_type: TYPE_UINT8, dims: [ -1 ] } ]''',
    "raw": '''
        backend: "python"
        max_batch_size: 4
        input [ { name: "R", data_type: TYPE_FP32, dims: [ 2, -1 ] } ]
        output [ { name: "O1", data_type: TYPE_FP32, dims: [ -1 ] },
                 { name: "O2", data_type: TYPE_INT32, dims: [ 1 ] } ]''',
    "raw_u8": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "R", data_type: TYPE_UINT8, dims: [ -1 ] } ]
        output [ { name: "O", data_type: TYPE_UINT8, dims: [ -1 ] } ]''',
    "raw_fixed": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "R", data_type: TYPE_INT16, dims: [ 3 ] } ]
        output [ { name: "O", data_type: TYPE_INT16, dims: [ 3 ] } ]''',
    "raw_bytes": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "S", data_type: TYPE_STRING, dims: [ 1 ] } ]
        output [ { name: "O", data_type: TYPE_STRING, dims: [ 1 ] } ]''',
    "raw_two_var": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "R", data_type: TYPE_FP32, dims: [ -1, -1 ] } ]
        output [ { name: "O", data_type: TYPE_FP32, dims: [ -1 ] } ]''',
    "half": '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "H", data_type: TYPE_FP16, dims: [ 2 ] },
                { name: "BF", data_type: TYPE_BF16, dims: [ 2 ] } ]
        output [ { name: "HO", data_type: TYPE_FP16, dims: [ 2 ] },
                 { name: "BO", data_type: TYPE_BF16, dims: [ 2 ] } ]''',
}


def _info(name, text):
    cfg = normalize(text_format.Parse(text, mc.ModelConfig()), name)
    return ModelInfo(name, cfg.SerializeToString(), [VersionInfo(1, "READY")])


@pytest.fixture(scope="module")
def catalog():
    c = ModelCatalog()
    c.update(ModelTable([_info(n, t) for n, t in CONFIGS.items()], startup_done=True))
    return c


def _re(text):
    return re.escape(text)


def jbody(doc) -> bytes:
    return json.dumps(doc).encode()


def t_in(name, datatype, shape, data=None, **params):
    d = {"name": name, "datatype": datatype, "shape": shape}
    if data is not None:
        d["data"] = data
    if params:
        d["parameters"] = params
    return d


def parse(catalog, arena, model, body, header_len=None, body_ref=None):
    return http_codec.parse_infer(catalog.get(model), body, header_len, body_ref, arena, ShmRegistry())


def binary_request(doc, *parts):
    header = jbody(doc)
    return header + b"".join(parts), len(header)


def in_arena(arena, data: bytes):
    slot = arena.alloc(len(data))
    slot.view[:] = data
    return slot


# ---- JSON inputs ------------------------------------------------------------------------------

def test_json_inputs_nested_and_flat(catalog, arena):
    doc = {"id": "r1", "inputs": [
        t_in("A", "FP32", [2, 2], [[1, 2.5], [3, 4]]),
        t_in("B", "BYTES", [3], ["x", "héllo", ""]),
        t_in("C", "INT32", [2], [-7, 8]),
    ]}
    p = parse(catalog, arena, "multi", jbody(doc))
    a, b, c = p.payload.inputs
    assert (a.name, a.datatype, a.shape) == ("A", "FP32", [2, 2])
    assert a.data == np.array([1, 2.5, 3, 4], dtype=np.float32).tobytes() and a.shm is None
    assert b.data == dtypes.serialize_bytes(np.array(["x", "héllo", ""], dtype=object)).tobytes()
    assert c.data == np.array([-7, 8], dtype=np.int32).tobytes()
    assert p.batch_size == 1
    assert p.request_id == "r1" and p.payload.request_id == "r1"
    assert [o.name for o in p.payload.outputs] == ["OUT0", "OUT1"]
    assert {n: o.binary for n, o in p.outputs.items()} == {"OUT0": False, "OUT1": False}
    assert p.scratch == [] and arena.bytes_used == 0
    assert p.payload.parameters == {}

    flat = dict(doc, inputs=[t_in("A", "FP32", [2, 2], [1, 2.5, 3, 4])] + doc["inputs"][1:])
    assert parse(catalog, arena, "multi", jbody(flat)).payload.inputs[0].data == a.data


def test_json_batched_request(catalog, arena):
    doc = {"inputs": [t_in("X", "INT64", [2, 3], [[1, 2, 3], [4, 5, -6]]),
                      t_in("Y", "BOOL", [2, 1], [[True], [False]])]}
    p = parse(catalog, arena, "batched", jbody(doc))
    assert p.batch_size == 2
    x, y = p.payload.inputs
    assert np.frombuffer(x.data, dtype=np.int64).tolist() == [1, 2, 3, 4, 5, -6]
    assert y.data == b"\x01\x00"
    assert p.request_id == "" and [o.name for o in p.payload.outputs] == ["Z"]


def test_request_parameters_reach_the_model(catalog, arena):
    doc = {"parameters": {"binary_data_output": True, "delay_ms": 5, "tag": "t"},
           "inputs": [t_in("X", "INT64", [1, 3], [1, 2, 3]), t_in("Y", "BOOL", [1, 1], [True])]}
    p = parse(catalog, arena, "batched", jbody(doc))
    assert p.payload.parameters == {"delay_ms": 5, "tag": "t"}


def test_large_json_input_is_copied_into_the_arena(catalog, arena, maps):
    n = INLINE_LIMIT + 1
    values = [i % 256 for i in range(n)]
    doc = {"inputs": [t_in("U", "UINT8", [n], values), t_in("V", "UINT8", [3], [1, 2, 3])]}
    p = parse(catalog, arena, "blob", jbody(doc))
    u, v = p.payload.inputs
    assert u.data is None and u.shm is not None
    assert p.scratch == [u.shm]
    assert u.shm.nbytes == n and u.shm.segment.startswith(arena.name_prefix)
    assert bytes(maps.view(u.shm)) == bytes(values)
    assert v.data == b"\x01\x02\x03" and v.shm is None
    assert arena.bytes_used >= n


def test_json_input_at_inline_limit_stays_inline(catalog, arena):
    n = INLINE_LIMIT
    doc = {"inputs": [t_in("U", "UINT8", [n], [0] * n), t_in("V", "UINT8", [0], [])]}
    p = parse(catalog, arena, "blob", jbody(doc))
    assert p.payload.inputs[0].data == bytes(n) and p.scratch == []
    assert p.payload.inputs[1].data == b""
    assert arena.bytes_used == 0


# ---- binary inputs ----------------------------------------------------------------------------

def test_binary_inputs_from_an_shm_body(catalog, arena, maps):
    big = bytes(range(256)) * (INLINE_LIMIT // 256) + b"\x07"      # INLINE_LIMIT + 1 bytes
    small = b"\x01\x02\x03"
    body, hlen = binary_request({"inputs": [t_in("U", "UINT8", [len(big)], binary_data_size=len(big)),
                                            t_in("V", "UINT8", [3], binary_data_size=3)]}, big, small)
    slot = in_arena(arena, body)
    used = arena.bytes_used
    p = parse(catalog, arena, "blob", slot.view, hlen, slot.ref)
    u, v = p.payload.inputs
    assert u.data is None
    assert u.shm == ShmRef(slot.ref.segment, slot.ref.offset + hlen, len(big))
    assert bytes(maps.view(u.shm)) == big
    assert v.shm is None and v.data == small
    assert p.scratch == [] and arena.bytes_used == used      # nothing copied


def test_binary_input_at_inline_limit_is_inline(catalog, arena):
    data = b"\x05" * INLINE_LIMIT
    body, hlen = binary_request({"inputs": [t_in("U", "UINT8", [INLINE_LIMIT], binary_data_size=INLINE_LIMIT),
                                            t_in("V", "UINT8", [0], binary_data_size=0)]}, data)
    slot = in_arena(arena, body)
    p = parse(catalog, arena, "blob", slot.view, hlen, slot.ref)
    assert p.payload.inputs[0].data == data and p.payload.inputs[0].shm is None
    assert p.payload.inputs[1].data == b""


def test_large_binary_input_without_shm_body_is_inline(catalog, arena):
    big = b"\x09" * (INLINE_LIMIT + 10)
    body, hlen = binary_request({"inputs": [t_in("U", "UINT8", [len(big)], binary_data_size=len(big)),
                                            t_in("V", "UINT8", [1], [4])]}, big)
    p = parse(catalog, arena, "blob", body, hlen, None)
    assert p.payload.inputs[0].data == big and p.payload.inputs[0].shm is None
    assert p.payload.inputs[1].data == b"\x04"


def test_binary_bytes_and_mixed_inputs(catalog, arena):
    strings = dtypes.serialize_bytes(np.array([b"ab", b"\xff"], dtype=object)).tobytes()
    a = np.arange(4, dtype=np.float32).tobytes()
    body, hlen = binary_request({"inputs": [t_in("B", "BYTES", [2], binary_data_size=len(strings)),
                                            t_in("A", "FP32", [2, 2], binary_data_size=16),
                                            t_in("C", "INT32", [1], [3])]}, strings, a)
    p = parse(catalog, arena, "multi", memoryview(body), hlen, None)
    assert [t.data for t in p.payload.inputs] == [strings, a, b"\x03\x00\x00\x00"]


# ---- raw body ---------------------------------------------------------------------------------

def test_raw_body_deduces_the_variable_dim(catalog, arena):
    data = np.arange(12, dtype=np.float32).tobytes()    # 48 bytes / (2 * 4) -> 6
    p = parse(catalog, arena, "raw", data, 0, None)
    (t,) = p.payload.inputs
    assert (t.name, t.datatype, t.shape) == ("R", "FP32", [1, 2, 6])
    assert t.data == data
    assert p.batch_size == 1 and p.request_id == ""
    assert [o.name for o in p.payload.outputs] == ["O1", "O2"]
    assert {n: o.binary for n, o in p.outputs.items()} == {"O1": True, "O2": True}


def test_raw_fixed_and_bytes_inputs(catalog, arena, maps):
    p = parse(catalog, arena, "raw_fixed", b"\x01\x00\x02\x00\x03\x00", 0, None)
    assert p.payload.inputs[0].shape == [3]
    # a raw BYTES body is the one element, without the length the binary extension puts first
    s = dtypes.serialize_bytes(np.array([b"hello"], dtype=object)).tobytes()
    p = parse(catalog, arena, "raw_bytes", b"hello", 0, None)
    assert (p.payload.inputs[0].shape, p.payload.inputs[0].data) == ([1], s)
    big = b"x" * (INLINE_LIMIT + 1)          # past the inline size: copied into the arena
    p = parse(catalog, arena, "raw_bytes", big, 0, None)
    (t,) = p.payload.inputs
    assert t.data is None and bytes(maps.view(t.shm)) == len(big).to_bytes(4, "little") + big


def test_large_raw_body_is_passed_by_reference(catalog, arena):
    data = b"\x02" * (INLINE_LIMIT + 1)
    slot = in_arena(arena, data)
    p = parse(catalog, arena, "raw_u8", slot.view, 0, slot.ref)
    (t,) = p.payload.inputs
    assert t.shm == slot.ref and t.data is None and t.shape == [INLINE_LIMIT + 1]
    small = in_arena(arena, b"\x01\x02")
    t = parse(catalog, arena, "raw_u8", small.view, 0, small.ref).payload.inputs[0]
    assert t.shm is None and t.data == b"\x01\x02"


@pytest.mark.parametrize("model, body, match", [
    ("multi", b"\x00" * 16, "Raw request must only have 1 input (found 1) to be deduced but got 3 "
                            "inputs in 'multi' model configuration"),
    ("raw", b"\x00" * 12, "12 bytes do not fit input 'R' with dims [2, -1]"),
    ("raw_fixed", b"\x00" * 4, "input byte size mismatch for input 'R'"),
    ("raw_two_var", b"\x00" * 8, "The shape of the raw input 'R' can not be deduced because there "
                                 "are more than one variable-sized dimension"),
])
def test_raw_body_errors(catalog, arena, model, body, match):
    with pytest.raises(InferError, match=_re(match)) as e:
        parse(catalog, arena, model, body, 0, None)
    assert e.value.code == ErrorCode.INVALID_ARG


# ---- outputs ----------------------------------------------------------------------------------

BATCHED_INPUTS = [t_in("X", "INT64", [1, 3], [1, 2, 3]), t_in("Y", "BOOL", [1, 1], [True])]


@pytest.mark.parametrize("params, outputs, expected", [
    (None, None, {"OUT0": False, "OUT1": False}),
    ({"binary_data_output": True}, None, {"OUT0": True, "OUT1": True}),
    ({"binary_data_output": False}, None, {"OUT0": False, "OUT1": False}),
    (None, [{"name": "OUT1"}], {"OUT1": False}),
    # binary_data_output sets the outputs not listed; a listed one is JSON unless it says
    # binary_data true (Triton's rule, which its L0_http test.sh checks)
    ({"binary_data_output": True}, [{"name": "OUT1"}, {"name": "OUT0", "parameters": {"binary_data": False}}],
     {"OUT1": False, "OUT0": False}),
    ({"binary_data_output": True}, [{"name": "OUT1", "parameters": {"binary_data": True}}],
     {"OUT1": True}),
    (None, [{"name": "OUT0", "parameters": {"binary_data": True}}, {"name": "OUT1"}],
     {"OUT0": True, "OUT1": False}),
    (None, [], {}),
], ids=["default", "all-binary", "all-json", "one", "listed-json", "listed-binary", "override-on",
        "empty"])
def test_binary_data_output(catalog, arena, params, outputs, expected):
    doc = {"inputs": [t_in("A", "FP32", [2, 2], [0] * 4), t_in("B", "BYTES", [1], ["s"])]}
    if params is not None:
        doc["parameters"] = params
    if outputs is not None:
        doc["outputs"] = outputs
    p = parse(catalog, arena, "multi", jbody(doc))
    assert {n: o.binary for n, o in p.outputs.items()} == expected
    assert [o.name for o in p.payload.outputs] == list(expected)
    assert "binary_data_output" not in p.payload.parameters


# ---- errors -----------------------------------------------------------------------------------

A_OK = t_in("A", "FP32", [2, 2], [1, 2, 3, 4])
B_OK = t_in("B", "BYTES", [1], ["s"])

# (id, model, inputs, message fragment naming the input)
INPUT_ERRORS = [
    ("datatype", "multi", [t_in("A", "FLOAT", [2, 2], [0] * 4), B_OK], "invalid datatype for input A (got 'FLOAT')"),
    ("no-datatype", "multi", [{"name": "A", "shape": [2, 2], "data": [0] * 4}, B_OK], "Unable to parse 'datatype': attempt to access non-existing object member 'datatype' (input 'A')"),
    ("shape-negative", "multi", [t_in("A", "FP32", [2, -2], [0] * 4), B_OK], "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A'"),
    ("shape-missing", "multi", [{"name": "A", "datatype": "FP32", "data": [0] * 4}, B_OK], "Unable to parse 'shape': attempt to access non-existing object member 'shape' (input 'A')"),
    ("shape-float", "multi", [t_in("A", "FP32", [2.0, 2], [0] * 4), B_OK], "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A'"),
    ("shape-bool", "multi", [t_in("A", "FP32", [True, 2], [0] * 4), B_OK], "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A'"),
    ("data-and-binary", "multi", [t_in("A", "FP32", [2, 2], [0] * 4, binary_data_size=16), B_OK],
     "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
     "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size' (input 'A')"),
    ("neither", "multi", [t_in("A", "FP32", [2, 2]), B_OK], "But no field is set (input 'A')"),
    ("binary-size-negative", "multi", [t_in("A", "FP32", [2, 2], binary_data_size=-1), B_OK],
     "Unable to parse 'binary_data_size': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A')"),
    ("binary-size-str", "multi", [t_in("A", "FP32", [2, 2], binary_data_size="16"), B_OK],
     "Unable to parse 'binary_data_size': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A')"),
    ("binary-size-bool", "multi", [t_in("A", "FP32", [2, 2], binary_data_size=True), B_OK],
     "Unable to parse 'binary_data_size': attempt to access JSON non-unsigned-integer as unsigned-integer (input 'A')"),
    ("binary-past-end", "multi", [t_in("A", "FP32", [2, 2], binary_data_size=16), B_OK],
     "unexpected size for input 'A', expecting 16 additional bytes for model 'multi'"),
    ("count", "multi", [t_in("A", "FP32", [2, 2], [1, 2, 3]), B_OK],
     "Failed to parse 'data' field: shape does not match true shape"),
    ("count-nested", "multi", [t_in("A", "FP32", [2, 2], [[1, 2], [3, 4], [5, 6]]), B_OK],
     "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ("bytes-not-str", "multi", [A_OK, t_in("B", "BYTES", [2], ["a", 1])], "input 'B' of datatype BYTES must hold JSON strings"),
    ("numbers", "multi", [t_in("A", "FP32", [2, 2], [1, "2", 3, 4]), B_OK], "input 'A' of datatype FP32 must hold numbers"),
    ("null", "multi", [t_in("A", "FP32", [2, 2], [1, None, 3, 4]), B_OK], "input 'A' of datatype FP32 must hold numbers"),
    ("bool-in-number", "multi", [t_in("A", "FP32", [2, 2], [1, True, 3, 4]), B_OK], "input 'A' of datatype FP32 must hold numbers"),
    ("dict", "multi", [t_in("A", "FP32", [2, 2], [1, {}, 3, 4]), B_OK], "input 'A' of datatype FP32 must hold numbers"),
    ("int-float", "multi", [A_OK, B_OK, t_in("C", "INT32", [2], [1, 2.5])], "input 'C' of datatype INT32 must hold integers"),
    ("overflow", "multi", [A_OK, B_OK, t_in("C", "INT32", [1], [2 ** 40])], "input 'C' holds a value that is not a valid INT32"),
    ("bool", "batched", [t_in("X", "INT64", [1, 3], [1, 2, 3]), t_in("Y", "BOOL", [1, 1], [1])],
     "input 'Y' of datatype BOOL must hold JSON true/false values"),
    ("fp16-json", "half", [t_in("H", "FP16", [2], [1, 2]), t_in("BF", "BF16", [2], binary_data_size=0)],
     "receiving input 'H' of datatype FP16 via JSON is not supported"),
    ("bf16-json", "half", [t_in("BF", "BF16", [2], [1, 2]), t_in("H", "FP16", [2], [1, 2])],
     "receiving input 'BF' of datatype BF16 via JSON is not supported"),
    ("unknown-input", "multi", [A_OK, B_OK, t_in("Q", "INT32", [1], [1])], "unexpected inference input 'Q' for model 'multi'"),
    ("duplicate", "multi", [A_OK, A_OK, B_OK], "input 'A' already exists in request"),
    ("dtype-mismatch", "multi", [t_in("A", "FP64", [2, 2], [1, 2, 3, 4]), B_OK],
     "inference input 'A' data-type is 'FP64', but model 'multi' expects 'FP32'"),
    ("shape-mismatch", "multi", [t_in("A", "FP32", [4], [1, 2, 3, 4]), B_OK],
     "[request id: <id_unknown>] unexpected shape for input 'A' for model 'multi'. Expected [2,2], got [4]. "),
    ("missing", "multi", [A_OK], "missing required input(s) ['B']"),
    ("no-batch-dim", "batched", [t_in("X", "INT64", [], [1]), t_in("Y", "BOOL", [1, 1], [True])],
     "input 'X' for model 'batched' has no batch dimension"),
    ("batch-mismatch", "batched", [t_in("X", "INT64", [2, 3], [0] * 6), t_in("Y", "BOOL", [1, 1], [True])],
     "input 'Y' has batch size 1 but other inputs of the request have batch size 2"),
    ("batch-too-big", "batched", [t_in("X", "INT64", [5, 3], [0] * 15), t_in("Y", "BOOL", [5, 1], [True] * 5)],
     "inference request batch-size must be <= 4 for 'batched'"),
    ("batched-shape", "batched", [t_in("X", "INT64", [1, 4], [0] * 4), t_in("Y", "BOOL", [1, 1], [True])],
     "[request id: <id_unknown>] unexpected shape for input 'X' for model 'batched'. Expected [-1,3], got [1,4]. NOTE: Setting a non-zero max_batch_size"),
]


@pytest.mark.parametrize("model, inputs, match", [c[1:] for c in INPUT_ERRORS], ids=[c[0] for c in INPUT_ERRORS])
def test_input_errors_name_the_input(catalog, arena, model, inputs, match):
    with pytest.raises(InferError, match=_re(match)) as e:
        parse(catalog, arena, model, jbody({"inputs": inputs}))
    # a shape that is not unsigned integers is Triton's 500 (its JSON reader fails there)
    shape = "Unable to parse 'shape': attempt to access JSON non-unsigned" in match
    assert e.value.code == (ErrorCode.INTERNAL if shape else ErrorCode.INVALID_ARG)
    assert e.value.message == str(e.value)


def test_an_unregistered_region_is_not_found_as_triton_says(catalog, arena):
    inputs = [t_in("A", "FP32", [2, 2], shared_memory_region="r", shared_memory_byte_size=16), B_OK]
    with pytest.raises(InferError) as e:
        parse(catalog, arena, "multi", jbody({"inputs": inputs}))
    assert e.value.code == ErrorCode.NOT_FOUND      # 404 over HTTP, as Triton
    assert e.value.message == "Unable to find shared memory region: 'r' (input 'A')"


# (id, model, body builder, header_len, message fragment)
BINARY_ERRORS = [
    ("size-mismatch", "multi", lambda: binary_request({"inputs": [t_in("A", "FP32", [2, 2], binary_data_size=12), B_OK]},
                                                      b"\x00" * 12), "input byte size mismatch for input 'A' for model 'multi'. Expected 16, got 12"),
    ("bad-bytes", "multi", lambda: binary_request({"inputs": [A_OK, t_in("B", "BYTES", [2], binary_data_size=9)]},
                                                  b"\x01\x00\x00\x00a\x09\x00\x00\x00"),
     "incomplete string data for inference input 'B', expecting string of length 9 but only 0 bytes available"),
    ("bytes-count", "multi", lambda: binary_request({"inputs": [A_OK, t_in("B", "BYTES", [2], binary_data_size=5)]},
                                                    b"\x01\x00\x00\x00a"),
     "expected 2 string elements for inference input 'B' for model 'multi', got 1"),
    ("short-body", "blob", lambda: binary_request({"inputs": [t_in("U", "UINT8", [4], binary_data_size=4),
                                                              t_in("V", "UINT8", [4], binary_data_size=4)]}, b"\x00" * 6),
     "unexpected size for input 'V', expecting 2 additional bytes for model 'blob'"),
]


@pytest.mark.parametrize("model, build, match", [c[1:] for c in BINARY_ERRORS], ids=[c[0] for c in BINARY_ERRORS])
def test_binary_input_errors_name_the_input(catalog, arena, model, build, match):
    body, hlen = build()
    with pytest.raises(InferError, match=_re(match)) as e:
        parse(catalog, arena, model, body, hlen)
    assert e.value.code == ErrorCode.INVALID_ARG


REQUEST_ERRORS = [
    ("json", b'{"inputs": [', None, "failed to parse the request JSON buffer"),
    ("not-object", b"[1, 2]", None, "the request JSON must be an object"),
    ("no-inputs", b"{}", None, "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"),
    ("inputs-not-list", b'{"inputs": {}}', None, "Unable to parse 'inputs': attempt to access JSON non-array as array"),
    ("input-not-object", b'{"inputs": [1]}', None, "But no field is set (each entry of 'inputs' is an object)"),
    ("input-no-name", b'{"inputs": [{"datatype": "FP32", "data": [1]}]}', None,
     "Unable to parse 'name': attempt to access non-existing object member 'name' (an entry of 'inputs')"),
    ("input-name-not-str", b'{"inputs": [{"name": 1, "data": [1]}]}', None,
     "Unable to parse 'name': attempt to access JSON non-string as string (an entry of 'inputs')"),
    ("binary-output-not-bool", b'{"inputs": [], "parameters": {"binary_data_output": "yes"}}', None,
     "Unable to parse 'binary_data_output': attempt to access JSON non-boolean as boolean"),
    ("params", b'{"inputs": [], "parameters": [1]}', None, "failed to get request params.: attempt to get members for non-object"),
    ("id", b'{"inputs": [], "id": 5}', None, "Unable to parse 'id': attempt to access JSON non-string as string"),
    ("header-len", b'{"inputs": []}', 100, "inference header size should be in range (0, 14), got: 100 (Inference-Header-Content-Length is larger than the request body of 14 bytes)"),
    ("header-len-negative", b'{"inputs": []}', -1, "inference header size should be in range (0, 14), got: -1 (Inference-Header-Content-Length is negative)"),
    ("trailing", b'{"inputs": []}xyz', 14, "unexpected additional input data for model 'multi': 3 bytes after the last binary input"),
    ("header-cut", b'{"inputs": []}', 5, "failed to parse the request JSON buffer"),
]


@pytest.mark.parametrize("body, hlen, match", [c[1:] for c in REQUEST_ERRORS], ids=[c[0] for c in REQUEST_ERRORS])
def test_request_errors(catalog, arena, body, hlen, match):
    with pytest.raises(InferError, match=_re(match)) as e:
        parse(catalog, arena, "multi", body, hlen)
    assert e.value.code == ErrorCode.INVALID_ARG


OUTPUT_ERRORS = [
    ("unknown", [{"name": "NOPE"}], "unexpected inference output 'NOPE' for model 'multi'"),
    ("not-list", {"name": "OUT0"}, "Unable to parse 'outputs': attempt to access JSON non-array as array"),
    ("no-name", [{"parameters": {}}], "Unable to parse 'name': attempt to access non-existing object member 'name' (an entry of 'outputs')"),
    ("binary-not-bool", [{"name": "OUT0", "parameters": {"binary_data": 1}}],
     "Unable to parse 'binary_data': attempt to access JSON non-boolean as boolean (output 'OUT0')"),
    ("shm", [{"name": "OUT0", "parameters": {"shared_memory_region": "r"}}],
     "Unable to find shared memory region: 'r' (output 'OUT0')"),
    ("classification-bytes", [{"name": "OUT1", "parameters": {"classification": 2}}],
     "output 'OUT1': class result not available for output due to unsupported type 'BYTES'"),
    ("classification-zero", [{"name": "OUT0", "parameters": {"classification": 0}}],
     "output 'OUT0': invalid value for 'classification' parameter, expected a positive integer, "
     "got 0"),
    ("classification-negative", [{"name": "OUT0", "parameters": {"classification": -3}}],
     "output 'OUT0': invalid value for 'classification' parameter"),
    ("classification-string", [{"name": "OUT0", "parameters": {"classification": "2"}}],
     "output 'OUT0': invalid value for 'classification' parameter"),
    ("classification-bool", [{"name": "OUT0", "parameters": {"classification": True}}],
     "output 'OUT0': invalid value for 'classification' parameter"),
    ("classification-float", [{"name": "OUT0", "parameters": {"classification": 2.0}}],
     "output 'OUT0': invalid value for 'classification' parameter"),
    ("classification-huge", [{"name": "OUT0", "parameters": {"classification": 1 << 64}}],
     "output 'OUT0': invalid value for 'classification' parameter"),
    ("classification-shm", [{"name": "OUT0", "parameters": {"classification": 2,
                                                            "shared_memory_region": "r"}}],
     "output 'OUT0': classification cannot be written to shared memory"),
]


def test_classification_rides_on_the_output_spec(catalog, arena):
    doc = {"inputs": [A_OK, B_OK], "outputs": [
        {"name": "OUT0", "parameters": {"classification": 3}}, {"name": "OUT1"}]}
    p = parse(catalog, arena, "multi", jbody(doc))
    assert [(o.name, o.classification) for o in p.payload.outputs] == [("OUT0", 3), ("OUT1", 0)]
    assert not p.outputs["OUT0"].binary     # JSON unless asked for binary, like any output


def test_json_limit_counts_a_classified_output_as_its_k_strings(catalog, arena):
    x, y = np.arange(6, dtype=np.int64).tobytes(), b"\x01\x00"
    doc = {"inputs": [t_in("X", "INT64", [2, 3], binary_data_size=len(x)),
                      t_in("Y", "BOOL", [2, 1], binary_data_size=len(y))],
           "outputs": [{"name": "Z", "parameters": {"classification": 1}}]}
    limits = RequestLimits(max_json_elements=4)
    # [2, 3] as JSON would pass the limit; its top 1 per item is 2 strings
    body, hlen = binary_request(doc, x, y)
    http_codec.parse_infer(catalog.get("batched"), body, hlen, None, arena, ShmRegistry(), limits)
    doc["outputs"] = [{"name": "Z"}]
    body, hlen = binary_request(doc, x, y)
    with pytest.raises(InferError, match="output 'Z' of model 'batched' has 6 elements"):
        http_codec.parse_infer(catalog.get("batched"), body, hlen, None, arena, ShmRegistry(),
                               limits)


@pytest.mark.parametrize("outputs, match", [c[1:] for c in OUTPUT_ERRORS], ids=[c[0] for c in OUTPUT_ERRORS])
def test_output_errors_name_the_output(catalog, arena, outputs, match):
    doc = {"inputs": [A_OK, B_OK], "outputs": outputs}
    with pytest.raises(InferError, match=_re(match)):
        parse(catalog, arena, "multi", jbody(doc))


@pytest.mark.parametrize("key", ["triton_enable_x", "triton_enable_empty_final_response"])
def test_reserved_parameter(catalog, arena, key):
    """Triton's words; over HTTP even the key its gRPC stream takes is refused."""
    doc = {"inputs": [A_OK, B_OK], "parameters": {key: True}}
    with pytest.raises(InferError, match="parameter keys starting with 'triton_' are reserved "
                                         "for Triton usage and should not be specified."):
        parse(catalog, arena, "multi", jbody(doc))


def test_failed_parse_frees_the_scratch_it_allocated(catalog, arena):
    n = INLINE_LIMIT + 1
    for bad, match in ((t_in("V", "UINT8", [2], [1]), "'data'"),   # fails while parsing inputs
                       (t_in("V", "INT8", [1], [1]), "'V'")):       # fails in validate_inputs
        doc = {"inputs": [t_in("U", "UINT8", [n], [0] * n), bad]}
        with pytest.raises(InferError, match=match):
            parse(catalog, arena, "blob", jbody(doc))
        assert arena.bytes_used == 0
    doc = {"inputs": [t_in("U", "UINT8", [n], [0] * n), t_in("V", "UINT8", [1], [1])],
           "outputs": [{"name": "NOPE"}]}
    with pytest.raises(InferError, match="'NOPE'"):
        parse(catalog, arena, "blob", jbody(doc))
    assert arena.bytes_used == 0


# ---- render_response --------------------------------------------------------------------------

def _parsed(binary, request_id=""):
    return PreparedRequest(payload=None, batch_size=1, request_id=request_id,
                           outputs={n: OutputWanted(n, b) for n, b in binary.items()})


def _result(**kw):
    out0 = np.array([[1.5, 2], [3, 4]], dtype=np.float32).tobytes()
    out1 = dtypes.serialize_bytes(np.array(["é", "b"], dtype=object)).tobytes()
    outputs = [Tensor("OUT0", "FP32", [2, 2], data=out0), Tensor("OUT1", "BYTES", [2], data=out1)]
    return InferResult(1, "multi", 3, outputs=outputs, **kw), [out0, out1]


def test_render_json_outputs_and_id_echo():
    result, views = _result()
    header, parts, hlen = http_codec.render_response(result, _parsed({}, "req-7"), views)
    assert hlen == len(header) and parts == []
    doc = json.loads(header)
    assert list(doc) == ["id", "model_name", "model_version", "outputs"]
    assert doc["id"] == "req-7" and doc["model_name"] == "multi" and doc["model_version"] == "3"
    assert doc["outputs"] == [
        {"name": "OUT0", "datatype": "FP32", "shape": [2, 2], "data": [1.5, 2.0, 3.0, 4.0]},
        {"name": "OUT1", "datatype": "BYTES", "shape": [2], "data": ["é", "b"]},
    ]


def test_render_binary_outputs_in_order():
    result, views = _result(parameters={"sequence_id": 4})
    mv = memoryview(bytearray(views[0]))
    header, parts, hlen = http_codec.render_response(result, _parsed({"OUT0": True, "OUT1": True}), [mv, views[1]])
    doc = json.loads(header)
    assert "id" not in doc
    assert doc["parameters"] == {"sequence_id": 4}
    assert doc["outputs"][0] == {"name": "OUT0", "datatype": "FP32", "shape": [2, 2],
                                 "parameters": {"binary_data_size": 16}}
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": len(views[1])}
    assert "data" not in doc["outputs"][1]
    assert parts[0] is mv and [bytes(p) for p in parts] == views
    assert hlen == len(header)


def test_render_mixed_and_empty_binary_output():
    result, views = _result()
    result.outputs.append(Tensor("EMPTY", "INT32", [0], data=b""))
    header, parts, _ = http_codec.render_response(result, _parsed({"OUT1": True, "EMPTY": True}),
                                                  views + [b""])
    doc = json.loads(header)
    assert doc["outputs"][0]["data"] == [1.5, 2.0, 3.0, 4.0]
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": len(views[1])}
    assert doc["outputs"][2]["parameters"] == {"binary_data_size": 0}
    assert parts == [views[1]]                                      # empty outputs add no part


@pytest.mark.parametrize("datatype, data", [
    ("FP16", np.array([1, 2], dtype=np.float16).tobytes()),
    ("BF16", np.array([1, 2], dtype=ml_dtypes.bfloat16).tobytes()),
])
def test_render_half_as_json_is_refused(datatype, data):
    result = InferResult(1, "half", 1, outputs=[Tensor("HO", datatype, [2], data=data)])
    with pytest.raises(InferError, match=f"output 'HO' of datatype {datatype} cannot be returned as JSON"):
        http_codec.render_response(result, _parsed({}), [data])
    header, parts, _ = http_codec.render_response(result, _parsed({"HO": True}), [data])
    assert parts == [data]


@pytest.mark.parametrize("datatype, values", [
    ("BOOL", [True, False]), ("UINT8", [0, 255]), ("INT8", [-128, 127]), ("UINT64", [2 ** 64 - 1, 0]),
    ("INT64", [-(2 ** 63), 5]), ("FP64", [0.1, -2.5]), ("INT16", [-3, 3]), ("UINT32", [7, 2 ** 32 - 1]),
])
def test_render_json_numbers(datatype, values):
    data = np.array(values, dtype=dtypes.WIRE_TO_NUMPY[datatype]).tobytes()
    result = InferResult(1, "m", 1, outputs=[Tensor("O", datatype, [2], data=data)])
    header, _, _ = http_codec.render_response(result, _parsed({}), [data])
    assert json.loads(header)["outputs"][0]["data"] == values


def test_parse_then_render_round_trip(catalog, arena):
    doc = {"id": "x", "inputs": [A_OK, B_OK],
           "outputs": [{"name": "OUT1"}, {"name": "OUT0", "parameters": {"binary_data": True}}]}
    parsed = parse(catalog, arena, "multi", jbody(doc))
    out1 = dtypes.serialize_bytes(np.array(["z"], dtype=object)).tobytes()
    out0 = parsed.payload.inputs[0].data
    result = InferResult(1, "multi", 1, outputs=[Tensor("OUT1", "BYTES", [1], data=out1),
                                                 Tensor("OUT0", "FP32", [2, 2], data=out0)])
    header, parts, _ = http_codec.render_response(result, parsed, [out1, out0])
    d = json.loads(header)
    assert d["id"] == "x"
    assert d["outputs"][0]["data"] == ["z"]
    assert d["outputs"][1]["parameters"] == {"binary_data_size": 16}
    assert parts == [out0]
