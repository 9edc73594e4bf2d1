"""Pipelines lent to run worker to worker (workers/leases/chain.py has the workers' part).

An ensemble whose steps run one after the other (engine/ensemble/plan.py ``chained``) runs
without the scheduler once its frontend holds leases on every step's version. This is the
scheduler's part: when to lend those steps, and to whom. Not after each step of a run here (the
run's next step would take the lease back at once), but when a run ends and the steps are idle;
and under load, a request that comes while runs are under way is held until they end, then
returned to its frontend with the leases, as a plain model's queue is handed over with its lease.

Pure: it acts through the core it belongs to (its port, leases and lifecycle).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shmserve.engine.ensemble.plan import EnsemblePlan
from shmserve.engine.leases import unlimited
from shmserve.engine.models import ModelVersion
from shmserve.ipc.messages.common import ENSEMBLE_FRONTEND, ErrorCode
from shmserve.ipc.messages.to_frontend import LeaseGranted
from shmserve.ipc.messages.to_scheduler import SubmitRequest

if TYPE_CHECKING:
    from shmserve.engine.core import SchedulerCore


class ChainLending:
    def __init__(self, core: "SchedulerCore") -> None:
        self.core = core
        # ensemble version -> requests of one frontend held while the ensemble's runs here
        # end, then returned to it with its steps' leases (lend)
        self.held: dict[ModelVersion, list[tuple[SubmitRequest, bytes]]] = {}

    def steps(self, plan: EnsemblePlan) -> list[ModelVersion] | None:
        """The versions serving an ensemble's chained steps now; None if one has none, or if
        the scheduler runs its steps now (EnsemblePlan.chained)."""
        chained = plan.chained()
        if not chained:
            return None
        steps = []
        for step in chained:
            v = self.core.lifecycle.ready_version(step.model, step.version)
            if v is None:
                return None
            steps.append(self.core.versions[(step.model, v)])
        return steps

    def lost(self, ver: ModelVersion, msg: SubmitRequest) -> bool:
        """A request of ``ver`` ran worker to worker and a worker of its route died: whether
        it fails now (the worker died of it, its model does not retry, or the server stops),
        answered as a request of a dead batch would be, named by the step whose model's
        worker died; otherwise it runs again here."""
        core = self.core
        blamed = core.deaths.blamed(msg.frontend, msg.req_id)
        if not blamed and msg.lost_retry and not core.stopping:
            return False
        reason = blamed or msg.lost
        plan = ver.ensemble
        step = next((s for s in plan.chain if f"model '{s.model}'" in reason), None) \
            if plan is not None else None
        where = f", {step.label}" if step is not None else ""
        ver.stats.failed("OTHER", core.clock() - msg.received_ns)
        core.reply_error(msg.frontend, msg.req_id, ver.name, ver.version, ErrorCode.INTERNAL,
                         f"in ensemble '{ver.name}'{where}: {reason}")
        return True

    def hold(self, ver: ModelVersion, msg: SubmitRequest, payload) -> bool:
        """A request of an ensemble that may run worker to worker, from a frontend that could
        hold leases on all its steps (each takes any number in flight), while runs of it end
        here: held, to go back to that frontend with the leases once they have (lend).
        Under load the ensemble moves to the workers this way, as a plain model's queue is
        handed over with its lease."""
        plan = ver.ensemble
        frontend = msg.frontend
        if plan is None or not plan.chained() or msg.lost or msg.no_lease or msg.trace or \
                frontend not in self.core.lease_takers or frontend > ENSEMBLE_FRONTEND or \
                self.core.stopping:
            return False        # (a BLS client never runs an ensemble worker to worker)
        held = self.held.get(ver)
        if held and held[0][0].frontend != frontend or any(
                run.version is ver and run.head.frontend != frontend
                for run in self.core.ensembles.runs.values()):
            # frontends compete for it: none is lent it, and nothing held waits for them
            self.release(ver)
            return False
        steps = self.steps(plan)
        if steps is None or not all(unlimited(v) and self.core.leases.can_hand_over(v, frontend)
                                    for v in steps):
            return False
        self.held.setdefault(ver, []).append((msg, payload))
        self.lend(ver, frontend)
        return True

    def lend(self, ver: ModelVersion, frontend: int) -> None:
        """A run of ensemble ``ver`` for ``frontend`` ended, or a request of it is held: when
        its steps' instances are idle, they are lent to that frontend (which then sends the
        ensemble's requests worker to worker) with the requests held for it. Not after each
        step: the run's next step would take the lease back at once."""
        held = self.held.pop(ver, [])
        plan = ver.ensemble
        assert plan is not None
        steps = self.steps(plan)
        if frontend in self.core.lease_takers and frontend < ENSEMBLE_FRONTEND and \
                steps is not None and \
                self.lend_steps(steps, frontend):
            if held:
                lease = self.core.leases.by_version[steps[-1]][0]
                self.core.port.send_frontend(frontend, LeaseGranted(
                    lease.lease_id, steps[-1].name, steps[-1].version, lease.instance.spawn_id,
                    lease.depth, [m.req_id for m, _ in held]))
            return
        if not held:
            return
        if any(run.version is ver for run in self.core.ensembles.runs.values()):
            self.held[ver] = held         # the next run to end tries again
            return
        for msg, payload in held:               # nothing will end: they run here
            self.core.ensembles.start(ver, plan, msg, payload)

    def release(self, ver: ModelVersion) -> None:
        """The requests held for ``ver`` run here."""
        plan = ver.ensemble
        assert plan is not None
        for msg, payload in self.held.pop(ver, []):
            self.core.ensembles.start(ver, plan, msg, payload)

    def lend_steps(self, steps: list[ModelVersion], frontend: int) -> bool:
        """Lease each step's idle instances to ``frontend`` (those it holds already stay);
        False when one cannot be lent now (busy, requests queued, or lent elsewhere)."""
        for v in steps:
            self.core.leases.note_request(v, frontend)
        for v in steps:
            held = self.core.leases.by_version.get(v)
            if held:
                if any(h.frontend != frontend or h.revoked_ns for h in held):
                    return False
                continue
            limiter = self.core.rate_limiter
            if limiter is not None and limiter.constrained(v):
                if not self.core.lend_limited(v, limiter, frontend):
                    return False
            elif len(v.queue) or not v.queue.idle or \
                    not self.core.leases.offer(v, v.queue.idle, frontend):
                return False
        return True
