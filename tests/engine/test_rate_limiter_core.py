"""The rate limiter (--rate-limit execution_count, engine/batching/rate_limiter.py) in SchedulerCore,
in-process: instances execute only while they hold their resources, across models; per device
or global; the lowest priority goes first when resources come back; a worker that dies busy
gives its resources back; an instance that could never run fails its model's load; a limited
model is lent while its resources are free and holds them for the lease; and with the limiter
off nothing changes."""
import pytest
from fakes import IO, Harness, write_model

from shmserve.engine.batching.rate_limiter import RateLimiter, parse_override
from shmserve.engine.states import InstanceState
from shmserve.ipc.messages.common import ModelState
from shmserve.ipc.messages.to_frontend import LeaseGranted
from shmserve.ipc.messages.to_scheduler import LeaseEnded
from shmserve.ipc.messages.to_worker import RevokeLease


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


def grants(h, model):
    return [m for _, m in h.port.to_frontend if isinstance(m, LeaseGranted) and m.model == model]


def lent_a(h):
    """a's request runs, and once its queue is empty and R free, its instance is lent."""
    a = sid_of(h, "a")
    h.submit("a")
    h.finish(a)
    (grant,) = grants(h, "a")
    assert grant.spawn_id == a and instance_state(h, a) is InstanceState.LEASED
    return a, grant


def instance_state(h, sid):
    return h.core.supervisor.by_spawn[sid][1].state


def test_a_limited_model_is_lent_while_its_resources_are_free_and_they_stay_held(repo):
    h = Harness(repo, rate_limit=True, instance_leases=True).start()
    a, grant = lent_a(h)
    assert grant.depth == 0             # one instance: its worker takes them in order
    # the lease holds R: b, which needs it, waits, and takes the lease back
    b = sid_of(h, "b")
    h.submit("b")
    assert h.batches(b) == []
    assert h.to_worker(RevokeLease) == [(a, RevokeLease(grant.lease_id))]
    assert grants(h, "b") == []         # nothing is lent while a version waits for resources
    h.core.handle(LeaseEnded(a, grant.lease_id))
    assert len(h.batches(b)) == 1 and running(h) == ["b"]
    h.submit("a")                       # scheduler's path now: a waits for b
    assert len(h.batches(a)) == 1
    h.finish(b)
    assert len(h.batches(a)) == 2


def test_a_lent_instance_counts_against_what_others_may_hold(repo):
    # R:2: a's lease holds one, b's execution the other; a third needs must wait
    write_model(repo, "c", limited())
    h = Harness(repo, rate_limit=True, instance_leases=True,
                rate_limit_resources=["R:2"]).start()
    a, grant = lent_a(h)
    c = sid_of(h, "c")
    h.submit("b")
    assert running(h) == ["b"] and h.to_worker(RevokeLease) == []
    h.submit("c")
    assert h.batches(c) == [] and h.to_worker(RevokeLease) == [(a, RevokeLease(grant.lease_id))]
    h.core.handle(LeaseEnded(a, grant.lease_id))
    assert len(h.batches(c)) == 1


def test_a_worker_that_dies_lent_gives_its_resources_back(repo):
    h = Harness(repo, rate_limit=True, instance_leases=True).start()
    a, _ = lent_a(h)
    b = sid_of(h, "b")
    h.submit("b")
    assert h.batches(b) == []
    h.die(a)
    h.tick(1.0)
    assert len(h.batches(b)) == 1


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
