"""The Prometheus endpoint (``GET /metrics`` on --metrics-port) with Triton's metric names.

Inference counters come from the scheduler, which keeps every model's statistics for the
server's whole life (worker restarts neither reset nor double them). They are fetched once per
scrape and rendered by prometheus_client from a custom collector. CPU and memory gauges are
sampled every --metrics-interval-ms, GPU gauges too where nvidia-ml-py finds a GPU.
"""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from shmserve.engine.stats import DEFAULT_LATENCY_BUCKETS_MS, FAILURE_REASONS, SUMMARY_QUANTILES
from shmserve.ipc import channel
from shmserve.ipc.messages import ModelStatistics

from .engine_client import EngineClient
from .http_server import HttpConnection, HttpRequest
from .system_metrics import SystemSampler

log = logging.getLogger("shmserve.metrics")


TRITON_COUNTERS: set[str] = set()


def _counter(name: str, doc: str) -> Metric:
    # Triton's counters carry no _total suffix; dashboards written for it query these names
    TRITON_COUNTERS.add(name)
    return Metric(name, doc, "counter")


def exposition(registry) -> bytes:
    """prometheus_client's text format, with Triton's counter names in HELP/TYPE lines too
    (prometheus_client always writes a counter family as <name>_total there, which would no
    longer match the sample names that Triton's dashboards query)."""
    text = generate_latest(registry).decode()
    for name in TRITON_COUNTERS:
        text = text.replace(f"# HELP {name}_total ", f"# HELP {name} ")
        text = text.replace(f"# TYPE {name}_total counter", f"# TYPE {name} counter")
    return text.encode()


class InferenceCollector:
    def __init__(self, counter_latencies: bool = True, histogram_latencies: bool = False):
        self.models: list[ModelStatistics] = []
        self.ipc: dict[str, int] = {}
        self.counter_latencies = counter_latencies
        self.histogram_latencies = histogram_latencies

    def collect(self):
        fams = {
            "success": _counter("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
            "failure": _counter("nv_inference_request_failure", "Number of failed inference requests, all batch sizes"),
            "count": _counter("nv_inference_count", "Number of inferences performed (does not include cached requests)"),
            "exec": _counter("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)"),
        }
        lat = {}
        if self.counter_latencies:
            lat = {
                "success": _counter("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached requests)"),
                "queue": _counter("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached requests)"),
                "compute_input": _counter("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include cached requests)"),
                "compute_infer": _counter("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not include cached requests)"),
                "compute_output": _counter("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
            }
        pending = GaugeMetricFamily("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting execution per-model.", labels=["model", "version"])
        load = GaugeMetricFamily("nv_model_load_duration_secs", "Model load time in seconds", labels=["model", "version"])
        hist = HistogramMetricFamily("nv_inference_first_response_histogram_ms", "Duration from request to first response in milliseconds", labels=["model", "version"])
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
        yield pending
        yield load
        if self.histogram_latencies:
            yield hist
        yield from self._summaries()
        yield from self._ipc()

    def _summaries(self):
        """Quantiles over each model's latest observations (--metrics-config summary_latencies)."""
        names = {"request": "nv_inference_request_summary_us",
                 "queue": "nv_inference_queue_summary_us",
                 "compute_input": "nv_inference_compute_input_summary_us",
                 "compute_infer": "nv_inference_compute_infer_summary_us",
                 "compute_output": "nv_inference_compute_output_summary_us"}
        totals = {"request": "success", "queue": "queue", "compute_input": "compute_input",
                  "compute_infer": "compute_infer", "compute_output": "compute_output"}
        if not any(m.summaries for m in self.models):
            return
        for kind, name in names.items():
            fam = Metric(name, f"Summary of {kind.replace('_', ' ')} durations in microseconds",
                         "summary")
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


class MetricsApp:
    def __init__(self, client: EngineClient, sampler: SystemSampler | None,
                 counter_latencies: bool = True, histogram_latencies: bool = False):
        self.client = client
        self.registry = CollectorRegistry(auto_describe=False)
        self.inference = InferenceCollector(counter_latencies, histogram_latencies)
        self.registry.register(self.inference)
        if sampler is not None:
            self.registry.register(sampler)

    def check_body_size(self, req, n):
        return ""

    def body_buffer(self, req, n):
        return None

    def release_body(self, req):
        pass

    def connection_lost(self, conn):
        pass

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
        except asyncio.TimeoutError:
            log.warning("scheduler did not answer the statistics query in time")
        conn.respond(req, 200, exposition(self.registry), "text/plain; charset=utf-8")
