"""The generate extension's JSON mapping (frontend/http/generate.py), in-process: request keys onto
model inputs and parameters as Triton maps them, its words for what it refuses, and the answer's
JSON. tests/e2e/test_generate.py runs the endpoints on a real server."""
import json

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.engine.requests.prepare import DEFAULT_LIMITS
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.http import generate
from shmserve.ipc import dtypes
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ModelState, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.model_config import normalize
from shmserve.ipc.shm import ShmMapCache

# the interface of Triton's generate test model (qa/python_models/generate_models/mock_llm)
LLM = '''
backend: "python"
max_batch_size: 0
input [
  { name: "PROMPT", data_type: TYPE_STRING, dims: [ 1, 1 ] },
  { name: "STREAM", data_type: TYPE_BOOL, dims: [ 1, 1 ] },
  { name: "input_ids", data_type: TYPE_INT32, dims: [ 1, -1 ], optional: true }
]
output [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1, -1 ] } ]
'''

TYPES = '''
backend: "python"
max_batch_size: 4
input [
  { name: "B", data_type: TYPE_BOOL, dims: [ -1 ], optional: true },
  { name: "I8", data_type: TYPE_INT8, dims: [ -1 ], optional: true },
  { name: "U32", data_type: TYPE_UINT32, dims: [ -1 ], optional: true },
  { name: "F32", data_type: TYPE_FP32, dims: [ -1 ], optional: true },
  { name: "H", data_type: TYPE_FP16, dims: [ -1 ], optional: true },
  { name: "S", data_type: TYPE_STRING, dims: [ -1 ], optional: true },
  { name: "PAIR", data_type: TYPE_INT64, dims: [ 2 ], optional: true },
  { name: "ONE", data_type: TYPE_STRING, dims: [ 1 ], optional: true }
]
output [ { name: "O", data_type: TYPE_INT32, dims: [ -1 ] } ]
'''


def _view(config: str, name: str = "m"):
    cfg = normalize(text_format.Parse(config, mc.ModelConfig()), name)
    catalog = ModelCatalog()
    catalog.update(ModelTable([ModelInfo(name, cfg.SerializeToString(),
                                         [VersionInfo(1, ModelState.READY)])], startup_done=True))
    return catalog.get(name)


LLM_VIEW = _view(LLM, "llm")
TYPES_VIEW = _view(TYPES, "types")


def _map(body, view=LLM_VIEW, max_input_size=1 << 20):
    if not isinstance(body, str):
        body = json.dumps(body)
    return generate.map_request(view, generate.parse_json(body.encode()), max_input_size)


def _refused(body, view=LLM_VIEW, max_input_size=1 << 20) -> str:
    with pytest.raises(InferError) as e:
        _map(body, view, max_input_size)
    assert e.value.code.name == "INVALID_ARG"
    return e.value.message


def _inputs(mapped) -> dict:
    return {t.name: (t.datatype, t.shape, data) for t, data in mapped.inputs}


def _bytes(*strings: str) -> bytes:
    return dtypes.serialize_bytes(np.array([s.encode() for s in strings], dtype=object)).tobytes()


# ---- mapping ------------------------------------------------------------------------------------
def test_inputs_parameters_and_id():
    mapped = _map({"id": "42", "PROMPT": "hello world", "STREAM": False, "input_ids": [100, 200],
                   "temperature": 0.5, "parameters": {"REPETITION": 3, "stop": "x", "ok": True}})
    assert _inputs(mapped) == {
        "PROMPT": ("BYTES", [1, 1], _bytes("hello world")),
        "STREAM": ("BOOL", [1, 1], b"\x00"),
        "input_ids": ("INT32", [1, 2], np.array([100, 200], np.int32).tobytes())}
    # every other key is a parameter the model reads, "id" too (Triton sets it both ways)
    assert mapped.parameters == {"id": "42", "temperature": 0.5, "REPETITION": 3, "stop": "x",
                                 "ok": True}
    assert mapped.request_id == "42"


def test_an_input_inside_parameters_is_an_input():
    mapped = _map({"PROMPT": ["hi"], "parameters": {"STREAM": True}})
    assert _inputs(mapped)["STREAM"] == ("BOOL", [1, 1], b"\x01")
    assert mapped.parameters == {}


@pytest.mark.parametrize("shape, count, expected", [
    ([-1], 3, [3]),
    ([-1, -1], 3, [1, 3]),          # a batching model's batch dim is 1
    ([-1, 2], 4, [2, 2]),
    ([-1, 1], 3, [3, 1]),
    ([1, -1], 3, [1, 3]),
    ([1], 1, [1]),
    ([2, -1, -1], 6, [2, 1, 3]),
    ([], 1, []),
])
def test_shape_deduction(shape, count, expected):
    assert generate.deduce_shape("X", shape, count) == expected


@pytest.mark.parametrize("shape, count", [([-1, 2], 3), ([2], 1), ([1], 2), ([0, -1], 2)])
def test_shapes_that_cannot_be_deduced(shape, count):
    with pytest.raises(InferError, match="The schema can not convert input 'X' to tensor with "
                                         "proper shape"):
        generate.deduce_shape("X", shape, count)


def test_batching_model_gets_a_batch_dim():
    mapped = _map({"S": ["a", "b", "c"], "PAIR": [1, 2], "ONE": "x"}, TYPES_VIEW)
    got = _inputs(mapped)
    assert got["S"][:2] == ("BYTES", [1, 3])
    assert got["PAIR"] == ("INT64", [1, 2], np.array([1, 2], np.int64).tobytes())
    assert got["ONE"][:2] == ("BYTES", [1, 1])


@pytest.mark.parametrize("body, text", [
    # Triton's generate_endpoint_test.py cases, with its words
    ({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
    ({"PROMPT": "hello", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
    ({"PROMPT": True, "STREAM": 123}, "attempt to access JSON non-string as string"),
    ({"STREAM": 123, "PROMPT": True}, "attempt to access JSON non-boolean as boolean"),
    ({"PROMPT": {"USER": "hello", "BOT": "hi"}, "STREAM": True},
     "attempt to access JSON non-string as string"),
    ({"PROMPT": "x", "STREAM": True, "PARAMS": {"A": 0}}, "parameter 'PARAMS' has invalid type"),
    ({"PROMPT": "x", "parameters": 1}, "Expected JSON object for keyword: 'parameters'"),
    ({"PROMPT": "x", "parameters": {"nested": {"twice": 1}}},
     "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
    ({"PROMPT": "x", "p": None}, "parameter 'p' has invalid type. It should be either 'int', "
                                 "'bool', or 'string'."),
    ({"PROMPT": "x", "p": [1]}, "parameter 'p' has invalid type"),
    ({"id": 42, "PROMPT": "x"}, "Unable to parse 'id': attempt to access JSON non-string as "
                                "string"),
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate"}',
     "input 'PROMPT' already exists in request"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": false}',
     "input 'STREAM' already exists in request"),
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate", "STREAM": true}',
     "input 'PROMPT' already exists in request"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": true, "PROMPT": "duplicate"}',
     "input 'STREAM' already exists in request"),
    ({"PROMPT": "x", "parameters": {"PROMPT": "y"}},
     "Converting keyword: 'parameters': input 'PROMPT' already exists in request"),
])
def test_refusals_in_tritons_words(body, text):
    assert text in _refused(body)


def test_parameters_named_like_an_input():
    view = _view(LLM.replace('"input_ids"', '"parameters"'), "llm2")
    assert _refused({"PROMPT": "x", "parameters": {}}, view) == \
        "Keyword 'parameters' for nested schema also given as input tensor name"


@pytest.mark.parametrize("body, text", [
    ({"I8": [1.5]}, "Unable to parse 'data': attempt to access JSON non-signed-integer as "
                    "signed-integer"),
    ({"I8": [True]}, "non-signed-integer as signed-integer"),
    ({"U32": [-1]}, "Unable to parse 'data': attempt to access JSON non-unsigned-integer as "
                    "unsigned-integer"),
    ({"F32": ["1"]}, "Unable to parse 'data': attempt to access JSON non-number as double"),
    ({"F32": [False]}, "non-number as double"),
    ({"B": [1]}, "attempt to access JSON non-boolean as boolean"),
    ({"S": ["a", 1]}, "Unable to parse JSON bytes array: attempt to access JSON non-string as "
                      "string"),
    ({"H": [1.0]}, "receiving FP16 data via JSON is not supported. Please use the binary data "
                   "format for input H"),
    ({"F32": [[1, 2], [3]]}, "Unable to parse 'data': Shape does not match true shape of 'data' "
                             "field"),
    ({"F32": [[], [3]]}, "Failed to parse 'data' field: shape does not match true shape"),
    ({"I8": [300]}, "input 'I8' holds a value that is not a valid INT8"),
    ({"PAIR": [1, 2, 3]}, "The schema can not convert input 'PAIR' to tensor with proper shape"),
])
def test_tensor_values(body, text):
    assert text in _refused(body, TYPES_VIEW)


def test_nested_arrays_that_fit_are_read_flat():
    got = _inputs(_map({"F32": [[1], [2.5]]}, TYPES_VIEW))
    assert got["F32"] == ("FP32", [1, 2], np.array([1, 2.5], np.float32).tobytes())


def test_an_empty_input_has_no_shape():
    assert _inputs(_map({"S": []}, TYPES_VIEW))["S"] == ("BYTES", [], b"")


def test_parameter_values():
    mapped = _map({"PROMPT": "x", "big": 1 << 63, "neg": -5, "f": 1e300, "s": "", "b": False})
    assert mapped.parameters == {"big": float(1 << 63), "neg": -5, "f": 1e300, "s": "",
                                 "b": False}
    # a repeated parameter keeps its first value (Triton's lookup finds the first)
    assert _map('{"PROMPT": "x", "t": 1, "t": 2}').parameters == {"t": 1}


def test_input_size_limit():
    text = _refused({"PROMPT": "x" * 100}, max_input_size=50)
    assert text == ("request size of 0 bytes with input 'PROMPT' of size 104 bytes exceeds the "
                    "maximum allowed input size of 50. Use --http-max-input-size to increase "
                    "the limit.")
    # the inputs of one level add up
    text = _refused({"S": "x" * 26, "ONE": "y" * 26}, TYPES_VIEW, max_input_size=50)
    assert text.startswith("request size of 30 bytes with input 'ONE' of size 30 bytes exceeds "
                           "the maximum allowed input size of 50")
    # a JSON list of small numbers expands: 8 bytes per INT64
    assert " bytes exceeds the maximum allowed input size of " in \
        _refused({"PAIR": [1, 2] * 4}, TYPES_VIEW, max_input_size=40)


@pytest.mark.parametrize("body, text", [
    (b"", "failed to parse the request JSON buffer"),
    (b"{", "failed to parse the request JSON buffer"),
    (b"[1]", "attempt to get members for non-object"),
    (b'{"F32": [NaN]}', "failed to parse the request JSON buffer"),
    (b"\xff", "failed to parse the request JSON buffer"),
    (b"[" * 100000, http_codec.TOO_DEEP),
])
def test_bodies_that_are_not_a_json_object(body, text):
    with pytest.raises(InferError, match=text.replace("(", r"\(").replace(")", r"\)")):
        generate.parse_json(body)


# ---- the request as any infer request -----------------------------------------------------------
def test_prepare_passes_every_parameter_to_the_model(arena):
    mapped = _map({"id": "7", "PROMPT": "hi", "STREAM": True, "priority": 3, "timeout": "x"})
    prepared = generate.prepare(LLM_VIEW, mapped, arena, DEFAULT_LIMITS)
    assert prepared.request_id == "7" and prepared.priority == 0 and prepared.timeout_us == 0
    assert prepared.payload.parameters == {"id": "7", "priority": 3, "timeout": "x"}
    assert [o for o in prepared.outputs] == ["TEXT"]
    assert not prepared.outputs["TEXT"].binary


def test_prepare_checks_like_infer(arena):
    with pytest.raises(InferError, match="expected number of inputs between 2 and 3 but got 0"):
        generate.prepare(LLM_VIEW, _map({}), arena, DEFAULT_LIMITS)
    with pytest.raises(InferError, match="expected number of inputs between 2 and 3 but got 1"):
        generate.prepare(LLM_VIEW, _map({"STREAM": False, "other": "param"}), arena,
                         DEFAULT_LIMITS)
    with pytest.raises(InferError, match="keys starting with 'triton_'"):
        generate.prepare(LLM_VIEW, _map({"PROMPT": "a", "STREAM": True, "triton_x": 1}), arena,
                         DEFAULT_LIMITS)
    with pytest.raises(InferError, match="unexpected shape for input 'PROMPT'"):
        generate.prepare(LLM_VIEW, _map({"PROMPT": [], "STREAM": True}), arena, DEFAULT_LIMITS)
    with pytest.raises(InferError, match="input 'S' for model 'types' has no batch dimension"):
        generate.prepare(TYPES_VIEW, _map({"S": []}, TYPES_VIEW), arena, DEFAULT_LIMITS)


def test_large_inputs_go_through_shared_memory(arena):
    text = "x" * (INLINE_LIMIT + 10)
    prepared = generate.prepare(LLM_VIEW, _map({"PROMPT": text, "STREAM": False}), arena,
                                DEFAULT_LIMITS)
    prompt = prepared.payload.inputs[0]
    assert prompt.shm is not None and prepared.scratch == [prompt.shm]
    maps = ShmMapCache()
    try:
        assert bytes(maps.view(prompt.shm)) == _bytes(text)
    finally:
        maps.close()


# ---- the answer ---------------------------------------------------------------------------------
def _answer(outputs, views, request_id="", parameters=None) -> dict:
    result = InferResult(1, "llm", 3, outputs=outputs, parameters=parameters or {})
    body = generate.render_answer(result, request_id, views, 1000)
    doc = json.loads(body)
    assert list(doc) == sorted(doc)         # Triton writes the keys in order
    return doc


def test_answer_json():
    doc = _answer([Tensor("TEXT", "BYTES", [1, 1]), Tensor("N", "INT32", [3]),
                   Tensor("E", "FP32", [1, 0])],
                  [_bytes("hi"), np.arange(3, dtype=np.int32).tobytes(), b""],
                  request_id="42", parameters={"finish": "stop", "model_name": "not me"})
    assert doc == {"id": "42", "model_name": "llm", "model_version": "3", "finish": "stop",
                   "TEXT": "hi", "N": [0, 1, 2], "E": []}


def test_answer_without_id():
    doc = _answer([Tensor("B", "BOOL", [1])], [b"\x01"])
    assert doc == {"model_name": "llm", "model_version": "3", "B": True}


def test_answer_past_the_json_limit():
    result = InferResult(1, "llm", 3, outputs=[Tensor("N", "INT32", [2000])])
    with pytest.raises(InferError, match="more than can be returned as JSON"):
        generate.render_answer(result, "", [bytes(8000)], 1000)
