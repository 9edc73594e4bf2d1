"""``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` in the frontend's event loop,
with tritonclient's generated modules, served by ``grpc/loop.py`` (HTTP/2 on the loop) or grpc.aio.

This module only translates: each RPC turns its request message into arguments of
``FrontendService``, and its answer into the response message. An ``InferError`` aborts the RPC
with ``errors.grpc_status`` of its code, the same mapping for every RPC.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from shmserve.engine.launch import restricted
from shmserve.engine.requests.header_forward import HeaderForward
from shmserve.frontend.grpc import codec as grpc_codec
from shmserve.frontend.grpc import loop as grpc_loop
from shmserve.frontend.grpc.guard import GrpcLimits
from shmserve.frontend.grpc.status import grpc_status
from shmserve.frontend.grpc.stream import Refused, StreamSession, build_response
from shmserve.frontend.observability import log_settings, statistics, trace
from shmserve.frontend.service import FrontendService
from shmserve.ipc.errors import InferError
from shmserve.ipc.spawn_args import GrpcTls

log = logging.getLogger("shmserve.grpc")

MAX_MESSAGE = 2 ** 31 - 1
# requests of one ModelStreamInfer stream running or waiting to be written (back-pressure)
STREAM_MAX_INFLIGHT = 16
# a ModelStreamInfer client that sends this header with the value "true" (exactly, as Triton
# compares it) gets a failed answer as the stream's gRPC status, which ends the stream
STREAM_ERROR_HEADER = "triton_grpc_error"


def stream_error_mode(context) -> bool:
    metadata = context.invocation_metadata() if context is not None else None
    return any(k == STREAM_ERROR_HEADER and v == "true" for k, v in metadata or ())


def translated(rpc):
    """A unary RPC whose InferErrors abort the call with the mapped status."""
    @functools.wraps(rpc)
    async def call(self, request, context):
        try:
            return await rpc(self, request, context)
        except InferError as e:
            await context.abort(grpc_status(e.code), e.message)
    return call


# the restricted-API group (engine/launch/restricted.py) of each RPC
RPC_GROUPS = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


def _guard_unary(rpc, group: str, restrictions):
    @functools.wraps(rpc)
    async def call(request, context):
        refusal = restricted.grpc_refusal(group, restrictions, context.invocation_metadata())
        if refusal:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        return await rpc(request, context)
    return call


def _guard_stream(rpc, group: str, restrictions):
    @functools.wraps(rpc)
    async def call(request_iterator, context):
        refusal = restricted.grpc_refusal(group, restrictions, context.invocation_metadata())
        if refusal:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        async for response in rpc(request_iterator, context):
            yield response
    return call


DELAY_VARIABLE = "TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC"


def _response_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_VARIABLE, "0") or 0))
    except ValueError:
        return 0.0


def _delayed(rpc, seconds: float):
    @functools.wraps(rpc)
    async def call(request, context):
        await asyncio.sleep(seconds)        # the loop serves other calls meanwhile
        return await rpc(request, context)
    return call


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: FrontendService,
                 restrictions: dict[str, tuple[str, str]] | None = None,
                 max_message: int = MAX_MESSAGE, header_forward: str = ""):
        self.service = service
        self.max_message = max_message
        # --grpc-header-forward-pattern: matching metadata becomes the request's parameters
        self.forward = HeaderForward(header_forward)
        # Triton's test hook: every answer but an inference's is held this many seconds
        # (its QA suites test clients' timeouts with it); off unless the variable is set
        delay = _response_delay()
        if delay > 0:
            for name in RPC_GROUPS:
                if name not in ("ModelInfer", "ModelStreamInfer"):
                    setattr(self, name, _delayed(getattr(self, name), delay))
        # restricted RPCs are replaced on the instance before the server registers them
        for name, group in RPC_GROUPS.items():
            if restrictions and group in restrictions:
                guard = _guard_stream if name == "ModelStreamInfer" else _guard_unary
                setattr(self, name, guard(getattr(self, name), group, restrictions))
        # handlers the loop server runs without a task (grpc_loop.GrpcLoopServer.now)
        self.now = {} if restrictions and RPC_GROUPS["ModelInfer"] in restrictions else \
            {b"/inference.GRPCInferenceService/ModelInfer": self.model_infer_now}

    # ---- health and metadata -------------------------------------------------------------------
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.service.server_ready())

    @translated
    async def ModelReady(self, request, context):
        ready = self.service.model_ready(request.name, request.version)
        asked = self.service.model_decides(request.name, request.version) if ready else None
        if asked is not None:
            ready = await self.service.client.model_decides_ready(*asked)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.service.metadata())

    @translated
    async def ModelMetadata(self, request, context):
        view, v = self.service.model(request.name, request.version)
        meta = view.metadata(v if request.version else None)
        resp = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                        platform=meta["platform"])
        for t in meta["inputs"]:
            resp.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        for t in meta["outputs"]:
            resp.outputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    @translated
    async def ModelConfig(self, request, context):
        view, _ = self.service.model(request.name, request.version)
        return pb.ModelConfigResponse(config=view.config)

    @translated
    async def ModelStatistics(self, request, context):
        return statistics.to_proto(await self.service.statistics(request.name, request.version))

    # ---- inference ------------------------------------------------------------------------------
    def forwarded(self, context) -> dict[str, str] | None:
        """The call's metadata that becomes parameters; raises InferError for a reserved one."""
        if self.forward.regex is None or context is None:
            return None
        return self.forward.params(context.invocation_metadata() or ())

    async def _infer(self, req: pb.ModelInferRequest, peer: str, unary: str = "",
                     forwarded: dict[str, str] | None = None) -> pb.ModelInferResponse:
        """One request through the service; raises InferError. ``peer``: the client's
        address (``context.peer()``); ``unary``: see infer_target; ``forwarded``: metadata
        that becomes parameters (``forwarded()``)."""
        view, v, prepared, traced = self._admit(req, peer, unary, forwarded)
        return self._response(await self.service.infer(view, v, prepared), prepared, traced)

    def start_infer(self, req: pb.ModelInferRequest, done: Callable, peer: str, unary: str = "",
                    forwarded: dict[str, str] | None = None) -> Callable[[], None]:
        """``_infer`` without a task: the request is submitted now (raises Refused if it is
        refused before that) and ``done(response, None)`` or ``done(None, exception)`` is
        called with its answer, never before this returns. Returns what drops the request
        when nobody waits for its answer any more; call it only before ``done``."""
        svc = self.service
        view, v, prepared, traced = self._admit(req, peer, unary, forwarded)

        def answered(result) -> None:
            try:
                response = self._response(result, prepared, traced)
            except Exception as e:      # noqa: BLE001 - the caller says what it was
                done(None, e)
                return
            done(response, None)
        req_id = svc.submit(view, v, prepared, answered)
        return lambda: svc.abandon(req_id, prepared)

    def _admit(self, req: pb.ModelInferRequest, peer: str, unary: str,
               forwarded: dict[str, str] | None):
        """The model, version and prepared request of a call, and its trace (or None); raises
        Refused. ``peer`` decides whether it may name shared-memory regions."""
        svc = self.service
        traced = None
        try:
            view, v = svc.infer_target(req.model_name, req.model_version, unary)
            if svc.tracer.active:
                traced = svc.tracer.sample(view.name, v)
                if traced is not None:     # the call's message is read whole before this
                    traced.started("GRPC_WAITREAD", traced.created_ns)
            prepared = grpc_codec.parse_infer(view, req, svc.arena, svc.registry.for_peer(peer),
                                              svc.limits, forwarded)
        except InferError as e:
            raise Refused(e.code, e.message) from None
        if traced is not None:
            traced.queued(prepared, svc.maps)
        return view, v, prepared, traced

    def _response(self, result, prepared, traced) -> pb.ModelInferResponse:
        svc = self.service
        refs = svc.release_inputs(prepared, result)
        if traced is not None:
            traced.answered(result, svc.maps)
            traced.stamp("GRPC_SEND_START")
        try:
            response = build_response(svc, result, prepared, self.max_message)
        finally:
            svc.release_outputs(result, refs)       # build_response copied the bytes out
        if traced is not None:      # handed to the connection, which writes it next
            traced.stamp("GRPC_SEND_END")
            svc.tracer.finish(traced)
        return response

    async def ModelInfer(self, request, context):
        # written out rather than @translated: this is the hot path (on the loop server,
        # model_infer_now is, and this serves grpc.aio)
        try:
            forwarded = self.forwarded(context) if self.forward.regex is not None else None
            return await self._infer(request, context.peer(), "ModelInfer RPC", forwarded)
        except InferError as e:
            await context.abort(grpc_status(e.code), e.message)

    def model_infer_now(self, request: pb.ModelInferRequest, call, answer) -> None:
        """ModelInfer without a task (grpc_loop: a call's ``now`` handler), answered through
        ``answer(call, response, error)``. Sets ``call.cancel``, which the connection calls if
        the call ends first (a reset stream, its deadline). Saves the loop server a task, a
        future and a turn of the loop per call."""
        forwarded = self.forwarded(call.context) if self.forward.regex is not None else None
        call.cancel = self.start_infer(request, functools.partial(answer, call),
                                       call.context.peer(), "ModelInfer RPC", forwarded)

    async def ModelStreamInfer(self, request_iterator, context):
        """Many requests on one stream (frontend/grpc/stream.py: order, decoupled answers,
        errors and the ``triton_grpc_error`` header, back-pressure)."""
        try:
            forwarded = self.forwarded(context)     # the stream's metadata, for its requests
        except InferError as e:
            await context.abort(grpc_status(e.code), e.message)
        start = functools.partial(self.start_infer, peer=context.peer(), forwarded=forwarded)
        session = StreamSession(self.service, context, stream_error_mode(context),
                                STREAM_MAX_INFLIGHT, start, self.max_message, forwarded)
        async for response in session.run(request_iterator):
            yield response

    # ---- repository -----------------------------------------------------------------------------
    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        for e in await self.service.index(request.ready):
            resp.models.add(name=e["name"], version=e.get("version", ""),
                            state=e.get("state", ""), reason=e.get("reason", ""))
        return resp

    @translated
    async def RepositoryModelLoad(self, request, context):
        await self.service.load(request.model_name,
                                grpc_codec.parameters_to_dict(request.parameters),
                                request.repository_name)
        return pb.RepositoryModelLoadResponse()

    @translated
    async def RepositoryModelUnload(self, request, context):
        await self.service.unload(request.model_name,
                                  grpc_codec.parameters_to_dict(request.parameters),
                                  request.repository_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- shared memory --------------------------------------------------------------------------
    @translated
    async def SystemSharedMemoryStatus(self, request, context):
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in self.service.status_system(request.name, context.peer()):
            resp.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return resp

    @translated
    async def SystemSharedMemoryRegister(self, request, context):
        self.service.register_system(request.name, request.key, request.offset,
                                     request.byte_size, context.peer())
        return pb.SystemSharedMemoryRegisterResponse()

    @translated
    async def SystemSharedMemoryUnregister(self, request, context):
        self.service.unregister_system(request.name, context.peer())
        return pb.SystemSharedMemoryUnregisterResponse()

    @translated
    async def CudaSharedMemoryStatus(self, request, context):
        resp = pb.CudaSharedMemoryStatusResponse()
        for r in self.service.status_cuda(request.name, context.peer()):
            resp.regions[r["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(**r))
        return resp

    @translated
    async def CudaSharedMemoryRegister(self, request, context):
        self.service.register_cuda(request.name, request.raw_handle, request.device_id,
                                   request.byte_size, context.peer())
        return pb.CudaSharedMemoryRegisterResponse()

    @translated
    async def CudaSharedMemoryUnregister(self, request, context):
        self.service.unregister_cuda(request.name, context.peer())
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- trace and logging ----------------------------------------------------------------------
    @translated
    async def TraceSetting(self, request, context):
        control = self.service.tracing
        now = await control.update(trace.from_grpc(request.settings),
                                   request.model_name) if request.settings \
            else control.get(request.model_name)
        resp = pb.TraceSettingResponse()
        for key, value in now.items():
            resp.settings[key].value.extend(value if isinstance(value, list) else [value])
        return resp

    @translated
    async def LogSettings(self, request, context):
        control = self.service.logging
        now = await control.update(log_settings.from_grpc(request)) if request.settings \
            else control.get()
        return log_settings.to_grpc(*now)


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self, service: FrontendService):
        self.service = service

    async def Check(self, request, context):
        # a balancer that checks gRPC health moves away during the grace period too
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if self.service.serving()
            else health_pb2.HealthCheckResponse.NOT_SERVING)


class _GenericHandlers:
    """Takes what the generated ``add_*_to_server`` functions register, keeping only their
    generic handler, which serves every method of the service by its path.

    They also register each method with grpc.aio as a "registered method", and grpc.aio's
    accept loop then keeps one pending request-call task per registered method (20 for
    GRPCInferenceService, 2 for Health, plus the generic one) and runs ``asyncio.wait`` over all
    of them for every call it accepts: Python work on the event loop that grows with the
    number of methods (bench/grpc_ab.py). With the generic handler alone it waits on one."""

    def __init__(self) -> None:
        self.handlers: list = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers) -> None:
        pass        # the service's generic handler serves the same methods


async def serve(service: FrontendService, address: str, port: int,
                restrictions: dict[str, tuple[str, str]] | None = None,
                max_message: int = MAX_MESSAGE,
                options: dict[str, int] | None = None, kind: str = "loop",
                reuse_port: bool = False, tls: GrpcTls | None = None,
                header_forward: str = "", limits: GrpcLimits | None = None,
                ) -> tuple[grpc_loop.GrpcLoopServer | grpc.aio.Server, int]:
    """``max_message`` (--grpc-max-message-size) bounds each message, either way: a larger
    request is answered RESOURCE_EXHAUSTED before it reaches a handler, and so is a larger
    answer. ``kind`` (--grpc-server): ``loop`` serves on this event loop (grpc_loop), ``aio``
    with grpc.aio; ``options`` (keep-alive, connection age, compression flags) are grpc.aio
    channel options: given one the loop server does not implement (ping policing, response
    compression), grpc.aio serves. ``tls`` (--grpc-use-ssl): either serves over TLS, with the
    PEM files it names (read here, at start). ``limits``: the connection budget shared with the
    other ports and the timeouts (grpc_guard); grpc.aio gets what of them its options can say."""
    limits = limits or GrpcLimits()
    handlers = _GenericHandlers()
    inference = InferenceService(service, restrictions, max_message, header_forward)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(inference, handlers)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(service), handlers)
    unsupported = sorted(set(options or {}) - grpc_loop.OPTIONS)
    if kind == "loop" and not unsupported:
        loop_server = grpc_loop.GrpcLoopServer(handlers.handlers, max_message, options,
                                               inference.now, limits)
        try:
            bound = await loop_server.start(address.strip("[]"), port, reuse_port,
                                            _ssl_context(tls) if tls is not None else None)
        except OSError as e:
            raise OSError(f"cannot listen for gRPC on {address}:{port}: {e}") from None
        return loop_server, bound
    if kind == "loop":
        log.info("gRPC served by grpc.aio: the loop server does not implement %s",
                 ", ".join(unsupported))
    server = grpc.aio.server(options=[("grpc.max_send_message_length", max_message),
                                      ("grpc.max_receive_message_length", max_message),
                                      ("grpc.so_reuseport", int(reuse_port)),
                                      *_aio_limits(limits).items(), *(options or {}).items()])
    server.add_generic_rpc_handlers(handlers.handlers)
    if tls is None:
        bound = server.add_insecure_port(f"{address}:{port}")
    else:
        bound = server.add_secure_port(f"{address}:{port}", _credentials(tls))
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {address}:{port}")
    await server.start()
    return server, bound


def _aio_limits(limits: GrpcLimits) -> dict[str, int]:
    """The loop server's limits as grpc.aio's options: its handshake and idle time, and a part
    of the connection budget, which grpc.aio cannot share: it takes half, the other ports keep
    the rest."""
    out = {"grpc.server_handshake_timeout_ms": int(limits.handshake_s * 1000),
           "grpc.max_connection_idle_ms": int(limits.idle_timeout_s * 1000)}
    budget = limits.budget
    if budget is not None:
        share = max(1, budget.total // 2)
        budget.total -= share
        out["grpc.max_allowed_incoming_connections"] = share
    return out


def _credentials(tls: GrpcTls) -> grpc.ServerCredentials:
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_server_credentials(
        [(read(tls.server_key), read(tls.server_cert))],
        root_certificates=read(tls.root_cert) if tls.root_cert else None,
        require_client_auth=tls.mutual)


def _ssl_context(tls: GrpcTls) -> ssl.SSLContext:
    """TLS for the loop server: HTTP/2 needs TLS 1.2 or later and ALPN "h2"."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.server_cert, tls.server_key)
    ctx.set_alpn_protocols(["h2"])
    if tls.root_cert:
        ctx.load_verify_locations(tls.root_cert)
    if tls.mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
