"""The KServe v2 HTTP/REST endpoints with Triton's extensions (TRITON.md §1)."""
from __future__ import annotations

import asyncio
import logging
import zlib
from urllib.parse import unquote

from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.messages import ErrorCode, InferResult
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache

from . import http_codec, request, statistics
from .engine_client import EngineClient
from .errors import InferError, http_status, invalid
from .http_server import HttpConnection, HttpRequest
from .request import PreparedRequest
from .shm_registry import ShmRegistry

log = logging.getLogger("shmserve.http")

EXTENSIONS = ["model_repository", "schedule_policy", "model_configuration",
              "system_shared_memory", "cuda_shared_memory", "binary_tensor_data", "parameters",
              "statistics"]
MAX_BODY = 1 << 32
_NOT_FOUND = b'{"error":"Not Found"}'
_NOT_ALLOWED = b'{"error":"Method Not Allowed"}'


class KServeHttpApp:
    def __init__(self, client: EngineClient, arena: ShmArena, maps: ShmMapCache,
                 registry: ShmRegistry, server_id: str, server_version: str,
                 strict_readiness: bool, max_input_size: int):
        self.client = client
        self.arena = arena
        self.maps = maps
        self.registry = registry
        self.strict_readiness = strict_readiness
        self.max_input_size = max_input_size
        self.server_metadata = http_codec.encode_json(
            {"name": server_id, "version": server_version, "extensions": EXTENSIONS})
        self.accepting = True

    # ---- body buffers ----------------------------------------------------------------------------
    def check_body_size(self, req: HttpRequest, n: int) -> str:
        limit = MAX_BODY if req.path.endswith("/infer") else self.max_input_size
        if n > limit:
            return f"request body of {n} bytes exceeds the limit of {limit} bytes"
        return ""

    def body_buffer(self, req: HttpRequest, n: int):
        if n > INLINE_LIMIT and req.method == "POST" and req.path.endswith("/infer") \
                and "content-encoding" not in req.headers:
            try:
                return self.arena.alloc(n)
            except ShmError as e:
                log.error("cannot receive a %d byte body into shared memory: %s", n, e)
        return None

    def release_body(self, req: HttpRequest) -> None:
        if req.body_slot is not None:
            req.body = b""
            self.arena.free(req.body_slot.ref)
            req.body_slot = None

    def connection_lost(self, conn: HttpConnection) -> None:
        if conn.busy and conn.inflight:
            self.client.cancel(conn.inflight)
        for req in conn.queue:
            self.release_body(req)
        conn.queue.clear()
        if conn.request is not None:
            self.release_body(conn.request)

    # ---- routing ------------------------------------------------------------------------------------
    def handle(self, conn: HttpConnection, req: HttpRequest) -> None:
        try:
            self.route(conn, req)
        except InferError as e:
            self.release_body(req)
            self.error(conn, req, http_status(e.code), e.message)
        except Exception as e:  # a bug must cost one request, not the frontend
            log.exception("error handling %s %s", req.method, req.path)
            self.release_body(req)
            self.error(conn, req, 500, f"internal error: {type(e).__name__}: {e}")

    def route(self, conn: HttpConnection, req: HttpRequest) -> None:
        path, method = req.path, req.method
        if path == "/v2/health/live":
            if method != "GET":
                return self.not_allowed(conn, req)
            return conn.respond(req, 200, content_type="")
        if path == "/v2/health/ready":
            if method != "GET":
                return self.not_allowed(conn, req)
            ok = self.accepting and self.client.catalog.server_ready(self.strict_readiness)
            return conn.respond(req, 200 if ok else 400, content_type="")
        if path == "/v2" or path == "/v2/":
            if method != "GET":
                return self.not_allowed(conn, req)
            return conn.respond(req, 200, self.server_metadata)
        if path.startswith("/v2/systemsharedmemory") or path.startswith("/v2/cudasharedmemory"):
            return self.shared_memory(conn, req)
        if path == "/v2/repository/index":
            if method != "POST":
                return self.not_allowed(conn, req)
            return self.repository_index(conn, req)
        if path.startswith("/v2/repository/"):
            return self.repository_control(conn, req)
        if path == "/v2/models/stats":
            if method != "GET":
                return self.not_allowed(conn, req)
            return self.statistics(conn, req, "", "")
        parts = path.split("/")
        if len(parts) < 4 or parts[1] != "v2" or parts[2] != "models" or not parts[3]:
            return conn.respond(req, 404, _NOT_FOUND)
        model = unquote(parts[3])
        rest = parts[4:]
        version = ""
        if len(rest) >= 2 and rest[0] == "versions":
            version = rest[1]
            rest = rest[2:]
        if len(rest) > 1 or (rest and rest[0] not in ("ready", "config", "infer", "stats")):
            return conn.respond(req, 404, _NOT_FOUND)
        action = rest[0] if rest else ""
        want = "POST" if action == "infer" else "GET"
        if method != want:
            return self.not_allowed(conn, req)
        if action == "infer":
            return self.infer(conn, req, model, version)
        if action == "stats":
            return self.statistics(conn, req, model, version)
        catalog = self.client.catalog
        if action == "ready":
            catalog.get(model)              # an unknown model is a 404, not "not ready"
            try:
                catalog.resolve(model, version)
            except InferError as e:
                if e.code == ErrorCode.INVALID_ARG:
                    raise
                return self.error(conn, req, 400, "Model version not ready")
            return conn.respond(req, 200, content_type="")
        view, v = catalog.resolve(model, version)
        if action == "config":
            return conn.respond(req, 200, view.config_json)
        return conn.respond(req, 200, http_codec.encode_json(
            view.metadata(v if version else None)))

    def repository_control(self, conn: HttpConnection, req: HttpRequest) -> None:
        parts = req.path.split("/")      # '', v2, repository, [repo,] models, m, load|unload
        if len(parts) == 7 and parts[4] == "models" and parts[3]:
            return self.error(conn, req, 501, "repository names are not supported: use "
                                              "/v2/repository/models/<model>/...")
        if len(parts) != 6 or parts[3] != "models" or parts[5] not in ("load", "unload") \
                or not parts[4]:
            return conn.respond(req, 404, _NOT_FOUND)
        if req.method != "POST":
            return self.not_allowed(conn, req)
        name, action = unquote(parts[4]), parts[5]
        params = {}
        if req.body:
            try:
                doc = http_codec.decode_json(req.body)
            except Exception:
                raise invalid(f"failed to parse the {action} request JSON") from None
            params = doc.get("parameters", {}) if isinstance(doc, dict) else None
            if not isinstance(params, dict):
                raise invalid(f"{action} request 'parameters' must be a JSON object")
        config = params.get("config", "")
        if not isinstance(config, str):
            raise invalid("load parameter 'config' must be a string holding the model "
                          "configuration as JSON")
        if any(k.startswith("file:") for k in params):
            raise invalid("load parameters 'file:<version>/<name>' are not supported yet")
        dependents = params.get("unload_dependents", False)

        async def answer():
            try:
                reply = await self.client.control(action, name, config, dependents is True)
            except asyncio.TimeoutError:
                return self.error(conn, req, 503, f"{action} of '{name}' did not finish in time")
            if reply.error:
                return self.error(conn, req, http_status(reply.code), reply.error)
            conn.respond(req, 200, content_type="")
        asyncio.get_running_loop().create_task(answer())

    def statistics(self, conn: HttpConnection, req: HttpRequest, model: str, version: str) -> None:
        if version and not version.isdigit():
            raise invalid(f"invalid model version '{version}' for model '{model}'")

        async def answer():
            try:
                reply = await self.client.statistics(model, int(version) if version else -1)
                body = http_codec.encode_json(statistics.to_json(statistics.check(reply)))
            except InferError as e:
                return self.error(conn, req, http_status(e.code), e.message)
            except asyncio.TimeoutError:
                return self.error(conn, req, 503, "the scheduler did not answer in time")
            conn.respond(req, 200, body)
        asyncio.get_running_loop().create_task(answer())

    def repository_index(self, conn: HttpConnection, req: HttpRequest) -> None:
        ready = False
        if req.body:
            try:
                doc = http_codec.decode_json(req.body)
            except Exception:
                raise invalid("failed to parse the repository index request JSON") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("ready", False), bool):
                raise invalid("repository index request: 'ready' must be a boolean")
            ready = doc.get("ready", False)
        conn.respond(req, 200, http_codec.encode_json(self.client.catalog.index(ready)))

    def shared_memory(self, conn: HttpConnection, req: HttpRequest) -> None:
        parts = req.path.split("/")[2:]          # e.g. systemsharedmemory region r register
        kind = parts[0]
        name = ""
        if len(parts) >= 3 and parts[1] == "region":
            name = unquote(parts[2])
            parts = [kind] + parts[3:]
        if len(parts) != 2 or parts[1] not in ("status", "register", "unregister"):
            return conn.respond(req, 404, _NOT_FOUND)
        action = parts[1]
        if req.method != ("GET" if action == "status" else "POST"):
            return self.not_allowed(conn, req)
        system = kind == "systemsharedmemory"
        reg = self.registry
        if action == "status":
            regions = reg.status_system(name) if system else reg.status_cuda(name)
            return conn.respond(req, 200, http_codec.encode_json(regions))
        if action == "unregister":
            gone = reg.unregister_system(name) if system else reg.unregister_cuda(name)
            if gone:
                self.client.forget_segments(gone)
            return conn.respond(req, 200, content_type="")
        if not name:
            raise invalid("shared memory register needs a region name in the path "
                          "(.../region/<name>/register)")
        try:
            doc = http_codec.decode_json(req.body) if req.body else {}
        except Exception:
            raise invalid("failed to parse the shared memory register request JSON") from None
        if not isinstance(doc, dict):
            raise invalid("the shared memory register request must be a JSON object")
        if system:
            for field in ("key", "byte_size"):
                if field not in doc:
                    raise invalid(f"shared memory register request for '{name}' is missing '{field}'")
            region = reg.register_system(name, doc["key"], doc.get("offset", 0), doc["byte_size"])
            # a key may name a segment the client re-created: drop stale mappings of it first
            self.client.forget_segments([region.segment])
        else:
            reg.register_cuda(name, doc.get("raw_handle"), doc.get("device_id"), doc.get("byte_size"))
        conn.respond(req, 200, content_type="")

    def not_allowed(self, conn, req):
        self.release_body(req)
        conn.respond(req, 405, _NOT_ALLOWED)

    def error(self, conn: HttpConnection, req: HttpRequest, status: int, message: str) -> None:
        conn.respond(req, status, http_codec.encode_json({"error": message}))

    # ---- inference ------------------------------------------------------------------------------------
    def infer(self, conn: HttpConnection, req: HttpRequest, model: str, version: str) -> None:
        if not self.accepting:
            raise InferError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        view, v = self.client.catalog.resolve(model, version)
        body = req.body
        encoding = req.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            body = self._decompress(body, encoding)
        elif encoding != "identity":
            self.release_body(req)
            return conn.respond(req, 501, http_codec.encode_json(
                {"error": f"unsupported Content-Encoding '{encoding}'"}),
                headers=(("Accept-Encoding", "gzip, deflate"),))
        hlen = req.headers.get("inference-header-content-length")
        if hlen is not None:
            try:
                hlen = int(hlen)
            except ValueError:
                raise invalid(f"Inference-Header-Content-Length must be an integer, got "
                              f"'{hlen}'") from None
            if hlen > self.max_input_size:
                raise invalid(f"request JSON of {hlen} bytes exceeds --http-max-input-size "
                              f"({self.max_input_size})")
        elif len(body) > self.max_input_size:
            raise invalid(f"request JSON of {len(body)} bytes exceeds --http-max-input-size "
                          f"({self.max_input_size})")
        if req.body_slot is None and len(body) > INLINE_LIMIT:
            # chunked or compressed bodies arrive in memory: large tensors still must not ride
            # in a message, so move the body into shared memory (the one extra copy of this path)
            slot = self.arena.alloc(len(body))
            slot.view[:] = body
            req.body_slot = slot
            body = slot.view
        slot_ref = req.body_slot.ref if req.body_slot is not None else None
        parsed = http_codec.parse_infer(view, body, hlen, slot_ref, self.arena, self.registry)
        conn.inflight = self.client.submit(
            view.name, v, parsed, lambda result: self.infer_done(conn, req, parsed, result),
            view.preserve_ordering)

    def _decompress(self, body, encoding: str) -> bytes:
        try:
            wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
            d = zlib.decompressobj(wbits)
            out = d.decompress(bytes(body), self.max_input_size + MAX_BODY // 4)
        except zlib.error as e:
            raise invalid(f"failed to decompress the {encoding} request body: {e}") from None
        return out

    def infer_done(self, conn: HttpConnection, req: HttpRequest, parsed: PreparedRequest,
                   result: InferResult) -> None:
        # the worker has finished reading the inputs: their memory can be reused now
        self.release_body(req)
        request.release(parsed, self.arena)
        refs = request.worker_slots(result, parsed)
        try:
            if result.error:
                return self.error(conn, req, http_status(result.code), result.error)
            try:
                views = request.output_views(result, parsed, self.maps)
                header, parts, hlen = http_codec.render_response(result, parsed, views)
            except (ShmError, InferError) as e:
                status = 400 if isinstance(e, InferError) else 500
                return self.error(conn, req, status, getattr(e, "message", str(e)))
            if parts:
                conn.respond(req, 200, header, "application/octet-stream",
                             (("Inference-Header-Content-Length", hlen),), tuple(parts))
            else:
                conn.respond(req, 200, header)
        finally:
            if refs:
                worker = result.worker
                conn.after_sent(lambda: self.client.release(worker, refs))
