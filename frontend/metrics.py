"""The Prometheus endpoint (``GET /metrics`` on --metrics-port), rendered by prometheus_client."""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shmserve.ipc import channel

from .engine_client import EngineClient
from .http_server import HttpConnection, HttpRequest

log = logging.getLogger("shmserve.metrics")


class IpcCollector:
    """Bytes and messages that crossed ZeroMQ sockets, per process.

    Every socket has one end in the frontend or the scheduler, so these two processes see all
    traffic; ``largest`` shows that big tensors never ride in a message.
    """

    def __init__(self):
        self.scheduler: dict[str, int] = {}

    def collect(self):
        total = CounterMetricFamily("shmserve_ipc_bytes", "Bytes sent and received over ZeroMQ",
                                    labels=["process", "direction"])
        msgs = CounterMetricFamily("shmserve_ipc_messages", "Messages sent and received over "
                                   "ZeroMQ", labels=["process", "direction"])
        largest = GaugeMetricFamily("shmserve_ipc_largest_message_bytes", "Largest message "
                                    "(all frames) sent or received over ZeroMQ",
                                    labels=["process", "direction"])
        for proc, stats in (("frontend", channel.COUNTERS.as_dict()), ("scheduler", self.scheduler)):
            for d in ("sent", "received"):
                if f"{d}_bytes" in stats:
                    total.add_metric([proc, d], stats[f"{d}_bytes"])
                    msgs.add_metric([proc, d], stats[f"{d}_messages"])
                    largest.add_metric([proc, d], stats[f"largest_{d}"])
        yield total
        yield msgs
        yield largest


class MetricsApp:
    def __init__(self, client: EngineClient):
        self.client = client
        self.registry = CollectorRegistry(auto_describe=False)
        self.ipc = IpcCollector()
        self.registry.register(self.ipc)

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
            self.ipc.scheduler = await self.client.scheduler_stats()
        except asyncio.TimeoutError:
            log.warning("scheduler did not answer the statistics query in time")
        conn.respond(req, 200, generate_latest(self.registry), "text/plain; charset=utf-8")
