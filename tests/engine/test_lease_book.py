"""Instance leases in the scheduler core (engine/leases.py): when they are granted and taken back,
and what happens to leased work when workers die, models unload or frontends compete. Driven
in-process with the fake port and clock; the worker's and frontend's halves are played by the
test (tests/e2e/test_leases.py runs the real processes)."""
import pytest
from fakes import FRONTEND, IO, ONE, TWO, Harness, write_model

from shmserve.engine.leases import COOLDOWN_NS, TERM_NS
from shmserve.engine.models import PING_TIMEOUT_S
from shmserve.engine.states import InstanceState
from shmserve.ipc.messages.common import CacheRecord, ControlAction, ErrorCode, LeasedRecord, ModelState
from shmserve.ipc.messages.to_frontend import LeaseGranted, LeaseLost, LeaseRevoked
from shmserve.ipc.messages.to_scheduler import (
    ControlRequest,
    FrontendHello,
    LeasedDone,
    LeaseEnded,
    StatsQuery,
    SubmitRequest,
)
from shmserve.ipc.messages.to_worker import RevokeLease, Shutdown

OTHER = 1       # a second frontend


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "pair", f"max_batch_size: 8\n{IO}\n{TWO}")
    write_model(r, "noretry", f'max_batch_size: 8\n{IO}\n{ONE}\n'
                              f'parameters {{ key: "retry_on_worker_death" '
                              f'value {{ string_value: "false" }} }}')
    write_model(r, "timed", f'max_batch_size: 8\n{IO}\n{ONE}\n'
                            f'parameters {{ key: "execution_timeout_ms" '
                            f'value {{ string_value: "1000" }} }}')
    write_model(r, "batched", f"max_batch_size: 8\n{IO}\n{ONE}\ndynamic_batching {{ }}")
    write_model(r, "batched_slow", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                                   f"dynamic_batching {{ max_queue_delay_microseconds: 5000000 }}")
    write_model(r, "batched_pair", f"max_batch_size: 8\n{IO}\n{TWO}\ndynamic_batching {{ }}")
    write_model(r, "batched_levels", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                                     f"dynamic_batching {{ priority_levels: 2 "
                                     f"default_priority_level: 1 }}")
    write_model(r, "batched_policy", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                                     f"dynamic_batching {{ default_queue_policy {{ "
                                     f"default_timeout_microseconds: 1000 }} }}")
    write_model(r, "policy_delayed", f"max_batch_size: 8\n{IO}\n{ONE}\n"
                                     f"dynamic_batching {{ max_queue_delay_microseconds: 100 "
                                     f"default_queue_policy {{ max_queue_size: 1 }} }}")
    return r


def leased_harness(repo, **settings) -> Harness:
    h = Harness(repo, instance_leases=True, **settings).start()
    h.core.handle(FrontendHello(OTHER, "inproc://frontend-1"))
    return h


def sid_of(h, model):
    return [s for s in h.spawn_ids(model) if s not in h.port.reaped][-1]


def grants(h, frontend=FRONTEND):
    return [m for f, m in h.port.to_frontend if f == frontend and isinstance(m, LeaseGranted)]


def sent(h, kind, frontend=None):
    return [m for f, m in h.port.to_frontend
            if isinstance(m, kind) and (frontend is None or f == frontend)]


def instance(h, model):
    ver = h.core.versions[(model, 1)]
    return ver.instances[0]


def first_request_leases(h, model="plain"):
    """The first request goes through the scheduler; when it is done the instance is idle and
    the queue empty, so the frontend that sent it gets a lease."""
    sid = sid_of(h, model)
    h.submit(model)
    assert grants(h) == []
    h.finish(sid)
    [grant] = grants(h)
    assert (grant.model, grant.version, grant.spawn_id) == (model, 1, sid)
    return sid, grant


def leased_done(h, sid, req_id, failed=(), took_ns=1000, model="plain", executed=-1):
    """The worker ran a request its frontend sent under the lease; the frontend passes its
    completion record on (in bulk, later: the clock has moved on since)."""
    record = LeasedRecord(sid, model, 1, 2, h.clock(), h.clock() + took_ns, 10, 20, 30,
                          bool(failed), executed)
    h.clock.advance(0.05)
    h.core.handle(LeasedDone([record]))


def test_a_lease_goes_to_the_frontend_that_used_the_idle_model(repo):
    h = leased_harness(repo)
    assert grants(h) == []                       # nobody asked yet: nothing is lent
    sid, grant = first_request_leases(h)
    assert instance(h, "plain").state is InstanceState.LEASED
    assert grants(h, OTHER) == []


def test_leased_requests_are_counted_in_statistics(repo):
    h = leased_harness(repo)
    sid, _ = first_request_leases(h)
    before = h.core.statistics(StatsQuery(0, 1, "plain")).models[0].success.ns
    leased_done(h, sid, 100, took_ns=1000)
    leased_done(h, sid, 101, failed=[0])
    st = h.core.statistics(StatsQuery(0, 1, "plain")).models[0]
    assert st.inference_count == 1 + 2 and st.execution_count == 3
    assert st.success.count == 2 and st.fail.count == 1
    assert st.success.ns - before == 1000       # to when it finished, not to when we heard
    assert instance(h, "plain").state is InstanceState.LEASED     # still lent


def test_a_queued_request_takes_the_lease_back(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h)
    # another frontend's request finds no idle instance: the lease is revoked
    h.core.handle(SubmitRequest(500, OTHER, "plain", 1, 1, h.clock()), [b"p"])
    assert h.to_worker(RevokeLease) == [(sid, RevokeLease(grant.lease_id))]
    assert sent(h, LeaseRevoked, FRONTEND) == [LeaseRevoked(grant.lease_id)]
    n = len(h.batches())
    h.core.handle(SubmitRequest(501, OTHER, "plain", 1, 1, h.clock()), [b"p"])
    assert len(h.to_worker(RevokeLease)) == 1    # once
    assert len(h.batches()) == n                 # nothing dispatched to a lent instance
    # the worker has run what it accepted under the lease: the scheduler dispatches again
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    assert [r.req_id for r in h.last_batch(sid).routes] == [500]
    h.finish(sid)
    h.finish(sid)
    # the queue is empty and the instance idle, but a lease that was just revoked is not
    # granted again at once (under load the scheduler serves)
    assert len(grants(h, OTHER)) == 0 and instance(h, "plain").state is InstanceState.IDLE
    h.clock.advance(COOLDOWN_NS / 1e9)
    h.core.handle(SubmitRequest(502, OTHER, "plain", 1, 1, h.clock()), [b"p"])
    h.finish(sid)
    assert [g.spawn_id for g in grants(h, OTHER)] == [sid]   # the last user gets it


def test_a_stale_lease_ended_is_ignored(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h)
    h.core.handle(LeaseEnded(sid, grant.lease_id + 7))
    assert instance(h, "plain").state is InstanceState.LEASED


def test_two_frontends_race_for_two_instances(repo):
    h = leased_harness(repo)
    a, b = h.core.versions[("pair", 1)].instances
    h.core.handle(SubmitRequest(10, FRONTEND, "pair", 1, 1, h.clock()), [b"p"])
    # one instance runs it; the other is idle with an empty queue: lent to that frontend
    [grant] = grants(h)
    leased = a if a.spawn_id == grant.spawn_id else b
    other = b if leased is a else a
    assert leased.state is InstanceState.LEASED and other.state is InstanceState.BUSY
    # the second frontend's request finds no idle instance: the lease is taken back, and the
    # request waits for whichever instance comes back first, never for the lent one
    h.core.handle(SubmitRequest(11, OTHER, "pair", 1, 1, h.clock()), [b"p"])
    assert h.to_worker(RevokeLease) == [(leased.spawn_id, RevokeLease(grant.lease_id))]
    assert [s for s, _, _ in h.batches()] == [other.spawn_id]
    h.finish(other.spawn_id)
    assert [r.req_id for r in h.last_batch(other.spawn_id).routes] == [11]
    h.core.handle(LeaseEnded(leased.spawn_id, grant.lease_id))
    assert leased.state is InstanceState.IDLE
    assert len(grants(h)) + len(grants(h, OTHER)) == 1     # cooldown: not lent again yet


def test_worker_death_while_leased_resubmits_alone_then_fails(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h)
    h.die(sid)                                   # while running a leased request
    [lost] = sent(h, LeaseLost, FRONTEND)
    assert lost.spawn_id == sid and lost.retry and "exited unexpectedly" in lost.reason
    assert not lost.clean                        # what went through it worker to worker too
    assert instance(h, "plain").state is not InstanceState.LEASED
    h.tick(0)                                    # restarting
    # the frontend submits what it had sent the dead worker: it runs again, alone
    h.core.handle(SubmitRequest(77, FRONTEND, "plain", 1, 1, h.clock(), lost=lost.reason),
                  [b"p"])
    h.ready_all()
    new = sid_of(h, "plain")
    assert [r.req_id for r in h.last_batch(new).routes] == [77]
    h.die(new)                                   # a poison request: no second retry
    err = h.results()[77]
    assert err.code is ErrorCode.INTERNAL and "retried alone" in err.error


def test_lost_request_of_a_model_without_retries_fails_with_the_reason(repo):
    h = leased_harness(repo)
    sid, _ = first_request_leases(h, "noretry")
    h.die(sid)
    [lost] = sent(h, LeaseLost, FRONTEND)
    h.core.handle(SubmitRequest(78, FRONTEND, "noretry", 1, 1, h.clock(), lost=lost.reason),
                  [b"p"])
    err = h.results()[78]
    assert err.code is ErrorCode.INTERNAL and err.error == lost.reason
    st = h.core.statistics(StatsQuery(0, 1, "noretry")).models[0]
    assert st.fail.count == 1


def test_leases_are_renewed_and_a_hung_leased_worker_is_killed(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h, "timed")
    h.tick(TERM_NS / 1e9)
    assert (sid, RevokeLease(grant.lease_id)) in h.to_worker(RevokeLease)
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    [_, renewed] = grants(h)                     # granted again at once: no cooldown
    assert renewed.lease_id > grant.lease_id
    h.tick(TERM_NS / 1e9)                        # revoked again; this time the worker hangs
    h.tick(1.0 + PING_TIMEOUT_S + 0.1)
    assert sid in h.port.killed
    h.kill_reported()
    [lost] = sent(h, LeaseLost, FRONTEND)
    assert not lost.retry and "execution timeout of 1 s" in lost.reason


def test_a_lease_is_not_renewed_while_a_request_may_wait_the_batchers_delay(repo):
    """Triton's optional-input test holds a lone request for a 5 s queue delay: a renewal
    after 2 s would make the worker run it then (its inbox wakes the batch's wait)."""
    h = leased_harness(repo)
    sid = sid_of(h, "batched_slow")
    h.submit("batched_slow")
    h.tick(5.01)                                 # the scheduler's batcher waits its delay too
    h.finish(sid)
    [grant] = grants(h)
    h.tick(TERM_NS / 1e9 + 1.0)
    assert h.to_worker(RevokeLease) == []
    h.tick(5.0)                                  # past the delay and the term: renewed
    assert (sid, RevokeLease(grant.lease_id)) in h.to_worker(RevokeLease)


def test_a_single_instance_plain_dynamic_batcher_is_leased_and_batches_count_once(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h, "batched")
    assert grant.depth == 0                     # any number in flight: they batch in the worker
    # a batch of three leased requests (batch size 2 each): the first record counts the
    # execution of 6 inferences, the others only their requests
    for req_id, executed in ((100, 6), (101, 0), (102, 0)):
        leased_done(h, sid, req_id, model="batched", executed=executed)
    st = h.core.statistics(StatsQuery(0, 1, "batched")).models[0]
    assert st.inference_count == 1 + 6 and st.execution_count == 1 + 1
    assert {b.batch_size: b.compute_infer.count for b in st.batch_stats} == {1: 1, 6: 1}


@pytest.mark.parametrize("model", ["batched_levels", "batched_policy"])
def test_a_batcher_with_queue_rules_lends_one_request_at_a_time(repo, model):
    """Priority levels and queue policies are rules of a queue: the one instance is lent with
    depth 1 (a leased request never queues, so they have nothing to act on), and the first
    request that would queue goes to the scheduler's queue and takes the lease back."""
    h = leased_harness(repo)
    sid = sid_of(h, model)
    h.submit(model)
    h.tick(0.01)
    h.finish(sid)
    [grant] = grants(h)
    assert (grant.spawn_id, grant.depth) == (sid, 1)
    assert instance(h, model).state is InstanceState.LEASED
    h.core.handle(SubmitRequest(600, FRONTEND, model, 1, 1, h.clock()), [b"p"])
    assert h.to_worker(RevokeLease) == [(sid, RevokeLease(grant.lease_id))]
    assert grants(h) == [grant]                 # not returned under the lease: it queues


def test_a_batcher_with_queue_rules_and_a_delay_is_not_leased(repo):
    """A request waiting out the delay is queued, and the queue's rules must see it (a bound
    of one refuses the next request)."""
    h = leased_harness(repo)
    sid = sid_of(h, "policy_delayed")
    h.submit("policy_delayed")
    h.tick(0.01)
    h.finish(sid)
    assert grants(h) == []


def test_under_a_revoked_lease_queued_requests_run_by_priority(repo):
    h = leased_harness(repo)
    sid = sid_of(h, "batched_levels")
    h.submit("batched_levels")
    h.tick(0.01)
    h.finish(sid)
    [grant] = grants(h)
    # while a leased request runs, a low and then a high priority request queue
    h.core.handle(SubmitRequest(700, OTHER, "batched_levels", 1, 1, h.clock(), priority=2),
                  [b"p"])
    h.core.handle(SubmitRequest(701, OTHER, "batched_levels", 1, 1, h.clock(), priority=1),
                  [b"p"])
    assert len(h.to_worker(RevokeLease)) == 1
    n = len(h.batches(sid))
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    h.tick(0.01)
    assert h.sent_to(sid)[n:] == [[701, 700]]       # one batch, the higher priority first


# ---- several instances with a plain dynamic batcher: each idle one lent, no depth limit ---------
def test_every_idle_instance_of_a_batching_pair_is_lent_to_one_frontend(repo):
    h = leased_harness(repo)
    a, b = h.core.versions[("batched_pair", 1)].instances
    h.submit("batched_pair")
    h.tick(0.01)                                 # the batcher's delay: it runs on one
    [(busy, _, _)] = h.batches()
    [first] = grants(h)                          # the other idles with the queue empty: lent
    assert first.depth == 0 and first.spawn_id != busy
    h.finish(busy)                               # the second turns idle: lent to the same one
    [_, second] = grants(h)
    assert second.depth == 0 and second.spawn_id == busy
    assert a.state is b.state is InstanceState.LEASED
    # a request sent before the frontend heard of the grants goes back to it
    h.core.handle(SubmitRequest(300, FRONTEND, "batched_pair", 1, 1, h.clock()), [b"p"])
    assert grants(h)[-1].returned == [300] and len(h.batches()) == 1
    # another frontend's request queues: every lease comes back, and nobody gets them at once
    h.core.handle(SubmitRequest(301, OTHER, "batched_pair", 1, 1, h.clock()), [b"p"])
    assert sorted(s for s, _ in h.to_worker(RevokeLease)) == sorted([a.spawn_id, b.spawn_id])
    assert sorted(m.lease_id for m in sent(h, LeaseRevoked, FRONTEND)) == \
        sorted([first.lease_id, second.lease_id])
    h.core.handle(LeaseEnded(first.spawn_id, first.lease_id))
    h.tick(0.01)
    assert [r.req_id for r in h.last_batch(first.spawn_id).routes] == [301]
    h.core.handle(LeaseEnded(second.spawn_id, second.lease_id))
    h.finish(first.spawn_id)
    assert grants(h, OTHER) == [] and len(grants(h)) == 3      # cooldown


def test_one_frontends_batching_queue_is_handed_over_to_the_idle_instances(repo):
    h = leased_harness(repo)
    h.core.handle(SubmitRequest(400, OTHER, "batched_pair", 1, 1, h.clock()), [b"p"])
    [(x, _, _)] = h.batches()
    [lent] = grants(h, OTHER)                    # the idle one goes to OTHER
    y = lent.spawn_id
    h.core.handle(SubmitRequest(401, FRONTEND, "batched_pair", 1, 1, h.clock()), [b"p"])
    assert h.to_worker(RevokeLease) == [(y, RevokeLease(lent.lease_id))]    # 401 queued
    h.core.handle(LeaseEnded(y, lent.lease_id))
    assert [r.req_id for r in h.last_batch(y).routes] == [401]
    for rid in (402, 403):                       # both instances busy: these queue
        h.core.handle(SubmitRequest(rid, FRONTEND, "batched_pair", 1, 1, h.clock()), [b"p"])
    h.clock.advance(COOLDOWN_NS / 1e9)
    n = len(h.batches())
    h.finish(x)          # idle, only FRONTEND's requests queued: they go back with a lease
    [grant] = grants(h)
    assert (grant.spawn_id, grant.depth, grant.returned) == (x, 0, [402, 403])
    assert len(h.batches()) == n and len(h.core.versions[("batched_pair", 1)].queue) == 0
    h.finish(y)                                  # and the other, once it is done
    assert [g.spawn_id for g in grants(h)] == [x, y]


def test_a_lease_of_a_pair_is_renewed_while_the_other_stays(repo):
    h = leased_harness(repo)
    h.submit("batched_pair")
    h.tick(0.01)
    [(busy, _, _)] = h.batches()
    h.finish(busy)
    first, second = grants(h)
    h.clock.advance(TERM_NS / 2e9)
    leased_done(h, second.spawn_id, 500, model="batched_pair")      # progress on the second
    h.tick(TERM_NS / 2e9)
    assert h.to_worker(RevokeLease) == [(first.spawn_id, RevokeLease(first.lease_id))]
    h.core.handle(LeaseEnded(first.spawn_id, first.lease_id))
    renewed = grants(h)[-1]                       # no cooldown, same frontend, beside the other
    assert renewed.spawn_id == first.spawn_id and renewed.lease_id > second.lease_id


def test_unload_takes_the_lease_back_and_stops_after_it_ended(repo):
    h = leased_harness(repo, model_control_mode="explicit", load_models=["plain"])
    sid, grant = first_request_leases(h)
    h.core.handle(ControlRequest(FRONTEND, 9, ControlAction.UNLOAD, "plain"))
    assert (sid, RevokeLease(grant.lease_id)) in h.to_worker(RevokeLease)
    assert h.to_worker(Shutdown) == []           # what it accepted under the lease runs first
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    assert h.to_worker(Shutdown) == [(sid, Shutdown())]
    assert h.states("plain")[1][0] is ModelState.UNAVAILABLE
    h.die(sid, rc=0)
    [lost] = sent(h, LeaseLost, FRONTEND)        # anything sent after it stopped comes back
    # told to stop and exited 0: it handed back or ran all it was sent, so a request that went
    # through it worker to worker is answered by a later step (frontend/engine_client.py)
    assert lost.clean
    h.core.handle(SubmitRequest(79, FRONTEND, "plain", 1, 1, h.clock(), lost=lost.reason),
                  [b"p"])
    assert h.results()[79].code is ErrorCode.UNAVAILABLE


def test_a_worker_told_to_stop_that_did_not_exit_0_is_not_a_clean_stop(repo):
    h = leased_harness(repo, model_control_mode="explicit", load_models=["plain"])
    sid, grant = first_request_leases(h)
    h.core.handle(ControlRequest(FRONTEND, 9, ControlAction.UNLOAD, "plain"))
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    h.die(sid, rc=-9)                            # killed while it stopped: it may have lost some
    [lost] = sent(h, LeaseLost, FRONTEND)
    assert not lost.clean


def test_no_lease_while_the_server_stops(repo):
    h = leased_harness(repo)
    sid = sid_of(h, "plain")
    h.submit("plain")
    h.core.begin_shutdown()
    h.finish(sid)
    assert grants(h) == []


def test_leases_can_be_turned_off(repo):
    h = Harness(repo, instance_leases=False).start()
    sid = sid_of(h, "plain")
    h.submit("plain")
    h.finish(sid)
    assert grants(h) == [] and instance(h, "plain").state is InstanceState.IDLE


# ---- single-instance versions: no depth limit, the queue handed over ---------------------------
def test_a_single_instance_is_lent_without_a_limit_and_one_of_several_one_at_a_time(repo):
    h = leased_harness(repo)
    _, grant = first_request_leases(h)
    assert grant.depth == 0 and grant.returned == []
    h.submit("pair")                             # runs on one; the other idles: lent
    [pair] = [g for g in grants(h) if g.model == "pair"]
    assert pair.depth == 1


def test_one_frontends_queue_is_handed_over_with_the_lease(repo):
    h = leased_harness(repo)
    sid = sid_of(h, "plain")
    first, *queued = (h.submit("plain") for _ in range(3))
    assert grants(h) == []                       # the instance is busy: they queue
    h.finish(sid)                                # idle, and only this frontend's requests wait
    [grant] = grants(h)
    assert grant.depth == 0 and grant.returned == queued
    assert len(h.core.versions[("plain", 1)].queue) == 0
    assert len(h.batches()) == 1                 # the frontend sends them, not the scheduler
    assert instance(h, "plain").state is InstanceState.LEASED


def test_no_hand_over_while_two_frontends_queue(repo):
    h = leased_harness(repo)
    sid = sid_of(h, "plain")
    h.submit("plain")
    h.submit("plain")
    h.core.handle(SubmitRequest(500, OTHER, "plain", 1, 1, h.clock()), [b"p"])
    h.finish(sid)
    assert grants(h) == [] and grants(h, OTHER) == []
    assert len(h.batches()) == 2                 # the scheduler serves both, in order


def test_a_request_sent_before_the_grant_arrived_is_given_back(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h)
    rid = h.submit("plain")                      # crossed the grant on its way
    again = grants(h)[-1]
    assert (again.lease_id, again.returned, again.depth) == (grant.lease_id, [rid], 0)
    assert h.to_worker(RevokeLease) == []
    # the frontend could not use its lease (the worker's inbox full): it queues, and the
    # lease comes back
    h.core.handle(SubmitRequest(600, FRONTEND, "plain", 1, 1, h.clock(), no_lease=True),
                  [b"p"])
    assert h.to_worker(RevokeLease) == [(sid, RevokeLease(grant.lease_id))]
    h.core.handle(LeaseEnded(sid, grant.lease_id))
    assert [r.req_id for r in h.last_batch(sid).routes] == [600]


def test_a_lease_that_makes_progress_is_not_renewed(repo):
    h = leased_harness(repo)
    sid, grant = first_request_leases(h, "timed")
    for _ in range(5):
        h.tick(TERM_NS / 1e9 / 2)
        h.core.handle(LeasedDone([LeasedRecord(sid, "timed", 1, 1, h.clock(), h.clock(),
                                               1, 1, 1)]))
    assert h.to_worker(RevokeLease) == []        # its progress shows it is alive
    h.tick(TERM_NS / 1e9)
    assert h.to_worker(RevokeLease) == [(sid, RevokeLease(grant.lease_id))]


def test_a_dynamic_batching_queue_of_one_frontend_is_handed_over_with_the_lease(repo):
    h = leased_harness(repo)
    sid = sid_of(h, "batched")
    reqs = [h.submit("batched") for _ in range(3)]
    h.tick(0.01)
    [(_, batch, _)] = h.batches(sid)            # the first went as a batch; the rest queue
    queued = [r for r in reqs if r not in [route.req_id for route in batch.routes]]
    h.finish(sid)                                # idle, one frontend's requests queued
    h.tick(0.01)
    [grant] = grants(h)
    assert grant.depth == 0 and sorted(grant.returned) == sorted(queued)
    assert len(h.batches(sid)) == 1 and len(h.core.versions[("batched", 1)].queue) == 0


BLS = 1 << 24       # a worker's BLS client (workers/python_backend/bls.py)


def test_a_bls_client_never_gets_a_lease_nor_a_hand_over(repo):
    """Its requests carry a chain; it said hello without leases. A queue of its requests on a
    single instance is dispatched by the scheduler, not handed over under a lease it could not
    use (it would lose them)."""
    h = leased_harness(repo)
    h.core.handle(FrontendHello(BLS, "inproc://bls", leases=False))
    sid = sid_of(h, "plain")
    for rid in (700, 701, 702):
        h.core.handle(SubmitRequest(rid, BLS, "plain", 1, 1, h.clock(), chain=["caller"]),
                      [b"p"])
    h.finish(sid)
    h.finish(sid)
    assert grants(h, BLS) == [] and grants(h) == []
    assert len(h.batches()) == 3


def test_a_bls_request_that_would_wait_for_its_own_chain_is_refused(repo):
    h = Harness(repo).start()
    h.core.handle(FrontendHello(BLS, "inproc://bls", leases=False))
    sid = sid_of(h, "plain")
    h.submit("plain")                            # the instance is busy with the caller's batch
    h.core.handle(SubmitRequest(800, BLS, "plain", 1, 1, h.clock(), chain=["plain"]), [b"p"])
    refused = h.results()[800]
    assert refused.code == ErrorCode.UNAVAILABLE and "would wait for itself" in refused.error
    h.finish(sid)                                # idle now: the same request runs
    h.core.handle(SubmitRequest(801, BLS, "plain", 1, 1, h.clock(), chain=["plain"]), [b"p"])
    assert 801 not in h.results() and len(h.batches()) == 2


def test_a_bls_request_to_its_own_model_takes_another_leased_instance(repo):
    """Triton's bls_parameters test: a model with several instances calls itself. Every
    instance is leased (a plain dynamic batcher); the one running the caller is not free, the
    other is: the request queues, its lease comes back, and it runs there."""
    h = leased_harness(repo)
    a, b = h.core.versions[("batched_pair", 1)].instances
    h.submit("batched_pair")
    h.tick(0.01)
    [(busy, _, _)] = h.batches()
    h.finish(busy)
    assert a.state is b.state is InstanceState.LEASED
    caller = a if a.spawn_id == busy else b
    other = b if caller is a else a
    h.core.handle(FrontendHello(BLS + caller.spawn_id, "inproc://bls", leases=False))
    h.core.handle(SubmitRequest(900, BLS + caller.spawn_id, "batched_pair", 1, 1, h.clock(),
                                chain=["batched_pair"]), [b"p"])
    assert 900 not in h.results()                           # not refused
    revoked = {s: m for s, m in h.to_worker(RevokeLease)}
    assert sorted(revoked) == sorted([a.spawn_id, b.spawn_id])
    h.core.handle(LeaseEnded(other.spawn_id, revoked[other.spawn_id].lease_id))
    h.tick(0.01)
    assert [r.req_id for r in h.last_batch(other.spawn_id).routes] == [900]


def test_a_bls_request_from_the_only_instance_leased_to_run_it_is_refused(repo):
    h = leased_harness(repo)
    h.submit("plain")
    sid = sid_of(h, "plain")
    h.finish(sid)
    assert h.core.versions[("plain", 1)].instances[0].state is InstanceState.LEASED
    h.core.handle(FrontendHello(BLS + sid, "inproc://bls", leases=False))
    h.core.handle(SubmitRequest(901, BLS + sid, "plain", 1, 1, h.clock(), chain=["plain"]),
                  [b"p"])
    assert "would wait for itself" in h.results()[901].error


def test_response_cache_records_reach_the_statistics(repo):
    """A frontend's cache records ride with its leased records: a hit counts as a success
    that ran nothing, a miss as its lookup plus its insert; a version that is gone is skipped."""
    h = leased_harness(repo)
    h.core.handle(LeasedDone([], [CacheRecord("plain", 1, True, 2_000, 9_000),
                                  CacheRecord("plain", 1, False, 3_000),
                                  CacheRecord("plain", 1, False, 4_000, count=0),
                                  CacheRecord("plain", 7, True, 1, 1)]))
    st = h.core.statistics(StatsQuery(0, 1, "plain")).models[0]
    assert (st.cache_hit.count, st.cache_hit.ns) == (1, 2_000)
    assert (st.cache_miss.count, st.cache_miss.ns) == (1, 7_000)
    assert (st.success.count, st.success.ns) == (1, 9_000)
    assert st.inference_count == 0 and st.execution_count == 0
