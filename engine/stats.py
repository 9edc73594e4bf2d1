"""Statistics of one model version, accumulated in the scheduler (pure: no sockets).

All counters live in this one process, which sees every request's fate: queue time when it is
dispatched, compute times from the worker's BatchDone, failures it rejects itself. A worker that
restarts therefore neither resets nor double-counts anything, and /stats and /metrics are two
views of the same numbers.
"""
from __future__ import annotations

import bisect
import time
from collections import deque

import numpy as np

from shmserve.ipc.messages.to_frontend import BatchStatistics, Duration, ModelStatistics, ResponseStatistics

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# Triton's default buckets for nv_inference_first_response_histogram_ms
DEFAULT_LATENCY_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
# Triton's default summary quantiles; summaries cover the latest observations
SUMMARY_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
SUMMARY_WINDOW = 4096
SUMMARY_KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output",
                 "cache_hit", "cache_miss")


def _add(d: Duration, ns: int) -> None:
    d.count += 1
    d.ns += max(0, ns)


def _positive_sum(col: list[int]) -> int:
    """The sum of the durations in ``col``, a negative one (clocks of two processes that
    disagree) counting as zero."""
    total = sum(col)
    return total if not col or min(col) >= 0 else sum(ns for ns in col if ns > 0)


class VersionStats:
    def __init__(self, name: str, version: int, buckets_ms=DEFAULT_LATENCY_BUCKETS_MS,
                 wall_clock=time.time, summaries: bool = False):
        self.record = ModelStatistics(name, version, failures={r: 0 for r in FAILURE_REASONS})
        self.windows: dict[str, deque[float]] | None = \
            {k: deque(maxlen=SUMMARY_WINDOW) for k in SUMMARY_KINDS} if summaries else None
        self.buckets_ms = tuple(buckets_ms)
        # the bucket bounds in ns: a request's duration finds its bucket without a division
        self.buckets_ns = tuple(ms * 1e6 for ms in self.buckets_ms)
        self.record.latency_buckets = [0] * (len(self.buckets_ms) + 1)
        self.batches: dict[int, BatchStatistics] = {}
        self.wall_clock = wall_clock

    def executions(self, sizes: list[int], inputs: list[int], infers: list[int],
                   outputs: list[int]) -> None:
        """Executions of ``sizes[i]`` inferences each (the sum of a batch's batch sizes), with
        their compute times. Lists, so that the many a frontend reports at once (leased
        requests, engine/accounting.py) cost one call."""
        if not sizes:
            return
        r = self.record
        r.execution_count += len(sizes)
        r.last_inference = int(self.wall_clock() * 1000)
        batches = self.batches
        if len(set(sizes)) == 1:
            groups = [(sizes[0], inputs, infers, outputs)]
        else:
            by_size: dict[int, list[int]] = {}
            for i, size in enumerate(sizes):
                by_size.setdefault(size, []).append(i)
            groups = [(size, [inputs[i] for i in ix], [infers[i] for i in ix],
                       [outputs[i] for i in ix]) for size, ix in by_size.items()]
        for size, *cols in groups:
            b = batches.get(size)
            if b is None:
                b = batches[size] = BatchStatistics(size, Duration(), Duration(), Duration())
            for d, col in zip((b.compute_input, b.compute_infer, b.compute_output), cols):
                d.count += len(col)
                d.ns += _positive_sum(col)

    def successes(self, sizes: list[int], totals: list[int], queues: list[int],
                  inputs: list[int], infers: list[int], outputs: list[int]) -> None:
        """Requests that succeeded: their batch sizes and durations in ns, one list each."""
        if not sizes:
            return
        r = self.record
        n = len(sizes)
        r.inference_count += sum(sizes)
        for d, col in ((r.success, totals), (r.queue, queues), (r.compute_input, inputs),
                       (r.compute_infer, infers), (r.compute_output, outputs)):
            d.count += n
            d.ns += _positive_sum(col)
        buckets, edges = r.latency_buckets, self.buckets_ns
        for t in totals:
            buckets[bisect.bisect_left(edges, t)] += 1
        r.latency_sum_ms += sum(totals) / 1e6
        if self.windows is not None:
            for kind, col in zip(SUMMARY_KINDS, (totals, queues, inputs, infers, outputs)):
                self.windows[kind].extend(ns / 1e3 for ns in col)

    def cached(self, hit: bool, cache_ns: int, total_ns: int, count: int) -> None:
        """A response cache lookup (``count`` 1) or insert (0). A hit is a success that ran
        nothing: it counts in success and queue (no time queued), not in the inference and
        execution counts or the compute times, as in Triton."""
        r = self.record
        d = r.cache_hit if hit else r.cache_miss
        d.count += count
        d.ns += max(0, cache_ns)
        if self.windows is not None and count:     # a lookup (an insert adds to its miss)
            self.windows["cache_hit" if hit else "cache_miss"].append(max(0, cache_ns) / 1e3)
        if hit:
            total_ns = max(0, total_ns)
            _add(r.success, total_ns)
            r.queue.count += 1
            r.latency_buckets[bisect.bisect_left(self.buckets_ns, total_ns)] += 1
            r.latency_sum_ms += total_ns / 1e6
            r.last_inference = int(self.wall_clock() * 1000)
            if self.windows is not None:
                self.windows["request"].append(total_ns / 1e3)

    def response(self, index: int, kind: str, start_ns: int, output_start_ns: int,
                 end_ns: int) -> None:
        """One response a backend reported (a decoupled model's, engine/core.py), at its
        index within its request: a success or failure splits its time into computing the
        response and its outputs; an empty one (nothing to send) only computed; a cancelled
        one counts its clean-up."""
        key = str(index)
        rs = self.record.response_stats.get(key)
        if rs is None:
            rs = self.record.response_stats[key] = ResponseStatistics()
        total = end_ns - start_ns
        if kind in ("success", "fail"):
            _add(rs.compute_infer, output_start_ns - start_ns)
            _add(rs.compute_output, end_ns - output_start_ns)
            _add(rs.success if kind == "success" else rs.fail, total)
        elif kind == "empty":
            _add(rs.compute_infer, total)
            _add(rs.empty_response, total)
        elif kind == "cancel":
            _add(rs.cancel, total)

    def failed(self, reason: str, total_ns: int) -> None:
        r = self.record
        _add(r.fail, total_ns)
        r.failures[reason if reason in r.failures else "OTHER"] += 1

    def snapshot(self, pending: int) -> ModelStatistics:
        r = self.record
        r.pending = pending
        r.batch_stats = [self.batches[k] for k in sorted(self.batches)]
        if self.windows is not None:
            r.summaries = {k: (np.quantile(np.fromiter(w, float), SUMMARY_QUANTILES).tolist()
                               if w else [0.0] * len(SUMMARY_QUANTILES))
                           for k, w in self.windows.items()}
        return r
