"""The rate limiter (--rate-limit execution_count, engine/batching/rate_limiter.py) in SchedulerCore,
in-process: instances execute only while they hold their resources, across models; per device
or global; the lowest priority goes first when resources come back; a worker that dies busy
gives its resources back; an instance that could never run fails its model's load; leases
stay off for limited models; and with the limiter off nothing changes."""
import pytest
from fakes import IO, Harness, write_model

from shmserve.engine.batching.rate_limiter import RateLimiter, parse_override
from shmserve.ipc.messages.common import ModelState


def limited(count=1, resource="R", priority=0, kind="KIND_CPU", extra="", glob=False):
    g = " global: true" if glob else ""
    return (f"max_batch_size: 8\n{IO}\ninstance_group [ {{ count: {count} kind: {kind} "
            f"rate_limiter {{ resources [ {{ name: \"{resource}\" count: 1{g} }} ] "
            f"priority: {priority} }} }} ]\n{extra}")


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "a", limited())
    write_model(r, "b", limited())
    write_model(r, "free", f"max_batch_size: 8\n{IO}\ninstance_group [ {{ count: 1 }} ]")
    return r


def sid_of(h, model):
    (sid,) = [s for s in h.spawn_ids(model) if s not in h.port.reaped]
    return sid


def running(h):
    """The models whose workers hold a batch now."""
    return sorted(h.port.spawned[s].model_name for s, m, _ in h.batches()
                  if h.core.supervisor.by_spawn[s][1].batch_id == m.batch_id
                  and h.core.supervisor.by_spawn[s][1].batch is not None)


def test_two_models_that_share_a_resource_take_turns(repo):
    h = Harness(repo, rate_limit=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    h.submit("a")
    h.submit("b")               # R (1) is held by a's execution: b waits with an idle worker
    assert running(h) == ["a"] and h.batches(b) == []
    h.submit("free")            # a model that needs nothing is not held back
    assert running(h) == ["a", "free"]
    h.finish(a)                 # R comes back: b runs
    assert len(h.batches(b)) == 1 and running(h) == ["b", "free"]
    h.submit("a")
    assert len(h.batches(a)) == 1       # a's second request waits for b
    h.finish(b)
    assert len(h.batches(a)) == 2


def test_without_the_limiter_the_resources_mean_nothing(repo):
    h = Harness(repo).start()
    h.submit("a"), h.submit("b")
    assert running(h) == ["a", "b"]


def test_an_override_lets_more_run_at_once(repo):
    h = Harness(repo, rate_limit=True, rate_limit_resources=["R:2"]).start()
    h.submit("a"), h.submit("b")
    assert running(h) == ["a", "b"]


def test_resources_are_counted_per_device_unless_global(tmp_path):
    r = str(tmp_path / "models")
    # two GPU instances, one on each of two GPUs: R is counted on each device
    write_model(r, "g", limited(kind="KIND_GPU", extra="").replace(
        "kind: KIND_GPU", "kind: KIND_GPU gpus: [ 0, 1 ]"))
    write_model(r, "shared", limited(count=2, resource="S", glob=True))
    h = Harness(r, rate_limit=True).start()
    h.submit("g"), h.submit("g")
    assert running(h) == ["g", "g"]         # R on device 0 and R on device 1
    h.submit("shared"), h.submit("shared")
    assert running(h) == ["g", "g", "shared"]     # one global S for both instances


def test_the_lowest_priority_goes_first_when_resources_come_back(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "holder", limited())
    write_model(r, "low", limited(priority=1))
    write_model(r, "high", limited(priority=5))
    h = Harness(r, rate_limit=True).start()
    h.submit("holder")
    h.submit("high")            # waits first
    h.submit("low")             # waits second, but its priority is lower
    h.finish(sid_of(h, "holder"))
    assert running(h) == ["low"]
    h.finish(sid_of(h, "low"))
    assert running(h) == ["high"]


def test_a_worker_that_dies_busy_gives_its_resources_back(repo):
    h = Harness(repo, rate_limit=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    h.submit("a"), h.submit("b")
    assert h.batches(b) == []
    h.die(a)
    h.tick(1.0)                 # the waiting model is looked at again
    assert len(h.batches(b)) == 1


def test_an_instance_that_could_never_run_fails_its_load(repo):
    write_model(repo, "greedy", limited().replace("count: 1 }", "count: 3 }"))
    h = Harness(repo, rate_limit=True, rate_limit_resources=["R:2"]).start()
    state, reason, _ = h.states("greedy")[1]
    assert state is ModelState.UNAVAILABLE
    assert reason.startswith("Resource count for 'R' is limited to 2 which will prevent "
                             "scheduling of one or more model instances: instance 'greedy_0_0' "
                             "of model 'greedy' needs 3")
    assert h.states("a")[1][0] is ModelState.READY


def test_limited_models_are_never_leased(repo):
    h = Harness(repo, rate_limit=True, instance_leases=True).start()
    a = sid_of(h, "a")
    h.submit("a")
    h.finish(a)                 # idle, queue empty: a plain model would be lent now
    assert h.core.leases.by_version == {} or \
        all(v.name != "a" for v in h.core.leases.by_version)
    h.submit("free")
    h.finish(sid_of(h, "free"))
    assert any(v.name == "free" for v in h.core.leases.by_version)


def test_unloading_a_model_stops_it_counting(repo):
    h = Harness(repo, rate_limit=True, model_control_mode="explicit",
                load_models=["a", "b"]).start()
    limiter = h.core.rate_limiter
    assert {v.name for v in limiter.versions} == {"a", "b"}
    from shmserve.ipc.messages.common import ControlAction
    from shmserve.ipc.messages.to_scheduler import ControlRequest
    h.core.handle(ControlRequest(0, 100, ControlAction.UNLOAD, "a"))
    assert {v.name for v in limiter.versions} == {"b"}


@pytest.mark.parametrize("text, parsed", [
    ("R1:4", (("R1", "*"), 4)), ("R1:0:2", (("R1", 2), 0)), ("a:b:1:2", None), ("R1", None),
    (":3", None), ("R1:-1", None), ("R1:2:x", None)])
def test_parse_override(text, parsed):
    if parsed is None:
        with pytest.raises(ValueError):
            parse_override(text)
    else:
        assert parse_override(text) == parsed


def test_capacity_defaults_to_the_most_any_instance_asks_for(repo):
    h = Harness(repo, rate_limit=True).start()
    limiter: RateLimiter = h.core.rate_limiter
    assert limiter.capacity(("R", 0)) == 1 and limiter.capacity(("nothing", 0)) == 0
