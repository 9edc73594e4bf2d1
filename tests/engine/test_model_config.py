"""config.pbtxt reading, Triton's defaults and checks, version policies and the JSON rendering."""
import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.ipc import model_config
from shmserve.ipc.model_config import ConfigError, normalize, select_versions

BASIC = '''
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def norm(text: str, name: str = "m", **kw) -> mc.ModelConfig:
    return normalize(parse(text), name, **kw)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---- read_config ------------------------------------------------------------------------------

def test_read_config(tmp_path):
    write(tmp_path / "config.pbtxt", BASIC)
    cfg = model_config.read_config(str(tmp_path), "m")
    assert cfg.backend == "python" and cfg.max_batch_size == 8 and cfg.input[0].name == "IN"


def test_read_config_parse_error_names_the_file(tmp_path):
    write(tmp_path / "config.pbtxt", 'backend: "python"\nmax_batch_size: "eight"\n')
    with pytest.raises(ConfigError) as e:
        model_config.read_config(str(tmp_path), "m")
    msg = str(e.value)
    assert msg.startswith(f"failed to parse {tmp_path / 'config.pbtxt'}:")
    assert "max_batch_size" in msg and "2" in msg  # protobuf's position and field


def test_read_config_unknown_field(tmp_path):
    write(tmp_path / "config.pbtxt", 'backend: "python"\nno_such_field: 1\n')
    with pytest.raises(ConfigError, match=r"config\.pbtxt.*no_such_field"):
        model_config.read_config(str(tmp_path), "m")


def test_read_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"not provided: .*config\.pbtxt does not exist"):
        model_config.read_config(str(tmp_path), "m")


def test_read_config_named_config(tmp_path):
    write(tmp_path / "config.pbtxt", BASIC)
    write(tmp_path / "configs" / "small.pbtxt", BASIC.replace("max_batch_size: 8", "max_batch_size: 2"))
    write(tmp_path / "configs" / "broken.pbtxt", "{")
    assert model_config.read_config(str(tmp_path), "m", "small").max_batch_size == 2
    # a model without configs/<name>.pbtxt falls back to config.pbtxt
    assert model_config.read_config(str(tmp_path), "m", "other").max_batch_size == 8
    with pytest.raises(ConfigError, match=r"configs/broken\.pbtxt"):
        model_config.read_config(str(tmp_path), "m", "broken")


def test_config_from_json():
    cfg = model_config.config_from_json('{"name": "m", "max_batch_size": 3, "input": [{"dims": ["4"]}]}')
    assert cfg.max_batch_size == 3 and list(cfg.input[0].dims) == [4]
    with pytest.raises(ConfigError, match="failed to parse model configuration JSON"):
        model_config.config_from_json('{"max_batch_size": "x"}')


# ---- normalize: defaults ----------------------------------------------------------------------

def test_normalize_fills_defaults():
    cfg = norm(BASIC, "mymodel")
    assert cfg.name == "mymodel"
    assert cfg.platform == "" and cfg.backend == "python"
    assert cfg.default_model_filename == "model.py"
    assert cfg.version_policy.WhichOneof("policy_choice") == "latest"
    assert cfg.version_policy.latest.num_versions == 1
    assert len(cfg.instance_group) == 1
    group = cfg.instance_group[0]
    assert group.name == "mymodel_0"
    assert group.kind == mc.ModelInstanceGroup.KIND_CPU
    assert group.count == 1
    assert list(group.gpus) == []
    assert cfg.HasField("model_transaction_policy") and not cfg.model_transaction_policy.decoupled
    assert cfg.optimization.input_pinned_memory.enable is True
    assert cfg.optimization.output_pinned_memory.enable is True
    assert not cfg.HasField("dynamic_batching")
    d = model_config.config_to_dict(cfg)
    assert d["model_transaction_policy"] == {"decoupled": False}
    assert d["optimization"]["input_pinned_memory"] == {"enable": True}


def test_normalize_keeps_explicit_values():
    cfg = norm(BASIC + '''
        name: "m"
        default_model_filename: "custom.py"
        version_policy { latest { num_versions: 3 } }
        instance_group [ { name: "g", count: 4, kind: KIND_CPU }, { kind: KIND_CPU } ]
        optimization { input_pinned_memory { enable: false } }
    ''')
    assert cfg.default_model_filename == "custom.py"
    assert cfg.version_policy.latest.num_versions == 3
    assert [(g.name, g.count) for g in cfg.instance_group] == [("g", 4), ("m_1", 1)]
    assert cfg.optimization.input_pinned_memory.enable is False
    assert cfg.optimization.output_pinned_memory.enable is True


def test_normalize_backend_sets_platform():
    cfg = norm(BASIC.replace("python", "onnxruntime"))
    assert (cfg.backend, cfg.platform, cfg.default_model_filename) == \
        ("onnxruntime", "onnxruntime_onnx", "model.onnx")


def test_normalize_platform_sets_backend():
    cfg = norm(BASIC.replace('backend: "python"', 'platform: "onnxruntime_onnx"'))
    assert (cfg.backend, cfg.platform, cfg.default_model_filename) == \
        ("onnxruntime", "onnxruntime_onnx", "model.onnx")
    cfg = norm(BASIC.replace('backend: "python"', 'platform: "tensorrt_plan"'))
    assert (cfg.backend, cfg.default_model_filename) == ("tensorrt", "model.plan")


def test_normalize_dynamic_batching_preferred_size():
    cfg = norm(BASIC + "dynamic_batching { }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]
    cfg = norm(BASIC + "dynamic_batching { preferred_batch_size: [ 2, 4 ] }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2, 4]
    cfg = norm(BASIC.replace("max_batch_size: 8", "max_batch_size: 0") + "dynamic_batching { }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == []


def test_normalize_latest_zero_means_one():
    cfg = norm(BASIC + "version_policy { latest { num_versions: 0 } }")
    assert cfg.version_policy.latest.num_versions == 1


def test_normalize_auto_kind():
    auto = BASIC.replace("python", "onnxruntime") + "instance_group [ { kind: KIND_AUTO } ]"
    assert norm(auto).instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    cfg = norm(auto, gpu_count=2)
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert list(cfg.instance_group[0].gpus) == [0, 1]
    python_auto = BASIC + "instance_group [ { kind: KIND_AUTO } ]"
    assert norm(python_auto, gpu_count=2).instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


def test_normalize_is_idempotent():
    once = norm(BASIC + "dynamic_batching { }")
    twice = normalize(mc.ModelConfig.FromString(once.SerializeToString()), "m")
    assert twice == once


# ---- normalize: errors ------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    (BASIC + 'name: "other"', "model name 'other' in config.pbtxt does not match the directory name 'm'"),
    (BASIC.replace('backend: "python"', ""), "must set 'backend'"),
    (BASIC.replace("python", "tensorflow"), "unable to find backend library for backend 'tensorflow'"),
    (BASIC.replace('backend: "python"', 'platform: "pytorch_libtorch"'), "unexpected platform type 'pytorch_libtorch' for "),
    (BASIC.replace('backend: "python"', 'backend: "python" platform: "ensemble"'),
     "ensemble 'm' must not set a backend"),
    (BASIC.replace("max_batch_size: 8", "max_batch_size: -1"), "max_batch_size must be >= 0"),
    (BASIC.replace("data_type: TYPE_FP32, dims: [ 4 ] } ]\noutput", "dims: [ 4 ] } ]\noutput"),
     "input 'IN' of model 'm' must specify a valid data_type"),
    (BASIC.replace('{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }',
                   '{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }, '
                   '{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }'),
     "declares input 'IN' more than once"),
    (BASIC.replace('name: "IN", ', ""), "has an input without a name"),
    (BASIC.replace("dims: [ 4 ] } ]\noutput", "dims: [ 0 ] } ]\noutput"), "input 'IN' of model 'm' has invalid dim 0"),
    (BASIC.replace("dims: [ 4 ] } ]\noutput", "dims: [ 2, -2 ] } ]\noutput"),
     "input 'IN' of model 'm' has invalid dim -2"),
    (BASIC.replace("dims: [ 4 ] } ]\noutput", "dims: [ ] } ]\noutput"), "input 'IN' of model 'm' must specify dims"),
    (BASIC.replace("dims: [ 4 ] } ]\noutput", "dims: [ 2, 3 ], reshape: { shape: [ 7 ] } } ]\noutput"),
     r"input 'IN' of model 'm' has reshape \[7\] with a different element count than dims \[2, 3\]"),
    (BASIC.replace('name: "OUT", data_type: TYPE_FP32, ', 'name: "OUT", '),
     "output 'OUT' of model 'm' must specify a valid data_type"),
    (BASIC.replace('"OUT", data_type: TYPE_FP32, dims: [ 4 ]', '"OUT", data_type: TYPE_FP32, dims: [ 0 ]'),
     "output 'OUT' of model 'm' has invalid dim 0"),
    (BASIC + "sequence_batching { oldest { } }", "max_candidate_sequences must be > 0"),
    (BASIC.replace('"python"', '"onnxruntime"') + "model_transaction_policy { decoupled: true }",
     "the onnxruntime backend cannot serve a decoupled model"),
    (BASIC + "model_transaction_policy { decoupled: true } response_cache { enable: true }",
     "Response Cache does not currently support model 'm' with 'decoupled' transaction policy"),
    (BASIC + "instance_group [ { count: -1 } ]", "instance_group 'm_0' of model 'm' has a negative count"),
    (BASIC + "instance_group [ { count: 100 }, { count: 29 } ]",
     r"model 'm': instance_group asks for 129 instances, more than the limit of 128"),
    (BASIC + "instance_group [ { count: 100000000 } ]", "more than the limit of 128"),
    (BASIC + 'default_model_filename: "../../../etc/passwd"',
     r"model 'm': default_model_filename '../../../etc/passwd' must be a file name inside the "
     r"model directory, not a path"),
    (BASIC + 'default_model_filename: "/etc/passwd"', "must be a file name inside the model"),
    (BASIC + 'default_model_filename: ".."', "must be a file name inside the model"),
    (BASIC + 'model_warmup [ { name: "w" batch_size: 1 inputs { key: "IN" value { '
             'data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "../../secret" } } } ]',
     r"model_warmup 'w' input 'IN' input_data_file '../../secret' must be a file name"),
], ids=["name", "no-backend", "backend", "platform", "ensemble", "max-batch", "no-dtype", "dup-input",
        "no-name", "dim-0", "dim-neg", "no-dims", "reshape", "out-dtype", "out-dim", "sequence",
        "decoupled", "decoupled-cached", "count", "too-many-instances", "count-huge", "filename-dotdot",
        "filename-absolute", "filename-parent", "warmup-file-path"])
def test_normalize_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        norm(text)


@pytest.mark.parametrize("dims, shape", [("[ 2, 3 ]", "[ 6 ]"), ("[ 2, 3 ]", "[ 3, 1, 2 ]"),
                                         ("[ -1, 3 ]", "[ 7 ]"), ("[ 6 ]", "[ -1, 2 ]"), ("[ ]", "[ 1 ]")])
def test_normalize_accepts_consistent_reshape(dims, shape):
    cfg = norm(BASIC.replace("dims: [ 4 ] } ]\noutput", f"dims: {dims}, reshape: {{ shape: {shape} }} }} ]\noutput"))
    assert cfg.input[0].HasField("reshape")


def test_matching_name_is_accepted():
    assert norm(BASIC + 'name: "m"').name == "m"


# ---- select_versions --------------------------------------------------------------------------

@pytest.mark.parametrize("policy, available, chosen, missing", [
    ("", [3, 1, 2], [3], []),
    ("version_policy { latest { num_versions: 2 } }", [1, 5, 3], [3, 5], []),
    ("version_policy { latest { num_versions: 9 } }", [2, 1], [1, 2], []),
    ("version_policy { all { } }", [4, 1, 2], [1, 2, 4], []),
    ("version_policy { specific { versions: [ 3, 1 ] } }", [1, 2, 3], [1, 3], []),
    ("version_policy { specific { versions: [ 7, 2, 2, 5 ] } }", [1, 2, 3], [2], [5, 7]),
    ("version_policy { specific { versions: [ 4 ] } }", [1], [], [4]),
], ids=["default", "latest-2", "latest-more", "all", "specific", "specific-missing", "none-left"])
def test_select_versions(policy, available, chosen, missing):
    cfg = norm(BASIC + policy)
    assert select_versions(cfg, available) == (chosen, missing)


def test_select_versions_without_normalize():
    assert select_versions(mc.ModelConfig(), [1, 2]) == ([2], [])


# ---- config_to_dict ---------------------------------------------------------------------------

def test_config_to_dict_int64_as_numbers_and_enums_as_strings():
    cfg = norm('''
        backend: "onnxruntime"
        max_batch_size: 4
        input [ { name: "IN", data_type: TYPE_INT64, dims: [ -1, 6 ], reshape: { shape: [ 2, 3 ] } } ]
        output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 3 ] } ]
        version_policy { specific { versions: [ 1, 3 ] } }
        dynamic_batching {
          max_queue_delay_microseconds: 100
          priority_levels: 2
          default_priority_level: 2
          default_queue_policy { default_timeout_microseconds: 7 }
          priority_queue_policy { key: 1 value: { default_timeout_microseconds: 500 } }
          priority_queue_policy { key: 2 value: { default_timeout_microseconds: 9000000000 } }
        }
        parameters { key: "p" value: { string_value: "v" } }
    ''')
    d = model_config.config_to_dict(cfg)
    assert d["name"] == "m" and d["max_batch_size"] == 4
    assert d["input"][0]["dims"] == [-1, 6]
    assert d["input"][0]["reshape"] == {"shape": [2, 3]}
    assert d["input"][0]["data_type"] == "TYPE_INT64"
    assert d["output"][0]["dims"] == [3]
    assert d["output"][0]["data_type"] == "TYPE_STRING"
    assert d["version_policy"] == {"specific": {"versions": [1, 3]}}
    db = d["dynamic_batching"]
    assert db["max_queue_delay_microseconds"] == 100
    assert db["priority_levels"] == 2
    assert db["default_queue_policy"]["default_timeout_microseconds"] == 7
    assert db["default_queue_policy"]["timeout_action"] == "REJECT"
    assert db["preferred_batch_size"] == [4]
    pqp = db["priority_queue_policy"]
    assert set(pqp) == {"1", "2"}
    assert pqp["1"]["default_timeout_microseconds"] == 500
    assert pqp["2"]["default_timeout_microseconds"] == 9000000000
    assert d["instance_group"][0]["kind"] == "KIND_CPU"
    assert d["instance_group"][0]["count"] == 1
    assert d["parameters"] == {"p": {"string_value": "v"}}
    assert d["platform"] == "onnxruntime_onnx"
    # fields without presence are printed with their defaults, as Triton does
    assert d["output"][0]["is_shape_tensor"] is False and d["input"][0]["optional"] is False


def test_config_to_dict_latest_policy():
    d = model_config.config_to_dict(norm(BASIC))
    assert d["version_policy"] == {"latest": {"num_versions": 1}}
    assert d["input"][0]["dims"] == [4]


def test_config_to_json_is_compact_and_round_trips():
    cfg = norm(BASIC + "dynamic_batching { max_queue_delay_microseconds: 250 }")
    text = model_config.config_to_json(cfg)
    assert " " not in text.replace('"', "")
    assert json.loads(text) == model_config.config_to_dict(cfg)
    assert '"dims":[4]' in text and '"max_queue_delay_microseconds":250' in text
    assert model_config.config_from_json(text) == cfg


# ---- normalize: dynamic batching --------------------------------------------------------------

@pytest.mark.parametrize("db, match", [
    ("preferred_batch_size: [ 0 ]",
     r"model 'm': dynamic_batching preferred_batch_size 0 must be between 1 and max_batch_size \(8\)"),
    ("preferred_batch_size: [ 2, -1 ]", r"preferred_batch_size -1 must be between 1 and max_batch_size"),
    ("preferred_batch_size: [ 4, 9 ]",
     r"preferred_batch_size 9 must be between 1 and max_batch_size \(8\)"),
    ("priority_levels: 2", r"default_priority_level must be in \[1, 2\] when priority_levels is 2"),
    ("priority_levels: 2 default_priority_level: 3",
     r"model 'm': dynamic_batching default_priority_level must be in \[1, 2\]"),
    ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 3 value { } }",
     r"model 'm': dynamic_batching priority_queue_policy has level 3, outside "
     r"\[1, priority_levels=2\]"),
    ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 0 value { } }",
     r"priority_queue_policy has level 0, outside \[1, priority_levels=2\]"),
    ("priority_queue_policy { key: 1 value { } }",
     r"priority_queue_policy has level 1, outside \[1, priority_levels=0\]"),
], ids=["preferred-0", "preferred-neg", "preferred-above-max", "default-level-0",
        "default-level-above", "policy-level-above", "policy-level-0", "policy-without-levels"])
def test_normalize_dynamic_batching_errors(db, match):
    with pytest.raises(ConfigError, match=match):
        norm(BASIC + f"dynamic_batching {{ {db} }}")


def test_normalize_dynamic_batching_valid_priorities():
    cfg = norm(BASIC + """dynamic_batching {
        preferred_batch_size: [ 1, 8 ]
        priority_levels: 3 default_priority_level: 3
        priority_queue_policy { key: 1 value { max_queue_size: 2 } }
        priority_queue_policy { key: 3 value { timeout_action: DELAY } } }""")
    db = cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [1, 8]
    assert sorted(db.priority_queue_policy) == [1, 3]
    assert db.default_priority_level == 3


def test_normalize_dynamic_batching_preferred_defaults_to_max_batch_size():
    cfg = norm(BASIC.replace("max_batch_size: 8", "max_batch_size: 5") +
               "dynamic_batching { max_queue_delay_microseconds: 100 }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [5]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100


def test_a_config_that_is_not_utf8_is_a_config_error(tmp_path):
    """It was an uncaught UnicodeDecodeError that stopped the server's start."""
    from shmserve.ipc.model_config import read_config
    (tmp_path / "config.pbtxt").write_bytes(b'name: "m"\nbackend: "\xff\xfepython"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_config(str(tmp_path), "m")


def test_instance_names_are_tritons():
    """By group and index, a group's only instance too (Triton's 'simple_0_0' since 2.37, which
    python models see as model_instance_name and its error texts name)."""
    from shmserve.engine.lifecycle.loading import instances_of
    cfg = normalize(text_format.Parse('''
        backend: "python"
        instance_group [ { count: 1 kind: KIND_CPU }, { count: 2 kind: KIND_CPU },
                         { name: "mine" count: 1 kind: KIND_CPU } ]''', mc.ModelConfig()), "simple")
    assert [i.name for i in instances_of(cfg)] == ["simple_0_0", "simple_1_0", "simple_1_1",
                                                   "mine_0"]
