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

from shmserve.ipc.messages import BatchStatistics, Duration, ModelStatistics

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# Triton's default buckets for nv_inference_first_response_histogram_ms
DEFAULT_LATENCY_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
# Triton's default summary quantiles; summaries cover the latest observations
SUMMARY_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
SUMMARY_WINDOW = 4096
SUMMARY_KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")


def _add(d: Duration, ns: int) -> None:
    d.count += 1
    d.ns += max(0, ns)


class VersionStats:
    def __init__(self, name: str, version: int, buckets_ms=DEFAULT_LATENCY_BUCKETS_MS,
                 wall_clock=time.time, summaries: bool = False):
        self.record = ModelStatistics(name, version, failures={r: 0 for r in FAILURE_REASONS})
        self.windows = {k: deque(maxlen=SUMMARY_WINDOW) for k in SUMMARY_KINDS} if summaries \
            else None
        self.buckets_ms = tuple(buckets_ms)
        self.record.latency_buckets = [0] * (len(self.buckets_ms) + 1)
        self.batches: dict[int, BatchStatistics] = {}
        self.wall_clock = wall_clock

    def _latency(self, ms: float) -> None:
        r = self.record
        r.latency_buckets[bisect.bisect_left(self.buckets_ms, ms)] += 1
        r.latency_sum_ms += ms

    def executed(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One execution of ``batch_size`` inferences (the sum of its requests' batch sizes)."""
        r = self.record
        r.execution_count += 1
        r.last_inference = int(self.wall_clock() * 1000)
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = BatchStatistics(batch_size, Duration(), Duration(),
                                                           Duration())
        for d, ns in ((b.compute_input, input_ns), (b.compute_infer, infer_ns),
                      (b.compute_output, output_ns)):
            d.count += 1
            if ns > 0:
                d.ns += ns

    def succeeded(self, batch_size: int, total_ns: int, queue_ns: int, input_ns: int,
                  infer_ns: int, output_ns: int) -> None:
        r = self.record
        r.inference_count += batch_size
        # _add() written out: this runs for every request (engine/accounting.py, leased())
        for d, ns in ((r.success, total_ns), (r.queue, queue_ns), (r.compute_input, input_ns),
                      (r.compute_infer, infer_ns), (r.compute_output, output_ns)):
            d.count += 1
            if ns > 0:
                d.ns += ns
        ms = total_ns / 1e6
        r.latency_buckets[bisect.bisect_left(self.buckets_ms, ms)] += 1
        r.latency_sum_ms += ms
        if self.windows is not None:
            w = self.windows
            w["request"].append(total_ns / 1e3)
            w["queue"].append(queue_ns / 1e3)
            w["compute_input"].append(input_ns / 1e3)
            w["compute_infer"].append(infer_ns / 1e3)
            w["compute_output"].append(output_ns / 1e3)

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
