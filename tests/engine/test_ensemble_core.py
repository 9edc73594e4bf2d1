"""Ensembles in SchedulerCore and its EnsembleRunner, driven in-process (tests/engine/fakes.py):
loading after the composing models, steps as the scheduler's own requests, tensors passed by
shared-memory reference, slots given back, errors, cancellation, worker deaths, decoupled steps,
statistics, explicit load and unload. No sockets, no processes, no sleeping."""
import pytest
from fakes import FRONTEND, IO, ONE, Harness, tensor_payload, write_ensemble, write_model

from shmserve.ipc import channel
from shmserve.ipc.messages.common import (
    ENSEMBLE_FRONTEND,
    ControlAction,
    ErrorCode,
    ModelState,
    OutputSpec,
    ShmRef,
    StateCause,
    Tensor,
)
from shmserve.ipc.messages.to_frontend import InferResult, LeaseGranted
from shmserve.ipc.messages.to_scheduler import (
    CancelRequest,
    ControlRequest,
    FrontendHello,
    LeaseEnded,
    StatsQuery,
    SubmitRequest,
)
from shmserve.ipc.messages.to_worker import ReleaseOutputs

SCHEDULER = channel.scheduler_worker_address("")      # the Harness's run_dir is ""
CLIENT_IN = ShmRef("client-in", 0, 16)

CHAIN = [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),       # E: IN -> a -> mid -> b -> OUT
         ("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})]
FORK = [("a", {"INPUT0": "IN"}, {"OUTPUT0": "X"}),          # P: IN -> a -> X, IN -> b -> Y
        ("b", {"INPUT0": "IN"}, {"OUTPUT0": "Y"})]


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    for name in ("a", "b", "c"):
        write_model(r, name, f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "frail", f'max_batch_size: 8\n{IO}\n{ONE}\nparameters {{ key: '
                            f'"retry_on_worker_death" value {{ string_value: "false" }} }}')
    write_model(r, "gen", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                          f"model_transaction_policy {{ decoupled: true }}")
    write_ensemble(r, "E", CHAIN)
    write_ensemble(r, "P", FORK, outputs=("X", "Y"))
    write_ensemble(r, "F", [("frail", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})])
    write_ensemble(r, "S", [("gen", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),      # streams
                            ("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    return r


def sid_of(h, model):
    sids = [s for s in h.spawn_ids(model) if s not in h.port.reaped]
    assert len(sids) == 1, sids
    return sids[0]


def stats(h, model):
    return h.core.statistics(StatsQuery(0, 1, model)).models[0]


def run(h, model="E", outputs=("OUT",), **kw):
    """A client's request for ``model`` with its input in a shared-memory region."""
    return h.submit(model, payload=tensor_payload({"IN": CLIENT_IN}, outputs, **kw))


def released(h, sid=None):
    """The refs given back to workers (to ``sid`` only, when given), in order."""
    return [ref for s, m in h.to_worker(ReleaseOutputs) if sid is None or s == sid
            for ref in m.refs]


def cancels(h):
    return [(s, m) for s, m in h.to_worker(CancelRequest)]


def control(h, action, name, dependents=False):
    h.core.handle(ControlRequest(0, len(h.replies()) + 100, action, name,
                                 unload_dependents=dependents))


# ---- loading ---------------------------------------------------------------------------------------
def test_an_ensemble_is_ready_only_after_its_composing_models(repo):
    h = Harness(repo).start(ready=False)
    assert h.states("E")[1][0] is ModelState.LOADING
    assert h.spawn_ids("E") == []                   # it has no instances of its own
    h.ready(sid_of(h, "a"))
    assert h.states("a")[1][0] is ModelState.READY
    assert h.states("E")[1][0] is ModelState.LOADING     # b still loads
    h.ready(sid_of(h, "b"))
    assert h.states("E")[1] == (ModelState.READY, "", StateCause.NONE)
    assert h.states("P")[1][0] is ModelState.READY
    assert h.states("S")[1][0] is ModelState.LOADING     # gen still loads
    h.ready_all()
    assert h.states("S")[1][0] is ModelState.READY and h.core.lifecycle.startup_done


def test_an_ensemble_fails_when_a_composing_model_fails(repo):
    h = Harness(repo).start(ready=False)
    h.load_failed(sid_of(h, "b"), "ImportError: no module named nope")
    assert h.states("E")[1][0] is ModelState.LOADING     # a still loads
    h.ready_all()
    state, reason, cause = h.states("E")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.LOAD_FAILED
    assert reason == "ensemble 'E' depends on 'b', which has no ready version"
    assert h.states("F")[1][0] is ModelState.READY       # does not use b
    rid = run(h)
    assert h.results()[rid].code is ErrorCode.UNAVAILABLE


def test_an_ensemble_of_a_model_missing_from_the_repository_fails(repo):
    write_ensemble(repo, "G", [("nowhere", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})])
    h = Harness(repo).start()
    assert h.states("G")[1][0] is ModelState.UNAVAILABLE
    assert "depends on 'nowhere', which has no ready version" in h.states("G")[1][1]


def test_a_bad_step_map_fails_the_ensemble_at_load(repo):
    write_ensemble(repo, "G", [("a", {"NOPE": "IN"}, {"OUTPUT0": "OUT"})])
    h = Harness(repo).start()
    state, reason, _ = h.states("G")[1]
    assert state is ModelState.UNAVAILABLE
    assert "step 0 (model 'a') maps 'IN' to input 'NOPE', which the model does not have" in reason


# ---- a request, step by step -------------------------------------------------------------------------
def test_a_request_runs_step_after_step_by_reference(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = run(h, request_id="r-7", parameters={"p": 1}, correlation_id=0)
    (s, batch, payloads), = h.batches()              # step 0 only: b waits for mid
    assert s == a and [(r.frontend) for r in batch.routes] == [ENSEMBLE_FRONTEND]
    ((step0, p0),) = h.steps_of(a)
    assert p0.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, CLIENT_IN)]    # renamed, by ref
    assert p0.outputs == [OutputSpec("OUTPUT0")]
    assert p0.chain == ["E"] and p0.request_id == "r-7" and p0.parameters == {"p": 1}
    (res0,) = h.answer(a)
    mid = res0.outputs[0].shm
    ((step1, p1),) = h.steps_of(b)
    assert step1 != step0
    # the intermediate tensor stays in a's slot: b reads it there, no byte is copied
    assert p1.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, mid)]
    assert p1.outputs == [OutputSpec("OUTPUT0")]
    assert released(h) == []                         # mid is still in use
    (res1,) = h.answer(b)
    out = res1.outputs[0].shm
    (final,) = h.answers(rid)
    assert final == InferResult(rid, "E", 1, [Tensor("OUT", "FP32", [1, 4], None, out)],
                                worker=SCHEDULER, final=True)
    assert released(h) == [mid] and released(h, a) == [mid]     # the request ended
    # the frontend gives the answer's slot back to the scheduler, which owns no slots: it goes
    # to the worker that wrote it, once
    h.core.handle(ReleaseOutputs([out, ShmRef("unknown", 0, 4)]))
    assert released(h, b) == [out]
    h.core.handle(ReleaseOutputs([out]))
    assert released(h) == [mid, out]


def test_inline_inputs_pass_through_unchanged(repo):
    h = Harness(repo).start()
    data = bytes(range(16))
    h.submit("E", payload=tensor_payload({"IN": data}))
    ((_, p0),) = h.steps_of(sid_of(h, "a"))
    assert p0.inputs == [Tensor("INPUT0", "FP32", [1, 4], data)]


def test_a_client_output_region_is_passed_to_the_step_that_writes_it(repo):
    h = Harness(repo).start()
    region = ShmRef("client-out", 64, 16)
    run(h, outputs=[OutputSpec("OUT", region)])
    h.answer(sid_of(h, "a"))
    ((_, p1),) = h.steps_of(sid_of(h, "b"))
    assert p1.outputs == [OutputSpec("OUTPUT0", region)]


def test_independent_steps_are_dispatched_together(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = run(h, "P", outputs=("Y", "X"))
    assert sorted(s for s, _, _ in h.batches()) == sorted([a, b])   # both before any answer
    ((_, pb),) = h.steps_of(b)
    assert pb.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, CLIENT_IN)]
    (y,) = h.answer(b)
    assert h.answers(rid) == []
    (x,) = h.answer(a)
    (final,) = h.answers(rid)
    # in the order the client asked for, named as in the ensemble
    assert [(t.name, t.shm) for t in final.outputs] == [("Y", y.outputs[0].shm),
                                                        ("X", x.outputs[0].shm)]
    assert final.worker == SCHEDULER and released(h) == []   # nothing intermediate
    h.core.handle(ReleaseOutputs([t.shm for t in final.outputs]))
    assert released(h, a) == [x.outputs[0].shm] and released(h, b) == [y.outputs[0].shm]


def test_an_output_nobody_reads_is_not_asked_for(repo):
    write_model(repo, "two", f'''max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{ONE}''')
    write_ensemble(repo, "G", [("two", {"INPUT0": "IN"}, {"OUTPUT0": "OUT", "OUTPUT1": "side"})],
                   outputs=("OUT", "side"))
    h = Harness(repo).start()
    run(h, "G", outputs=("OUT",))                   # side is an output, but not asked for
    ((_, p),) = h.steps_of(sid_of(h, "two"))
    assert p.outputs == [OutputSpec("OUTPUT0")]


def test_ensemble_requests_for_a_composing_model_that_went_away_fail(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["E"]).start()
    rid = run(h)                                    # in flight while b goes away
    control(h, ControlAction.UNLOAD, "b")
    h.tick(0)
    h.answer(sid_of(h, "a"))
    err = h.results()[rid]
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.error == "in ensemble 'E', step 1 (model 'b'): model 'b' has no ready version"
    assert released(h) != []                         # a's output slot went back


# ---- errors and cancellation ---------------------------------------------------------------------------
def test_a_step_error_fails_the_request_and_cancels_the_running_step(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = run(h, "P", outputs=("X", "Y"))
    ((step_b, _),) = h.steps_of(b)
    h.answer(a, error="boom")
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL
    assert err.error == "in ensemble 'P', step 0 (model 'a'): boom"
    assert cancels(h) == [(b, CancelRequest(ENSEMBLE_FRONTEND, step_b))]
    (late,) = h.answer(b)                           # it finished anyway: its slot goes back
    assert released(h, b) == [late.outputs[0].shm]
    assert len(h.answers(rid)) == 1
    # the failed step counts against the ensemble as well as the request itself (Triton's
    # qa L0_model_queue pins two per failed ensemble request)
    assert stats(h, "P").failures["OTHER"] == 2 and stats(h, "P").inference_count == 0
    assert stats(h, "P").fail.count == 2


def test_a_step_error_drops_a_queued_step(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    busy = h.submit("b")                            # b's only instance is busy
    rid = run(h, "P", outputs=("X", "Y"))
    assert [s for s, _, _ in h.batches()] == [b, a]
    h.answer(a, error="boom")
    assert "step 0 (model 'a'): boom" in h.results()[rid].error
    assert cancels(h) == []                         # it was queued: dropped there
    assert stats(h, "b").failures["CANCELED"] == 1
    h.finish(b)
    assert busy not in h.results() and len(h.batches(b)) == 1   # the step never ran


def test_an_error_after_a_step_answered_gives_its_slots_back(repo):
    h = Harness(repo).start()
    rid = run(h)
    (res0,) = h.answer(sid_of(h, "a"))
    h.answer(sid_of(h, "b"), error="bad")
    assert h.results()[rid].error == "in ensemble 'E', step 1 (model 'b'): bad"
    assert released(h, sid_of(h, "a")) == [res0.outputs[0].shm]


def test_a_client_cancel_cancels_the_steps(repo):
    h = Harness(repo).start()
    a = sid_of(h, "a")
    rid = run(h)
    ((step0, _),) = h.steps_of(a)
    h.core.handle(CancelRequest(0, rid))
    err = h.results()[rid]
    assert err.code is ErrorCode.CANCELLED and err.error == "the request was cancelled by the client"
    assert cancels(h) == [(a, CancelRequest(ENSEMBLE_FRONTEND, step0))]
    (late,) = h.answer(a)                           # its answer comes anyway
    assert released(h, a) == [late.outputs[0].shm]
    assert h.batches(sid_of(h, "b")) == []          # nothing after it runs
    assert len(h.answers(rid)) == 1
    assert stats(h, "E").failures["CANCELED"] == 1
    h.core.handle(CancelRequest(0, rid))            # again: nothing more happens
    assert len(cancels(h)) == 1 and len(h.answers(rid)) == 1


def test_a_client_cancel_drops_queued_steps(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    h.submit("a"), h.submit("b")                    # both instances busy
    rid = run(h, "P", outputs=("X", "Y"))
    h.core.handle(CancelRequest(0, rid))
    assert h.results()[rid].code is ErrorCode.CANCELLED and cancels(h) == []
    h.finish(a), h.finish(b)
    assert len(h.batches()) == 2                    # neither step ran


# ---- worker deaths ---------------------------------------------------------------------------------------
def test_a_step_whose_worker_dies_is_retried_once_then_fails_the_request(repo):
    h = Harness(repo).start()
    a = sid_of(h, "a")
    rid = run(h)
    ((step0, _),) = h.steps_of(a)
    h.die(a, rc=-9)                                 # killed from outside: requeued, alone
    h.tick(0)
    (a2,) = h.waiting()
    h.ready(a2)
    ((again, _),) = h.steps_of(a2)
    assert again == step0 and rid not in h.results()
    h.die(a2)                                       # its retry dies too
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL
    assert err.error.startswith("in ensemble 'E', step 0 (model 'a'): the worker process of "
                                "instance 'a_0_0' of model 'a' exited unexpectedly")
    assert "retried alone after an earlier worker death" in err.error
    assert stats(h, "E").failures["OTHER"] == 2 and stats(h, "a").failures["BACKEND"] == 1


def test_a_step_that_crashes_its_worker_alone_fails_the_request_at_once(repo):
    h = Harness(repo).start()
    a = sid_of(h, "a")
    rid = run(h)
    h.die(a)                                        # SIGSEGV while running the step alone
    err = h.results()[rid]
    assert err.error.startswith("in ensemble 'E', step 0 (model 'a'): the worker process of "
                                "instance 'a_0_0' of model 'a' exited unexpectedly (killed by "
                                "SIGSEGV)")
    assert "taken for the cause and not retried" in err.error


def test_a_retried_step_that_succeeds_completes_the_request(repo):
    h = Harness(repo).start()
    rid = run(h)
    h.clock.advance(0.5)                            # step 0 runs 0.5 s, then its worker dies
    h.die(sid_of(h, "a"), rc=-9)
    h.tick(0)
    (a2,) = h.waiting()
    h.ready(a2)
    h.answer(a2)
    h.answer(sid_of(h, "b"))
    assert h.results()[rid].error == "" and [t.name for t in h.results()[rid].outputs] == ["OUT"]
    # its wait before the first run counts once; the run its worker died in is no queue time
    assert stats(h, "E").queue.ns == 0


def test_a_step_of_a_model_without_retries_fails_at_once(repo):
    h = Harness(repo).start()
    rid = run(h, "F")
    h.die(sid_of(h, "frail"), rc=3)
    err = h.results()[rid]
    assert err.error.startswith("in ensemble 'F', step 0 (model 'frail'): the worker process")
    assert "exit code 3" in err.error


def test_a_dead_workers_slots_are_not_given_back(repo):
    """Slots handed to a frontend with an answer die with their worker: a later ReleaseOutputs
    for them goes nowhere."""
    h = Harness(repo).start()
    rid = run(h, "P", outputs=("X", "Y"))
    h.answer(sid_of(h, "a"))
    h.answer(sid_of(h, "b"))
    refs = [t.shm for t in h.results()[rid].outputs]
    h.die(sid_of(h, "a"))
    h.core.handle(ReleaseOutputs(refs))
    assert released(h) == [refs[1]]                 # b's only


# ---- decoupled steps -------------------------------------------------------------------------------------------
def test_a_decoupled_step_streams_through_the_ensemble(repo):
    h = Harness(repo).start()
    g, b = sid_of(h, "gen"), sid_of(h, "b")
    assert h.core.lifecycle.entries["S"].config.model_transaction_policy.decoupled
    rid = run(h, "S")
    ((gen_step, _),) = h.steps_of(g)
    mids = []
    for _ in range(3):                              # three responses, each runs b once
        mids.append(h.respond(g, gen_step).outputs[0].shm)
    h.finish(g)                                     # its execute returned; it still streams
    outs = []
    for mid in mids:
        ((_, p),) = h.steps_of(b)
        assert p.inputs[0].shm == mid
        outs.append(h.answer(b)[0].outputs[0].shm)
    answers = h.answers(rid)
    assert [(r.final, [t.shm for t in r.outputs], r.worker) for r in answers] == \
        [(False, [o], SCHEDULER) for o in outs]
    h.respond(g, gen_step, final=True, no_response=True)    # the stream ends
    last = h.answers(rid)[-1]
    assert len(h.answers(rid)) == 4
    assert last.final and last.no_response and last.outputs == [] and last.error == ""
    assert sorted(released(h, g), key=lambda r: r.offset) == mids   # intermediates go back
    assert stats(h, "S").inference_count == 1


def test_a_decoupled_step_whose_worker_dies_while_streaming_fails_the_request(repo):
    h = Harness(repo).start()
    g = sid_of(h, "gen")
    rid = run(h, "S")
    ((gen_step, _),) = h.steps_of(g)
    h.respond(g, gen_step)
    h.finish(g)
    h.answer(sid_of(h, "b"))
    h.die(g)
    answers = h.answers(rid)
    assert [r.final for r in answers] == [False, True]
    assert answers[-1].code is ErrorCode.INTERNAL
    assert answers[-1].error.startswith("in ensemble 'S', step 0 (model 'gen'): the worker "
                                        "process of instance 'gen_0_0'")
    assert "while sending responses" in answers[-1].error


# ---- statistics -----------------------------------------------------------------------------------------------
def test_statistics_sum_the_steps_queue_and_compute_times(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    h.submit("a")                                   # a is busy: step 0 waits 0.5 s
    rid = run(h)
    h.clock.advance(0.5)
    h.finish(a)
    h.clock.advance(0.25)
    h.answer(a, times=(1, 2, 3))
    h.answer(b, times=(10, 20, 30))
    assert h.results()[rid].error == ""
    st = stats(h, "E")
    assert st.inference_count == 1 and st.execution_count == 1
    assert st.success.count == 1 and st.success.ns == int(0.75e9)
    assert (st.queue.count, st.queue.ns) == (1, int(0.5e9))
    assert (st.compute_input.ns, st.compute_infer.ns, st.compute_output.ns) == (11, 22, 33)
    assert [b.batch_size for b in st.batch_stats] == [1]
    assert sum(st.failures.values()) == 0
    # the composing models count their own executions as usual
    assert stats(h, "a").inference_count == 2 and stats(h, "b").inference_count == 1


def test_a_failed_ensemble_request_counts_as_other(repo):
    """Twice, as in Triton: the failed step's request counts against the ensemble as well as
    against its own model, and then the ensemble request itself fails."""
    h = Harness(repo).start()
    run(h)
    h.clock.advance(0.1)
    h.answer(sid_of(h, "a"), error="boom")
    st = stats(h, "E")
    assert st.failures["OTHER"] == 2 and st.fail.count == 2 and st.fail.ns == 2 * int(0.1e9)
    assert st.success.count == 0 and st.execution_count == 0


# ---- explicit mode ---------------------------------------------------------------------------------------------
def test_loading_an_ensemble_loads_its_composing_models(repo):
    h = Harness(repo, model_control_mode="explicit").start()
    control(h, ControlAction.LOAD, "E")
    assert sorted(h.port.spawned[s].model_name for s in h.waiting()) == ["a", "b"]
    assert h.states("E")[1][0] is ModelState.LOADING and h.replies() == []
    h.ready(sid_of(h, "a"))
    assert h.replies() == []
    h.ready(sid_of(h, "b"))
    assert h.states("E")[1][0] is ModelState.READY
    assert h.replies()[-1].error == "" and h.replies()[-1].code is None
    assert h.states("c") == {} or h.states("c")[1][0] is not ModelState.READY
    rid = run(h)
    h.answer(sid_of(h, "a"))
    h.answer(sid_of(h, "b"))
    assert h.results()[rid].error == ""


def test_loading_an_ensemble_reuses_loaded_models(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["a"]).start()
    a = sid_of(h, "a")
    control(h, ControlAction.LOAD, "E")
    assert [h.port.spawned[s].model_name for s in h.waiting()] == ["b"]
    h.ready_all()
    assert h.states("E")[1][0] is ModelState.READY and sid_of(h, "a") == a


def test_an_explicit_ensemble_load_fails_when_a_composing_model_fails(repo):
    h = Harness(repo, model_control_mode="explicit").start()
    control(h, ControlAction.LOAD, "E")
    h.ready(sid_of(h, "a"))
    h.load_failed(sid_of(h, "b"), "ImportError: nope")
    reply = h.replies()[-1]
    assert reply.code is ErrorCode.INVALID_ARG
    assert reply.error == "load failed for model 'E': ensemble 'E' depends on 'b', which has no " \
                          "ready version"


def test_unload_with_dependents_spares_models_another_ensemble_uses(repo):
    write_ensemble(repo, "Q", [("b", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                               ("c", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    h = Harness(repo, model_control_mode="explicit", load_models=["E", "Q"]).start()
    assert all(h.states(m)[1][0] is ModelState.READY for m in ("E", "Q", "a", "b", "c"))
    control(h, ControlAction.UNLOAD, "E", dependents=True)
    assert h.replies()[-1].error == ""
    # E was unloaded (not "contains models that are not available": its models went after it)
    assert h.states("E")[1] == (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
    assert h.states("a")[1] == (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
    assert h.states("b")[1][0] is ModelState.READY and h.states("c")[1][0] is ModelState.READY
    assert h.states("Q")[1][0] is ModelState.READY


def test_unload_without_dependents_keeps_the_composing_models(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["E"]).start()
    control(h, ControlAction.UNLOAD, "E")
    assert h.states("E")[1][0] is ModelState.UNAVAILABLE
    assert h.states("a")[1][0] is ModelState.READY and h.states("b")[1][0] is ModelState.READY


def test_a_decoupled_worker_that_dies_before_its_first_response_fails_the_request(repo):
    """Its execute returned (BatchDone) and it would answer from a thread: nothing streamed
    yet, so only the dead worker's answered requests say that the step is lost."""
    h = Harness(repo).start()
    g = sid_of(h, "gen")
    rid = run(h, "S")
    h.finish(g)
    h.die(g)
    (err,) = h.answers(rid)
    assert err.code is ErrorCode.INTERNAL and err.final
    assert err.error.startswith("in ensemble 'S', step 0 (model 'gen'): the worker process of "
                                "instance 'gen_0_0'")


def test_a_client_cancel_reaches_a_step_that_streams_past_its_execution(repo):
    h = Harness(repo).start()
    g = sid_of(h, "gen")
    rid = run(h, "S")
    ((gen_step, _),) = h.steps_of(g)
    h.respond(g, gen_step)
    h.finish(g)                                     # no batch holds it any more
    h.core.handle(CancelRequest(0, rid))
    assert h.answers(rid)[-1].code is ErrorCode.CANCELLED
    assert (g, CancelRequest(ENSEMBLE_FRONTEND, gen_step)) in cancels(h)
    late = h.respond(g, gen_step)                   # one that crossed the cancel: given back
    assert late.outputs[0].shm in released(h, g)


def test_a_tensor_in_several_responses_is_given_back_after_the_last(repo):
    """A decoupled step next to a plain one: every response holds the plain step's output, so
    its slot goes back only when the frontend released it from every response and the request
    has ended."""
    write_ensemble(repo, "T", [("gen", {"INPUT0": "IN"}, {"OUTPUT0": "X"}),
                               ("a", {"INPUT0": "IN"}, {"OUTPUT0": "Y"})], outputs=("X", "Y"))
    h = Harness(repo).start()
    g, a = sid_of(h, "gen"), sid_of(h, "a")
    rid = run(h, "T", outputs=("X", "Y"))
    ((gen_step, _),) = h.steps_of(g)
    (ya,) = h.answer(a)
    y = ya.outputs[0].shm
    x1 = h.respond(g, gen_step).outputs[0].shm
    (r1,) = h.answers(rid)
    assert [t.shm for t in r1.outputs] == [x1, y] and r1.worker == SCHEDULER and not r1.final
    h.core.handle(ReleaseOutputs([x1, y]))          # the frontend wrote the first response
    assert released(h, g) == [x1] and released(h, a) == []     # y: a later response needs it
    x2 = h.respond(g, gen_step).outputs[0].shm
    r2 = h.answers(rid)[-1]
    assert [t.shm for t in r2.outputs] == [x2, y] and r2.worker == SCHEDULER
    h.respond(g, gen_step, final=True, no_response=True)
    h.finish(g)
    assert h.answers(rid)[-1].final
    assert released(h, a) == []                     # the frontend still holds the second
    h.core.handle(ReleaseOutputs([x2, y]))
    assert released(h, g) == [x1, x2] and released(h, a) == [y]


def test_an_output_in_the_clients_region_is_no_slot_to_give_back(repo):
    write_model(repo, "two", f'''max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{ONE}''')
    write_ensemble(repo, "G", [("two", {"INPUT0": "IN"}, {"OUTPUT0": "OUT", "OUTPUT1": "side"}),
                               ("b", {"INPUT0": "side"}, {"OUTPUT0": "OUT2"})],
                   outputs=("OUT", "OUT2"))
    h = Harness(repo).start()
    region = ShmRef("client-out", 0, 16)
    rid = run(h, "G", outputs=[OutputSpec("OUT", region), OutputSpec("OUT2")])
    (r0,) = h.answer(sid_of(h, "two"))
    by_name = {t.name: t.shm for t in r0.outputs}
    assert r0.worker and by_name["OUTPUT0"] == region
    side = by_name["OUTPUT1"]
    (r1,) = h.answer(sid_of(h, "b"))
    out2 = r1.outputs[0].shm
    final = h.results()[rid]
    assert [t.shm for t in final.outputs] == [region, out2] and final.worker == SCHEDULER
    assert released(h) == [side]                    # the region is the client's, never a slot
    assert list(h.core.ensembles.book.handed) == [out2]
    h.core.handle(ReleaseOutputs([out2]))           # what a frontend gives back (worker_slots)
    assert released(h) == [side, out2] and h.core.ensembles.book.handed == {}


def test_a_streamed_output_a_later_step_reads_outlives_its_response(repo):
    """X goes out with a response at once, while a step that reads it waits for Y: the
    frontend's release must not free X under that step."""
    write_model(repo, "join", f'''max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
        {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{ONE}''')
    write_ensemble(repo, "J", [("gen", {"INPUT0": "IN"}, {"OUTPUT0": "X"}),
                               ("a", {"INPUT0": "IN"}, {"OUTPUT0": "Y"}),
                               ("join", {"INPUT0": "X", "INPUT1": "Y"}, {"OUTPUT0": "W"})],
                   outputs=("X",))
    h = Harness(repo).start()
    g, a, j = sid_of(h, "gen"), sid_of(h, "a"), sid_of(h, "join")
    rid = run(h, "J", outputs=("X",))
    ((gen_step, _),) = h.steps_of(g)
    x = h.respond(g, gen_step).outputs[0].shm
    assert [t.shm for t in h.answers(rid)[-1].outputs] == [x]
    h.core.handle(ReleaseOutputs([x]))              # the frontend is done with it
    assert released(h, g) == []                     # join has yet to read it
    h.respond(g, gen_step, final=True, no_response=True)
    h.finish(g)
    h.answer(a)
    ((_, p),) = h.steps_of(j)
    assert {t.name: t.shm for t in p.inputs}["INPUT0"] == x
    h.answer(j)
    assert h.answers(rid)[-1].final and x in released(h, g)


def test_a_plain_step_that_answers_after_the_stream_ended_completes_its_responses(repo):
    """gen streams and ends while a still runs: a's answer reaches every branch of the stream
    (each a response) before the request ends."""
    write_ensemble(repo, "T", [("gen", {"INPUT0": "IN"}, {"OUTPUT0": "X"}),
                               ("a", {"INPUT0": "IN"}, {"OUTPUT0": "Y"})], outputs=("X", "Y"))
    h = Harness(repo).start()
    g, a = sid_of(h, "gen"), sid_of(h, "a")
    rid = run(h, "T", outputs=("X", "Y"))
    ((gen_step, _),) = h.steps_of(g)
    xs = [h.respond(g, gen_step).outputs[0].shm for _ in range(2)]
    h.respond(g, gen_step, final=True, no_response=True)
    h.finish(g)
    assert h.answers(rid) == []                     # no response holds Y yet
    (ya,) = h.answer(a)
    y = ya.outputs[0].shm
    answers = h.answers(rid)
    assert [(r.final, [t.shm for t in r.outputs]) for r in answers] == \
        [(False, [xs[0], y]), (False, [xs[1], y]), (True, [])]
    assert released(h) == []                        # the frontend holds them all
    h.core.handle(ReleaseOutputs([xs[0], y]))
    assert released(h) == [xs[0]]
    h.core.handle(ReleaseOutputs([xs[1], y]))
    assert released(h, g) == xs and released(h, a) == [y] and h.core.ensembles.book.handed == {}


def test_an_output_that_feeds_a_step_cannot_be_a_classification(repo):
    write_ensemble(repo, "G", CHAIN, outputs=("mid", "OUT"))
    h = Harness(repo).start()
    rid = run(h, "G", outputs=[OutputSpec("mid", classification=3), OutputSpec("OUT")])
    err = h.results()[rid]
    assert err.code is ErrorCode.INVALID_ARG
    assert err.error == "in ensemble 'G', output 'mid' feeds another step, so it cannot be " \
                        "returned as a classification"
    assert h.batches() == [] and stats(h, "G").failures["OTHER"] == 1
    ok = run(h, "G", outputs=[OutputSpec("mid"), OutputSpec("OUT", classification=3)])
    h.answer(sid_of(h, "a"))
    ((_, p),) = h.steps_of(sid_of(h, "b"))
    assert p.outputs == [OutputSpec("OUTPUT0", None, 3)]    # the step that writes it classifies
    h.answer(sid_of(h, "b"))
    assert [t.name for t in h.results()[ok].outputs] == ["mid", "OUT"]


def test_a_step_gets_the_time_left_of_the_requests_timeout(repo):
    h = Harness(repo).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = h.submit("E", payload=tensor_payload({"IN": CLIENT_IN}), timeout_us=1_000_000)
    h.clock.advance(0.4)
    h.answer(a)                                     # step 1 starts 0.4 s into the request
    (res,) = h.answer(b)
    assert h.answers(rid)[-1].error == ""
    # the request's timeout covers its steps: one whose time ran out during step 0 fails at
    # step 1, before it is queued there
    rid = h.submit("E", payload=tensor_payload({"IN": CLIENT_IN}), timeout_us=100_000)
    h.clock.advance(0.2)
    h.answer(a)
    (res,) = h.answers(rid)
    assert res.code == ErrorCode.UNAVAILABLE
    assert res.error == "in ensemble 'E', step 1 (model 'b'): Request timeout expired"
    assert len(h.steps_of(b)) == 1                  # only the first request's step reached b


def test_unloading_a_composing_model_unloads_the_ensemble(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["E"]).start()
    control(h, ControlAction.UNLOAD, "b")
    state, reason, _ = h.states("E")[1]
    assert state is ModelState.UNAVAILABLE
    assert reason == "ensemble 'E' contains models that are not available: b"
    assert h.states("a")[1][0] is ModelState.READY
    rid = run(h)                                    # refused, as for any unloaded model
    assert h.answers(rid)[0].code == ErrorCode.UNAVAILABLE
    # loading the ensemble again loads b again (explicit mode)
    control(h, ControlAction.LOAD, "E")
    assert h.states("b")[1][0] is ModelState.LOADING


# ---- lending the steps, so the frontend runs the ensemble worker to worker (workers/leases/chain.py) ---
def granted(h):
    return [m for f, m in h.port.to_frontend if isinstance(m, LeaseGranted)]


def scheduled(h):
    """A request of E the frontend could not send worker to worker: it runs here."""
    return h.submit("E", payload=tensor_payload({"IN": CLIENT_IN}, ("OUT",)), no_lease=True)


def test_a_request_whose_steps_are_idle_goes_back_with_their_leases(repo):
    h = Harness(repo, instance_leases=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    route = h.table().models[[m.name for m in h.table().models].index("E")].versions[0].route
    assert [(hop.step, hop.model, hop.version, hop.inputs, hop.outputs) for hop in route] == \
        [(0, "a", 1, {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
         (1, "b", 1, {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})]
    rid = run(h)
    assert h.batches() == []        # nothing ran here
    # both granted, then the request goes back with the last (to go worker to worker)
    assert [(g.model, g.spawn_id, g.returned) for g in granted(h)] == \
        [("a", a, []), ("b", b, []), ("b", b, [rid])]
    # a fork runs its steps side by side here: no route, never held
    assert not [hop for m in h.table().models if m.name == "P" for v in m.versions
                for hop in v.route]


def test_a_chain_ensembles_steps_are_lent_once_a_run_here_ends(repo):
    h = Harness(repo, instance_leases=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    rid = scheduled(h)
    h.answer(a)
    assert granted(h) == []         # not after a step: the run's next step would revoke it
    h.answer(b)
    assert not h.results()[rid].error
    assert sorted((g.model, g.spawn_id) for g in granted(h)) == [("a", a), ("b", b)]


def test_requests_that_come_while_runs_end_are_returned_with_the_leases(repo):
    h = Harness(repo, instance_leases=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    first = scheduled(h)
    second = run(h)                 # a run is under way: held, not started
    assert len(h.batches(a)) == 1
    h.answer(a)
    h.answer(b)
    assert not h.results()[first].error and second not in h.results()
    leases = granted(h)
    assert {g.model for g in leases} == {"a", "b"} and leases[-1].returned == [second]


def test_held_requests_run_here_when_the_steps_cannot_be_lent(repo):
    h = Harness(repo, instance_leases=True).start()
    a, b = sid_of(h, "a"), sid_of(h, "b")
    h.core.handle(FrontendHello(5, "inproc://frontend-5"))
    first = scheduled(h)
    second = run(h)                 # held
    h.answer(a)                     # E's step 1 runs on b
    h.core.handle(SubmitRequest(900, 5, "b", 1, 1, h.clock()), [b"other"])    # queues for b
    h.answer(b)                     # b goes to the other frontend: it cannot be lent
    assert not h.results()[first].error
    mine = [m for f, m in h.port.to_frontend if f == FRONTEND and isinstance(m, LeaseGranted)]
    assert all(not g.returned for g in mine)
    # no run of E is left to end here: the held request runs here; a, lent meanwhile (it
    # was idle), comes back for its step
    for g in mine:
        h.core.handle(LeaseEnded(g.spawn_id, g.lease_id))
    _, batch, _ = h.batches(a)[-1]
    assert len(h.batches(a)) == 2 and [r.frontend for r in batch.routes] == [ENSEMBLE_FRONTEND]
    h.answer(a)
    (other,) = [m for f, m in h.port.to_frontend if f == 5 and isinstance(m, LeaseGranted)]
    h.core.handle(LeaseEnded(b, other.lease_id))    # E's step takes b back from frontend 5
    h.answer(b)
    assert not h.results()[second].error


def test_a_chained_request_lost_with_its_worker_fails_by_its_step(repo):
    h = Harness(repo, instance_leases=True).start()
    h.core.handle(SubmitRequest(77, FRONTEND, "E", 1, 1, h.clock(),
                                lost="the worker process of instance 'b_0_0' of model 'b' "
                                     "exited unexpectedly", lost_retry=False),
                  [tensor_payload({"IN": CLIENT_IN}, ("OUT",))])
    res = h.results()[77]
    assert res.code is ErrorCode.INTERNAL
    assert res.error.startswith("in ensemble 'E', step 1 (model 'b'): the worker process")


def test_held_requests_do_not_wait_for_another_frontends_runs(repo):
    h = Harness(repo, instance_leases=True).start()
    a = sid_of(h, "a")
    h.core.handle(FrontendHello(5, "inproc://frontend-5"))
    first = scheduled(h)
    second = run(h)                 # held while the run ends
    assert len(h.batches(a)) == 1
    # the other frontend's request: they compete, so the held one runs here at once
    h.core.handle(SubmitRequest(900, 5, "E", 1, 1, h.clock()),
                  [tensor_payload({"IN": CLIENT_IN}, ("OUT",))])
    assert not h.core.chains.held
    # both wait for a here (it runs the first one's step): the held one was not left behind
    assert len(h.core.versions[("a", 1)].queue) == 2
    assert first not in h.results() and second not in h.results()
