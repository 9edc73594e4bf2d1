"""``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` on grpc.aio, in the frontend's
event loop, with tritonclient's generated modules. Every RPC reuses what HTTP uses (catalog,
shared request preparation, shared-memory registry); only the message shapes differ.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from shmserve.ipc.messages import ErrorCode, InferResult
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache

from . import grpc_codec, request, statistics
from .engine_client import EngineClient
from .errors import InferError
from .http_app import EXTENSIONS
from .shm_registry import ShmRegistry

log = logging.getLogger("shmserve.grpc")

STATUS = {
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL, ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED, ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
}
MAX_MESSAGE = 2 ** 31 - 1


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, client: EngineClient, arena: ShmArena, maps: ShmMapCache,
                 registry: ShmRegistry, server_id: str, server_version: str, strict: bool):
        self.client, self.arena, self.maps, self.registry = client, arena, maps, registry
        self.server_id, self.server_version, self.strict = server_id, server_version, strict
        self.accepting = True

    async def _abort(self, context, e: InferError):
        await context.abort(STATUS.get(e.code, grpc.StatusCode.INVALID_ARGUMENT), e.message)

    # ---- health and metadata -------------------------------------------------------------------
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(
            ready=self.accepting and self.client.catalog.server_ready(self.strict))

    async def ModelReady(self, request, context):
        catalog = self.client.catalog
        try:
            catalog.get(request.name)
            catalog.resolve(request.name, request.version)
            return pb.ModelReadyResponse(ready=True)
        except InferError as e:
            if e.code == ErrorCode.NOT_FOUND and request.name not in catalog.models \
                    or e.code == ErrorCode.INVALID_ARG:
                await self._abort(context, e)
            return pb.ModelReadyResponse(ready=False)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=self.server_id, version=self.server_version,
                                         extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        try:
            view, v = self.client.catalog.resolve(request.name, request.version)
        except InferError as e:
            await self._abort(context, e)
        meta = view.metadata(v if request.version else None)
        resp = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                        platform=meta["platform"])
        for t in meta["inputs"]:
            resp.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        for t in meta["outputs"]:
            resp.outputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    async def ModelConfig(self, request, context):
        try:
            view, _ = self.client.catalog.resolve(request.name, request.version)
        except InferError as e:
            await self._abort(context, e)
        return pb.ModelConfigResponse(config=view.config)

    async def ModelStatistics(self, request, context):
        try:
            if request.version and not request.version.isdigit():
                raise InferError(ErrorCode.INVALID_ARG, f"invalid model version "
                                                        f"'{request.version}'")
            reply = await self.client.statistics(request.name,
                                                 int(request.version) if request.version else -1)
            return statistics.to_proto(statistics.check(reply))
        except InferError as e:
            await self._abort(context, e)

    # ---- inference -------------------------------------------------------------------------------
    async def _infer(self, req: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """One request through the shared path; raises InferError."""
        if not self.accepting:
            raise InferError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        view, v = self.client.catalog.resolve(req.model_name, req.model_version)
        prepared = grpc_codec.parse_infer(view, req, self.arena, self.registry)
        fut = asyncio.get_running_loop().create_future()
        req_id = self.client.submit(view.name, v, prepared, fut.set_result,
                                    view.preserve_ordering)
        try:
            result: InferResult = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the client cancelled the RPC: drop the request if it is still queued; its slots
            # are released when the (cancelled or finished) answer arrives
            self.client.cancel(req_id)
            fut.add_done_callback(lambda f: self._release_late(prepared, f.result()))
            raise
        request.release(prepared, self.arena)
        refs = request.worker_slots(result, prepared)
        try:
            if result.error:
                raise InferError(result.code or ErrorCode.INTERNAL, result.error)
            try:
                views = request.output_views(result, prepared, self.maps)
            except ShmError as e:
                raise InferError(ErrorCode.INTERNAL, str(e)) from None
            return grpc_codec.build_response(result, prepared, views)
        finally:
            if refs:                    # build_response copied the bytes out already
                self.client.release(result.worker, refs)

    def _release_late(self, prepared, result: InferResult) -> None:
        request.release(prepared, self.arena)
        refs = request.worker_slots(result, prepared)
        if refs:
            self.client.release(result.worker, refs)

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request)
        except InferError as e:
            await self._abort(context, e)

    async def ModelStreamInfer(self, request_iterator, context):
        """Answers in request order; an error is a message on the stream, which stays open."""
        pending: asyncio.Queue = asyncio.Queue()

        async def read():
            async for req in request_iterator:
                pending.put_nowait((req.id, asyncio.ensure_future(self._infer(req))))
            pending.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await pending.get()
                if item is None:
                    break
                req_id, task = item
                try:
                    yield pb.ModelStreamInferResponse(infer_response=await task)
                except InferError as e:
                    yield pb.ModelStreamInferResponse(
                        error_message=e.message, infer_response=pb.ModelInferResponse(id=req_id))
            await reader
        finally:
            reader.cancel()

    # ---- repository --------------------------------------------------------------------------------
    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        for e in self.client.catalog.index(request.ready):
            resp.models.add(name=e["name"], version=e.get("version", ""),
                            state=e.get("state", ""), reason=e.get("reason", ""))
        return resp

    async def _control(self, action: str, request, context):
        if request.repository_name:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "repository names are not supported")
        params = grpc_codec.parameters_to_dict(request.parameters)
        if any(k.startswith("file:") for k in params):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "load parameters 'file:<version>/<name>' are not supported yet")
        config = params.get("config", "")
        if not isinstance(config, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "load parameter 'config' must be a string_param holding JSON")
        reply = await self.client.control(action, request.model_name, config,
                                          params.get("unload_dependents") is True)
        if reply.error:
            await self._abort(context, InferError(reply.code or ErrorCode.INTERNAL, reply.error))

    async def RepositoryModelLoad(self, request, context):
        await self._control("load", request, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._control("unload", request, context)
        return pb.RepositoryModelUnloadResponse()

    # ---- shared memory -------------------------------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request, context):
        try:
            regions = self.registry.status_system(request.name)
        except InferError as e:
            await self._abort(context, e)
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            resp.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return resp

    async def SystemSharedMemoryRegister(self, request, context):
        try:
            region = self.registry.register_system(request.name, request.key, request.offset,
                                                   request.byte_size)
        except InferError as e:
            await self._abort(context, e)
        self.client.forget_segments([region.segment])
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        try:
            gone = self.registry.unregister_system(request.name)
        except InferError as e:
            await self._abort(context, e)
        if gone:
            self.client.forget_segments(gone)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        try:
            self.registry.status_cuda(request.name)
        except InferError as e:
            await self._abort(context, e)
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        try:
            self.registry.register_cuda(request.name, request.raw_handle, request.device_id,
                                        request.byte_size)
        except InferError as e:
            await self._abort(context, e)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        try:
            self.registry.unregister_cuda(request.name)
        except InferError as e:
            await self._abort(context, e)
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- trace and logging -------------------------------------------------------------------------
    async def TraceSetting(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "the trace extension is not available on this server yet")

    async def LogSettings(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "the logging extension is not available on this server yet")


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self, inference: InferenceService):
        self.inference = inference

    async def Check(self, request, context):
        serving = self.inference.accepting
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(service: InferenceService, address: str, port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(service), server)
    bound = server.add_insecure_port(f"{address}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {address}:{port}")
    await server.start()
    return server, bound
