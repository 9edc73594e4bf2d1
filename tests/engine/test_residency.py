"""On-demand loading (--model-control-mode=on_demand): the residency policy alone
(engine/lifecycle/residency.py), then wired into the scheduler core (engine/lifecycle/on_demand.py) and driven with
the fake port and clock (tests/engine/fakes.py). No sockets, no processes, no sleeping."""
import pytest
from fakes import IO, ONE, TWO, Harness, write_ensemble, write_model

from shmserve.engine.lifecycle.residency import (
    ADMIT_SHARE,
    DEFAULT_ESTIMATE,
    LOAD_RETRY_S,
    MEASURE_INTERVAL_S,
    MIB,
    SECOND_READING_S,
    ModelResidency,
    Residence,
    parse_bytes,
)
from shmserve.ipc.messages.common import ControlAction, ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_frontend import ControlReply
from shmserve.ipc.messages.to_scheduler import ControlRequest, StatsQuery
from shmserve.ipc.messages.to_worker import ExecuteBatch, Shutdown


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def never_busy(name):
    return False


def policy(budget=0, idle=0.0, **kw):
    clock = Clock()
    return ModelResidency(budget, idle, clock, **kw), clock


def loaded(p, clock, name, size, instances=1, composing=()):
    """``name`` went through a whole load and measured ``size``."""
    p.add(name, instances, composing)
    assert p.request(name) == ""
    p.set_state(name, Residence.LOADING)
    p.set_state(name, Residence.IN)
    p.measured(name, size)
    clock.t += 1


# ---- the policy ------------------------------------------------------------------------------------
def test_parse_bytes():
    assert parse_bytes("0") == 0
    assert parse_bytes("512M") == 512 * MIB
    assert parse_bytes("4G") == 4 << 30
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("1.5g") == 3 << 29
    assert parse_bytes("100k") == 102400
    assert parse_bytes("123") == 123
    for bad in ("", "lots", "-1G", "nan"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_estimate_own_size_then_mean_per_instance_then_default():
    p, clock = policy(budget=1 << 40)
    p.add("a", 2)
    assert p.estimate("a") == 2 * DEFAULT_ESTIMATE
    loaded(p, clock, "b", 30 * MIB, instances=1)
    loaded(p, clock, "c", 90 * MIB, instances=3)
    assert p.estimate("a") == 2 * 30 * MIB       # (30 + 90) / 4 per instance
    loaded(p, clock, "a", 50 * MIB, instances=2)
    assert p.estimate("a") == 50 * MIB           # its own last size
    p.add("e", 0, ["a", "b"])
    assert p.estimate("e") == 0                   # an ensemble needs nothing itself


def test_without_a_budget_every_waiting_load_starts():
    p, _ = policy()
    for n in "abc":
        p.request(n)
    assert p.plan(never_busy).load == ["a", "b", "c"]


def test_loads_start_while_they_fit_in_arrival_order():
    p, clock = policy(budget=100 * MIB, default_estimate=40 * MIB)
    for n in "abc":
        p.request(n)
        clock.t += 1
    plan = p.plan(never_busy)
    assert plan.load == ["a", "b"] and plan.evict == []     # c waits: a and b are loading
    for n in plan.load:
        p.set_state(n, Residence.LOADING)
    assert p.charged() == 80 * MIB and p.queue == ["c"]
    assert p.plan(never_busy).load == []        # nothing loaded to evict yet


def test_lru_eviction_makes_room_and_the_load_waits_for_the_exit():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 30 * MIB)
    loaded(p, clock, "b", 30 * MIB)
    loaded(p, clock, "c", 30 * MIB)
    p.use("a")                  # b is now the least recently used
    clock.t += 1
    p.request("d")
    plan = p.plan(never_busy)
    assert plan.load == [] and plan.evict == ["b"]
    p.set_state("b", Residence.LEAVING)
    assert p.charged() == 90 * MIB              # its workers still live
    again = p.plan(never_busy)
    assert again.load == [] and again.evict == []   # room is coming: no second victim
    p.set_state("b", Residence.OUT)
    assert p.plan(never_busy).load == ["d"]


def test_busy_models_and_loading_ones_are_never_evicted():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 40 * MIB)
    loaded(p, clock, "b", 40 * MIB)
    p.request("d")
    assert p.plan(lambda n: n == "a").evict == ["b"]         # a is older, but busy
    assert p.plan(lambda n: n in "ab").evict == []           # nothing may go: d waits
    p, clock = policy(budget=130 * MIB)
    loaded(p, clock, "c", 40 * MIB)
    p.set_state("c", Residence.LEAVING)
    p.set_state("c", Residence.OUT)
    p.request("c")
    p.set_state("c", Residence.LOADING)                      # the oldest, but loading
    loaded(p, clock, "a", 40 * MIB)
    loaded(p, clock, "b", 40 * MIB)
    p.request("d")                                           # 10 free, 40 needed
    assert p.plan(lambda n: n == "a").evict == ["b"]


def test_nothing_is_evicted_when_even_every_candidate_would_not_make_room():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 30 * MIB)
    loaded(p, clock, "big", 90 * MIB)       # over the budget together: measured after
    loaded(p, clock, "b", 30 * MIB)
    p.add("huge")
    p.models["huge"].size = 95 * MIB
    p.request("huge")
    # a and b are idle but 60 MiB do not make room for 95 while big (busy) stays
    assert p.plan(lambda n: n == "big").evict == []


def test_a_model_larger_than_the_budget_is_refused():
    p, clock = policy(budget=100 * MIB)
    p.add("whale")
    p.models["whale"].size = 200 * MIB
    reason = p.request("whale")
    assert "needs about 200.0 MiB" in reason and "--model-memory-budget of 100.0 MiB" in reason
    assert p.queue == []


def test_an_unmeasured_guess_never_keeps_a_model_out():
    p, _ = policy(budget=64 * MIB, default_estimate=128 * MIB)
    p.request("a")
    assert p.estimate("a") == p.limit == int(64 * MIB * ADMIT_SHARE)
    assert p.plan(never_busy).load == ["a"]


def test_loads_leave_a_share_of_the_budget_for_growth():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 50 * MIB)
    p.add("b")
    p.models["b"].size = 46 * MIB               # 96 > 95: a must go first
    p.request("b")
    assert p.plan(never_busy).evict == ["a"]
    p.models["b"].size = 45 * MIB
    assert p.plan(never_busy).load == ["b"]


def test_head_of_line_waits_and_blocks_the_rest():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 60 * MIB)
    p.add("big")
    p.models["big"].size = 70 * MIB
    p.add("small")
    p.models["small"].size = 10 * MIB
    p.request("big")
    p.request("small")
    plan = p.plan(lambda n: n == "a")
    assert plan.load == [] and plan.evict == []     # small fits, but big came first


def test_an_ensemble_pins_its_models_and_goes_first():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "pre", 30 * MIB)
    loaded(p, clock, "post", 30 * MIB)
    loaded(p, clock, "ens", 0, instances=0, composing=["pre", "post"])
    loaded(p, clock, "other", 30 * MIB)
    p.request("new")
    # pre and post are the least recently used, but pinned: ens goes, then pre
    assert p.plan(never_busy).evict == ["ens", "pre"]
    assert p.plan(lambda n: n == "ens").evict == ["other"]


def test_idle_models_unload_ensembles_first():
    p, clock = policy(idle=10.0)
    loaded(p, clock, "pre", 30 * MIB)
    loaded(p, clock, "ens", 0, instances=0, composing=["pre"])
    loaded(p, clock, "solo", 30 * MIB)
    clock.t += 5
    p.use("solo")
    assert p.idle(never_busy) == []
    clock.t += 6
    assert p.idle(never_busy) == ["ens", "pre"]
    assert p.idle(lambda n: n == "ens") == []       # pinned by a busy ensemble
    assert p.idle_due() == 1.0                      # overdue but pinned: look again soon
    for n in ("ens", "pre"):
        p.set_state(n, Residence.LEAVING)
    assert p.idle_due() == pytest.approx(4.0)       # solo's turn


def test_a_failed_load_fails_fast_then_is_tried_again():
    p, clock = policy()
    p.request("bad")
    p.set_state("bad", Residence.LOADING)
    p.load_failed("bad", "initialize() raised")
    p.set_state("bad", Residence.LEAVING)
    assert p.request("bad") == "initialize() raised"
    clock.t += LOAD_RETRY_S
    assert p.request("bad") == "" and p.queue == ["bad"]


def test_charges_follow_the_load():
    p, clock = policy(budget=1 << 40, default_estimate=50 * MIB)
    p.request("a")
    p.set_state("a", Residence.LOADING)
    p.measured("a", 5 * MIB)             # while loading: ignored, the reserve stays
    assert p.charged() == 50 * MIB
    p.set_state("a", Residence.IN)
    assert p.charged() == 50 * MIB       # until the first reading
    p.measured("a", 20 * MIB)
    assert p.charged() == 20 * MIB and p.models["a"].size == 20 * MIB
    p.set_state("a", Residence.LEAVING)
    assert p.charged() == 20 * MIB
    p.set_state("a", Residence.OUT)
    assert p.charged() == 0 and p.models["a"].loads == 1


def test_measure_soon_after_the_load_then_the_stalest_first():
    p, clock = policy()
    for n in "ab":                  # both loaded now, read at once: a second reading soon
        p.request(n)
        p.set_state(n, Residence.LOADING)
        p.set_state(n, Residence.IN)
        p.measured(n, MIB)
    assert p.measure_due() == pytest.approx(SECOND_READING_S)
    clock.t += SECOND_READING_S
    assert p.to_measure(8) == ["a", "b"]
    p.measured("a", 2 * MIB)
    p.measured("b", 2 * MIB)
    assert p.measure_due() == pytest.approx(MEASURE_INTERVAL_S) and p.to_measure(8) == []
    clock.t += 1
    p.measured("b", 2 * MIB)
    clock.t += MEASURE_INTERVAL_S - 1
    assert p.to_measure(8) == ["a"]
    clock.t += 1
    assert p.to_measure(8) == ["a", "b"] and p.to_measure(1) == ["a"]
    assert p.charged() == 4 * MIB and p.models["a"].size == 2 * MIB


def test_wait_histogram():
    p, _ = policy()
    p.waited(0.0005)
    p.waited(2.0)
    p.waited(1e6)
    assert p.wait_counts[0] == 1 and p.wait_counts[-1] == 1 and sum(p.wait_counts) == 3
    assert p.wait_sum_us == pytest.approx(500 + 2e6 + 1e12)


# ---- in the core ------------------------------------------------------------------------------------
@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    for name in ("a", "b", "c", "d"):
        write_model(r, name, f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "pair", f"max_batch_size: 8\n{IO}\n{TWO}")
    write_model(r, "pre", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_ensemble(r, "ens", [("pre", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})])
    return r


def on_demand(repo, **kw) -> Harness:
    kw.setdefault("model_load_wait_secs", 30.0)
    return Harness(repo, model_control_mode="on_demand", **kw).start()


def spawned(h, model):
    return [s for s in h.spawn_ids(model) if s not in h.port.reaped]


def serve(h, model, mib=30):
    """Every worker of ``model`` that is loading says it is ready, measuring ``mib``."""
    for sid in spawned(h, model):
        h.port.memory_bytes[sid] = mib * MIB
        if sid not in h.port.connected:
            h.ready(sid)


def stopped_exit(h):
    """Workers told to stop exit."""
    for sid, msg, _ in list(h.port.to_worker):
        if isinstance(msg, Shutdown) and sid not in h.port.reaped:
            h.die(sid, 0)


def test_every_model_is_listed_and_the_first_request_loads_it(repo):
    h = on_demand(repo)
    assert h.port.spawned == {}
    info = {m.name: m for m in h.table().models}
    assert info["a"].on_demand and info["a"].config
    assert h.states("a") == {1: (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)}
    rid = h.submit("a")
    assert h.results() == {} and len(spawned(h, "a")) == 1
    assert h.states("a")[1][0] == ModelState.LOADING
    serve(h, "a")
    assert h.states("a")[1][0] == ModelState.READY
    assert h.sent_to(spawned(h, "a")[0]) == [[rid]]
    h.finish(spawned(h, "a")[0])
    st = h.core.statistics(StatsQuery(0, 1)).on_demand
    assert [(m.name, m.loads, m.memory_bytes) for m in st.models] == [("a", 1, 30 * MIB)]
    assert sum(st.wait_counts) == 1


def test_concurrent_first_requests_trigger_one_load(repo):
    h = on_demand(repo)
    rids = [h.submit("pair") for _ in range(5)]
    assert len(spawned(h, "pair")) == 2            # one load: its two instances
    serve(h, "pair")
    for _ in range(2):                              # one request at a time per instance
        for sid in spawned(h, "pair"):
            h.finish(sid)
    sent = [r for sid in spawned(h, "pair") for b in h.sent_to(sid) for r in b]
    assert sorted(sent) == rids


def test_a_failed_load_answers_its_requests_and_fails_fast_for_a_while(repo):
    h = on_demand(repo)
    r1, r2 = h.submit("a"), h.submit("a")
    h.load_failed(spawned(h, "a")[0], "initialize() raised ValueError")
    h.kill_reported()
    for rid in (r1, r2):
        res = h.results()[rid]
        assert res.code is ErrorCode.INVALID_ARG
        assert res.error == "load failed for model 'a': initialize() raised ValueError"
    assert h.states("a")[1][2] == StateCause.LOAD_FAILED
    r3 = h.submit("a")
    assert "initialize() raised ValueError" in h.results()[r3].error
    assert len(h.spawn_ids("a")) == 1              # not tried again yet
    h.clock.advance(LOAD_RETRY_S)
    h.submit("a")
    assert len(h.spawn_ids("a")) == 2              # now it is
    rid = h.submit("b")                            # and the others load meanwhile
    serve(h, "b")
    assert h.sent_to(spawned(h, "b")[0]) == [[rid]]


def test_a_load_that_takes_too_long_answers_still_loading(repo):
    h = on_demand(repo, model_load_wait_secs=5.0)
    rid = h.submit("a")
    h.tick(4.9)
    assert rid not in h.results()
    h.tick(0.2)
    res = h.results()[rid]
    assert res.code is ErrorCode.UNAVAILABLE
    assert "model 'a' is still loading after 5 s" in res.error and "has not finished" in res.error
    serve(h, "a")                       # it still loads, for the next request
    rid2 = h.submit("a")
    assert h.sent_to(spawned(h, "a")[0]) == [[rid2]]


def test_a_held_request_can_be_cancelled(repo):
    from shmserve.ipc.messages.to_scheduler import CancelRequest
    h = on_demand(repo)
    rid = h.submit("a")
    h.core.handle(CancelRequest(0, rid))
    assert h.results()[rid].code is ErrorCode.CANCELLED
    serve(h, "a")
    assert h.batches() == []


def test_the_budget_evicts_the_least_recently_used_idle_model(repo):
    h = on_demand(repo, model_memory_budget=100 * MIB)
    for name in ("a", "b"):
        h.submit(name)
        serve(h, name, mib=40)
        h.finish(spawned(h, name)[0])
        h.clock.advance(1)
    h.submit("a")                       # a is used again: b is the least recently used
    h.finish(spawned(h, "a")[0])
    h.clock.advance(1)
    rid = h.submit("c")
    assert spawned(h, "c") == []        # 40 + 40 + 40 > 100: b must go first
    b = spawned(h, "b")[0]
    assert (b, Shutdown()) in [(s, m) for s, m, _ in h.port.to_worker]
    assert h.states("b")[1] == (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
    assert spawned(h, "c") == []        # its memory counts until its worker has exited
    stopped_exit(h)
    serve(h, "c", mib=40)
    assert h.sent_to(spawned(h, "c")[0]) == [[rid]]
    st = {m.name: m for m in h.core.statistics(StatsQuery(0, 1)).on_demand.models}
    assert st["b"].evictions == 1 and st["b"].memory_bytes == 0 and st["a"].evictions == 0


def test_a_busy_model_is_never_evicted(repo):
    h = on_demand(repo, model_memory_budget=100 * MIB, model_load_wait_secs=10.0)
    for name in ("a", "b"):
        h.submit(name)
        serve(h, name, mib=40)
        h.clock.advance(1)
    # both still execute their request: c waits, nothing is unloaded
    rid = h.submit("c")
    h.tick(1)
    assert spawned(h, "c") == [] and h.to_worker(Shutdown) == []
    h.finish(spawned(h, "b")[0])        # b is done: it may go now
    h.tick(0)
    assert [s for s, _ in h.to_worker(Shutdown)] == spawned(h, "b")
    stopped_exit(h)
    serve(h, "c", mib=40)
    assert h.sent_to(spawned(h, "c")[0]) == [[rid]]


def test_a_load_waiting_for_room_past_the_wait_is_given_up(repo):
    h = on_demand(repo, model_memory_budget=100 * MIB, model_load_wait_secs=5.0)
    for name in ("a", "b"):
        h.submit(name)
        serve(h, name, mib=40)
    rid = h.submit("c")
    h.tick(5.1)
    res = h.results()[rid]
    assert res.code is ErrorCode.UNAVAILABLE and "waits for room under the " \
        "--model-memory-budget of 100.0 MiB" in res.error
    assert h.core.on_demand.policy.queue == []      # nobody waits for it any more
    for name in ("a", "b"):
        h.finish(spawned(h, name)[0])
    h.tick(1)
    assert spawned(h, "c") == [] and h.to_worker(Shutdown) == []


def test_idle_models_unload(repo):
    h = on_demand(repo, model_idle_unload_secs=10.0)
    h.submit("a")
    serve(h, "a")
    sid = spawned(h, "a")[0]
    h.tick(20)
    assert h.to_worker(Shutdown) == []         # executing: not idle
    h.finish(sid)
    h.tick(9)
    assert h.to_worker(Shutdown) == []
    h.tick(1.1)
    assert h.to_worker(Shutdown) == [(sid, Shutdown())]
    stopped_exit(h)
    assert h.core.on_demand.policy.models["a"].state == Residence.OUT
    h.submit("a")                               # and loads again
    assert len(spawned(h, "a")) == 1


def test_an_ensemble_loads_its_models_and_keeps_them(repo):
    h = on_demand(repo, model_memory_budget=70 * MIB, model_idle_unload_secs=10.0)
    from fakes import tensor_payload
    rid = h.submit("ens", payload=tensor_payload({"IN": b"\0" * 16}))
    assert h.states("ens")[1][0] == ModelState.LOADING
    serve(h, "pre", mib=40)
    assert h.states("ens")[1][0] == ModelState.READY
    pre = spawned(h, "pre")[0]
    [(step, _)] = h.steps_of(pre)
    h.answer(pre)
    assert h.results()[rid].error == ""
    h.submit("a")                   # 40 + 40 > 70: ens goes first, then pre
    assert h.to_worker(Shutdown) == [(pre, Shutdown())]
    assert h.states("ens")[1] == (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
    stopped_exit(h)
    serve(h, "a", mib=40)
    assert h.batches(spawned(h, "a")[0])


def test_the_load_api_loads_within_the_budget(repo):
    h = on_demand(repo, model_memory_budget=50 * MIB)
    h.submit("a")
    serve(h, "a", mib=40)
    h.finish(spawned(h, "a")[0])
    h.core.handle(ControlRequest(0, 7, ControlAction.LOAD, "b"))
    assert spawned(h, "b") == [] and [s for s, _ in h.to_worker(Shutdown)] == spawned(h, "a")
    stopped_exit(h)
    serve(h, "b", mib=40)
    assert ControlReply(7) in h.replies()
    h.core.handle(ControlRequest(0, 8, ControlAction.UNLOAD, "b"))
    assert ControlReply(8) in h.replies()
    assert h.states("b")[1][2] == StateCause.UNLOADED


def test_batches_of_loaded_models_go_straight_through(repo):
    h = on_demand(repo)
    h.submit("a")
    serve(h, "a")
    sid = spawned(h, "a")[0]
    h.finish(sid)
    rid = h.submit("a")
    assert isinstance(h.last_batch(sid), ExecuteBatch) and h.sent_to(sid)[-1] == [rid]


def test_evictions_for_several_waiting_loads_overlap():
    p, clock = policy(budget=100 * MIB)
    for n in "abc":
        loaded(p, clock, n, 30 * MIB)
    p.request("d")
    p.request("e")
    plan = p.plan(never_busy)
    assert plan.load == [] and plan.evict == ["a", "b"]     # room for d and for e at once
    for n in plan.evict:
        p.set_state(n, Residence.LEAVING)
    assert p.plan(never_busy).evict == []
    p.set_state("a", Residence.OUT)
    assert p.plan(never_busy).load == ["d"]


def test_what_the_head_lacks_when_nothing_may_go():
    p, clock = policy(budget=100 * MIB)
    loaded(p, clock, "a", 60 * MIB)
    p.request("b")
    p.models["b"].size = 50 * MIB
    plan = p.plan(lambda n: n == "a")
    assert plan.evict == [] and plan.short == 15 * MIB      # 95 - 60 = 35 free, 50 needed
    assert p.victims(plan.short, never_busy, at_least=plan.short) == ["a"]


def test_a_leased_model_is_taken_back_then_evicted(repo):
    from shmserve.ipc.messages.to_frontend import LeaseGranted
    from shmserve.ipc.messages.to_scheduler import LeaseEnded
    from shmserve.ipc.messages.to_worker import RevokeLease
    h = on_demand(repo, model_memory_budget=50 * MIB, instance_leases=True)
    h.submit("a")
    serve(h, "a", mib=40)
    sid = spawned(h, "a")[0]
    h.finish(sid)           # idle with nothing queued: lent to the frontend
    [grant] = [m for _, m in h.port.to_frontend if isinstance(m, LeaseGranted)]
    h.submit("b")
    # a might be running requests sent under its lease: taken back first, not unloaded yet
    assert h.to_worker(RevokeLease) == [(sid, RevokeLease(grant.lease_id))]
    assert h.to_worker(Shutdown) == []
    h.core.handle(LeaseEnded(sid, grant.lease_id))      # the worker is done with them
    assert h.to_worker(Shutdown) == [(sid, Shutdown())]
    stopped_exit(h)
    assert len(spawned(h, "b")) == 1


def test_the_load_api_reloads_a_loaded_model(repo):
    h = on_demand(repo)
    h.submit("a")
    serve(h, "a")
    old = spawned(h, "a")[0]
    h.finish(old)
    h.core.handle(ControlRequest(0, 9, ControlAction.LOAD, "a"))
    new = [s for s in spawned(h, "a") if s != old]
    assert len(new) == 1                        # a new version loads beside the old one
    serve(h, "a")
    assert ControlReply(9) in h.replies()
    assert h.to_worker(Shutdown) == [(old, Shutdown())]
    assert h.core.on_demand.policy.models["a"].state == Residence.IN


def test_command_line():
    from shmserve.engine.launch.cli import parse_settings
    s, _ = parse_settings(["--model-repository", "r", "--model-control-mode", "on_demand",
                           "--model-memory-budget", "4G", "--model-idle-unload-secs", "30",
                           "--model-load-wait-secs", "10"])
    assert (s.model_control_mode, s.model_memory_budget, s.model_idle_unload_secs,
            s.model_load_wait_secs) == ("on_demand", 4 << 30, 30.0, 10.0)
    s, _ = parse_settings(["--model-repository", "r", "--model-control-mode", "on_demand"])
    assert (s.model_memory_budget, s.model_idle_unload_secs, s.model_load_wait_secs) == \
        (0, 0.0, 120.0)
    for bad in (["--model-memory-budget", "4G"],                     # not on demand
                ["--model-control-mode", "on_demand", "--model-memory-budget", "lots"],
                ["--model-control-mode", "on_demand", "--model-load-wait-secs", "0"],
                ["--model-control-mode", "on_demand", "--model-idle-unload-secs", "-1"]):
        with pytest.raises(SystemExit):
            parse_settings(["--model-repository", "r", *bad])
