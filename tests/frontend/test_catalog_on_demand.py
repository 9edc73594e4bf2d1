"""ModelCatalog with --model-control-mode=on_demand: models that are not loaded are served (the
scheduler holds their requests while they load), their readiness and metadata come from the
config, and a table that changes only some models' states reuses the others' views."""
import pytest
from test_catalog import config_bytes

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_frontend import ModelInfo, ModelTable, VersionInfo

UNLOADED = VersionInfo(1, ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)


def info(name, *versions, config=None, on_demand=True):
    return ModelInfo(name, config_bytes(name) if config is None else config,
                     list(versions) or [UNLOADED], on_demand)


def catalog(*models) -> ModelCatalog:
    c = ModelCatalog()
    c.update(ModelTable(list(models), True))
    return c


def test_a_model_that_is_not_loaded_resolves_to_its_version():
    c = catalog(info("cold"), info("two", UNLOADED, VersionInfo(2, ModelState.UNAVAILABLE,
                                                                  "unloaded", StateCause.UNLOADED)))
    view, v = c.resolve("cold", "")
    assert v == 1 and view.on_demand and view.servable(view.states[1])
    assert c.resolve("two", "")[1] == 2 and c.resolve("two", "1")[1] == 1
    with pytest.raises(InferError) as e:
        c.resolve("two", "3")
    assert e.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(InferError) as e:
        c.get("nothing")
    assert e.value.code == ErrorCode.NOT_FOUND


def test_loaded_versions_come_first_and_failed_loads_are_not_ready():
    c = catalog(info("m", VersionInfo(1, ModelState.READY),
                     VersionInfo(2, ModelState.LOADING)),
                info("bad", VersionInfo(1, ModelState.UNAVAILABLE, "boom",
                                        StateCause.LOAD_FAILED)))
    view, v = c.resolve("m", "")
    assert v == 1                                   # the READY one, not the loading one
    assert c.resolve("m", "2")[1] == 2              # held while it loads
    bad, v = c.resolve("bad", "")                   # the scheduler answers with the failure
    assert not bad.servable(bad.states[v])


def test_readiness_counts_models_that_load_on_demand_as_ready():
    c = catalog(info("cold"), info("loading", VersionInfo(1, ModelState.LOADING)),
                info("going", VersionInfo(1, ModelState.UNLOADING)))
    assert c.server_ready(strict=True)
    c = catalog(info("bad", VersionInfo(1, ModelState.UNAVAILABLE, "boom",
                                        StateCause.LOAD_FAILED)))
    assert not c.server_ready(strict=True)


def test_metadata_lists_the_versions_a_request_loads():
    c = catalog(info("cold"))
    view, _ = c.resolve("cold", "")
    meta = view.metadata(None)
    assert meta["versions"] == ["1"] and [t["name"] for t in meta["inputs"]] == ["IN0", "IN1"]


def test_a_config_the_model_completes_needs_a_load_first():
    c = catalog(info("auto", config=b""))
    with pytest.raises(InferError) as e:
        c.resolve("auto", "")
    assert e.value.code == ErrorCode.UNAVAILABLE and "load it once first" in e.value.message


def test_views_are_reused_when_their_model_did_not_change():
    c = catalog(info("a"), info("b"))
    a, b = c.models["a"], c.models["b"]
    c.update(ModelTable([info("a"), info("b", VersionInfo(1, ModelState.READY))], True))
    assert c.models["a"] is a                       # nothing changed: the same view
    assert c.models["b"] is not b and c.models["b"].ready_versions() == [1]
    assert c.models["b"].inputs is b.inputs         # the parsed config is shared
    assert b.ready_versions() == []                 # a view a request holds does not change
    c.update(ModelTable([info("a", config=config_bytes("a", "backend: \"python\"\n")),
                         info("b")], True))
    assert c.models["a"].inputs == {}               # a new config is parsed again


def test_not_on_demand_stays_as_it_was():
    c = catalog(info("m", on_demand=False))
    with pytest.raises(InferError) as e:
        c.resolve("m", "")
    assert e.value.code == ErrorCode.NOT_FOUND and "has no available versions" in e.value.message
