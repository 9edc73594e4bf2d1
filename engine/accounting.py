"""The scheduler's statistics: what each finished batch (or leased request) adds to its model's
counters, the custom metrics workers report, and the reply to a statistics query.

Pure: no sockets, an injected clock. The core hands it what it finished; ``ensemble_timings`` adds a step's times
to the ensemble request it belongs to (engine/ensemble.py).
"""
from __future__ import annotations

from typing import Callable

from shmserve.ipc.messages import (
    ENSEMBLE_FRONTEND,
    BatchDone,
    CustomMetrics,
    StatsQuery,
    StatsReply,
    SubmitRequest,
)

from .batching import QueuedRequest
from .models import ModelVersion
from .states import ModelState


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

    def leased(self, ver: ModelVersion | None, head: SubmitRequest, done: BatchDone) -> None:
        """A request a frontend sent under a lease, answered by its worker; ``ver``: its
        version, None when it is gone (counted as leased all the same)."""
        self.leased_counts[head.model] = self.leased_counts.get(head.model, 0) + 1
        if ver is None:
            return
        # it waited in the worker's inbox from when the frontend got it until it started
        started = done.finished_ns - done.compute_input_ns - done.compute_infer_ns - \
            done.compute_output_ns
        self.account(ver, [QueuedRequest(
            head.req_id, head.frontend, head.batch_size, None, enqueued_ns=head.received_ns,
            received_ns=head.received_ns,
            dispatched_ns=max(head.received_ns, started))], done, done.executed)

    def account(self, ver: ModelVersion, batch: list[QueuedRequest], done: BatchDone,
                executed: int = -1) -> None:
        """Statistics of a finished batch; ``executed``: the inferences of the execution to
        count (-1: the batch's; 0: none, another record of a leased batch counts it)."""
        now = done.finished_ns or self.clock()
        failed = set(done.failed)
        stats = ver.stats
        if executed < 0:
            executed = sum(r.batch_size for i, r in enumerate(batch) if i not in failed) or \
                sum(r.batch_size for r in batch)
        if executed:
            stats.executed(executed, done.compute_input_ns, done.compute_infer_ns,
                           done.compute_output_ns)
        for i, r in enumerate(batch):
            if i in failed:
                stats.failed("BACKEND", now - r.received_ns)
            else:
                stats.succeeded(r.batch_size, now - r.received_ns, r.dispatched_ns - r.enqueued_ns,
                                done.compute_input_ns, done.compute_infer_ns,
                                done.compute_output_ns)
                if r.frontend == ENSEMBLE_FRONTEND:
                    # an ensemble's step: its times are the ensemble's too (a retry, alone
                    # after its worker died, waited through the run that died: no queue time)
                    self.ensemble_timings(r.req_id, 0 if r.alone else
                                          r.dispatched_ns - r.enqueued_ns, done.compute_input_ns,
                                          done.compute_infer_ns, done.compute_output_ns)

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
