"""The scheduler's statistics: what each finished batch (or leased request) adds to its model's
counters, the custom metrics workers report, and the reply to a statistics query.

Pure: no sockets, an injected clock. The core hands it what it finished; ``ensemble_timings`` adds a step's times
to the ensemble request it belongs to (engine/ensemble/runner.py).
"""
from __future__ import annotations

from typing import Callable

from shmserve.engine.batching.queues import QueuedRequest
from shmserve.engine.models import ModelVersion
from shmserve.engine.states import ModelState
from shmserve.ipc.messages.common import ENSEMBLE_FRONTEND, CustomMetrics, LeasedRecord
from shmserve.ipc.messages.to_frontend import StatsReply
from shmserve.ipc.messages.to_scheduler import BatchDone, StatsQuery


class Accounting:
    def __init__(self, clock: Callable[[], int],
                 ensemble_timings: Callable[[int, int, int, int, int], None]):
        self.clock = clock
        self.ensemble_timings = ensemble_timings
        self.leased_counts: dict[str, int] = {}     # per model, for /metrics
        self.custom_metrics: dict[int, CustomMetrics] = {}      # spawn id -> latest

    def custom_metrics_in(self, msg: CustomMetrics) -> None:
        # re-inserted so the order is the order of reports: the frontend lets the latest
        # report of a gauge win
        self.custom_metrics.pop(msg.spawn_id, None)
        self.custom_metrics[msg.spawn_id] = msg

    def worker_gone(self, spawn_id: int) -> None:
        self.custom_metrics.pop(spawn_id, None)

    def leased(self, ver: ModelVersion | None, model: str, records: list[LeasedRecord]) -> None:
        """Requests frontends sent under leases to one version of ``model``, answered by its
        workers; ``ver``: None when it is gone (counted as leased all the same). A frontend
        reports them in bulk, ~100 at a time at concurrency 1: they are counted a column at a
        time, not one by one, because this pass takes a CPU the requests in flight need
        (docs/performance.md, "The c=1 tail")."""
        self.leased_counts[model] = self.leased_counts.get(model, 0) + len(records)
        if ver is None:
            return
        stats = ver.stats
        ok = []
        for r in records:
            if r.failed:
                stats.failed("BACKEND", r.finished_ns - r.received_ns)
            else:
                ok.append(r)
        inputs = [r.compute_input_ns for r in ok]
        infers = [r.compute_infer_ns for r in ok]
        outputs = [r.compute_output_ns for r in ok]
        totals = [r.finished_ns - r.received_ns for r in ok]
        # it waited in the worker's inbox from when the frontend got it until it started
        queues = [max(0, t - a - b - c) for t, a, b, c in zip(totals, inputs, infers, outputs)]
        stats.successes([r.batch_size for r in ok], totals, queues, inputs, infers, outputs)
        # the execution each record counts: its request's alone (-1), none (0: another
        # record of the same execution counts it), or that many inferences
        runs = [r for r in records if r.executed]
        stats.executions([r.executed if r.executed > 0 else r.batch_size for r in runs],
                         [r.compute_input_ns for r in runs], [r.compute_infer_ns for r in runs],
                         [r.compute_output_ns for r in runs])

    def account(self, ver: ModelVersion, batch: list[QueuedRequest], done: BatchDone) -> None:
        """Statistics of a batch the scheduler dispatched, finished."""
        now = self.clock()
        failed = set(done.failed)
        stats = ver.stats
        ci, cinf, co = done.compute_input_ns, done.compute_infer_ns, done.compute_output_ns
        ok = []
        for i, r in enumerate(batch):
            if i in failed:
                stats.failed("BACKEND", now - r.received_ns)
            else:
                ok.append(r)
        executed = sum(r.batch_size for r in ok) or sum(r.batch_size for r in batch)
        if executed:
            stats.executions([executed], [ci], [cinf], [co])
        n = len(ok)
        stats.successes([r.batch_size for r in ok], [now - r.received_ns for r in ok],
                        [r.dispatched_ns - r.enqueued_ns for r in ok], [ci] * n, [cinf] * n,
                        [co] * n)
        for r in ok:
            if r.frontend == ENSEMBLE_FRONTEND:
                # an ensemble's step: its times are the ensemble's too (a retry, alone after
                # its worker died, waited through the run that died: no queue time)
                self.ensemble_timings(r.req_id, 0 if r.alone else r.dispatched_ns - r.enqueued_ns,
                                      ci, cinf, co)

    def reply(self, q: StatsQuery, versions: dict[tuple[str, int], ModelVersion],
              known: set[str] | dict, live: set[int] | dict, ipc: dict[str, int],
              on_demand=None) -> StatsReply:
        """The answer to ``q``: the READY versions it names; ``known``: the repository's model
        names; ``live``: the spawn ids of live workers (their custom metrics count)."""
        if q.model and q.model not in known:
            return StatsReply(q.query_id, [], ipc, f"requested model '{q.model}' is not available")
        chosen = [v for (name, version), v in sorted(versions.items())
                  if (not q.model or name == q.model) and (q.version < 0 or version == q.version)
                  and v.state == ModelState.READY]
        if q.model and not chosen:
            if q.version >= 0:
                return StatsReply(q.query_id, [], ipc, f"requested model version is not "
                                                       f"available for model '{q.model}'")
            return StatsReply(q.query_id, [], ipc, f"requested model '{q.model}' is not available")
        return StatsReply(q.query_id, [v.stats.snapshot(len(v.queue)) for v in chosen], ipc,
                          custom_metrics=[m for sid, m in self.custom_metrics.items()
                                          if sid in live], leased=self.leased_counts,
                          on_demand=on_demand)
