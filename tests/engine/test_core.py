"""SchedulerCore in-process: every decision of the scheduler process, driven with a fake port
and a fake clock (tests/engine/fakes.py). No sockets, no processes, no sleeping."""
import os
import shutil

import pytest
from fakes import IO, ONE, TWO, Harness, write_model

from shmserve.engine.models import BACKOFF_FIRST_S, CRASH_LOOP_DEATHS, PING_TIMEOUT_S
from shmserve.ipc.messages.common import ControlAction, CustomMetrics, ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_scheduler import CancelRequest, ControlRequest, ResponseReport, StatsQuery
from shmserve.ipc.messages.to_worker import ExecuteBatch, Ping, Shutdown


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "pair", f"max_batch_size: 8\n{IO}\n{TWO}")
    write_model(r, "norertry", f'max_batch_size: 8\n{IO}\n{TWO}\n'
                               f'parameters {{ key: "retry_on_worker_death" '
                               f'value {{ string_value: "false" }} }}')
    write_model(r, "prio", f'''max_batch_size: 4
{IO}
{ONE}
dynamic_batching {{
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {{ default_timeout_microseconds: 1000000 timeout_action: REJECT
                          allow_timeout_override: true }}
}}''')
    write_model(r, "streams", f"max_batch_size: 0\n{IO}\n{ONE}\n"
                              f"model_transaction_policy {{ decoupled: true }}")
    return r


def only(h, model):
    sids = [s for s in h.spawn_ids(model) if s not in h.port.reaped]
    assert len(sids) == 1, sids
    return sids[0]


def stats(h, model):
    return h.core.statistics(StatsQuery(0, 1, model)).models[0]


# ---- dispatch and completion ---------------------------------------------------------------------
def test_dispatch_and_completion(repo):
    h = Harness(repo).start()
    assert h.states("plain") == {1: (ModelState.READY, "", StateCause.NONE)}
    sid = only(h, "plain")
    a, b = h.submit("plain"), h.submit("plain")
    assert len(h.batches()) == 1                    # one instance: b waits for it
    s, batch, payloads = h.batches()[0]
    assert s == sid and [r.req_id for r in batch.routes] == [a] and payloads == [b"payload-1"]
    h.finish(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == [b]
    h.finish(sid)
    st = stats(h, "plain")
    assert st.inference_count == 2 and st.execution_count == 2 and st.pending == 0
    assert st.compute_infer.ns == 40 and h.results() == {}  # answers go worker -> frontend


def test_unknown_or_unready_version_is_unavailable(repo):
    h = Harness(repo).start()
    rid = h.submit("plain", version=7)
    r = h.results()[rid]
    assert r.code is ErrorCode.UNAVAILABLE and "version 7 is not at ready state" in r.error


def test_failed_requests_are_counted_per_request(repo):
    h = Harness(repo).start()
    sid = only(h, "prio")
    h.submit("prio")
    h.submit("prio"), h.submit("prio")            # queued: they form the next batch
    h.finish(sid)
    h.finish(sid, failed=[1])
    st = stats(h, "prio")
    assert st.inference_count == 2 and st.failures["BACKEND"] == 1


# ---- deaths, retries, restarts ------------------------------------------------------------------------
def test_worker_killed_from_outside_mid_request_retried_once_then_failed(repo):
    h = Harness(repo).start()
    first, second = h.spawn_ids("pair")
    rid = h.submit("pair")
    ran_on = h.batches()[-1][0]
    h.die(ran_on, rc=-9)                            # SIGKILL (the OOM killer, an operator)
    assert h.port.unlinked == [ran_on]              # its segments go at once
    other = second if ran_on == first else first
    assert [r.req_id for r in h.last_batch(other).routes] == [rid]   # the retry
    assert rid not in h.results()
    h.die(other)
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL
    assert "exited unexpectedly (killed by SIGSEGV) while executing this request" in err.error
    assert "retried alone after an earlier worker death" in err.error
    assert stats(h, "pair").failures["BACKEND"] == 1


@pytest.mark.parametrize("rc", [-11, -6, 3, 0])
def test_a_request_whose_lone_execution_crashed_its_worker_is_not_retried(repo, rc):
    """A worker that ended by itself (a crash signal, an exit) while it ran one request alone
    died of that request: it fails at once instead of killing the other instance too."""
    h = Harness(repo).start()
    rid = h.submit("pair")
    ran_on = h.batches()[-1][0]
    h.die(ran_on, rc=rc)
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL and "while executing this request" in err.error
    assert "it was the only request the worker was running, so it is taken for the cause " \
           "and not retried" in err.error
    assert len(h.batches()) == 1                    # no second worker ran it
    assert stats(h, "pair").failures["BACKEND"] == 1


def test_poison_requests_never_make_a_crash_loop(repo):
    """Deaths while running requests are the requests' doing: however many poison requests
    come in a row, the model stays READY, restarts at once and serves the next good one."""
    h = Harness(repo).start()
    sid = only(h, "plain")
    for _ in range(3 * CRASH_LOOP_DEATHS):
        rid = h.submit("plain")
        h.die(sid, rc=-11)
        assert "taken for the cause" in h.results()[rid].error
        h.tick(0)                                   # no backoff
        (sid,) = h.waiting()
        h.ready(sid)
    assert h.states("plain")[1][0] is ModelState.READY
    good = h.submit("plain")
    assert [r.req_id for r in h.last_batch(sid).routes] == [good]


def test_a_leased_workers_lone_request_is_blamed_when_its_frontend_submits_it_again(repo):
    """A leased worker's requests are known to it alone: its execution record names the one it
    ran; resubmitted by its frontend (LeaseLost), that one fails, the others run again."""
    from shmserve.ipc.messages.to_scheduler import SubmitRequest
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.port.executions[sid] = (1, 0, 77)             # running request 77 of frontend 0 alone
    h.die(sid, rc=-11)
    reason = "the worker process of instance 'plain_0' of model 'plain' exited unexpectedly " \
             "(killed by SIGSEGV) while executing this request"
    for rid in (77, 78):                            # 78 sat in the worker's inbox
        h.core.handle(SubmitRequest(rid, 0, "plain", 1, 1, h.clock(), lost=reason),
                      [b"payload"])
    err = h.results()[77]
    assert err.code is ErrorCode.INTERNAL and "taken for the cause" in err.error
    assert 78 not in h.results()                    # retried, alone
    h.tick(0)
    (sid,) = h.waiting()
    h.ready(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == [78]
    assert h.states("plain")[1][0] is ModelState.READY


def test_no_retry_when_the_model_turns_it_off(repo):
    h = Harness(repo).start()
    rid = h.submit("norertry")
    h.die(h.batches()[-1][0], rc=3)
    assert "exit code 3" in h.results()[rid].error


def test_backoff_grows_only_with_deaths_in_a_row(repo):
    """A worker that served and then died restarts at once (one poison request must not stall
    the model); deaths with no finished execution between them wait 0.2 s, 0.4 s, ..."""
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.submit("plain")
    h.finish(sid)
    h.die(sid)                                      # it had served: no wait
    h.tick(0)
    (sid,) = h.waiting()
    h.ready(sid)
    h.die(sid)                                      # second death in a row
    h.tick(BACKOFF_FIRST_S * 0.9)
    assert h.waiting() == []
    h.tick(BACKOFF_FIRST_S * 0.2)
    (sid,) = h.waiting()
    h.ready(sid)
    h.die(sid)                                      # third: twice the wait
    h.tick(BACKOFF_FIRST_S * 1.9)
    assert h.waiting() == []
    h.tick(BACKOFF_FIRST_S * 0.2)
    (sid,) = h.waiting()
    h.ready(sid)
    h.submit("plain")
    h.finish(sid)                                   # served again: the count starts over
    h.die(sid)
    h.tick(0)
    assert len(h.waiting()) == 1
    assert h.states("plain")[1][0] is ModelState.READY


def test_a_dead_batch_is_retried_one_by_one_and_the_poison_fails_alone(repo):
    h = Harness(repo).start()
    sid = only(h, "prio")
    first = h.submit("prio")                        # occupies the instance
    batch = [h.submit("prio") for _ in range(3)]
    h.finish(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == batch
    h.die(sid)                                      # the batch of three dies
    batch.append(h.submit("prio"))                  # a newcomer must not join the retries
    h.tick(0)
    (sid,) = h.waiting()
    h.ready(sid)
    ran = []
    for expected in batch[:2]:                      # each retry runs alone
        b = h.last_batch(sid)
        assert [r.req_id for r in b.routes] == [expected]
        ran.append(expected)
        h.finish(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == [batch[2]]
    h.die(sid)                                      # the third one is the poison
    err = h.results()[batch[2]]
    assert err.code is ErrorCode.INTERNAL and "retried alone after an earlier worker death" in \
        err.error
    assert first not in h.results() and not set(ran) & set(h.results())
    h.tick(0)                                       # it had served: back at once
    (sid,) = h.waiting()
    h.ready(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == [batch[3]]
    assert h.states("prio")[1][0] is ModelState.READY


def test_a_restart_that_no_longer_loads_backs_off_then_crash_loops(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.die(sid)
    for _ in range(CRASH_LOOP_DEATHS - 1):
        h.tick(15)
        (sid,) = h.waiting()
        h.load_failed(sid, "ImportError: gone")
        h.die(sid, rc=0)
    state, reason, cause = h.states("plain")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.CRASH_LOOP
    assert "failed to load the model again (ImportError: gone)" in reason


def test_crash_loop_makes_the_version_unavailable(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    for i in range(CRASH_LOOP_DEATHS - 1):        # deaths while idle, or while loading
        h.die(sid)
        h.tick(30)
        (sid,) = h.waiting()
        if i < CRASH_LOOP_DEATHS - 2:
            h.ready(sid)
    # requests wait while the last restart loads, which dies
    queued = [h.submit("plain"), h.submit("plain")]
    h.die(sid)
    state, reason, cause = h.states("plain")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.CRASH_LOOP
    assert reason.startswith("crash loop: instance 'plain_0_0'") and "5 times in a row" in reason
    for rid in queued:
        err = h.results()[rid]
        assert err.code is ErrorCode.UNAVAILABLE and "crash loop" in err.error
    kinds = [type(m).__name__ for _, m in h.port.to_frontend]
    assert kinds[-3:] == ["ModelTable", "InferResult", "InferResult"]   # the table goes first
    h.tick(60)
    assert h.waiting() == []                        # no more restarts
    late = h.submit("plain")
    assert h.results()[late].code is ErrorCode.UNAVAILABLE


def test_hung_execution_is_killed_and_not_retried(repo):
    h = Harness(repo, execution_timeout_secs=5.0).start()
    sid = only(h, "plain")
    rid = h.submit("plain")
    assert h.core.housekeeping_at <= h.clock() / 1e9 + 5.0   # the shell wakes in time
    h.tick(4.9)
    assert h.port.killed == []
    h.tick(0.2)
    assert h.port.killed == [sid]
    h.kill_reported()
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL
    assert "exceeded the execution timeout of 5 s and was killed" in err.error
    h.tick(1)
    assert len(h.waiting()) == 1                    # the instance comes back


def test_idle_worker_that_stops_answering_pings_is_killed(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.tick(2.1)
    assert len([m for s, m in h.to_worker(Ping) if s == sid]) == 1   # answered: no kill
    h.mute.add(sid)
    h.tick(2.1)
    ping = [m for s, m in h.to_worker(Ping) if s == sid][-1]
    for _ in range(4):
        h.tick(2.0)
    assert ping.seq and h.port.killed == [sid]
    assert PING_TIMEOUT_S < 8.1
    h.kill_reported()
    h.tick(1)
    assert len(h.waiting()) == 1


def test_worker_death_while_loading_fails_the_version(repo):
    h = Harness(repo).start(ready=False)
    first, second = h.spawn_ids("pair")
    h.die(first, rc=1)
    state, reason, cause = h.states("pair")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.LOAD_FAILED
    assert "worker process of instance 'pair_0_0' exited unexpectedly (exit code 1) while " \
           "loading" in reason
    assert second in h.port.killed                  # the rest of the load is released


def test_a_load_failure_reported_only_by_the_exit_keeps_its_reason(repo):
    """The worker's WorkerLoadFailed can reach the scheduler after its exit does; the reason it
    wrote before exiting is used then (a flake in test_warmup before)."""
    h = Harness(repo).start(ready=False)
    first, _ = h.spawn_ids("pair")
    h.port.failures[first] = "warmup 'w' failed: refusing warm-up data"
    h.die(first, rc=0)
    state, reason, cause = h.states("pair")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.LOAD_FAILED
    assert reason == "warmup 'w' failed: refusing warm-up data"


def test_exit_on_error_when_a_model_fails_at_startup(repo):
    write_model(repo, "broken", "max_batch_size: -3")
    h = Harness(repo, exit_on_error=True).start()
    assert h.core.exit_requested
    assert not Harness(repo).start().core.exit_requested


# ---- loading, reloading, unloading ------------------------------------------------------------------
def control(h, action, name, config=""):
    h.core.handle(ControlRequest(0, len(h.replies()) + 100, action, name, config))


def test_load_commits_when_ready_and_answers_after_the_table(repo):
    h = Harness(repo, model_control_mode="explicit").start()
    assert h.port.spawned == {}
    control(h, ControlAction.LOAD, "plain")
    assert h.replies() == [] and h.states("plain")[1][0] is ModelState.LOADING
    h.ready_all()
    kinds = [type(m).__name__ for _, m in h.port.to_frontend]
    assert kinds[-2:] == ["ModelTable", "ControlReply"]      # the table goes first
    assert h.replies()[-1].error == "" and h.replies()[-1].code is None
    assert h.states("plain")[1][0] is ModelState.READY


def test_reload_serves_the_old_version_until_the_new_one_is_ready(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["plain"]).start()
    old = only(h, "plain")
    control(h, ControlAction.LOAD, "plain")
    (new,) = h.waiting()
    rid = h.submit("plain")
    assert h.batches()[-1][0] == old and rid        # the old one still serves
    h.ready(new)
    assert h.to_worker(Shutdown) == []              # draining: it holds a batch
    h.finish(old)
    assert h.to_worker(Shutdown) == [(old, Shutdown())]
    h.submit("plain")
    assert h.batches()[-1][0] == new


def test_a_reload_shows_in_the_table_though_the_version_stays_ready(repo):
    """Frontends drop the cached answers of a model whose table entry changed: a reload of
    the serving version must change it even when its state is READY before and after."""
    h = Harness(repo, model_control_mode="explicit", load_models=["plain"]).start()

    def served():
        (info,) = [m for m in h.table().models if m.name == "plain"]
        (v,) = info.versions
        return v.state, v.loaded
    state, first = served()
    assert state is ModelState.READY and first > 0
    h.clock.advance(1.0)
    control(h, ControlAction.LOAD, "plain")
    h.ready_all()
    state, second = served()
    assert state is ModelState.READY and second > first


def test_failed_reload_rolls_back(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["pair"]).start()
    old = set(h.spawn_ids("pair"))
    control(h, ControlAction.LOAD, "pair")
    new_a, new_b = h.waiting()
    h.ready(new_a)
    h.load_failed(new_b, "ImportError: no module named nope")
    reply = h.replies()[-1]
    assert reply.code is ErrorCode.INVALID_ARG
    assert reply.error == "load failed for model 'pair': ImportError: no module named nope"
    assert h.states("pair")[1][0] is ModelState.READY
    assert new_a in h.port.killed and not old & set(h.port.killed)
    h.submit("pair")
    assert h.batches()[-1][0] in old


def test_bad_override_and_missing_model_are_refused(repo):
    h = Harness(repo, model_control_mode="explicit").start()
    control(h, ControlAction.LOAD, "nope")
    assert h.replies()[-1].code is ErrorCode.INTERNAL and "no model directory" in \
        h.replies()[-1].error
    control(h, ControlAction.LOAD, "plain", "{not json")
    assert h.replies()[-1].code is ErrorCode.INVALID_ARG
    assert h.port.spawned == {}


def test_load_refused_outside_explicit_mode(repo):
    h = Harness(repo).start()
    control(h, ControlAction.UNLOAD, "plain")
    assert h.replies()[-1].code is ErrorCode.UNAVAILABLE
    # Triton's words, which its clients match, then the mode this server really is in
    assert h.replies()[-1].error.startswith(
        "explicit model load / unload is not allowed if polling is enabled: the model control "
        "mode is 'none'; loading and unloading models needs --model-control-mode=explicit")


def test_unload_drains_then_stops(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["plain"]).start()
    sid = only(h, "plain")
    h.submit("plain")
    queued = h.submit("plain")
    control(h, ControlAction.UNLOAD, "plain")
    assert h.replies()[-1].error == ""
    assert h.states("plain")[1][0] is ModelState.UNLOADING
    h.finish(sid)                                   # the queued one still runs
    assert [r.req_id for r in h.last_batch(sid).routes] == [queued]
    assert h.to_worker(Shutdown) == []
    h.finish(sid)
    assert h.to_worker(Shutdown) == [(sid, Shutdown())]
    assert h.states("plain")[1] == (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
    late = h.submit("plain")
    assert h.results()[late].code is ErrorCode.UNAVAILABLE


def test_shutdown_answers_queued_requests(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.submit("plain")
    queued = h.submit("plain")
    waits = h.core.begin_shutdown()
    assert sid in waits and (sid, Shutdown()) in h.to_worker(Shutdown)
    err = h.results()[queued]
    assert err.code is ErrorCode.UNAVAILABLE and err.error == "the server is shutting down"
    h.die(sid, rc=0)
    h.tick(5)
    assert h.waiting() == []                        # no restart while stopping


# ---- priorities, timeouts, cancellation ---------------------------------------------------------------
def test_priorities_order_the_batch(repo):
    h = Harness(repo).start()
    sid = only(h, "prio")
    h.submit("prio")                                # occupies the instance
    low = h.submit("prio")                          # default level 2
    high = h.submit("prio", priority=1)
    h.finish(sid)
    assert [r.req_id for r in h.last_batch(sid).routes] == [high, low]


def test_queue_timeout_rejects_without_a_message(repo):
    h = Harness(repo).start()
    h.submit("prio")
    late = h.submit("prio")
    short = h.submit("prio", timeout_us=100_000)    # overrides the 1 s default
    h.tick(0.2)
    assert h.results()[short].error == "Request timeout expired"
    assert late not in h.results()
    h.tick(0.9)
    assert h.results()[late].code is ErrorCode.UNAVAILABLE
    assert stats(h, "prio").failures["REJECTED"] == 2


def test_cancel_while_queued_and_while_running(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    running = h.submit("plain")
    queued = h.submit("plain")
    h.core.handle(CancelRequest(0, queued))
    err = h.results()[queued]
    assert err.code is ErrorCode.CANCELLED and stats(h, "plain").failures["CANCELED"] == 1
    h.core.handle(CancelRequest(0, running))        # running: its worker is told
    assert h.to_worker(CancelRequest) == [(sid, CancelRequest(0, running))]
    h.finish(sid)
    assert len(h.batches()) == 1                    # the cancelled one never ran


# ---- poll mode -----------------------------------------------------------------------------------------
def test_poll_mode_loads_reloads_and_unloads(repo):
    h = Harness(repo, model_control_mode="poll", repository_poll_secs=10).start()
    old = only(h, "plain")
    write_model(repo, "plain", f"max_batch_size: 4\n{IO}\n{ONE}")   # changed on disk
    write_model(repo, "fresh", f"max_batch_size: 4\n{IO}\n{ONE}")   # new
    shutil.rmtree(os.path.join(repo, "pair"))                        # removed
    h.tick(5)
    assert h.waiting() == []                        # not yet time to look
    h.tick(5.1)
    assert sorted(h.port.spawned[s].model_name for s in h.waiting()) == ["fresh", "plain"]
    assert "pair" not in {m.name for m in h.table().models}
    h.ready_all()
    assert (old, Shutdown()) in h.to_worker(Shutdown)
    assert h.states("fresh")[1][0] is ModelState.READY
    h.submit("plain")
    assert h.batches()[-1][0] == h.spawn_ids("plain")[-1] != old


# ---- what the core keeps for the frontends ----------------------------------------------------------------
def test_custom_metrics_follow_live_workers(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.core.handle(CustomMetrics(sid, []))
    h.core.handle(CustomMetrics(999, []))           # not a worker of ours
    assert [m.spawn_id for m in h.core.statistics(StatsQuery(0, 1)).custom_metrics] == [sid]
    h.die(sid)
    assert h.core.statistics(StatsQuery(0, 1)).custom_metrics == []


def test_response_reports_count_in_their_workers_version(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.core.handle(ResponseReport(sid, 0, "success", 100, 130, 150))
    h.core.handle(ResponseReport(sid, 1, "empty", 150, 0, 170))
    h.core.handle(ResponseReport(999, 0, "success", 0, 1, 2))     # not a worker of ours
    [m] = h.core.statistics(StatsQuery(0, 1, "plain")).models
    assert sorted(m.response_stats) == ["0", "1"]
    assert (m.response_stats["0"].success.count, m.response_stats["0"].success.ns) == (1, 50)
    assert m.response_stats["1"].empty_response.ns == 20


def test_a_cancel_after_a_decoupled_execution_reaches_the_worker_that_ran_it(repo):
    """Its execute() returned, a thread of the model answers later: the cancel goes to that
    worker (the request is in no batch any more), and to no other."""
    h = Harness(repo).start()
    sid = only(h, "streams")
    rid = h.submit("streams")
    h.finish(sid)
    h.core.handle(CancelRequest(0, rid))
    assert h.to_worker(CancelRequest) == [(sid, CancelRequest(0, rid))]
    h.core.handle(CancelRequest(0, 12345))                  # no such request: nobody hears it
    assert len(h.to_worker(CancelRequest)) == 1


def test_statistics_errors_name_the_model(repo):
    h = Harness(repo).start()
    assert h.core.statistics(StatsQuery(0, 1, "nope")).error == \
        "requested model 'nope' is not available"
    assert "not available for model 'plain'" in h.core.statistics(StatsQuery(0, 1, "plain", 9)).error


def test_payload_frames_are_forwarded_untouched(repo):
    h = Harness(repo).start()
    h.submit("prio")
    h.submit("prio"), h.submit("prio")
    h.finish(only(h, "prio"))
    _, batch, payloads = h.batches()[-1]
    assert isinstance(batch, ExecuteBatch) and payloads == [b"payload-2", b"payload-3"]


# ---- what must not take the scheduler down -------------------------------------------------------
def test_a_worker_that_cannot_be_spawned_fails_its_load_only(repo):
    h = Harness(repo, model_control_mode="explicit", load_models=["plain"]).start()
    real_spawn = h.port.spawn

    def spawn(sid, spec):
        if spec.model_name == "pair":
            raise OSError(7, "Argument list too long")
        real_spawn(sid, spec)
    h.port.spawn = spawn
    control(h, ControlAction.LOAD, "pair")
    reply = h.replies()[-1]
    assert reply.code is ErrorCode.INVALID_ARG
    assert "could not start the worker process of instance 'pair_0_0': OSError" in reply.error
    assert h.states("pair")[1][0] is ModelState.UNAVAILABLE
    h.submit("plain")
    assert h.batches()[-1][0] == only(h, "plain")   # the rest keeps serving


def test_restart_that_cannot_be_spawned_is_tried_again(repo):
    h = Harness(repo).start()
    sid = only(h, "plain")
    h.submit("plain")
    h.finish(sid)
    real_spawn, fail = h.port.spawn, [True]

    def spawn(s, spec):
        if fail[0]:
            raise OSError(12, "Cannot allocate memory")
        real_spawn(s, spec)
    h.port.spawn = spawn
    h.die(sid)
    h.tick(0)                                       # the restart fails
    assert h.waiting() == []
    fail[0] = False
    h.tick(1.1)
    assert len(h.waiting()) == 1


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "soon"])
def test_execution_timeout_must_be_a_finite_number(repo, value):
    write_model(repo, "odd", f'max_batch_size: 8\n{IO}\n{ONE}\nparameters {{ key: '
                             f'"execution_timeout_ms" value {{ string_value: "{value}" }} }}')
    h = Harness(repo).start()
    state, reason, _ = h.states("odd")[1]
    assert state is ModelState.UNAVAILABLE
    assert "execution_timeout_ms of model 'odd' must be a finite, non-negative number" in reason
    assert h.spawn_ids("odd") == []



def test_a_dead_worker_names_what_it_answered_to_each_frontend(repo):
    """Answers still in a dead worker's queue die with it; the frontends hear which requests
    it had answered, so that any they still wait for can be submitted again."""
    from shmserve.ipc.messages.to_frontend import WorkerGone
    h = Harness(repo).start()
    sid = only(h, "prio")
    a = h.submit("prio")
    b, c = h.submit("prio"), h.submit("prio")
    h.finish(sid)
    h.finish(sid)
    h.die(sid)
    gone = [m for _, m in h.port.to_frontend if isinstance(m, WorkerGone)]
    assert gone == [WorkerGone(sid, [a, b, c])]
    h.tick(0)
    (sid,) = h.waiting()
    h.ready(sid)
    h.die(sid)                                      # answered nothing: nothing to say
    assert len([m for _, m in h.port.to_frontend if isinstance(m, WorkerGone)]) == 1


@pytest.mark.parametrize("action", [ControlAction.LOAD, ControlAction.UNLOAD])
def test_a_control_request_that_meets_a_bug_is_still_answered(repo, monkeypatch, action):
    """An unexpected error while loading or unloading costs that request, answered 500 with
    the error, never a client waiting for ever (before: the exception was only logged)."""
    h = Harness(repo, model_control_mode="explicit").start()

    def boom(*a, **kw):
        raise RuntimeError("unexpected")
    monkeypatch.setattr(h.core.lifecycle.repository, "read_model", boom)
    monkeypatch.setattr(h.core.lifecycle, "serving_versions", boom)
    control(h, action, "plain")
    (reply,) = h.replies()
    assert reply.code is ErrorCode.INTERNAL
    verb = "load" if action is ControlAction.LOAD else "unload"
    assert reply.error == f"failed to {verb} 'plain': RuntimeError: unexpected"
