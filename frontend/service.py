"""What the HTTP and gRPC frontends both do, written once.

Readiness rules, model control with its parameter checks, statistics, client shared memory and an
inference request's life after it is parsed (submit, wait, free the inputs, give the worker's
output slots back) live here. Methods take plain values, return plain values and raise only
``InferError``; ``http/app.py`` and ``grpc/service.py`` parse their messages, call in, and map the
error with ``errors.http_status`` / ``errors.grpc_status``. So the protocols cannot drift apart
in what they accept or how they fail.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from shmserve.engine.lifecycle.upload_files import FILE_PREFIX, ModelUploads
from shmserve.engine.requests import prepare as request
from shmserve.engine.requests import validation
from shmserve.engine.requests.catalog import ModelCatalog, ModelView, version_number
from shmserve.engine.requests.prepare import DEFAULT_LIMITS, PreparedRequest, RequestLimits
from shmserve.frontend.cache.store import ResponseCache
from shmserve.frontend.cache.submit import CachedRequests
from shmserve.frontend.observability.log_settings import LogControl
from shmserve.frontend.observability.trace import TraceControl, TraceCore
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.errors import InferError, invalid
from shmserve.ipc.messages.common import ControlAction, ErrorCode, ShmRef, TraceConfig
from shmserve.ipc.messages.to_frontend import InferResult, ModelStatistics
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache

EXTENSIONS = ["classification", "model_repository", "schedule_policy", "model_configuration",
              "system_shared_memory", "cuda_shared_memory", "binary_tensor_data", "parameters",
              "statistics", "trace", "logging"]

FIRST_TABLE_WAIT_S = 30.0

log = logging.getLogger("shmserve.frontend")


class FrontendService:
    def __init__(self, client: Any, arena: ShmArena, maps: ShmMapCache,
                 registry: ShmRegistry, server_id: str, server_version: str,
                 strict_readiness: bool, limits: RequestLimits = DEFAULT_LIMITS,
                 uploads: ModelUploads | None = None, trace: TraceCore | None = None,
                 cache: ResponseCache | None = None):
        # frontend/engine_client.py's EngineClient: typed Any because tests give fakes, and
        # this module runs compiled (ipc/compiled.py), which checks a class-typed argument
        self.client = client
        self.uploads = uploads          # where 'file:' load parameters go; None: refused
        self.limits = limits            # per-request tensor bounds both codecs apply
        self.arena = arena
        self.maps = maps
        self.registry = registry
        self.server_id = server_id
        self.server_version = server_version
        self.strict_readiness = strict_readiness
        self.accepting = True           # False once shutdown begins: not ready, no new requests
        # the launcher's mark, set the moment a stop signal reaches it (ipc/proc.py): read per
        # request, so requests sent after the signal are refused before this frontend's own
        # SIGTERM has been handled
        self.stopping: Callable[[], bool] = lambda: False
        # a stop signal came (--exit-grace-secs): not ready, while requests are still taken
        self.draining: Callable[[], bool] = lambda: False
        self.logging = LogControl(client)   # the logging extension (frontend/observability/log_settings.py)
        # the trace extension (frontend/observability/trace.py); ``tracer.active`` is all a request checks
        self.tracer = trace or TraceCore(TraceConfig())
        self.tracing = TraceControl(self.tracer, client, lambda name: name in self.catalog.models)
        client.on_trace_settings = self.tracing.apply
        # requests of models with the response cache (frontend/cache/submit.py); None:
        # --cache-config not given
        self.cached = None if cache is None else CachedRequests(cache, client, arena, maps,
                                                                self.release_outputs)

    @property
    def catalog(self) -> ModelCatalog:
        # the client replaces the catalog's contents on every model table; never cache a view
        return self.client.catalog

    # ---- health and metadata -------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"name": self.server_id, "version": self.server_version, "extensions": EXTENSIONS}

    def serving(self) -> bool:
        """No stop has begun (its grace period counts as begun: --exit-grace-secs)."""
        return self.accepting and not self.draining()

    def server_ready(self) -> bool:
        return self.serving() and self.catalog.server_ready(self.strict_readiness)

    def model_ready(self, name: str, version: str) -> bool:
        """Whether the model (or one version of it) serves. An unknown model and a malformed
        version are errors, not "not ready": clients tell a typo from a loading model that way."""
        catalog = self.catalog
        catalog.get(name)
        try:
            view, v = catalog.resolve(name, version)
        except InferError as e:
            if e.code == ErrorCode.INVALID_ARG:
                raise
            return False
        # on demand, a model that is not loaded is ready: a request loads it and is served
        if not view.servable(view.states[v]):
            return False
        if self.strict_readiness:
            unhealthy = view.unhealthy(v)
            if unhealthy:       # Triton's words for a dead instance process, then ours
                log.error("Model '%s' version %d is not ready: Stub process '%s' is not healthy. "
                          "(its worker process ended; it is restarting)", view.name, v, unhealthy)
                return False
        return True

    def model_decides(self, name: str, version: str) -> tuple[str, int] | None:
        """(model, version) when that version serves and its model decides its own readiness
        (a python model's is_ready(): ask it, ``client.model_decides_ready``); else None."""
        try:
            view, v = self.catalog.resolve(name, version)
        except InferError:
            return None
        return (view.name, v) if view.asks_model(v) else None

    def model(self, name: str, version: str) -> tuple[ModelView, int]:
        """The model and version a metadata, config or infer request addresses."""
        return self.catalog.resolve(name, version)

    async def index(self, ready_only: bool) -> list[dict]:
        # Until the scheduler's first model table arrives the catalog is empty, which a client
        # would read as "no models": wait for the table instead (it follows the frontend's hello).
        if not self.client.table_event.is_set():
            try:
                await asyncio.wait_for(self.client.table_event.wait(), FIRST_TABLE_WAIT_S)
            except asyncio.TimeoutError:
                raise InferError(ErrorCode.UNAVAILABLE, "the model repository has not been read "
                                 "yet; try again") from None
        return self.catalog.index(ready_only)

    # ---- model control --------------------------------------------------------------------------
    async def load(self, name: str, params: dict[str, Any], repository: str = "",
                   base64_files: bool = False) -> None:
        """``base64_files``: 'file:' values are base64 text (HTTP), not raw bytes (gRPC)."""
        _no_repository(repository)
        validation.check_load_name(name)
        config = params.get("config", "")
        if not isinstance(config, str):
            raise invalid(f"load parameter 'config' must be a string holding the model "
                          f"configuration as JSON, got {config!r}")
        upload_dir = ""
        if any(k.startswith(FILE_PREFIX) for k in params):
            upload_dir = await self._upload(name, params, base64_files)
        await self._control(ControlAction.LOAD, name, config, False, upload_dir)

    async def _upload(self, name: str, params: dict[str, Any], base64_files: bool) -> str:
        """Write the load's model files into a directory of their own (engine/lifecycle/upload_files.py)
        and return its path; the load request then hands it to the scheduler."""
        if self.uploads is None:
            raise InferError(ErrorCode.UNSUPPORTED, f"failed to load '{name}': load parameters "
                             f"'file:<path>' are not supported by this frontend")
        files = self.uploads.check(name, params, base64_files)
        # decoding and writing up to --model-upload-max-bytes must not stall the event loop
        written = asyncio.get_running_loop().run_in_executor(
            None, self.uploads.write, name, files, base64_files)
        try:
            return await asyncio.shield(written)
        except asyncio.CancelledError:      # the client left: remove what is still being written
            uploads = self.uploads
            written.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else uploads.discard(f.result()))
            raise

    async def unload(self, name: str, params: dict[str, Any], repository: str = "") -> None:
        _no_repository(repository)
        # Triton clients always send it. shmserve has no ensembles yet, so no model has
        # dependents and true and false unload the same (docs/protocols.md, "Model control").
        dependents = params.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise invalid(f"unload parameter 'unload_dependents' must be a boolean, "
                          f"got {dependents!r}")
        await self._control(ControlAction.UNLOAD, name, "", dependents)

    async def _control(self, action: ControlAction, name: str, config: str,
                       dependents: bool, upload_dir: str = "") -> None:
        try:
            reply = await self.client.control(action, name, config, dependents,
                                              upload_dir=upload_dir)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE,
                             f"{action.value} of '{name}' did not finish in time") from None
        except asyncio.CancelledError:
            raise                           # it was sent: the scheduler owns the upload
        except Exception:
            if upload_dir and self.uploads is not None:
                self.uploads.discard(upload_dir)    # it never reached the scheduler
            raise
        if reply.error:
            raise InferError(reply.code or ErrorCode.INTERNAL, reply.error)

    # ---- statistics -----------------------------------------------------------------------------
    async def statistics(self, model: str, version: str) -> list[ModelStatistics]:
        """Every model's counters (model ""), or one model's (every ready version, or one)."""
        number = version_number(model, version) if version else -1
        try:
            reply = await self.client.statistics(model, number)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE,
                             "the statistics query did not finish in time") from None
        if reply.error:
            # the scheduler refuses only an unknown model or version, which Triton calls a bad
            # argument here (400 / INVALID_ARGUMENT), not NOT_FOUND
            raise InferError(ErrorCode.INVALID_ARG, reply.error)
        return reply.models

    # ---- client shared memory -------------------------------------------------------------------
    def register_system(self, name: str, key, offset, byte_size, peer: str = "") -> None:
        # a key that names a segment the client unlinked and re-created needs nothing here:
        # readers look a client segment up by name on every use (ipc/shm.py ShmMapCache)
        self.registry.register_system(name, key, offset, byte_size, peer)

    def unregister_system(self, name: str, peer: str = "") -> None:
        gone = self.registry.unregister_system(name, peer)
        if gone:
            self.client.forget_segments(gone)

    def status_system(self, name: str, peer: str = "") -> list[dict]:
        return self.registry.status_system(name, peer)

    def register_cuda(self, name: str, raw_handle, device_id, byte_size, peer: str = "") -> None:
        # a handle registered again after an unregister was closed by the workers then; the
        # allocation behind a handle never changes (a new allocation gets a new handle)
        self.registry.register_cuda(name, raw_handle, device_id, byte_size, peer)

    def unregister_cuda(self, name: str, peer: str = "") -> None:
        gone = self.registry.unregister_cuda(name, peer)
        if gone:        # workers close the handles they opened
            self.client.forget_segments([], gone)

    def status_cuda(self, name: str, peer: str = "") -> list[dict]:
        return self.registry.status_cuda(name, peer)

    # ---- inference ------------------------------------------------------------------------------
    def infer_target(self, model: str, version: str, unary: str = "") -> tuple[ModelView, int]:
        """The model and version an infer request runs on, once the server takes requests.
        ``unary``: the endpoint, when it carries one answer only (a decoupled model is refused
        there with Triton's words)."""
        if not self.accepting or self.stopping():
            raise InferError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        view, v = self.catalog.resolve(model, version)
        if unary and view.decoupled:
            raise InferError(ErrorCode.UNSUPPORTED, f"{unary} doesn't support models with "
                                                    f"decoupled transaction policy")
        return view, v

    def submit(self, view: ModelView, version: int, prepared: PreparedRequest,
               on_result: Callable[[InferResult], None]) -> int:
        """Send a prepared request; ``on_result`` gets its answer. Returns the request id."""
        if self.cached is not None and view.response_cache:
            return self.cached.submit(view, version, prepared, on_result)
        return self.client.submit(view.name, version, prepared, on_result,
                                  view.preserve_ordering)

    async def infer(self, view: ModelView, version: int,
                    prepared: PreparedRequest) -> InferResult:
        """Submit and wait for the answer. If the caller is cancelled, the request is dropped
        when still queued, and its memory is released whenever its answer comes."""
        fut = asyncio.get_running_loop().create_future()

        def answered(result: InferResult) -> None:
            if fut.cancelled():     # the call ended while its task was being cancelled
                self.drop(result, prepared)
            else:
                fut.set_result(result)
        req_id = self.submit(view, version, prepared, answered)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():     # answered, then cancelled
                self.drop(fut.result(), prepared)
            else:
                self.abandon(req_id, prepared)
            raise

    def abandon(self, req_id: int, prepared: PreparedRequest) -> None:
        """Nobody waits for a request's answer any more: it is cancelled where it still
        waits, and its answer, when it comes, only gives memory back."""
        self.cancel(req_id)
        self.client.drain_abandoned(req_id, lambda r: self.drop(r, prepared))

    def drop(self, result: InferResult, prepared: PreparedRequest) -> None:
        """An answer nobody will send (its call or stream ended first): its slots go back,
        and with the last the request's inputs."""
        if result.final:
            request.release(prepared, self.arena)
        self.release_outputs(result, request.worker_slots(result, prepared))

    def cancel(self, req_id: int) -> None:
        self.client.cancel(req_id)

    def release_inputs(self, prepared: PreparedRequest, result: InferResult) -> list[ShmRef]:
        """The answer is here, so the worker is done reading the inputs: free our slots and let
        go of client regions. Returns the worker's output slots the answer points at; hand them
        to ``release_outputs`` once their bytes have been sent or copied."""
        request.release(prepared, self.arena)
        return request.worker_slots(result, prepared)

    def outputs(self, result: InferResult, prepared: PreparedRequest) -> list:
        """Each output's bytes (see ``request.output_views``); a failed answer raises."""
        if result.error:
            # every sender sets a code with an error; a missing one is a bug, so 500
            raise InferError(result.code or ErrorCode.INTERNAL, result.error)
        try:
            return request.output_views(result, prepared, self.maps)
        except ShmError as e:
            raise InferError(ErrorCode.INTERNAL, str(e)) from None

    def release_outputs(self, result: InferResult, refs: list[ShmRef]) -> None:
        if refs:
            self.client.release(result.worker, refs)


def _no_repository(repository: str) -> None:
    if repository:
        raise InferError(ErrorCode.UNSUPPORTED,
                         f"model repository names are not supported (got '{repository}'): "
                         f"address the model without one")
