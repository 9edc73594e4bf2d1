"""Readiness a model decides itself, in the scheduler (engine/readiness.py): one check at a time
per instance, every instance must say ready, a dead or restarting instance is not ready, and
answers nobody waits for are dropped. With a recording port and a fake clock."""
from types import SimpleNamespace

from shmserve.engine.readiness import STALE_NS, ReadinessChecks
from shmserve.engine.states import InstanceState, ModelState
from shmserve.ipc.messages.to_frontend import ReadinessReply
from shmserve.ipc.messages.to_scheduler import ReadinessQuery, ReadinessReport
from shmserve.ipc.messages.to_worker import CheckReadiness


class Port:
    def __init__(self):
        self.frontends: list[tuple[int, object]] = []
        self.workers: list[tuple[int, object]] = []

    def send_frontend(self, frontend, msg):
        self.frontends.append((frontend, msg))

    def send_worker(self, spawn_id, msg, payloads=()):
        self.workers.append((spawn_id, msg))


def version(*states: InstanceState, state=ModelState.READY):
    return SimpleNamespace(state=state, instances=[SimpleNamespace(spawn_id=10 + i, state=s)
                                                   for i, s in enumerate(states)])


def setup():
    now = [0]
    port = Port()
    return port, ReadinessChecks(port, lambda: now[0]), now


def checks_sent(port) -> dict[int, int]:
    return {sid: msg.check for sid, msg in port.workers if isinstance(msg, CheckReadiness)}


def test_every_instance_is_asked_and_all_must_say_ready():
    port, r, _ = setup()
    r.query(ReadinessQuery(1, 7, "m", 1), version(InstanceState.IDLE, InstanceState.BUSY))
    sent = checks_sent(port)
    assert set(sent) == {10, 11} and port.frontends == []
    r.report(ReadinessReport(10, sent[10], True))
    assert port.frontends == []                     # one still to answer
    r.report(ReadinessReport(11, sent[11], False))
    assert port.frontends == [(1, ReadinessReply(7, False))]


def test_queries_while_a_check_runs_share_its_answer():
    port, r, _ = setup()
    ver = version(InstanceState.LEASED)
    r.query(ReadinessQuery(1, 1, "m", 1), ver)
    r.query(ReadinessQuery(2, 2, "m", 1), ver)
    assert len(port.workers) == 1                   # one call at a time per instance
    r.report(ReadinessReport(10, port.workers[0][1].check, True))
    assert sorted(port.frontends) == [(1, ReadinessReply(1, True)), (2, ReadinessReply(2, True))]
    r.query(ReadinessQuery(1, 3, "m", 1), ver)      # the next query asks again
    assert len(port.workers) == 2


def test_a_version_that_is_not_running_everywhere_is_not_ready_at_once():
    for ver in (version(InstanceState.IDLE, InstanceState.BACKOFF),     # one died, restarting
                version(InstanceState.STARTING), version(), None,
                version(InstanceState.IDLE, state=ModelState.UNAVAILABLE)):
        port, r, _ = setup()
        r.query(ReadinessQuery(1, 5, "m", 1), ver)
        assert port.workers == [] and port.frontends == [(1, ReadinessReply(5, False))]


def test_a_worker_that_dies_during_its_check_makes_the_version_not_ready():
    port, r, _ = setup()
    r.query(ReadinessQuery(1, 4, "m", 1), version(InstanceState.IDLE))
    r.worker_gone(10)
    assert port.frontends == [(1, ReadinessReply(4, False))]
    r.worker_gone(10)                               # nothing more to answer
    assert len(port.frontends) == 1


def test_late_and_unknown_answers_are_ignored_and_stale_checks_are_sent_again():
    port, r, now = setup()
    ver = version(InstanceState.IDLE)
    r.query(ReadinessQuery(1, 1, "m", 1), ver)
    first = port.workers[0][1].check
    r.report(ReadinessReport(10, first + 100, True))     # not the check it was asked
    r.report(ReadinessReport(99, first, True))           # not a worker it asked
    assert port.frontends == []
    now[0] = STALE_NS + 1       # the frontend gave up long ago: a new query asks again
    r.query(ReadinessQuery(1, 2, "m", 1), ver)
    second = port.workers[-1][1].check
    assert len(port.workers) == 2 and second != first and r.queries[0].query_id == 2
    r.report(ReadinessReport(10, first, True))           # the old check's answer: ignored
    assert port.frontends == []
    r.report(ReadinessReport(10, second, True))
    assert port.frontends == [(1, ReadinessReply(2, True))]
