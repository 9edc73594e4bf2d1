"""Nested ensembles (a step whose model is itself an ensemble) in SchedulerCore, in-process: the
inner ensemble runs as the outer one's step, its answer comes back to the outer run, every
slot goes back to its worker exactly once, errors and cancels cross both levels, statistics
count both, and unloading a model retires every ensemble above it."""
import pytest
from fakes import IO, ONE, Harness, tensor_payload, write_ensemble, write_model

from shmserve.ipc import channel
from shmserve.ipc.messages.common import (
    ENSEMBLE_FRONTEND,
    ControlAction,
    ErrorCode,
    ModelState,
    ShmRef,
    Tensor,
)
from shmserve.ipc.messages.to_scheduler import CancelRequest, ControlRequest, StatsQuery
from shmserve.ipc.messages.to_worker import ReleaseOutputs

SCHEDULER = channel.scheduler_worker_address("")
CLIENT_IN = ShmRef("client-in", 0, 16)


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    for name in ("a", "b", "c"):
        write_model(r, name, f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "gen", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                          f"model_transaction_policy {{ decoupled: true }}")
    # E: IN -> a -> mid -> b -> OUT
    write_ensemble(r, "E", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    # N: IN -> E -> inner -> c -> OUT (E is its first step)
    write_ensemble(r, "N", [("E", {"IN": "IN"}, {"OUT": "inner"}),
                            ("c", {"INPUT0": "inner"}, {"OUTPUT0": "OUT"})])
    # W: E's answer is W's answer
    write_ensemble(r, "W", [("E", {"IN": "IN"}, {"OUT": "OUT"})])
    # S streams (gen is decoupled); NS nests it
    write_ensemble(r, "S", [("gen", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    write_ensemble(r, "NS", [("S", {"IN": "IN"}, {"OUT": "inner"}),
                             ("c", {"INPUT0": "inner"}, {"OUTPUT0": "OUT"})])
    return r


def sid_of(h, model):
    (sid,) = [s for s in h.spawn_ids(model) if s not in h.port.reaped]
    return sid


def run(h, model):
    return h.submit(model, payload=tensor_payload({"IN": CLIENT_IN}, ("OUT",)))


def released(h, sid=None):
    return [ref for s, m in h.to_worker(ReleaseOutputs) if sid is None or s == sid
            for ref in m.refs]


def stats(h, model):
    return h.core.statistics(StatsQuery(0, 1, model)).models[0]


def test_a_nested_ensemble_loads_after_its_inner_one_and_runs_through_it(repo):
    h = Harness(repo).start()
    assert h.states("N")[1][0] is ModelState.READY and h.spawn_ids("N") == []
    a, b, c = sid_of(h, "a"), sid_of(h, "b"), sid_of(h, "c")
    rid = run(h, "N")
    ((_, pa),) = h.steps_of(a)
    assert pa.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, CLIENT_IN)]
    assert pa.chain == ["N", "E"]           # both ensembles are on the way to the step
    mid = h.answer(a)[0].outputs[0].shm
    inner = h.answer(b)[0].outputs[0].shm
    ((_, pc),) = h.steps_of(c)              # E answered N: c reads b's slot, by reference
    assert pc.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, inner)]
    assert released(h) == [mid]             # E ended: its intermediate went back to a
    out = h.answer(c)[0].outputs[0].shm
    (final,) = h.answers(rid)
    assert final.error == "" and [t.shm for t in final.outputs] == [out]
    assert final.worker == SCHEDULER and final.final
    assert released(h, b) == [inner]        # N ended: E's answer went back to b, once
    h.core.handle(ReleaseOutputs([out]))    # the client's frontend is done with the answer
    assert released(h, c) == [out] and released(h) == [mid, inner, out]


def test_the_inner_ensembles_answer_can_be_the_outer_ones(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = run(h, "W")
    mid = h.answer(a)[0].outputs[0].shm
    out = h.answer(b)[0].outputs[0].shm
    (final,) = h.answers(rid)
    assert [t.shm for t in final.outputs] == [out] and final.worker == SCHEDULER
    assert released(h) == [mid]             # b's slot is the client's now
    h.core.handle(ReleaseOutputs([out]))
    assert released(h, b) == [out]
    h.core.handle(ReleaseOutputs([out]))    # a second release changes nothing
    assert released(h) == [mid, out]


def test_statistics_count_both_levels_and_the_outer_sums_the_inner_steps(repo):
    h = Harness(repo).start()
    rid = run(h, "N")
    h.answer(sid_of(h, "a"), times=(1, 2, 3))
    h.answer(sid_of(h, "b"), times=(10, 20, 30))
    h.answer(sid_of(h, "c"), times=(100, 200, 300))
    assert h.results()[rid].error == ""
    n, e = stats(h, "N"), stats(h, "E")
    assert (n.inference_count, n.success.count, e.inference_count, e.success.count) == (1, 1, 1, 1)
    assert (e.compute_input.ns, e.compute_infer.ns, e.compute_output.ns) == (11, 22, 33)
    assert (n.compute_input.ns, n.compute_infer.ns, n.compute_output.ns) == (111, 222, 333)
    assert [stats(h, m).inference_count for m in "abc"] == [1, 1, 1]


def test_an_inner_steps_error_fails_both_naming_both(repo):
    h = Harness(repo).start()
    rid = run(h, "N")
    mid = h.answer(sid_of(h, "a"))[0].outputs[0].shm
    h.answer(sid_of(h, "b"), error="bad")
    res = h.results()[rid]
    assert res.error == ("in ensemble 'N', step 0 (model 'E'): in ensemble 'E', step 1 "
                         "(model 'b'): bad")
    assert h.batches(sid_of(h, "c")) == []
    assert released(h) == [mid]
    # each ensemble: its failed step's request, then its own request (as in Triton)
    assert stats(h, "N").failures["OTHER"] == 2 and stats(h, "E").failures["OTHER"] == 2


def test_a_client_cancel_reaches_the_inner_ensembles_step(repo):
    h = Harness(repo).start()
    a = sid_of(h, "a")
    rid = run(h, "N")
    ((step, _),) = h.steps_of(a)
    h.core.handle(CancelRequest(0, rid))
    assert h.results()[rid].code is ErrorCode.CANCELLED
    assert [(s, m) for s, m in h.to_worker(CancelRequest)] == \
        [(a, CancelRequest(ENSEMBLE_FRONTEND, step))]
    (late,) = h.answer(a)                   # its answer comes anyway: its slot goes back
    assert released(h, a) == [late.outputs[0].shm]
    assert h.batches(sid_of(h, "b")) == [] and len(h.answers(rid)) == 1


def test_a_nested_streaming_ensemble_streams_the_outer_one(repo):
    h = Harness(repo).start()
    assert h.core.lifecycle.entries["NS"].config.model_transaction_policy.decoupled
    g, b, c = sid_of(h, "gen"), sid_of(h, "b"), sid_of(h, "c")
    rid = run(h, "NS")
    ((gen_step, _),) = h.steps_of(g)
    outs = []
    for _ in range(2):                      # two responses: each runs b, then c
        h.respond(g, gen_step)
        h.answer(b)
        outs.append(h.answer(c)[0].outputs[0].shm)
    h.respond(g, gen_step, final=True, no_response=True)
    h.finish(g)
    answers = h.answers(rid)
    assert [(r.final, [t.shm for t in r.outputs]) for r in answers[:2]] == \
        [(False, [o]) for o in outs]
    assert answers[-1].final and answers[-1].no_response and len(answers) == 3
    h.core.handle(ReleaseOutputs(outs))
    assert released(h, c) == outs


def test_unloading_a_model_retires_every_ensemble_above_it(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["N"]).start()
    assert h.states("N")[1][0] is ModelState.READY and h.states("E")[1][0] is ModelState.READY
    h.core.handle(ControlRequest(0, 100, ControlAction.UNLOAD, "b"))
    assert h.states("E")[1][:2] == (ModelState.UNAVAILABLE,
                                    "ensemble 'E' contains models that are not available: b")
    assert h.states("N")[1][:2] == (ModelState.UNAVAILABLE,
                                    "ensemble 'N' contains models that are not available: E")
    rid = run(h, "N")
    assert h.answers(rid)[0].code == ErrorCode.UNAVAILABLE


def test_an_ensemble_cannot_be_its_own_step_through_another(repo):
    # X -> Y -> X: neither is ever ready for the other to bind against
    write_ensemble(repo, "X", [("Y", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "Y", [("X", {"IN": "IN"}, {"OUT": "OUT"})])
    h = Harness(repo).start()
    reasons = {}
    for name in ("X", "Y"):
        state, reasons[name], _ = h.states(name)[1]
        assert state is ModelState.UNAVAILABLE
    # the first found waits for itself; the other then depends on a model that failed
    assert sorted(reasons.values()) == [
        "ensemble 'X' has a cycle of nested ensembles: X -> Y -> X",
        "ensemble 'Y' depends on 'X', which has no ready version"] or \
        sorted(reasons.values()) == [
        "ensemble 'X' depends on 'Y', which has no ready version",
        "ensemble 'Y' has a cycle of nested ensembles: Y -> X -> Y"]
    assert h.states("N")[1][0] is ModelState.READY      # the others load as ever


def test_an_explicit_load_of_a_cycle_fails_and_answers(repo):
    write_ensemble(repo, "X", [("Y", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "Y", [("X", {"IN": "IN"}, {"OUT": "OUT"})])
    h = Harness(repo, model_control_mode="explicit").start()
    h.core.handle(ControlRequest(0, 100, ControlAction.LOAD, "X"))
    (reply,) = h.replies()
    assert "cycle of nested ensembles" in reply.error or "depends on" in reply.error
    assert h.states("X")[1][0] is ModelState.UNAVAILABLE
    assert h.states("Y")[1][0] is ModelState.UNAVAILABLE
