"""The Prometheus endpoint (``GET /metrics`` on --metrics-port) with Triton's metric names.

Inference counters come from the scheduler, which keeps every model's statistics for the
server's whole life (worker restarts neither reset nor double them). They are fetched once per
scrape and rendered by prometheus_client from a custom collector. CPU and memory gauges are
sampled every --metrics-interval-ms, GPU gauges too where nvidia-ml-py finds a GPU. Python
models' own metrics (pb_utils.MetricFamily) come with the same statistics reply: the scheduler
keeps the latest snapshot each live worker sent.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from shmserve.engine.stats import DEFAULT_LATENCY_BUCKETS_MS, FAILURE_REASONS, SUMMARY_QUANTILES
from shmserve.frontend.engine_client import EngineClient
from shmserve.frontend.http.server import HttpApp, HttpConnection, HttpRequest
from shmserve.frontend.observability.system_metrics import ENERGY, SystemSampler
from shmserve.ipc import channel
from shmserve.ipc.messages.common import CustomMetrics, MetricKind
from shmserve.ipc.messages.to_frontend import ModelStatistics, OnDemandStats

log = logging.getLogger("shmserve.metrics")


TRITON_COUNTERS: set[str] = {ENERGY}


def _counter(name: str, doc: str) -> Metric:
    # Triton's counters carry no _total suffix; dashboards written for it query these names
    TRITON_COUNTERS.add(name)
    return Metric(name, doc, "counter")


def exposition(registry, custom: "CustomCollector | None" = None) -> bytes:
    """prometheus_client's text format, with Triton's counter names in HELP/TYPE lines too
    (prometheus_client always writes a counter family as <name>_total there, which would no
    longer match the sample names that Triton's dashboards query). Python models' counters, which
    the ``custom`` collector put on this page, carry the names the models gave them too."""
    text = generate_latest(registry).decode()
    extra = custom.counter_names if custom is not None else ()  # known once the page is made
    for name in TRITON_COUNTERS.union(extra):
        text = text.replace(f"# HELP {name}_total ", f"# HELP {name} ")
        text = text.replace(f"# TYPE {name}_total counter", f"# TYPE {name} counter")
    return text.encode()


def _pinned_memory():
    """Triton's pinned memory pool gauges, which its dashboards and QA read. shmserve has no
    pinned pool (--pinned-memory-pool-byte-size has no effect: tensors are in shared memory),
    so the pool is empty: 0 bytes in all, 0 used."""
    for name, doc in (("nv_pinned_memory_pool_total_bytes",
                       "Pinned memory pool total memory size, in bytes"),
                      ("nv_pinned_memory_pool_used_bytes",
                       "Pinned memory pool used memory size, in bytes")):
        fam = GaugeMetricFamily(name, doc)
        fam.add_metric([], 0)
        yield fam


class InferenceCollector:
    def __init__(self, counter_latencies: bool = True, histogram_latencies: bool = False,
                 cache: bool = False):
        self.models: list[ModelStatistics] = []
        self.cache = cache          # the server has a response cache: its counters are shown
        self.ipc: dict[str, int] = {}
        self.leased: dict[str, int] = {}        # model -> requests sent under a lease
        self.on_demand: OnDemandStats | None = None     # --model-control-mode=on_demand
        self.counter_latencies = counter_latencies
        self.histogram_latencies = histogram_latencies

    def collect(self):
        excl = "(does not include cached requests)"
        incl = "(includes cached requests)"
        fams = {
            "success": _counter("nv_inference_request_success",
                                "Number of successful inference requests, all batch sizes"),
            "failure": _counter("nv_inference_request_failure",
                                "Number of failed inference requests, all batch sizes"),
            "count": _counter("nv_inference_count", f"Number of inferences performed {excl}"),
            "exec": _counter("nv_inference_exec_count",
                             f"Number of model executions performed {excl}"),
        }
        lat = {}
        if self.counter_latencies:
            lat = {
                "success": _counter("nv_inference_request_duration_us",
                                    f"Cumulative inference request duration in microseconds {incl}"),
                "queue": _counter("nv_inference_queue_duration_us",
                                  f"Cumulative inference queuing duration in microseconds {incl}"),
                "compute_input": _counter("nv_inference_compute_input_duration_us",
                                          f"Cumulative compute input duration in microseconds {excl}"),
                "compute_infer": _counter("nv_inference_compute_infer_duration_us",
                                          f"Cumulative compute inference duration in microseconds {excl}"),
                "compute_output": _counter("nv_inference_compute_output_duration_us",
                                           "Cumulative inference compute output duration in "
                                           f"microseconds {excl}"),
            }
        mv = ["model", "version"]
        pending = GaugeMetricFamily("nv_inference_pending_request_count", "Instantaneous number of "
                                    "pending requests awaiting execution per-model.", labels=mv)
        load = GaugeMetricFamily("nv_model_load_duration_secs", "Model load time in seconds",
                                 labels=mv)
        hist = HistogramMetricFamily("nv_inference_first_response_histogram_ms", "Duration from "
                                     "request to first response in milliseconds", labels=mv)
        for m in self.models:
            labels = {"model": m.name, "version": str(m.version)}
            fams["success"].add_sample("nv_inference_request_success", labels, m.success.count)
            for reason in FAILURE_REASONS:
                fams["failure"].add_sample("nv_inference_request_failure",
                                           {**labels, "reason": reason}, m.failures.get(reason, 0))
            fams["count"].add_sample("nv_inference_count", labels, m.inference_count)
            fams["exec"].add_sample("nv_inference_exec_count", labels, m.execution_count)
            for field, fam in lat.items():
                fam.add_sample(fam.name, labels, getattr(m, field).ns // 1000)
            pending.add_metric([m.name, str(m.version)], m.pending)
            load.add_metric([m.name, str(m.version)], m.load_seconds)
            if self.histogram_latencies:
                edges = [str(b) for b in DEFAULT_LATENCY_BUCKETS_MS] + ["+Inf"]
                running, buckets = 0, []
                for edge, n in zip(edges, m.latency_buckets):
                    running += n
                    buckets.append((edge, running))
                hist.add_metric([m.name, str(m.version)], buckets, m.latency_sum_ms)
        yield from fams.values()
        yield from lat.values()
        if self.cache:
            yield from self._cache()
        yield pending
        yield load
        yield from _pinned_memory()
        if self.histogram_latencies:
            yield hist
        yield from self._summaries()
        yield from self._ipc()
        if self.on_demand is not None:
            yield from self._on_demand(self.on_demand)

    def _cache(self):
        """Triton's response cache counters, per model version."""
        fams = [(_counter("nv_cache_num_hits_per_model", "Number of cache hits per model"),
                 "cache_hit", False),
                (_counter("nv_cache_num_misses_per_model", "Number of cache misses per model"),
                 "cache_miss", False),
                (_counter("nv_cache_hit_duration_per_model",
                          "Total cache hit duration per model, in microseconds"),
                 "cache_hit", True),
                (_counter("nv_cache_miss_duration_per_model",
                          "Total cache miss (insert+lookup) duration per model, in "
                          "microseconds"), "cache_miss", True)]
        for m in self.models:
            labels = {"model": m.name, "version": str(m.version)}
            for fam, field, duration in fams:
                d = getattr(m, field)
                fam.add_sample(fam.name, labels, d.ns // 1000 if duration else d.count)
        for fam, _, _ in fams:
            yield fam

    def _summaries(self):
        """Quantiles over each model's latest observations (--metrics-config summary_latencies)."""
        names = {"request": "nv_inference_request_summary_us",
                 "queue": "nv_inference_queue_summary_us",
                 "compute_input": "nv_inference_compute_input_summary_us",
                 "compute_infer": "nv_inference_compute_infer_summary_us",
                 "compute_output": "nv_inference_compute_output_summary_us"}
        totals = {"request": "success", "queue": "queue", "compute_input": "compute_input",
                  "compute_infer": "compute_infer", "compute_output": "compute_output",
                  "cache_hit": "cache_hit", "cache_miss": "cache_miss"}
        if self.cache:
            # as Triton: with a cache, the request summary is not published (hits would mix
            # in), and the cache's lookups have summaries of their own
            del names["request"]
            names["cache_hit"] = "nv_cache_hit_summary_per_model"
            names["cache_miss"] = "nv_cache_miss_summary_per_model"
        if not any(m.summaries for m in self.models):
            return
        for kind, name in names.items():
            what = kind.replace("_", " ") + (" lookup" if kind.startswith("cache") else "")
            fam = Metric(name, f"Summary of {what} durations in microseconds", "summary")
            for m in self.models:
                if kind not in m.summaries:
                    continue
                labels = {"model": m.name, "version": str(m.version)}
                for q, v in zip(SUMMARY_QUANTILES, m.summaries[kind]):
                    fam.add_sample(name, {**labels, "quantile": str(q)}, v)
                total = getattr(m, totals[kind])
                fam.add_sample(name + "_count", labels, total.count)
                fam.add_sample(name + "_sum", labels, total.ns / 1000)
            yield fam

    def _ipc(self):
        """Bytes and messages over ZeroMQ. Every socket has one end in the frontend or the
        scheduler, so these two see all traffic; ``largest`` shows big tensors never ride in a
        message."""
        total = CounterMetricFamily("shmserve_ipc_bytes", "Bytes sent and received over ZeroMQ",
                                    labels=["process", "direction"])
        msgs = CounterMetricFamily("shmserve_ipc_messages", "Messages sent and received over "
                                   "ZeroMQ", labels=["process", "direction"])
        largest = GaugeMetricFamily("shmserve_ipc_largest_message_bytes", "Largest message "
                                    "(all frames) sent or received over ZeroMQ",
                                    labels=["process", "direction"])
        for proc, stats in (("frontend", channel.COUNTERS.as_dict()), ("scheduler", self.ipc)):
            for d in ("sent", "received"):
                if f"{d}_bytes" in stats:
                    total.add_metric([proc, d], stats[f"{d}_bytes"])
                    msgs.add_metric([proc, d], stats[f"{d}_messages"])
                    largest.add_metric([proc, d], stats[f"largest_{d}"])
        yield total
        yield msgs
        yield largest
        leased = CounterMetricFamily("shmserve_leased_requests", "Requests frontends sent "
                                     "straight to a model instance the scheduler lent them, "
                                     "without the scheduler hop (counted once finished)",
                                     labels=["model"])
        for model, n in sorted(self.leased.items()):
            leased.add_metric([model], n)
        yield leased


    @staticmethod
    def _on_demand(st: OnDemandStats):
        """--model-control-mode=on_demand: loads, evictions, memory against the budget, and
        how long the requests that waited for a load waited."""
        loads = CounterMetricFamily("shmserve_on_demand_loads", "Loads of the model started "
                                    "on demand (by a request, a load request or an ensemble)",
                                    labels=["model"])
        evictions = CounterMetricFamily("shmserve_on_demand_evictions", "Unloads of the model "
                                        "decided on demand: reason=budget to make room for "
                                        "another model under --model-memory-budget, reason=idle "
                                        "after --model-idle-unload-secs without requests",
                                        labels=["model", "reason"])
        memory = GaugeMetricFamily("shmserve_on_demand_model_memory_bytes", "Memory (PSS of its "
                                   "workers, or its estimate while it loads) the model is "
                                   "charged against the budget", labels=["model"])
        for m in st.models:
            loads.add_metric([m.name], m.loads)
            evictions.add_metric([m.name, "budget"], m.evictions)
            evictions.add_metric([m.name, "idle"], m.idle_unloads)
            if m.memory_bytes:
                memory.add_metric([m.name], m.memory_bytes)
        yield loads
        yield evictions
        yield memory
        yield GaugeMetricFamily("shmserve_on_demand_resident_bytes", "Memory charged against "
                                "the budget by every model loaded, loading or unloading",
                                value=st.resident_bytes)
        yield GaugeMetricFamily("shmserve_on_demand_budget_bytes", "--model-memory-budget "
                                "(0: no budget)", value=st.budget_bytes)
        running, buckets = 0, []
        for bound, n in zip([*st.wait_bounds_us, math.inf], st.wait_counts):
            running += n
            buckets.append((_le(bound), running))
        wait = HistogramMetricFamily("shmserve_on_demand_load_wait_us", "How long requests for a "
                                     "model that was not loaded waited for its load, in "
                                     "microseconds")
        wait.add_metric([], buckets, st.wait_sum_us)
        yield wait


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _exposed_names(fam: Metric) -> set[str]:
    """Every name a family puts on the page, HELP/TYPE lines included."""
    names = {fam.name, *(s.name for s in fam.samples)}
    if fam.type == "counter":
        names.add(fam.name + "_total")
    return names


def _le(bound: float) -> str:
    """Bucket bounds as Triton writes them: 1 not 1.0, +Inf for the last."""
    if math.isinf(bound):
        return "+Inf"
    return repr(bound)[:-2] if bound.is_integer() and abs(bound) < 1e15 else repr(bound)


class _Family:
    """One custom family merged over every worker that reports it."""
    __slots__ = ("name", "description", "kind", "samples")

    def __init__(self, name: str, description: str, kind: MetricKind):
        self.name, self.description, self.kind = name, description, kind
        self.samples: dict[tuple, list] = {}    # sorted labels -> [labels, value, bounds, counts, sum]


class CustomCollector:
    """Python models' pb_utils metrics, from the scheduler's latest snapshot of each live worker.

    Triton keeps one registry for the whole server, so two instances (or two models) that use the
    same family and labels update one metric. We merge the per-worker snapshots the same way:
    counters and histograms add up, and so does a gauge that is only ever incremented; a gauge
    that was set() shows the value of the instance that set it last (with that instance's own
    increments since; another instance's increments after that set are not seen). Labels
    are exactly the model's: Triton adds none. A family whose names would collide with a built-in
    family (nv_*, shmserve_*) or that is not valid Prometheus is left out, and logged once, so a
    model can never break the page."""

    def __init__(self):
        self.reports: list[CustomMetrics] = []
        self.counter_names: set[str] = set()    # rendered by the last collect(), for exposition()
        self._warned: set[str] = set()

    def _warn(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _merge(self) -> dict[str, _Family]:
        families: dict[str, _Family] = {}
        for report in self.reports:
            for f in report.families:
                fam = families.get(f.name)
                if fam is None:
                    fam = families[f.name] = _Family(f.name, f.description, f.kind)
                elif fam.kind != f.kind:
                    self._warn(f"kind:{f.name}", "custom metric family '%s' is reported as both "
                               "%s and %s; showing the %s only", f.name, fam.kind.value,
                               f.kind.value, fam.kind.value)
                    continue
                for m in f.metrics:
                    key = tuple(sorted(m.labels.items()))
                    cur = fam.samples.get(key)
                    if cur is None:
                        fam.samples[key] = [m.labels, m.value, list(m.buckets), list(m.counts),
                                            m.sum, m.set_ns]
                    elif fam.kind == MetricKind.COUNTER:
                        cur[1] += m.value
                    elif fam.kind == MetricKind.GAUGE:
                        if not cur[5] and not m.set_ns:
                            cur[1] += m.value       # increments only: one shared gauge's sum
                        elif m.set_ns > cur[5]:
                            cur[1], cur[5] = m.value, m.set_ns
                    elif cur[2] == m.buckets and len(cur[3]) == len(m.counts):
                        cur[3] = [a + b for a, b in zip(cur[3], m.counts)]
                        cur[4] += m.sum
                    else:
                        self._warn(f"buckets:{f.name}", "custom histogram '%s' has different "
                                   "buckets in different instances; showing the first", f.name)
        return families

    def _render(self, fam: _Family) -> Metric:
        if not _METRIC_NAME.match(fam.name):
            raise ValueError("not a valid metric name")
        metric = Metric(fam.name, fam.description, fam.kind.value)
        for labels, value, bounds, counts, total, _ in fam.samples.values():
            if not all(_LABEL_NAME.match(k) for k in labels):
                raise ValueError(f"invalid label name in {sorted(labels)}")
            if fam.kind != MetricKind.HISTOGRAM:
                metric.add_sample(fam.name, labels, value)
                continue
            if "le" in labels or len(counts) != len(bounds) + 1:
                raise ValueError("malformed histogram")
            running = 0
            for bound, n in zip([*bounds, math.inf], counts):
                running += n
                metric.add_sample(fam.name + "_bucket", {**labels, "le": _le(bound)}, running)
            metric.add_sample(fam.name + "_count", labels, running)
            metric.add_sample(fam.name + "_sum", labels, total)
        return metric

    def collect(self, taken: set[str]):
        """Families to add to a page that already shows the names in ``taken``."""
        self.counter_names = set()
        for fam in self._merge().values():
            try:
                metric = self._render(fam)
            except ValueError as e:
                self._warn(f"invalid:{fam.name}", "custom metric family '%s' left out of "
                           "/metrics: %s", fam.name, e)
                continue
            names = _exposed_names(metric)
            clash = names & taken
            if clash:
                self._warn(f"clash:{fam.name}", "custom metric family '%s' left out of "
                           "/metrics: %s already in use", fam.name, ", ".join(sorted(clash)))
                continue
            taken |= names
            if fam.kind == MetricKind.COUNTER:
                self.counter_names.add(fam.name)
            yield metric


class _Page:
    """The one collector the registry holds: the built-in families, then the custom ones, which
    need to know every name the built-in ones used in this same scrape."""

    def __init__(self, builtin: list, custom: CustomCollector):
        self.builtin, self.custom = builtin, custom

    def collect(self):
        taken: set[str] = set()
        for collector in self.builtin:
            for fam in collector.collect():
                taken |= _exposed_names(fam)
                yield fam
        yield from self.custom.collect(taken)


class MetricsApp(HttpApp):
    def __init__(self, client: EngineClient, sampler: SystemSampler | None,
                 counter_latencies: bool = True, histogram_latencies: bool = False,
                 cache: bool = False):
        self.client = client
        self.registry = CollectorRegistry(auto_describe=False)
        self.inference = InferenceCollector(counter_latencies, histogram_latencies, cache)
        self.custom = CustomCollector()
        builtin = [self.inference] if sampler is None else [self.inference, sampler]
        self.registry.register(_Page(builtin, self.custom))

    def handle(self, conn: HttpConnection, req: HttpRequest) -> None:
        if req.path != "/metrics":
            return conn.respond(req, 404, b'{"error":"Not Found"}')
        if req.method != "GET":
            return conn.respond(req, 405, b'{"error":"Method Not Allowed"}')
        asyncio.get_running_loop().create_task(self._render(conn, req))

    async def _render(self, conn: HttpConnection, req: HttpRequest) -> None:
        try:
            reply = await self.client.statistics()
            self.inference.models = reply.models
            self.inference.ipc = reply.ipc
            self.inference.leased = reply.leased
            self.inference.on_demand = reply.on_demand
            self.custom.reports = reply.custom_metrics
        except asyncio.TimeoutError:
            log.warning("scheduler did not answer the statistics query in time")
        page = exposition(self.registry, self.custom)
        conn.respond(req, 200, page, "text/plain; charset=utf-8")
