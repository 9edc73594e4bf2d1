"""The gRPC infer codec, the shared-memory registry and config.pbtxt parsing under arbitrary
input."""
import os

from google.protobuf import text_format
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import big_ints, datatypes, names
from test_fuzz_http import ARENA, CATALOG
from test_http_codec import CONFIGS
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests import prepare as request
from shmserve.frontend.grpc import codec as grpc_codec
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import model_config
from shmserve.ipc.errors import InferError
from shmserve.ipc.model_config import ConfigError

INT64 = st.integers(-(2 ** 63), 2 ** 63 - 1)
UINT64 = st.integers(0, 2 ** 64 - 1)


@st.composite
def infer_parameter(draw):
    p = pb.InferParameter()
    kind = draw(st.sampled_from(["bool_param", "int64_param", "string_param", "double_param",
                                 "uint64_param"]))
    value = draw({"bool_param": st.booleans(), "int64_param": INT64,
                  "string_param": st.text(max_size=8),
                  "double_param": st.floats(allow_nan=True, allow_infinity=True),
                  "uint64_param": UINT64}[kind])
    setattr(p, kind, value)
    return p


param_maps = st.dictionaries(st.one_of(st.sampled_from(
    ["shared_memory_region", "shared_memory_byte_size", "shared_memory_offset", "binary_data",
     "classification", "priority", "timeout", "sequence_id", "sequence_start", "triton_x"]),
    st.text(max_size=6)), infer_parameter(), max_size=3)


@st.composite
def infer_requests(draw):
    req = pb.ModelInferRequest(id=draw(st.text(max_size=4)))
    for _ in range(draw(st.integers(0, 3))):
        t = req.inputs.add(name=draw(names), datatype=draw(datatypes),
                           shape=draw(st.lists(st.integers(-3, 2 ** 40), max_size=4)))
        for k, v in draw(param_maps).items():
            t.parameters[k].CopyFrom(v)
        which = draw(st.sampled_from(["none", "int", "fp32", "bytes", "bool", "uint64"]))
        n = draw(st.integers(0, 20))
        if which == "int":
            t.contents.int_contents.extend(draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1),
                                                         min_size=n, max_size=n)))
        elif which == "fp32":
            t.contents.fp32_contents.extend([1.5] * n)
        elif which == "bytes":
            t.contents.bytes_contents.extend([b"ab"] * n)
        elif which == "bool":
            t.contents.bool_contents.extend([True] * n)
        elif which == "uint64":
            t.contents.uint64_contents.extend([2 ** 64 - 1] * n)
    for _ in range(draw(st.integers(0, 3))):
        req.raw_input_contents.append(draw(st.binary(max_size=64)))
    for _ in range(draw(st.integers(0, 2))):
        o = req.outputs.add(name=draw(names))
        for k, v in draw(param_maps).items():
            o.parameters[k].CopyFrom(v)
    for k, v in draw(param_maps).items():
        req.parameters[k].CopyFrom(v)
    return req


@given(model=st.sampled_from(sorted(CONFIGS)), req=infer_requests())
def test_grpc_infer_requests(model, req):
    try:
        prepared = grpc_codec.parse_infer(CATALOG.get(model), req, ARENA, ShmRegistry())
    except InferError as e:
        assert e.message
        event("refused")
        return
    event("accepted")
    request.release(prepared, ARENA)


# ---- shared-memory registry -------------------------------------------------------------------
# one per process: pytest-xdist runs this module's setup and teardown in each of its workers
KEY = f"shmtest_fuzz_{os.getpid()}"
SEGMENT = f"/dev/shm/{KEY}"


def setup_module():
    with open(SEGMENT, "wb") as f:          # a real segment some calls name
        f.write(b"\0" * 256)


def teardown_module():
    os.unlink(SEGMENT)


@given(calls=st.lists(st.tuples(
    st.sampled_from(["register", "unregister", "status", "resolve"]),
    st.one_of(st.sampled_from(["r1", "r2", ""]), st.text(max_size=6)),
    st.one_of(st.sampled_from(["/" + KEY, KEY, "/", "/..", "/a/b", "/x\0"]),
              st.text(max_size=10), big_ints),
    st.one_of(big_ints, st.none(), st.text(max_size=3)),
    st.one_of(big_ints, st.none(), st.booleans()),
    st.sampled_from(["ipv4:127.0.0.1:1", "ipv4:10.0.0.1:1", "", "garbage"])), max_size=8))
def test_shm_registry_calls(calls):
    reg = ShmRegistry()
    for action, name, key, offset, size, peer in calls:
        try:
            if action == "register":
                reg.register_system(name, key, offset, size, peer)
            elif action == "unregister":
                reg.unregister_system(name)
            elif action == "status":
                reg.status_system(name)
            else:
                reg.resolve(name, size, offset, "input 'X'")
        except InferError as e:
            assert e.message


# ---- config.pbtxt ---------------------------------------------------------------------------------
BASE = '''name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''
FIELDS = ["max_batch_size: ", "dynamic_batching { priority_levels: ", "instance_group [ { count: ",
          "version_policy { latest { num_versions: ", "dynamic_batching { preferred_batch_size: [ ",
          "input [ { name: \"J\" data_type: TYPE_INT8 dims: [ ", "default_model_filename: "]


@given(text=st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.builds(lambda f, v, close: BASE + f + v + close, st.sampled_from(FIELDS),
              st.one_of(big_ints.map(str), st.text(max_size=8).map(repr)),
              st.sampled_from([" }", " ] } ]", " ]", "", " } }"]))))
def test_config_text(text):
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError:
        event("not pbtxt")
        return
    try:
        model_config.normalize(cfg, "m")
        event("accepted")
    except ConfigError as e:
        assert str(e)
        event("refused")


@given(doc=st.text(max_size=300))
def test_config_json_override(doc):
    try:
        model_config.normalize(model_config.config_from_json(doc), "m")
    except ConfigError as e:
        assert str(e)
