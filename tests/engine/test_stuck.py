"""Workers that are stuck without dying (issue 13), in-process with the fake port and clock: a
load that never becomes ready (a hung initialize()) and a process the kernel reports stopped."""
import pytest
from fakes import IO, ONE, TWO, Harness, write_model

from shmserve.engine.models import STOPPED_KILL_S
from shmserve.ipc.messages.common import ControlAction, ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_scheduler import ControlRequest


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "pair", f"max_batch_size: 8\n{IO}\n{TWO}")
    return r


def _live(h, model):
    return [s for s in h.spawn_ids(model) if s not in h.port.reaped]


# ---- the load timeout ---------------------------------------------------------------------------
def test_a_load_that_never_becomes_ready_fails_at_the_load_timeout(repo):
    h = Harness(repo, model_load_timeout_secs=5.0).start(ready=False)
    (hung,) = _live(h, "plain")
    for sid in h.waiting():
        if sid != hung:
            h.ready(sid)
    assert h.states("pair")[1][0] is ModelState.READY
    assert not h.table().startup_done               # before: for ever
    h.tick(4.9)
    assert h.port.killed == []
    h.tick(0.2)
    assert h.port.killed == [hung]
    h.kill_reported()
    state, reason, cause = h.states("plain")[1]
    assert state is ModelState.UNAVAILABLE and cause is StateCause.LOAD_FAILED
    assert "instance 'plain_0_0' did not become ready within 5 s (initialize() hung?)" in reason
    assert h.table().startup_done                   # readiness is decided: honestly not ready
    rid = h.submit("plain")
    assert h.results()[rid].code is ErrorCode.UNAVAILABLE
    h.tick(10)
    assert h.waiting() == []                        # a failed load is not restarted


def test_a_hung_explicit_load_is_answered_with_the_reason(repo):
    h = Harness(repo, model_control_mode="explicit", model_load_timeout_secs=2.0).start()
    h.core.handle(ControlRequest(0, 100, ControlAction.LOAD, "pair", ""))
    first, second = h.waiting()
    h.ready(first)                                  # one instance loads, the other hangs
    h.tick(2.5)
    assert h.port.killed == [second]
    h.kill_reported()
    reply = h.replies()[-1]
    assert reply.code is ErrorCode.INVALID_ARG
    assert reply.error.startswith("load failed for model 'pair': ")
    assert "did not become ready within 2 s (initialize() hung?)" in reply.error
    assert first in h.port.killed                   # what the load started is released


def test_a_restart_that_hangs_counts_as_a_death_in_a_row(repo):
    h = Harness(repo, model_load_timeout_secs=5.0).start()
    (sid,) = _live(h, "plain")
    h.die(sid)                                      # served, then died: restarts at once
    h.tick()
    (restarted,) = h.waiting()
    h.tick(5.5)
    assert h.port.killed == [restarted]
    h.kill_reported()
    assert h.states("plain")[1][0] is ModelState.READY     # the version keeps its place
    inst = h.core.supervisor.backoff.copy().pop()[1]
    assert inst.deaths_in_a_row == 2                # backs off, and crash-loops if it persists


def test_no_load_timeout_when_it_is_off(repo):
    h = Harness(repo, model_load_timeout_secs=0).start(ready=False)
    h.tick(10_000)
    assert h.port.killed == []


# ---- a stopped process ------------------------------------------------------------------------------
def test_a_stopped_busy_worker_is_killed_and_its_request_retried(repo):
    h = Harness(repo, execution_timeout_secs=300.0).start()
    h.tick()
    rid = h.submit("pair")
    victim = h.batches()[-1][0]
    (other,) = [s for s in _live(h, "pair") if s != victim]
    h.port.stopped_workers.add(victim)
    elapsed = 0.0
    while not h.port.killed and elapsed < 10:
        h.tick(0.5)
        elapsed += 0.5
    assert h.port.killed == [victim]
    assert STOPPED_KILL_S <= elapsed <= STOPPED_KILL_S + 1.5       # not 300 s
    h.kill_reported()
    assert [r.req_id for r in h.last_batch(other).routes] == [rid]  # retried, not failed
    assert rid not in h.results()
    h.tick()
    assert len(h.waiting()) == 1                    # the instance restarts


def test_a_stopped_idle_worker_is_killed(repo):
    h = Harness(repo).start()
    (sid,) = _live(h, "plain")
    h.port.stopped_workers.add(sid)
    h.mute.add(sid)                                 # a stopped process answers no ping
    for _ in range(5):
        h.tick(1.0)
    assert h.port.killed == [sid]
    assert "was stopped (SIGSTOP or a debugger)" in \
        h.core.supervisor.by_spawn[sid][1].exit_detail
    h.kill_reported()


def test_a_worker_stopped_briefly_is_left_alone(repo):
    h = Harness(repo).start()
    h.tick()
    h.submit("plain")
    (sid,) = _live(h, "plain")
    h.port.stopped_workers.add(sid)
    h.tick(1.0)
    h.tick(1.0)
    h.port.stopped_workers.discard(sid)             # SIGCONT
    for _ in range(5):
        h.tick(1.0)
    assert h.port.killed == []
    h.finish(sid)
