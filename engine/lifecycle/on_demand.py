"""``OnDemand``: ``--model-control-mode=on_demand`` inside the scheduler core.

Every model of the repository is listed (its config read, nothing started) and loads at its
first request. Such a request is held here, in a waiting list per model, while the model loads:
once the model is READY it is submitted as if it had just arrived; if the load fails it gets the
failure (INVALID_ARG: the model cannot load as it is, as a load request would say); if the load
takes longer than ``--model-load-wait-secs`` it gets UNAVAILABLE ("still loading"). What loads
when, what is evicted for it and what is unloaded when idle is ``ModelResidency``'s decision
(engine/lifecycle/residency.py); this class feeds it the facts (requests, the lifecycle's states, the
workers' memory as the port reads it) and carries out its decisions through the lifecycle.

Socket-free like the rest of the core: it acts through the core (replies, submit), the
lifecycle (loads, unloads) and the port (memory readings); tests drive it with the core's fake
port and clock (tests/engine/test_residency.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmserve.engine.lifecycle.residency import (
    MEASURE_INTERVAL_S,
    WAIT_BOUNDS_US,
    ModelResidency,
    Residence,
    mib,
)
from shmserve.engine.states import InstanceState
from shmserve.ipc.messages.common import ControlAction, ErrorCode, ModelState
from shmserve.ipc.messages.to_frontend import OnDemandModel, OnDemandStats
from shmserve.ipc.messages.to_scheduler import ControlRequest, SubmitRequest

if TYPE_CHECKING:
    from shmserve.engine.core import SchedulerCore
    from shmserve.engine.models import ModelVersion

log = logging.getLogger("shmserve.scheduler")

# Models measured per housekeeping pass at most (each reading costs a few hundred µs).
MEASURE_BATCH = 16


@dataclass(eq=False)
class Held:
    msg: SubmitRequest
    payload: bytes
    since: float                # seconds on the core's clock


class OnDemand:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self.lifecycle = core.lifecycle
        s = core.settings
        self.wait_s = s.model_load_wait_secs
        self.policy = ModelResidency(s.model_memory_budget, s.model_idle_unload_secs, self.now)
        self.held: dict[str, list[Held]] = {}       # model -> requests waiting for its load
        # model -> load requests (the API's) waiting for room, with when they came
        self.controls: dict[str, list[tuple[ControlRequest, float]]] = {}
        self.scheduling = False
        self.again = False
        self.lifecycle.on_demand = self

    def now(self) -> float:
        return self.core.clock() / 1e9

    def start(self) -> None:
        """The repository was read (ModelLifecycle.load_initial): every model is known."""
        for name, entry in self.lifecycle.entries.items():
            self.describe(name, entry.config)
        log.info("on-demand loading: %d model(s) listed, memory budget %s, idle unload %s",
                 len(self.lifecycle.entries),
                 mib(self.policy.budget) if self.policy.budget else "none",
                 f"{self.policy.idle_unload_s:g} s" if self.policy.idle_unload_s else "never")

    def describe(self, name: str, config) -> None:
        if config is None:
            self.policy.add(name)
            return
        composing = list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step))
        instances = 0 if composing else sum(
            g.count * max(1, len(g.gpus)) for g in config.instance_group) or 1
        self.policy.add(name, instances, composing)

    # ---- requests ---------------------------------------------------------------------------------
    def used(self, name: str) -> None:
        self.policy.use(name)

    def finished(self, ver: ModelVersion) -> None:
        """A batch of ``ver`` finished: it is recently used, and may be evicted for a waiting
        load now."""
        self.policy.use(ver.name)
        if self.policy.queue and not len(ver.queue):
            self.schedule()

    def hold(self, msg: SubmitRequest, payload) -> bool:
        """A request for a version that is not READY: held while its model loads (True), or
        not for us (False: the core answers it as in the other modes)."""
        name = msg.model
        entry = self.lifecycle.entries.get(name)
        if entry is None or entry.error or self.core.stopping:
            return False
        if self.residence(name) == Residence.IN:
            return False        # loaded, but not that version
        reason = self.policy.request(name)
        if reason:
            self.core.reply_error(msg.frontend, msg.req_id, name, msg.version,
                                  ErrorCode.INVALID_ARG, f"load failed for model '{name}': {reason}")
            return True
        self.held.setdefault(name, []).append(Held(msg, payload, self.now()))
        self.schedule()
        return True

    def held_from(self, frontend: int) -> list[tuple[int, int]]:
        """(frontend, request id) of the requests of ``frontend`` waiting for a load."""
        return [(h.msg.frontend, h.msg.req_id) for items in self.held.values() for h in items
                if h.msg.frontend == frontend]

    def cancel(self, frontend: int, req_id: int) -> bool:
        for name, items in self.held.items():
            for i, h in enumerate(items):
                if h.msg.frontend == frontend and h.msg.req_id == req_id:
                    del items[i]
                    self.core.reply_error(frontend, req_id, name, h.msg.version,
                                          ErrorCode.CANCELLED,
                                          "the request was cancelled by the client")
                    return True
        return False

    def control(self, req: ControlRequest) -> None:
        """The load API: in this mode a load waits for room like any other; unload as usual."""
        lc = self.lifecycle
        name = req.name
        if req.action != ControlAction.LOAD:
            lc.control(req)
            self.policy.drop(name)
            self.fail_held(name, ErrorCode.UNAVAILABLE, f"model '{name}' was unloaded")
            self.sync_all()
            self.schedule()
            return
        self.policy.retry_now(name)
        if name in lc.loads or self.residence(name) == Residence.IN or \
                (not req.upload_dir and name not in lc.repository.model_dirs()):
            # joins the load in progress; reloads a loaded model (the new version's workers
            # count from their first reading); or is refused with the reason
            lc.control(req)
            self.sync(name)
            return
        reason = self.policy.request(name)
        if reason:
            self.give_up(req, ErrorCode.INVALID_ARG, f"load failed for model '{name}': {reason}")
            return
        self.controls.setdefault(name, []).append((req, self.now()))
        self.schedule()

    def give_up(self, req: ControlRequest, code: ErrorCode, error: str) -> None:
        if req.upload_dir and self.lifecycle.uploads.adopt(req.upload_dir):
            self.lifecycle.sweep_uploads()      # nothing loads from it: removed
        self.core.reply_control((req.frontend, req.query_id), code, error)

    # ---- what the lifecycle tells -------------------------------------------------------------------
    def need(self, name: str) -> None:
        if not self.policy.request(name):
            self.schedule()

    def pending(self, name: str) -> bool:
        return self.policy.waiting(name)

    def load_ended(self, name: str, error: str) -> None:
        entry = self.lifecycle.entries.get(name)
        if entry is not None:
            self.describe(name, entry.config)
        if error:
            self.policy.load_failed(name, error)
        self.sync(name)
        if not error:
            self.measure(name)
        held = self.held.pop(name, [])
        now = self.now()
        for h in held:
            if error:
                self.core.reply_error(h.msg.frontend, h.msg.req_id, name, h.msg.version,
                                      ErrorCode.INVALID_ARG,
                                      f"load failed for model '{name}': {error}")
            else:
                self.policy.waited(now - h.since)
                self.core.submit(h.msg, h.payload)
        self.schedule()

    def exited(self, name: str) -> None:
        """A worker of ``name`` ended: its memory may be free now."""
        before = self.policy.get(name).state
        self.sync(name)
        if before != self.policy.get(name).state:
            self.schedule()

    # ---- the lifecycle's facts -> the policy ------------------------------------------------------
    def residence(self, name: str) -> Residence:
        lc = self.lifecycle
        if name in lc.loads:
            return Residence.LOADING
        if lc.ready_version(name, -1) is not None:
            return Residence.IN
        if any(ver.name == name for ver, _ in self.core.supervisor.by_spawn.values()):
            return Residence.LEAVING
        return Residence.OUT

    def sync(self, name: str) -> None:
        self.policy.set_state(name, self.residence(name))

    def sync_all(self) -> None:
        lc = self.lifecycle
        ready = {v.name for v in lc.versions.values() if v.state == ModelState.READY}
        live = {ver.name for ver, _ in self.core.supervisor.by_spawn.values()}
        for name in self.policy.models:
            self.policy.set_state(name, Residence.LOADING if name in lc.loads else
                                  Residence.IN if name in ready else
                                  Residence.LEAVING if name in live else Residence.OUT)

    def measure(self, name: str) -> None:
        port = self.core.port
        total = 0
        for sid, (ver, _) in self.core.supervisor.by_spawn.items():
            if ver.name == name:
                total += port.memory(sid) or 0
        self.policy.measured(name, total)

    def busy_names(self) -> tuple[set[str], dict[str, ModelVersion]]:
        """Models that must not be unloaded now: requests held for them, queued, executing or
        in an ensemble run; and the versions lent to a frontend (the scheduler does not see
        the requests sent under a lease until they are done: such a model is busy until its
        lease is taken back and the worker says it is done, LeaseEnded)."""
        busy = {name for name, items in self.held.items() if items}
        busy.update(self.controls)
        leased: dict[str, ModelVersion] = {}
        for ver in self.lifecycle.live_versions():
            if len(ver.queue) or any(i.state == InstanceState.BUSY for i in ver.instances):
                busy.add(ver.name)
            elif any(i.state == InstanceState.LEASED for i in ver.instances):
                leased[ver.name] = ver
        for run in self.core.ensembles.runs.values():
            busy.add(run.version.name)
        return busy, leased

    # ---- decisions ----------------------------------------------------------------------------------
    def schedule(self) -> None:
        """Start the loads that fit, evict for the next one (engine/lifecycle/residency.py)."""
        if self.scheduling:         # a load that ended inside a load that started: go again
            self.again = True
            return
        self.scheduling = True
        try:
            while True:
                self.again = False
                busy, leased = self.busy_names()
                plan = self.policy.plan(lambda n: n in busy or n in leased)
                for name, reason in plan.refuse:
                    self.fail_held(name, ErrorCode.INVALID_ARG,
                                   f"load failed for model '{name}': {reason}")
                for name in plan.evict:
                    self.evict(name, idle=False)
                if plan.short and leased:
                    # models that would make room if their leases were back: take them back;
                    # each LeaseEnded plans again (finished), and then they may go
                    for name in self.policy.victims(plan.short, busy.__contains__):
                        ver = leased.get(name)
                        if ver is not None:
                            self.core.leases.revoke(ver)
                for name in plan.load:
                    self.begin_load(name)
                if not plan.load and not self.again:
                    return
        finally:
            self.scheduling = False

    def begin_load(self, name: str) -> None:
        self.policy.set_state(name, Residence.LOADING)      # charged from now on
        controls = self.controls.pop(name, [])
        log.info("on-demand: loading model '%s' (%d request(s) waiting; %s of %s in use)",
                 name, len(self.held.get(name, ())), mib(self.policy.charged()),
                 mib(self.policy.budget) if self.policy.budget else "no budget")
        if controls:
            for req, _ in controls:     # the first starts the load, the others join it
                self.lifecycle.control(req)
        else:
            self.lifecycle.start_load(name)
        self.sync(name)

    def evict(self, name: str, idle: bool) -> None:
        m = self.policy.get(name)
        log.info("on-demand: unloading model '%s' (%s; %s)", name,
                 "idle" if idle else "least recently used, to make room", mib(m.charged))
        self.policy.evicted(name, idle)
        self.lifecycle.unload(name, None)
        self.sync(name)

    def fail_held(self, name: str, code: ErrorCode, message: str) -> None:
        for h in self.held.pop(name, []):
            self.core.reply_error(h.msg.frontend, h.msg.req_id, name, h.msg.version, code,
                                  message)
        for req, _ in self.controls.pop(name, []):
            self.give_up(req, code, message)

    def due(self) -> float:
        """Waits past --model-load-wait-secs, loads nobody waits for, idle unloads, memory
        readings, then loads that fit; seconds until this is next due."""
        now = self.now()
        wait = MEASURE_INTERVAL_S
        for name in list(self.held):
            keep = []
            for h in self.held[name]:
                left = h.since + self.wait_s - now
                if left > 0:
                    keep.append(h)
                    wait = min(wait, left)
                else:
                    self.core.reply_error(h.msg.frontend, h.msg.req_id, name, h.msg.version,
                                          ErrorCode.UNAVAILABLE, self.still_loading(name))
            if keep:
                self.held[name] = keep
            else:
                del self.held[name]
        for name in list(self.controls):
            keep_c = []
            for req, since in self.controls[name]:
                left = since + self.wait_s - now
                if left > 0:
                    keep_c.append((req, since))
                    wait = min(wait, left)
                else:
                    self.give_up(req, ErrorCode.UNAVAILABLE, self.still_loading(name))
            if keep_c:
                self.controls[name] = keep_c
            else:
                del self.controls[name]
        dropped = [n for n in self.policy.queue if not self.wanted(n)]
        for name in dropped:
            self.policy.drop(name)
        if dropped:
            self.lifecycle.check_ensembles()    # an ensemble that waited for one fails
        # a lease does not keep a model that had no request for that long (its drain takes the
        # lease back and lets the worker finish what it took)
        busy, _ = self.busy_names()
        for name in self.policy.idle(busy.__contains__):
            self.evict(name, idle=True)
        for name in self.policy.to_measure(MEASURE_BATCH):
            self.measure(name)
        self.schedule()
        return min(wait, self.policy.idle_due(), self.policy.measure_due(), 1.0)

    def still_loading(self, name: str) -> str:
        why = (f"it waits for room under the --model-memory-budget of {mib(self.policy.budget)} "
               f"(the models in memory are busy)" if self.policy.waiting(name) else
               "its load has not finished")
        return (f"model '{name}' is still loading after {self.wait_s:g} s "
                f"(--model-load-wait-secs): {why}; try again later")

    def wanted(self, name: str) -> bool:
        """Whether a request, a load request or a wanted ensemble's load waits for ``name``."""
        if self.held.get(name) or self.controls.get(name):
            return True
        for load in self.lifecycle.loads.values():
            plan = load.versions[0].ensemble if load.versions else None
            if plan is not None and name in plan.composing() and \
                    (load.waiters or self.wanted(load.name)):
                return True
        return False

    def shutdown(self) -> None:
        for name in list(self.held):
            self.fail_held(name, ErrorCode.UNAVAILABLE, "the server is shutting down")
        for name in list(self.controls):
            self.fail_held(name, ErrorCode.UNAVAILABLE, "the server is shutting down")

    # ---- statistics ---------------------------------------------------------------------------------
    def statistics(self) -> OnDemandStats:
        p = self.policy
        return OnDemandStats(
            p.budget, p.charged(),
            [OnDemandModel(m.name, m.loads, m.evictions, m.idle_unloads, m.charged)
             for m in sorted(p.models.values(), key=lambda m: m.name) if m.loads],
            list(WAIT_BOUNDS_US), list(p.wait_counts), p.wait_sum_us)
