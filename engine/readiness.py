"""Readiness that a model decides itself (a python model's ``is_ready()``), in the scheduler.

A frontend asks (ReadinessQuery) for a version it sees READY whose model decides its own
readiness. The scheduler asks each live instance's worker (CheckReadiness), one check at a
time per instance: a query that comes while an instance's check runs waits for that answer
instead of starting another, as Triton shares one call among concurrent readiness requests.
The version is ready when every instance says so; an instance that is not running (it died
and waits to restart) makes it not ready, as a dead stub makes a Triton model not ready. The
frontend waits 5 s at most (Triton's timeout for ``is_ready()``), so a query whose answer never
comes is dropped here after that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shmserve.engine.models import ModelVersion
from shmserve.engine.port import SchedulerPort
from shmserve.engine.states import InstanceState, ModelState
from shmserve.ipc.messages.to_frontend import ReadinessReply
from shmserve.ipc.messages.to_scheduler import ReadinessQuery, ReadinessReport
from shmserve.ipc.messages.to_worker import CheckReadiness

# after this, nobody waits for an answer any more: the frontend has given up (5 s) and a new
# query asks again
STALE_NS = 6_000_000_000
# running instances, which a worker answers for
_RUNNING = (InstanceState.IDLE, InstanceState.BUSY, InstanceState.LEASED)


@dataclass
class _Query:
    frontend: int
    query_id: int
    started: int
    waiting: set[int] = field(default_factory=set)      # spawn ids yet to answer
    ready: bool = True


class ReadinessChecks:
    def __init__(self, port: SchedulerPort, clock: Callable[[], int]):
        self.port = port
        self.clock = clock
        self.checks: dict[int, tuple[int, int]] = {}    # spawn id -> (check, sent at)
        self.queries: list[_Query] = []
        self.next_check = 1

    def query(self, msg: ReadinessQuery, ver: ModelVersion | None) -> None:
        now = self.clock()
        self._forget_stale(now)
        if ver is None or ver.state != ModelState.READY or not ver.instances or \
                any(i.state not in _RUNNING for i in ver.instances):
            self.port.send_frontend(msg.frontend, ReadinessReply(msg.query_id, False))
            return
        q = _Query(msg.frontend, msg.query_id, now, {i.spawn_id for i in ver.instances})
        self.queries.append(q)
        for sid in q.waiting:
            if sid not in self.checks:
                self.checks[sid] = (self.next_check, now)
                self.port.send_worker(sid, CheckReadiness(self.next_check))
                self.next_check += 1

    def report(self, msg: ReadinessReport) -> None:
        sent = self.checks.get(msg.spawn_id)
        if sent is None or sent[0] != msg.check:
            return          # an answer nobody waits for any more
        del self.checks[msg.spawn_id]
        self._answered(msg.spawn_id, msg.ready)

    def worker_gone(self, spawn_id: int) -> None:
        """Its check will never be answered: the queries waiting for it are not ready."""
        if self.checks.pop(spawn_id, None) is not None:
            self._answered(spawn_id, False)

    def _answered(self, spawn_id: int, ready: bool) -> None:
        still = []
        for q in self.queries:
            if spawn_id in q.waiting:
                q.waiting.discard(spawn_id)
                q.ready = q.ready and ready
                if not q.waiting:
                    self.port.send_frontend(q.frontend, ReadinessReply(q.query_id, q.ready))
                    continue
            still.append(q)
        self.queries = still

    def _forget_stale(self, now: int) -> None:
        if self.queries and now - self.queries[0].started > STALE_NS:
            self.queries = [q for q in self.queries if now - q.started <= STALE_NS]
        for sid, (_, sent) in list(self.checks.items()):
            if now - sent > STALE_NS:
                del self.checks[sid]
