"""What a worker's death means: for the requests it held, for its model version, and for the
frontends and ensembles that waited on it. A part of ``SchedulerCore`` (engine/core.py), which
calls ``exited`` when the shell sees a worker process end; the supervisor (engine/processes/instances.py)
has decided by then whether the instance restarts, backs off or crash-loops.

Requests get one retry, alone, unless the death names them: a request a worker ran alone and
died of by itself (an exit, a crash; not a kill from outside, nor ours) is taken for a poison
and fails at once, instead of killing a second worker (Triton retries nothing). A leased
worker's requests are known only to it and their frontend, which submits them again once it
hears of the death (LeaseLost); the one its execution record names (ipc/exec_record.py)
is kept here (``culprits``) to fail then.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from shmserve.engine.batching.sequences import SequenceBatcher
from shmserve.engine.models import Instance, ModelVersion
from shmserve.engine.processes.instances import Death, Outcome
from shmserve.engine.states import ModelState
from shmserve.ipc.backend_catalog import config_runs_python
from shmserve.ipc.messages.common import BLS_FRONTEND_BASE, ENSEMBLE_FRONTEND, ErrorCode, StateCause
from shmserve.ipc.messages.to_frontend import WorkerGone
from shmserve.ipc.messages.to_scheduler import ForgetSegments

if TYPE_CHECKING:
    from shmserve.engine.core import SchedulerCore

# leased requests blamed for their worker's death, until their frontend submits them again
CULPRITS_KEPT = 4096
CULPRIT_NOTE = ("; it was the only request the worker was running, so it is taken for the "
                "cause and not retried")


def reason_of(death: Death) -> str:
    return (f"the worker process of instance '{death.instance.name}' of model "
            f"'{death.version.name}' {death.how} while executing this request")


class WorkerDeaths:
    def __init__(self, core: SchedulerCore):
        self.core = core
        # (frontend, request) -> why: a leased request its worker died of
        self.culprits: OrderedDict[tuple[int, int], str] = OrderedDict()

    def blamed(self, frontend: int, req_id: int) -> str:
        """Why a request a leased worker died of fails, once its frontend submits it again
        ("" for any other request)."""
        return self.culprits.pop((frontend, req_id), "") if self.culprits else ""

    def forget_frontend(self, frontend: int) -> None:
        """A frontend died: its requests will never come back."""
        for key in [k for k in self.culprits if k[0] == frontend]:
            del self.culprits[key]

    def exited(self, spawn_id: int) -> None:
        """The shell saw the worker process of ``spawn_id`` end."""
        core = self.core
        death = core.supervisor.exited(spawn_id)
        if death is None:
            return
        core.housekeeping_at = 0.0             # a restart may be due at once
        core.accounting.worker_gone(spawn_id)
        ver, inst = death.version, death.instance
        # ensemble steps it ran (a decoupled one may still have owed answers from a thread)
        steps = [rid for fid, rid in inst.answered if fid == ENSEMBLE_FRONTEND]
        for address in [a for a, sid in core.worker_addresses.items() if sid == spawn_id]:
            del core.worker_addresses[address]
            handles = core.ensembles.worker_gone(address)
            if handles:         # its device arena: workers that opened it close it
                core.forget_segments(ForgetSegments([], handles))
        if death.culprit is not None and not death.batch:
            # a leased worker's lone request: its frontend submits it again (LeaseLost), and
            # it fails then instead of killing another worker
            self.culprits[death.culprit] = reason_of(death) + CULPRIT_NOTE
            while len(self.culprits) > CULPRITS_KEPT:
                self.culprits.popitem(last=False)
        core.leases.worker_exited(spawn_id, reason_of(death), death.kill_reason.retries,
                                  death.clean)
        bls = BLS_FRONTEND_BASE + spawn_id
        if bls in core.lease_takers:        # its BLS client's leases end with it
            core.lease_takers.discard(bls)
            core.leases.frontend_gone(bls)
        if inst.answered:
            by_frontend: dict[int, list[int]] = {}
            for fid, rid in inst.answered:
                by_frontend.setdefault(fid, []).append(rid)
            inst.answered.clear()
            for fid, rids in by_frontend.items():
                core.port.send_frontend(fid, WorkerGone(spawn_id, rids))
        if ver.config.model_transaction_policy.decoupled:
            # its requests may still be streaming after their batch was done: every frontend
            # ends the ones this worker answered with the reason
            reason = (f"the worker process of instance '{inst.name}' of model '{ver.name}' "
                      f"{death.how} while sending responses")
            for fid in core.frontends:
                core.port.send_frontend(fid, WorkerGone(spawn_id, [], reason))
            core.ensembles.streams_ended(spawn_id, reason, steps)
        if death.batch:
            self.requests_of(death)
        now = core.clock()
        for r, why in ver.queue.take_failed():     # sequences whose state died with it
            core.queued_in.pop((r.frontend, r.req_id), None)
            ver.stats.failed("OTHER", now - r.received_ns)
            core.reply_error(r.frontend, r.req_id, ver.name, ver.version, ErrorCode.INTERNAL,
                             why)
        if isinstance(ver.queue, SequenceBatcher):
            # they waited for its lent sequences, lost with it: judged now
            for r in ver.queue.take_orphans():
                core.queued_in.pop((r.frontend, r.req_id), None)
                core.enqueue(ver, r)
        if death.outcome == Outcome.LOAD_FAILED:
            why = f"worker process of instance '{inst.name}' {death.how} while loading the model"
            if config_runs_python(ver.config):
                why = f"Stub process '{inst.name}' is not healthy. ({why})"     # Triton's words
            core.lifecycle.version_failed(ver, death.load_error or why)
        elif death.outcome == Outcome.NOT_SERVING:
            core.lifecycle.drain_progress(ver)
        elif death.outcome == Outcome.CRASH_LOOP:
            self.crash_loop(ver, inst, death.how)
        if core.on_demand is not None:
            core.on_demand.exited(ver.name)     # its memory may be free now
            if core.table_dirty:
                core.flush_table()

    def requests_of(self, death: Death) -> None:
        """Stateless models get one retry, unless we killed the worker for running too long.
        A request the worker ran alone and died of by itself (an exit or a crash, not a kill
        from outside) is the likely poison: it fails at once, as in Triton, which retries
        nothing, instead of killing a second worker. The requests of a dead batch are retried
        alone (one by one, on another or the restarted instance): a poison among them then
        kills one more worker and fails by itself, while the others succeed. A request that
        already had its retry, or a model that turned retries off, gets the error."""
        core, ver = self.core, death.version
        reason = reason_of(death)
        now = core.clock()
        retry = ver.retry_on_death and ver.state == ModelState.READY and not core.stopping \
            and death.kill_reason.retries
        for r in reversed(death.batch or []):   # requeued at the head, in their order
            blamed = death.culprit == (r.frontend, r.req_id)
            if retry and not r.alone and not blamed:
                r.alone = True
                ver.queue.requeue(r)
                core.queued_in[(r.frontend, r.req_id)] = ver
                continue
            ver.stats.failed("BACKEND", now - r.received_ns)
            note = ("; it had been retried alone after an earlier worker death, so it is not "
                    "retried again") if r.alone else CULPRIT_NOTE if retry and blamed else ""
            core.reply_error(r.frontend, r.req_id, ver.name, ver.version, ErrorCode.INTERNAL,
                             reason + note)
        core.dispatch(ver)

    def crash_loop(self, ver: ModelVersion, inst: Instance, how: str) -> None:
        """Stop restarting: the version is UNAVAILABLE with the reason until it is reloaded."""
        core = self.core
        reason = (f"crash loop: instance '{inst.name}' {how}; it died {inst.deaths_in_a_row} "
                  f"times in a row while loading or idle, without finishing an execution")
        # the table goes first: a client told "crash loop" must find the model not ready
        core.lifecycle.fail_version(ver, reason, StateCause.CRASH_LOOP)
        core.fail_queued(ver, ErrorCode.UNAVAILABLE, "OTHER",
                         f"model '{ver.name}' version {ver.version} is unavailable: {reason}")

