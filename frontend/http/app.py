"""The KServe v2 HTTP/REST endpoints with Triton's extensions (docs/triton-compat.md §1).

This module only translates: it routes a request through the table in ``routes``, turns paths
and JSON bodies into arguments of ``FrontendService``, and turns answers and ``InferError``s
into responses (``errors.http_status``). What HTTP alone does lives here too: receiving large
bodies straight into shared memory, Content-Encoding, and writing outputs from the worker's slot.
"""
from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Awaitable, Callable

import msgspec

from shmserve.engine.launch import restricted
from shmserve.engine.requests.header_forward import HeaderForward
from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend import peer_uid
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.http import inflate
from shmserve.frontend.http.generate import GenerateEndpoints
from shmserve.frontend.http.routes import Router
from shmserve.frontend.http.server import HttpApp, HttpConnection, HttpRequest
from shmserve.frontend.observability import log_settings, statistics
from shmserve.frontend.service import FrontendService
from shmserve.ipc import logs
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.errors import InferError, http_status, invalid, shm_error
from shmserve.ipc.messages.common import ErrorCode, ShmRef
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmError

log = logging.getLogger("shmserve.http")

MAX_BODY = 1 << 32
_NOT_FOUND = b'{"error":"Not Found"}'
_NOT_ALLOWED = b'{"error":"Method Not Allowed"}'
_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"


class _IndexRequest(msgspec.Struct):
    ready: bool = False


_decode_index = msgspec.json.Decoder(_IndexRequest).decode


def api_group(pattern: str) -> str:
    """The restricted-API group (engine/launch/restricted.py) an endpoint belongs to."""
    if pattern.startswith("/v2/health") or pattern.endswith("/ready"):
        return "health"
    if pattern.startswith("/v2/repository"):
        return "model-repository"
    if pattern == "/v2/logging":
        return "logging"
    if pattern.endswith("/trace/setting"):
        return "trace"
    if "sharedmemory" in pattern:
        return "shared-memory"
    for suffix, group in (("/stats", "statistics"), ("/config", "model-config"),
                          ("/infer", "inference"), ("/generate", "inference"),
                          ("/generate_stream", "inference")):
        if pattern.endswith(suffix):
            return group
    return "metadata"


class _DroppedBody:
    """Stands in for the shared-memory slot of a body that none could be had for (/dev/shm is
    full): the body is read and dropped, then the request is answered with ``error``. Refusing
    it at once would close the connection while the client is still sending, and the client
    would see a reset instead of the reason."""
    __slots__ = ("ref", "view", "error")

    def __init__(self, n: int, error: InferError):
        self.ref = ShmRef("", 0, 0)         # not the arena's: freeing it does nothing
        self.view = _Void(n)
        self.error = error


class _Void:
    """A buffer of ``n`` bytes that keeps nothing written into it."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __setitem__(self, key, value) -> None:
        pass

    def __getitem__(self, key) -> bytes:
        return b""


class KServeHttpApp(HttpApp):
    def __init__(self, service: FrontendService, max_input_size: int,
                 restrictions: dict[str, tuple[str, str]] | None = None,
                 header_forward: str = ""):
        self.service = service
        # --http-header-forward-pattern: matching headers become the request's parameters
        self.forward = HeaderForward(header_forward)
        self.raw_headers = self.forward.regex is not None
        self.arena = service.arena
        self.max_input_size = max_input_size
        self.server_metadata = http_codec.encode_json(service.metadata())
        self.tasks: set[asyncio.Task] = set()     # answers in progress (the loop keeps weak refs)
        self.restrictions = restrictions or {}
        self.generating = GenerateEndpoints(service, max_input_size, self.forward)
        self.router = Router([(m, p, self.guarded(h, p)) for m, p, h in self.routes()])

    def guarded(self, handler, pattern: str):
        """The handler itself, or, when its API group is restricted (--http-restricted-api),
        one that first checks the request's header."""
        group = api_group(pattern)
        if group not in self.restrictions:
            return handler
        restrictions = self.restrictions

        def check(conn, req, *captures):
            refusal = restricted.http_refusal(group, restrictions, req.headers)
            if refusal:
                self.release_body(req)
                return self.error(conn, req, 403, refusal)
            return handler(conn, req, *captures)
        return check

    def routes(self) -> list[tuple]:
        """Every endpoint: (methods, path pattern, handler(conn, req, *captures))."""
        table = [
            ("GET", "/v2/health/live", self.live),
            ("GET", "/v2/health/ready", self.ready),
            ("GET", "/v2", self.metadata),
            ("GET", "/v2/", self.metadata),
            ("POST", "/v2/repository/index", self.repository_index),
            ("POST", "/v2/repository/models/{model}/load", partial(self.control, "load")),
            ("POST", "/v2/repository/models/{model}/unload", partial(self.control, "unload")),
            ("POST", "/v2/repository/{repository}/models/{model}/load",
             partial(self.control_in_repository, "load")),
            ("POST", "/v2/repository/{repository}/models/{model}/unload",
             partial(self.control_in_repository, "unload")),
            ("GET", "/v2/models/stats", self.statistics),
            ("GET", "/v2/logging", self.get_logging),
            ("POST", "/v2/logging", self.update_logging),
            ("GET", "/v2/trace/setting", self.get_trace),
            ("POST", "/v2/trace/setting", self.update_trace),
            ("GET", _MODEL + "/trace/setting", self.get_trace),    # no version: as Triton
            ("POST", _MODEL + "/trace/setting", self.update_trace),
        ]
        for base in (_MODEL, _VERSION):
            table += [("GET", base, self.model_metadata),
                      ("GET", base + "/ready", self.model_ready),
                      ("GET", base + "/config", self.model_config),
                      ("GET", base + "/stats", self.statistics),
                      ("POST", base + "/infer", self.infer),
                      ("POST", base + "/generate", self.generate),
                      ("POST", base + "/generate_stream", self.generate_stream)]
        for kind, system in (("systemsharedmemory", True), ("cudasharedmemory", False)):
            for base in (f"/v2/{kind}", f"/v2/{kind}/region/{{region}}"):
                table += [("GET", base + "/status", partial(self.shm_status, system)),
                          ("POST", base + "/register", partial(self.shm_register, system)),
                          ("POST", base + "/unregister", partial(self.shm_unregister, system))]
        return table

    # ---- body buffers ---------------------------------------------------------------------------
    def check_body_size(self, req: HttpRequest, n: int) -> str:
        uploads = self.service.uploads
        if uploads is not None and req.path.startswith("/v2/repository/") \
                and req.path.endswith("/load"):
            # a load may carry model files, as base64: the upload limit's worth on top
            limit = self.max_input_size + uploads.base64_bytes
            why = "--http-max-input-size plus --model-upload-max-bytes as base64"
        elif not req.path.endswith("/infer"):
            limit, why = self.max_input_size, "--http-max-input-size"
        else:
            # its JSON part and its tensors' bytes are bounded each: refused before the body is
            # received (into a slot of its size) when it cannot fit both
            limit = min(MAX_BODY, self.max_input_size + self.service.limits.max_tensor_bytes)
            why = "--http-max-input-size plus --max-request-tensor-bytes"
        if n > limit:
            # Triton's words (its /infer says "request JSON size" of the JSON part alone, below)
            what = "request size" if req.path.endswith("/infer") else "request JSON size"
            return (f"{what} of {n} bytes exceeds the maximum allowed input size of {limit} "
                    f"bytes ({why}). Use --http-max-input-size to increase the limit.")
        return ""

    def body_buffer(self, req: HttpRequest, n: int):
        if n > INLINE_LIMIT and req.method == "POST" and req.path.endswith("/infer") \
                and "content-encoding" not in req.headers:
            try:
                return self.arena.alloc(n)
            except ShmError as e:
                log.error("cannot receive a %d byte body into shared memory: %s", n, e)
                return _DroppedBody(n, shm_error(e))
        return None

    def release_body(self, req: HttpRequest) -> None:
        if req.body_slot is not None:
            req.body = b""
            self.arena.free(req.body_slot.ref)
            req.body_slot = None

    def connection_lost(self, conn: HttpConnection) -> None:
        if conn.busy and conn.inflight:
            self.service.cancel(conn.inflight)
        self.generating.connection_lost(conn)
        for req in conn.queue:
            self.release_body(req)
        conn.queue.clear()
        if conn.request is not None:
            self.release_body(conn.request)

    # ---- dispatch -------------------------------------------------------------------------------
    def handle(self, conn: HttpConnection, req: HttpRequest) -> None:
        try:
            handler, captures = self.router.match(req.method, req.path)
            if handler is None:
                # a body received into shared memory for a path that does not exist
                self.release_body(req)
                if captures:
                    return conn.respond(req, 405, _NOT_ALLOWED, headers=(("Allow", captures),))
                return conn.respond(req, 404, _NOT_FOUND)
        except InferError as e:
            self.release_body(req)
            return self.error(conn, req, http_status(e.code), e.message)
        self.run(conn, req, handler, *captures)

    def run(self, conn: HttpConnection, req: HttpRequest, handler, *args) -> None:
        """``handler(conn, req, *args)``; what it raises becomes the request's answer."""
        try:
            handler(conn, req, *args)
        except InferError as e:
            self.release_body(req)
            self.error(conn, req, http_status(e.code), e.message)
        except Exception as e:  # a bug must cost one request, not the frontend
            log.exception("error handling %s %s", req.method, req.path)
            self.release_body(req)
            self.error(conn, req, 500, f"internal error: {type(e).__name__}: {e}")

    def later(self, conn: HttpConnection, req: HttpRequest, work: Awaitable,
              render: Callable[[Any], bytes] | None = None) -> None:
        """Answer once ``work`` finishes: 200 with ``render(result)`` (or no body), or the
        InferError it raised."""
        async def answer():
            try:
                result = await work
                body = render(result) if render is not None else b""
            except InferError as e:
                return self.error(conn, req, http_status(e.code), e.message)
            except Exception as e:
                log.exception("error handling %s %s", req.method, req.path)
                return self.error(conn, req, 500, f"internal error: {type(e).__name__}: {e}")
            if render is None:
                conn.respond(req, 200, content_type="")
            else:
                conn.respond(req, 200, body)
        task = asyncio.get_running_loop().create_task(answer())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def error(self, conn: HttpConnection, req: HttpRequest, status: int, message: str) -> None:
        if log.isEnabledFor(logging.DEBUG):     # --log-verbose: each failed request
            logs.written_before_answer(log, "%s %s failed (%d): %s", req.method, req.path,
                                       status, message)
        conn.respond(req, status, http_codec.encode_json({"error": message}))

    # ---- health and metadata --------------------------------------------------------------------
    def live(self, conn, req):
        conn.respond(req, 200, content_type="")

    def ready(self, conn, req):
        conn.respond(req, 200 if self.service.server_ready() else 400, content_type="")

    def metadata(self, conn, req):
        conn.respond(req, 200, self.server_metadata)

    def model_ready(self, conn, req, model: str, version: str = ""):
        if not self.service.model_ready(model, version):
            return self.error(conn, req, 400, "Model version not ready")
        asked = self.service.model_decides(model, version)
        if asked is not None:
            return self.later(conn, req, self._model_says_ready(*asked))
        conn.respond(req, 200, content_type="")

    async def _model_says_ready(self, model: str, version: int) -> None:
        if not await self.service.client.model_decides_ready(model, version):
            raise InferError(ErrorCode.INVALID_ARG, "Model version not ready")     # 400

    def model_metadata(self, conn, req, model: str, version: str = ""):
        view, v = self.service.model(model, version)
        conn.respond(req, 200, http_codec.encode_json(view.metadata(v if version else None)))

    def model_config(self, conn, req, model: str, version: str = ""):
        view, _ = self.service.model(model, version)
        conn.respond(req, 200, view.config_json)

    # ---- repository and statistics --------------------------------------------------------------
    def repository_index(self, conn, req):
        ready = False
        if req.body:
            try:
                # typed: a 'ready' that is not a boolean is refused before it is decoded, however
                # deeply it nests (Triton's test sends 250,000 levels)
                ready = _decode_index(req.body).ready
            except msgspec.ValidationError as e:
                if "$.ready" in str(e):
                    raise invalid("Invalid value for 'ready': expected a boolean") from None
                raise invalid(f"failed to parse the request JSON buffer: {e}") from None
            except msgspec.DecodeError as e:
                raise invalid(f"failed to parse the request JSON buffer: {e}") from None
            except RecursionError:
                raise invalid(http_codec.TOO_DEEP) from None
        self.later(conn, req, self.service.index(ready), http_codec.encode_json)

    def control_in_repository(self, action: str, conn, req, repository: str, model: str):
        self.control(action, conn, req, model, repository)     # the service refuses it

    def control(self, action: str, conn, req, model: str, repository: str = ""):
        params: Any = {}
        if req.body:
            try:
                doc = http_codec.decode_json(req.body)
            except Exception:
                raise invalid(f"failed to parse the {action} request JSON") from None
            params = doc.get("parameters", {}) if isinstance(doc, dict) else None
            if not isinstance(params, dict):
                raise invalid(f"attempt to get members for non-object ({action} request "
                              f"'parameters' must be a JSON object)")
        if action == "load":       # model files come as base64 text in JSON
            self.later(conn, req, self.service.load(model, params, repository, base64_files=True))
        else:
            self.later(conn, req, self.service.unload(model, params, repository))

    def statistics(self, conn, req, model: str = "", version: str = ""):
        self.later(conn, req, self.service.statistics(model, version),
                   lambda models: http_codec.encode_json(statistics.to_json(models)))

    # ---- logging --------------------------------------------------------------------------------
    def get_logging(self, conn, req):
        conn.respond(req, 200, http_codec.encode_json(log_settings.render(
            *self.service.logging.get())))

    def update_logging(self, conn, req):
        changes: dict = {}
        if req.body:                # an empty body changes nothing, as in Triton
            try:
                doc = http_codec.decode_json(req.body)
            except Exception:
                raise invalid("failed to parse the log settings request JSON") from None
            changes = log_settings.from_json(doc)
        self.later(conn, req, self.service.logging.update(changes),
                   lambda now: http_codec.encode_json(log_settings.render(*now)))

    # ---- trace ----------------------------------------------------------------------------------
    def get_trace(self, conn, req, model: str = ""):
        conn.respond(req, 200, http_codec.encode_json(self.service.tracing.get(model)))

    def update_trace(self, conn, req, model: str = ""):
        doc: Any = {}
        if req.body:                # an empty body changes nothing
            try:
                doc = http_codec.decode_json(req.body)
            except Exception:
                raise invalid("failed to parse the trace settings request JSON") from None
        self.later(conn, req, self.service.tracing.update(doc, model),
                   http_codec.encode_json)

    # ---- shared memory --------------------------------------------------------------------------
    def shm_status(self, system: bool, conn, req, region: str = ""):
        svc = self.service
        peer = _peer(conn)
        regions = svc.status_system(region, peer) if system else svc.status_cuda(region, peer)
        conn.respond(req, 200, http_codec.encode_json(regions))

    def shm_unregister(self, system: bool, conn, req, region: str = ""):
        if system:
            self.service.unregister_system(region, _peer(conn))
        else:
            self.service.unregister_cuda(region, _peer(conn))
        conn.respond(req, 200, content_type="")

    def shm_register(self, system: bool, conn, req, region: str = ""):
        if not region:
            raise invalid("shared memory register needs a region name in the path "
                          "(.../region/<name>/register)")
        try:
            doc = http_codec.decode_json(req.body) if req.body else {}
        except Exception as e:
            raise invalid(f"failed to parse the request JSON buffer: {e}") from None
        if not isinstance(doc, dict):
            raise invalid("the shared memory register request must be a JSON object")
        if system:
            for field in ("key", "byte_size"):
                if field not in doc:
                    raise invalid(f"Shared memory register request has no '{field}' field "
                                  f"(region '{region}')")
            self.service.register_system(region, doc["key"], doc.get("offset", 0),
                                         doc["byte_size"], _peer(conn))
        else:       # raw_handle {"b64": ...}; what is missing is None, and named as such
            self.service.register_cuda(region, doc.get("raw_handle"), doc.get("device_id"),
                                       doc.get("byte_size"), _peer(conn))
        conn.respond(req, 200, content_type="")

    # ---- inference ------------------------------------------------------------------------------
    def infer(self, conn: HttpConnection, req: HttpRequest, model: str, version: str = "") -> None:
        view, v = self.service.infer_target(model, version, "HTTP end point")
        if isinstance(req.body_slot, _DroppedBody):
            raise req.body_slot.error
        encoding = req.headers.get("content-encoding", "identity").lower()
        if encoding == "identity":
            return self.infer_body(conn, req, view, v, req.body)
        if encoding not in inflate.WBITS:
            self.release_body(req)
            return conn.respond(req, 501, http_codec.encode_json(
                {"error": f"unsupported Content-Encoding '{encoding}'"}),
                headers=(("Accept-Encoding", "gzip, deflate"),))

        async def inflated() -> None:
            try:
                body = await inflate.inflate(req.body, encoding, self.max_input_size)
            except inflate.TooLarge:
                return self.error(conn, req, 400, (
                    f"Decompressed data size exceeds the maximum allowed value of "
                    f"{self.max_input_size} bytes: the {encoding} request body inflates to more. "
                    f"Use --http-max-input-size to increase the limit."))
            except inflate.Corrupt as e:
                why = "is truncated" if str(e) == "truncated" else f"is corrupt: {e}"
                return self.error(conn, req, 400, f"failed to decompress the {encoding} request "
                                                  f"body: it {why}")
            except Exception as e:      # a bug must cost one request, not leave it unanswered
                log.exception("error inflating %s %s", req.method, req.path)
                return self.error(conn, req, 500, f"internal error: {type(e).__name__}: {e}")
            req.body = b""      # the compressed bytes are not needed any more
            self.run(conn, req, self.infer_inflated, model, version, body)
        task = asyncio.get_running_loop().create_task(inflated())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def infer_inflated(self, conn: HttpConnection, req: HttpRequest, model: str, version: str,
                       body: bytearray) -> None:
        # the model is looked up again: it may have been unloaded while the body inflated
        view, v = self.service.infer_target(model, version, "HTTP end point")
        self.infer_body(conn, req, view, v, body)

    def infer_body(self, conn: HttpConnection, req: HttpRequest, view, v, body) -> None:
        """An inference request whose body is ``body`` (inflated, if it came compressed)."""
        tracer = self.service.tracer
        traced = tracer.sample(view.name, v) if tracer.active else None
        hlen_text = req.headers.get("inference-header-content-length")
        hlen: int | None = None
        if hlen_text is not None:
            try:
                hlen = int(hlen_text)
            except ValueError:
                raise invalid(f"Unable to parse Inference-Header-Content-Length, got: {hlen_text} "
                              f"(it must be an integer)") from None
            if hlen < 0 or hlen > len(body):
                raise invalid(http_codec.header_size_error(hlen, len(body)))
            if hlen > self.max_input_size:
                raise invalid(self._json_too_large(hlen))
        elif len(body) > self.max_input_size:
            raise invalid(self._json_too_large(len(body)))
        if req.body_slot is None and len(body) > INLINE_LIMIT:
            # chunked or compressed bodies arrive in memory: large tensors still must not ride
            # in a message, so move the body into shared memory (the one extra copy of this path)
            try:
                slot = self.arena.alloc(len(body))
            except ShmError as e:
                raise shm_error(e) from None
            slot.view[:] = body
            req.body_slot = slot
            body = slot.view
        slot_ref = req.body_slot.ref if req.body_slot is not None else None
        if traced is not None:
            traced.started("HTTP_RECV", int(req.started * 1e9))
        forwarded = self.forward.params(req.raw_headers) if self.raw_headers else None
        parsed = http_codec.parse_infer(view, body, hlen, slot_ref, self.arena,
                                        self.service.registry.for_peer(conn.peer()),
                                        self.service.limits, forwarded)
        if traced is not None:
            traced.queued(parsed, self.service.maps)
        conn.inflight = self.service.submit(
            view, v, parsed, lambda result: self.infer_done(conn, req, parsed, result))

    def generate(self, conn, req, model: str, version: str = "") -> None:
        self.generating.start(conn, req, model, version, stream=False)

    def generate_stream(self, conn, req, model: str, version: str = "") -> None:
        self.generating.start(conn, req, model, version, stream=True)

    def _json_too_large(self, n: int) -> str:
        return (f"request JSON size of {n} bytes exceeds the maximum allowed input size of "
                f"{self.max_input_size} bytes. Use --http-max-input-size to increase the limit.")

    def infer_done(self, conn: HttpConnection, req: HttpRequest, parsed: PreparedRequest,
                   result: InferResult) -> None:
        svc = self.service
        traced = parsed.trace
        if traced is not None:
            traced.answered(result, svc.maps)
        # the worker has finished reading the inputs: their memory can be reused now
        self.release_body(req)
        refs = svc.release_inputs(parsed, result)
        try:
            views = svc.outputs(result, parsed)
            header, parts, hlen = http_codec.render_response(
                result, parsed, views, svc.limits.max_json_elements)
        except InferError as e:
            self.error(conn, req, http_status(e.code), e.message)
        else:
            if traced is not None:
                traced.stamp("HTTP_SEND_START")
            if parts:
                conn.respond(req, 200, header, "application/octet-stream",
                             (("Inference-Header-Content-Length", hlen),), tuple(parts))
            else:
                conn.respond(req, 200, header)
            if traced is not None:
                traced.stamp("HTTP_SEND_END")
                svc.tracer.finish(traced)
        finally:
            if refs:
                # the response was written from the worker's slots (registered after the write,
                # so it waits for those bytes): give them back once sent
                conn.after_sent(lambda: svc.release_outputs(result, refs))


def _peer(conn: HttpConnection) -> str:
    """The client's address and port in gRPC's form ("ipv4:127.0.0.1:5000"), which the
    shared-memory registry reads (the port finds a local client's user); "unknown:" when the
    connection has none, which the registry takes for a remote client."""
    return peer_uid.peer_name(conn.transport.get_extra_info("peername")
                              if conn.transport else None) or "unknown:"
