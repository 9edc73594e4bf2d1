"""``pb_utils.MetricFamily`` and its metrics: a python model's own Prometheus metrics.

The state lives in the worker process, in one module-level registry (a worker runs one model
instance, so the registry is that instance's). Every change marks the registry dirty; the worker
loop ships ``snapshot_if_dirty()`` to the scheduler, which keeps the latest snapshot of every
live worker, and the frontend renders them on ``/metrics``. Updating a metric is therefore a few
attribute writes in the model's own process, with no message per update.

Triton's semantics, as its python backend documents them: a family name that already exists is
the same family (a different kind is an error, the first description stays); ``Metric`` with
labels that already exist returns the existing metric; counters only go up; histograms need
buckets and have no ``value()``.
"""
from __future__ import annotations

import bisect
import math
import re
import threading
import time

from shmserve.ipc.messages.common import MetricFamilyState, MetricKind, MetricSample
from shmserve.workers.python_backend.errors import TritonModelException

# Prometheus' own rules for names; a model that breaks them hears it when it creates the metric,
# as it would from Triton, instead of producing a /metrics page that scrapers reject.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


class MetricArgumentError(TritonModelException, ValueError):
    """A bad name, kind, label or bucket list. Triton raises TritonModelException there; earlier
    shmserve versions raised ValueError, so it is both."""


class _Registry:
    __slots__ = ("families", "dirty")

    def __init__(self):
        self.families: dict[str, MetricFamily] = {}     # name -> the first family of that name
        self.dirty = False                              # changed since the last snapshot


REGISTRY = _Registry()


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = range(3)

    def __init__(self, name, description, kind):
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise MetricArgumentError(f"metric family '{name}': kind must be COUNTER, GAUGE or "
                                      "HISTOGRAM")
        if not isinstance(name, str) or not _METRIC_NAME.match(name):
            raise MetricArgumentError(f"metric family name {name!r} is not a valid Prometheus "
                                      "metric name")
        self.name, self.description, self.kind = name, str(description), kind
        first = REGISTRY.families.setdefault(name, self)
        if first.kind != kind:
            raise MetricArgumentError(f"metric family '{name}' already exists with a different "
                                      "kind")
        if first is self:
            self._metrics: dict = {}
            REGISTRY.dirty = True   # a new family shows on /metrics even before it has a metric
        else:                       # the same name is the same family: share its metrics
            self._metrics = first._metrics

    def Metric(self, labels=None, buckets=None):
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        for k in labels:
            if not _LABEL_NAME.match(k) or k.startswith("__"):
                raise MetricArgumentError(f"metric family '{self.name}': {k!r} is not a valid "
                                          "label name")
        bounds = None
        if self.kind == self.HISTOGRAM:
            if buckets is None:
                raise MetricArgumentError(f"metric family '{self.name}': buckets are required "
                                          "for histograms")
            bounds = [float(b) for b in buckets]
            if any(not math.isfinite(b) for b in bounds) or \
                    any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise MetricArgumentError(f"metric family '{self.name}': buckets must be "
                                          "finite numbers in ascending order, each once (+Inf "
                                          "is always added)")
            if "le" in labels:
                raise MetricArgumentError(f"metric family '{self.name}': a histogram cannot "
                                          "have a label named 'le'")
        elif buckets:
            raise MetricArgumentError(f"metric family '{self.name}': buckets are only for "
                                      "histograms")
        key = tuple(sorted(labels.items()))
        m = self._metrics.get(key)
        if m is None:
            m = self._metrics[key] = _Metric(self, labels, bounds)
            REGISTRY.dirty = True
        return m


class _Metric:
    def __init__(self, family, labels, buckets):
        # (a metric keeps its family: Triton fails a metric whose family object the model
        # dropped, but nothing is gained by failing it here)
        self.family = family
        self.name, self.kind = family.name, family.kind
        self.labels, self.buckets = labels, buckets
        self._value, self._sum, self._count = 0.0, 0.0, 0
        self._set_ns = 0            # a gauge's last set(): the latest across instances wins
        self._bucket_counts = [0] * (len(buckets) + 1) if buckets is not None else None  # +Inf last
        self._lock = threading.Lock()   # a model may update from its own threads

    def _require(self, op, *kinds):
        if self.kind not in kinds:
            raise TritonModelException(f"metric '{self.name}': {op} is not supported for "
                                       "this kind")

    def increment(self, value):
        self._require("increment", MetricFamily.COUNTER, MetricFamily.GAUGE)
        value = float(value)
        if self.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"metric '{self.name}': a counter cannot be "
                                       "decremented")
        with self._lock:
            self._value += value
        REGISTRY.dirty = True

    def set(self, value):
        self._require("set", MetricFamily.GAUGE)
        self._value = float(value)
        self._set_ns = time.monotonic_ns()
        REGISTRY.dirty = True

    def observe(self, value):
        self._require("observe", MetricFamily.HISTOGRAM)
        value = float(value)
        with self._lock:
            self._sum, self._count = self._sum + value, self._count + 1
            self._bucket_counts[bisect.bisect_left(self.buckets, value)] += 1  # type: ignore[index]  # a histogram's
        REGISTRY.dirty = True

    def value(self):
        self._require("value", MetricFamily.COUNTER, MetricFamily.GAUGE)
        return self._value

    def _sample(self) -> MetricSample:
        if self._bucket_counts is None:
            return MetricSample(self.labels, self._value, set_ns=self._set_ns)
        with self._lock:
            return MetricSample(self.labels, buckets=list(self.buckets),
                                counts=list(self._bucket_counts), sum=self._sum)


_KINDS = {MetricFamily.COUNTER: MetricKind.COUNTER, MetricFamily.GAUGE: MetricKind.GAUGE,
          MetricFamily.HISTOGRAM: MetricKind.HISTOGRAM}


def snapshot_if_dirty() -> list[MetricFamilyState] | None:
    """Every family's current state if anything changed since the last call, else None.

    The flag is cleared before reading, so an update made meanwhile (from a model thread) marks
    the registry dirty again and reaches the next snapshot."""
    if not REGISTRY.dirty:
        return None
    REGISTRY.dirty = False
    return [MetricFamilyState(f.name, f.description, _KINDS[f.kind],
                              [m._sample() for m in list(f._metrics.values())])
            for f in list(REGISTRY.families.values())]
