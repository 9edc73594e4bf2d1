"""Frontend process shell: the uvloop loop, the HTTP listeners, the link to the scheduler.

    python -m shmserve.frontend.main '<json ServerSettings>' FRONTEND_ID
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

import msgspec
import uvloop

from shmserve.engine.launch import restricted
from shmserve.engine.lifecycle.upload_files import ModelUploads
from shmserve.engine.requests.prepare import RequestLimits
from shmserve.frontend import connections
from shmserve.frontend.cache.store import ResponseCache
from shmserve.frontend.colocation import ColocateMode, Colocation
from shmserve.frontend.engine_client import EngineClient
from shmserve.frontend.grpc import service as grpc_service
from shmserve.frontend.grpc.guard import GrpcLimits
from shmserve.frontend.http import server as http_server
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.observability.metrics import MetricsApp
from shmserve.frontend.observability.system_metrics import SystemSampler
from shmserve.frontend.observability.trace import TraceCore
from shmserve.frontend.priority import DrainPriority, PriorityMode
from shmserve.frontend.service import FrontendService
from shmserve.frontend.shm.regions import RegionTable
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import channel, logs
from shmserve.ipc.proc import StoppingMark, die_with_parent, freeze_startup_heap
from shmserve.ipc.shm import ShmArena, ShmMapCache
from shmserve.ipc.spawn_args import ServerSettings

log = logging.getLogger("shmserve.frontend")


async def run(settings: ServerSettings, frontend_id: int, incarnation: int = 0) -> None:
    """``incarnation``: how many frontends of this id died before (the launcher restarts one)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    service: FrontendService | None = None

    def on_sigterm() -> None:
        if stop.is_set():   # the drain is taking too long for whoever sent it: go now
            log.warning("second SIGTERM: exiting at once, without answering what is held")
            logs.flush(0.5)
            os._exit(1)
        if service is not None:
            # refused from this turn of the loop on, not from when the stopping task runs:
            # requests read meanwhile would otherwise be taken (Triton refuses them once the
            # signal has arrived)
            service.accepting = False
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    priority = DrainPriority(PriorityMode(settings.frontend_priority))
    colocation = Colocation(ColocateMode(settings.colocate),
                            max_gap_ns=settings.colocate_max_gap_us * 1000)
    client = EngineClient(settings.run_dir, frontend_id, loop, settings.max_inflight_requests,
                          settings.request_deadline_secs, priority, colocation,
                          first_id=(incarnation << channel.FRONTEND_ID_BITS) + 1,
                          segment_prefix=settings.segment_prefix)
    arena = ShmArena(channel.frontend_segment_prefix(settings.segment_prefix, frontend_id,
                                                     incarnation))
    maps = ShmMapCache()
    shm_timer = _ShmTimer(loop, arena, maps)
    regions = RegionTable(os.path.join(settings.run_dir, "client-shm"))   # one per server
    registry = ShmRegistry(settings.allow_client_shm,
                           local_only=settings.client_shm_from != "any", table=regions)
    limits = RequestLimits(max_tensor_bytes=settings.max_request_tensor_bytes,
                           max_json_elements=settings.http_max_json_elements)
    uploads = (ModelUploads(settings.model_upload_dir, settings.model_upload_max_bytes)
               if settings.model_upload_dir else None)
    # several frontends sample and write traces each on their own, to files of their own
    tracer = TraceCore(settings.trace,
                       f".frontend{frontend_id}" if settings.frontends > 1 else "")
    # each frontend caches the answers it gives: the size is shared out between them
    cache = ResponseCache(settings.response_cache_bytes // settings.frontends) \
        if settings.response_cache_bytes > 0 else None
    service = FrontendService(client, arena, maps, registry, settings.server_id,
                              settings.server_version, settings.strict_readiness, limits,
                              uploads, tracer, cache)
    try:
        mark: StoppingMark | None = StoppingMark(settings.run_dir)
    except OSError:             # started without a launcher (tests): its SIGTERM alone stops it
        mark = None
    if mark is not None:
        service.stopping = mark.is_set
        service.draining = mark.draining
    servers, ports = [], {}
    grpc_server = sampler_task = None
    # one budget of connections (file descriptors) for all of this process's ports
    budget = connections.for_process(settings.http_max_connections)
    try:
        if settings.allow_http:
            app = KServeHttpApp(service, settings.http_max_input_size,
                                restricted.parse(settings.http_restricted_api),
                                settings.http_header_forward_pattern)
            http_limits = http_server.Limits(
                max_header_bytes=settings.http_max_header_size,
                max_connections=settings.http_max_connections,
                request_timeout_s=settings.http_request_timeout_secs,
                idle_timeout_s=settings.http_idle_timeout_secs, budget=budget)
            srv = await http_server.serve(app, settings.http_address, settings.http_port,
                                          reuse_port=settings.frontends > 1, limits=http_limits)
            servers.append(srv)
            ports["http"] = srv.sockets[0].getsockname()[1]
            log.info("HTTP service listening on %s:%d", settings.http_address, ports["http"])
        if settings.allow_grpc:
            grpc_server, ports["grpc"] = await grpc_service.serve(
                service, settings.grpc_address, settings.grpc_port,
                restricted.parse(settings.grpc_restricted_protocol, "protocol"),
                settings.grpc_max_message_size, settings.grpc_options, settings.grpc_server,
                reuse_port=settings.frontends > 1, tls=settings.grpc_tls,
                header_forward=settings.grpc_header_forward_pattern,
                limits=GrpcLimits(settings.http_request_timeout_secs,
                                  settings.http_idle_timeout_secs, budget))
            log.info("gRPC service listening on %s:%d", settings.grpc_address, ports["grpc"])
        # one page for the server: its numbers come from the scheduler, not from this process
        if settings.allow_metrics and frontend_id == 0:
            sampler = None
            if settings.allow_cpu_metrics or settings.allow_gpu_metrics:
                sampler = SystemSampler(settings.metrics_interval_ms / 1000,
                                        settings.allow_cpu_metrics, settings.allow_gpu_metrics)
                sampler_task = loop.create_task(sampler.run())
            metrics_app = MetricsApp(client, sampler, settings.counter_latencies,
                                     settings.histogram_latencies,
                                     cache=settings.response_cache_bytes > 0)
            srv = await http_server.serve(metrics_app,
                                          settings.metrics_address or settings.http_address,
                                          settings.metrics_port,
                                          reuse_port=settings.frontends > 1,
                                          limits=http_server.Limits(budget=budget))
            servers.append(srv)
            ports["metrics"] = srv.sockets[0].getsockname()[1]
            log.info("metrics service listening on port %d", ports["metrics"])
        if settings.port_file and frontend_id == 0:
            tmp = settings.port_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(ports, f)
            os.replace(tmp, settings.port_file)
        freeze_startup_heap()
        await stop.wait()
        log.info("frontend stopping")
        service.accepting = False
        for srv in servers:
            srv.close()
        deadline = loop.time() + settings.exit_timeout_secs
        while client.pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        client.fail_all("the server is shutting down")
        if sampler_task is not None:
            sampler_task.cancel()
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
    finally:
        tracer.flush()          # log_frequency 0: every trace is written now, at the stop
        shm_timer.cancel()
        priority.close()
        colocation.close()
        client.close()
        arena.close()
        maps.close()
        regions.close()
        if mark is not None:
            service.stopping = lambda: True
            mark.close()


class _ShmTimer:
    """Gives idle arena chunks back, and drops mappings of segments their owner unlinked, without
    waiting for a request: a burst of large tensors followed by silence must not pin /dev/shm."""

    def __init__(self, loop: asyncio.AbstractEventLoop, arena: ShmArena, maps: ShmMapCache):
        self.loop, self.arena, self.maps = loop, arena, maps
        self.period = max(0.05, min(1.0, arena.idle_release_s / 2))
        self.handle = loop.call_later(self.period, self.tick)

    def tick(self) -> None:
        self.handle = self.loop.call_later(self.period, self.tick)
        self.arena.trim()
        self.maps.sweep()

    def cancel(self) -> None:
        self.handle.cancel()


def main() -> None:
    settings = msgspec.json.decode(sys.argv[1].encode(), type=ServerSettings)
    frontend_id = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    incarnation = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    die_with_parent(settings.launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a log call never blocks the loop
    name = "frontend" if frontend_id == 0 else f"frontend-{frontend_id}"
    logs.setup(name, settings=logs.from_server(settings), path=settings.log_file)
    uvloop.run(run(settings, frontend_id, incarnation))
    logs.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
