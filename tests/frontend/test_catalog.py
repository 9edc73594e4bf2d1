"""ModelCatalog: the frontend's view of the scheduler's model table."""
import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_frontend import ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.model_config import normalize

CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "IN0", data_type: TYPE_INT32, dims: [ 16 ] },
        { name: "IN1", data_type: TYPE_STRING, dims: [ -1 ], optional: true } ]
output [ { name: "OUT0", data_type: TYPE_FP32, dims: [ 2, -1 ] },
         { name: "OUT1", data_type: TYPE_BF16, dims: [ 1 ] } ]
'''


def config_bytes(name, text=CONFIG):
    return normalize(text_format.Parse(text, mc.ModelConfig()), name).SerializeToString()


def table(startup_done=True):
    return ModelTable([
        ModelInfo("simple", config_bytes("simple"), [VersionInfo(1, "READY"), VersionInfo(2, "UNAVAILABLE", "load failed: boom"),
                                                     VersionInfo(3, "READY"), VersionInfo(4, "LOADING")]),
        ModelInfo("onnx", config_bytes("onnx", CONFIG.replace("python", "onnxruntime").replace("max_batch_size: 8", "max_batch_size: 0")),
                  [VersionInfo(1, ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)]),
        ModelInfo("broken", b"", [VersionInfo(-1, "UNAVAILABLE", "failed to parse config.pbtxt: x")]),
        ModelInfo("loading", config_bytes("loading"), [VersionInfo(1, "LOADING")]),
    ], startup_done=startup_done)


@pytest.fixture
def catalog():
    c = ModelCatalog()
    c.update(table())
    return c


def test_update_builds_views(catalog):
    assert sorted(catalog.models) == ["broken", "loading", "onnx", "simple"]
    v = catalog.get("simple")
    assert v.max_batch_size == 8 and v.platform == "python"
    assert list(v.inputs) == ["IN0", "IN1"]
    assert (v.inputs["IN0"].datatype, v.inputs["IN0"].dims, v.inputs["IN0"].optional) == ("INT32", [16], False)
    assert (v.inputs["IN1"].datatype, v.inputs["IN1"].optional) == ("BYTES", True)
    assert v.required_inputs == ["IN0"]
    assert v.output_names == ["OUT0", "OUT1"]
    assert (v.outputs["OUT0"].datatype, v.outputs["OUT0"].dims) == ("FP32", [2, -1])
    assert v.outputs["OUT1"].datatype == "BF16"
    assert v.ready_versions() == [1, 3]
    cfg = json.loads(v.config_json)
    assert cfg["name"] == "simple" and cfg["input"][0]["dims"] == [16]
    assert catalog.get("onnx").platform == "onnxruntime_onnx"
    broken = catalog.get("broken")
    assert broken.config is None and broken.config_json == b"" and broken.inputs == {}


def test_update_replaces_the_table(catalog):
    catalog.update(ModelTable([ModelInfo("new", config_bytes("new"), [VersionInfo(1, "READY")])], False))
    assert list(catalog.models) == ["new"]
    assert catalog.startup_done is False
    with pytest.raises(InferError):
        catalog.get("simple")


def test_metadata(catalog):
    v = catalog.get("simple")
    md = v.metadata(None)
    assert md["name"] == "simple" and md["versions"] == ["1", "3"] and md["platform"] == "python"
    assert md["inputs"] == [{"name": "IN0", "datatype": "INT32", "shape": [-1, 16]},
                            {"name": "IN1", "datatype": "BYTES", "shape": [-1, -1]}]
    assert md["outputs"][0] == {"name": "OUT0", "datatype": "FP32", "shape": [-1, 2, -1]}
    assert v.metadata(3)["versions"] == ["3"]
    assert catalog.get("onnx").metadata(None)["inputs"][0]["shape"] == [16]  # no batch dim


def test_get_unknown(catalog):
    with pytest.raises(InferError, match="Request for unknown model: 'nope' is not found") as e:
        catalog.get("nope")
    assert e.value.code == ErrorCode.NOT_FOUND


def test_a_model_never_loaded_is_unknown_and_an_unloaded_one_has_no_versions():
    """Explicit mode, as Triton answers it: a model in the repository that was never loaded is
    not known at all; one that was unloaded has no available versions."""
    c = ModelCatalog()
    c.update(ModelTable([ModelInfo("never", config_bytes("never"), []),
                         ModelInfo("gone", config_bytes("gone"), [VersionInfo(
                             1, ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)])],
                        startup_done=True))
    with pytest.raises(InferError) as e:
        c.resolve("never", "")
    assert (e.value.code, e.value.message) == (ErrorCode.NOT_FOUND,
                                               "Request for unknown model: 'never' is not found")
    with pytest.raises(InferError) as e:
        c.resolve("gone", "")
    assert (e.value.code, e.value.message) == (
        ErrorCode.NOT_FOUND, "Request for unknown model: 'gone' has no available versions (unloaded)")


def test_resolve_empty_version_is_highest_ready(catalog):
    view, v = catalog.resolve("simple", "")
    assert view is catalog.get("simple") and v == 3


def test_resolve_ready_version(catalog):
    assert catalog.resolve("simple", "1")[1] == 1
    assert catalog.resolve("simple", "3")[1] == 3


@pytest.mark.parametrize("version", ["9", "0", "007"])
def test_resolve_unknown_version(catalog, version):
    with pytest.raises(InferError, match=f"'simple' version {int(version)} is not found") as e:
        catalog.resolve("simple", version)
    assert e.value.code == ErrorCode.NOT_FOUND


@pytest.mark.parametrize("version", ["abc", "-1", "1.0", " 1", "+1", "\u0661", "\u00b2"])
def test_resolve_non_numeric_version(catalog, version):
    with pytest.raises(InferError, match="failed to get model version from specified version string") as e:
        catalog.resolve("simple", version)
    assert e.value.code == ErrorCode.INVALID_ARG
    assert f"'{version}'" in e.value.message


@pytest.mark.parametrize("version", ["2", "4"])
def test_resolve_version_not_ready(catalog, version):
    with pytest.raises(InferError, match=f"version {version} is not at ready state") as e:
        catalog.resolve("simple", version)
    assert e.value.code == ErrorCode.UNAVAILABLE


def test_resolve_model_without_ready_version(catalog):
    with pytest.raises(InferError) as e:
        catalog.resolve("broken", "")
    assert e.value.code == ErrorCode.NOT_FOUND
    assert "'broken' has no available versions" in e.value.message
    assert "failed to parse config.pbtxt: x" in e.value.message
    # a model that is loading will be there: 503, which says try again (a 404 would not)
    for version in ("", "1"):
        with pytest.raises(InferError) as e:
            catalog.resolve("loading", version)
        assert e.value.code == ErrorCode.UNAVAILABLE
        assert e.value.message == ("Request for unknown model: 'loading' version 1 is not at "
                                   "ready state: the model is loading")


def test_resolve_unknown_model(catalog):
    with pytest.raises(InferError) as e:
        catalog.resolve("nope", "1")
    assert e.value.code == ErrorCode.NOT_FOUND


def test_server_ready():
    c = ModelCatalog()
    assert not c.server_ready(strict=True) and not c.server_ready(strict=False)
    c.update(table(startup_done=False))
    assert not c.server_ready(strict=False)
    c.update(table())
    assert c.server_ready(strict=False)
    assert not c.server_ready(strict=True)      # 'broken', 'loading' and simple v2/v4 are not ready
    ok = ModelTable([
        ModelInfo("a", config_bytes("a"), [VersionInfo(1, "READY"), VersionInfo(2, "READY")]),
        ModelInfo("b", config_bytes("b"), [VersionInfo(1, ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)]),
    ], startup_done=True)
    c.update(ok)
    assert c.server_ready(strict=True)           # explicitly unloaded versions do not count
    ok.models[1].versions.append(VersionInfo(2, "UNAVAILABLE", "failed"))
    c.update(ok)
    assert not c.server_ready(strict=True) and c.server_ready(strict=False)
    c.update(ModelTable([], startup_done=True))
    assert c.server_ready(strict=True)


def test_index(catalog):
    assert catalog.index(ready_only=False) == [
        {"name": "broken", "state": "UNAVAILABLE", "reason": "failed to parse config.pbtxt: x"},
        {"name": "loading", "version": "1", "state": "LOADING"},
        {"name": "onnx", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
        {"name": "simple", "version": "1", "state": "READY"},
        {"name": "simple", "version": "2", "state": "UNAVAILABLE", "reason": "load failed: boom"},
        {"name": "simple", "version": "3", "state": "READY"},
        {"name": "simple", "version": "4", "state": "LOADING"},
    ]
    assert catalog.index(ready_only=True) == [
        {"name": "simple", "version": "1", "state": "READY"},
        {"name": "simple", "version": "3", "state": "READY"},
    ]
    assert ModelCatalog().index(ready_only=False) == []
