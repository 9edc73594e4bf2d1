"""engine/ensemble/step_costs.py: an ensemble whose steps could run side by side runs worker to
worker only while what it loses (their overlap) is less than what the hops save, judged from
its steps' statistics."""
from test_ensemble_plan import diamond_plan

from shmserve.engine.ensemble.step_costs import (
    MIN_REQUESTS,
    SAVED_PER_STEP_NS,
    EnsembleCosts,
    serial_ok,
)


def test_the_line_with_room_to_waver():
    saved = SAVED_PER_STEP_NS * 3
    assert serial_ok(False, saved - 1, 3) and not serial_ok(False, saved, 3)
    # once on, off only past twice the line
    assert serial_ok(True, saved * 1.5, 3) and not serial_ok(True, saved * 2, 3)


def test_a_step_s_cost_is_its_mean_since_the_last_look_over_enough_requests():
    c = EnsembleCosts()
    key = ("m", 1)
    assert c.cost(key, 3, 3_000) is None                      # too few to say
    assert c.cost(key, MIN_REQUESTS, 8 * 1_000) == 1_000      # from the start, once enough
    assert c.cost(key, MIN_REQUESTS + 2, 8 * 1_000 + 2 * 90_000) == 1_000    # too few new
    # the requests since the last look (not since the load): it turned slow
    assert c.cost(key, 2 * MIN_REQUESTS, 8 * 1_000 + 8 * 50_000) == 50_000
    # a reload's statistics start again from zero
    assert c.cost(key, 2, 200) is None


def _stats(costs_ns: dict[str, float], n: int = 50):
    return lambda model, version: (n, int(costs_ns[model] * n))


def test_light_steps_run_worker_to_worker_heavy_branches_side_by_side():
    p = diamond_plan()                          # a and b side by side, then c
    serving = lambda model, version: 1          # noqa: E731
    c = EnsembleCosts()
    # nothing known yet: the scheduler runs it
    assert not c.review([p], lambda m, v: (0, 0), serving) and p.chained() == []
    # python steps of ~60 µs: the overlap lost (60 µs) is less than 3 steps' hops
    assert c.review([p], _stats({"a": 60e3, "b": 60e3, "c": 60e3}), serving)
    assert p.serial_ok and [s.model for s in p.chained()] == ["a", "b", "c"]
    assert not c.review([p], _stats({"a": 60e3, "b": 60e3, "c": 60e3}, 100), serving)
    # the branches turn heavy (two networks, 5 ms each): side by side again
    assert c.review([p], _stats({"a": 5e6, "b": 5e6, "c": 60e3}, 200), serving)
    assert not p.serial_ok and p.chained() == []
    # a step with no version serving: nothing is known, it stays with the scheduler
    assert not c.review([p], _stats({"a": 1e3, "b": 1e3, "c": 1e3}, 300), lambda m, v: None)
    assert p.chained() == []


def test_it_forgets_the_versions_no_ensemble_runs_on():
    p = diamond_plan()
    c = EnsembleCosts()
    c.review([p], _stats({"a": 60e3, "b": 60e3, "c": 60e3}), lambda m, v: 1)
    assert set(c.seen) == {("a", 1), ("b", 1), ("c", 1)}
    c.review([p], _stats({"a": 60e3, "b": 60e3, "c": 60e3}, 100), lambda m, v: 2)   # reloaded
    assert set(c.seen) == {("a", 2), ("b", 2), ("c", 2)} and set(c.mean_ns) <= set(c.seen)
    c.review([], _stats({}), lambda m, v: 2)                    # the ensemble is gone
    assert not c.seen and not c.mean_ns
