"""Fakes for driving the frontend's service and both protocol layers in-process: an engine client
without sockets, an HTTP connection and a gRPC context that record what they are told."""
from __future__ import annotations

import asyncio

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.frontend.grpc.service import InferenceService
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.http.server import HttpConnection, HttpRequest
from shmserve.frontend.service import FrontendService
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.messages.common import ModelState
from shmserve.ipc.messages.to_frontend import (
    ControlReply,
    ModelInfo,
    ModelStatistics,
    ModelTable,
    StatsReply,
    VersionInfo,
)
from shmserve.ipc.model_config import normalize

CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "IN0", data_type: TYPE_INT32, dims: [ 16 ] } ]
output [ { name: "OUT0", data_type: TYPE_INT32, dims: [ 16 ] } ]
'''


def model_info(name: str, versions: list[VersionInfo]) -> ModelInfo:
    cfg = normalize(text_format.Parse(CONFIG, mc.ModelConfig()), name)
    return ModelInfo(name, cfg.SerializeToString(), versions)


def table() -> ModelTable:
    """'simple' serves version 1 and is loading version 2; 'never' was never loaded."""
    return ModelTable([
        model_info("simple", [VersionInfo(1, ModelState.READY),
                              VersionInfo(2, ModelState.LOADING)]),
        ModelInfo("never", b"", []),
    ], startup_done=True)


class FakeClient:
    """Stands in for EngineClient: answers control and statistics queries with what the test
    set (or raises ``control_raises`` / ``stats_raises``), and records what was sent."""

    def __init__(self):
        self.catalog = ModelCatalog()
        self.catalog.update(table())
        self.table_event = asyncio.Event()
        self.table_event.set()
        self.controls: list[tuple] = []
        self.upload_dirs: list[str] = []        # upload_dir of each control, in order
        self.control_reply = ControlReply(0)
        self.control_raises: BaseException | None = None
        self.stats_queries: list[tuple] = []
        self.stats_raises: BaseException | None = None
        self.forgotten: list[list[str]] = []
        self.forgotten_cuda: list[list[bytes]] = []     # CUDA IPC handles for workers to close
        self.cancelled: list[int] = []
        self.log_changes: list = []             # LogSettings sent on (the logging extension)
        self.log_raises: BaseException | None = None

    async def control(self, action, name, config="", unload_dependents=False, upload_dir=""):
        self.controls.append((action, name, config, unload_dependents))
        self.upload_dirs.append(upload_dir)
        if self.control_raises is not None:
            raise self.control_raises
        return self.control_reply

    async def statistics(self, model="", version=-1):
        self.stats_queries.append((model, version))
        if self.stats_raises is not None:
            raise self.stats_raises
        if model and model != "simple":
            return StatsReply(0, [], {}, f"requested model '{model}' is not available")
        return StatsReply(0, [ModelStatistics("simple", 1)], {})

    async def log_settings(self, settings, timeout=5.0):
        self.log_changes.append(settings)
        if self.log_raises is not None:
            raise self.log_raises
        return ControlReply(0)

    def forget_segments(self, segments, cuda_handles=()):
        if segments:
            self.forgotten.append(list(segments))
        if cuda_handles:
            self.forgotten_cuda.append(list(cuda_handles))

    def cancel(self, req_id):
        self.cancelled.append(req_id)


def make_service(client: FakeClient | None = None, allow_shm: bool = True) -> FrontendService:
    return FrontendService(client or FakeClient(), None, None, ShmRegistry(allow_shm),
                           "shmserve-test", "0.1", strict_readiness=True)


class FakeTransport:
    """A loopback client's transport, as far as the app reads it (its address)."""

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 50000) if name == "peername" else default


class FakeConn(HttpConnection):
    """An HttpConnection that keeps responses instead of writing them (a subclass: the app's
    module may be compiled, and then checks the type of what it is given)."""

    def __init__(self):
        super().__init__(None)
        self.responses: list[tuple[int, bytes, dict]] = []
        self.inflight = 0
        self.busy = True
        self.transport = FakeTransport()

    def respond(self, req, status, body=b"", content_type="application/json", headers=(),
                parts=()):
        self.responses.append((status, body, dict(headers)))

    def after_sent(self, callback):
        callback()

    def peer(self) -> str:
        return "127.0.0.1"


def http(app: KServeHttpApp, method: str, path: str, body: bytes = b"") -> tuple[int, bytes, dict]:
    """One request through the app, waiting for answers that come later (control, stats)."""
    async def run():
        conn = FakeConn()
        req = HttpRequest(method, path.encode(), {})
        req.body = body
        app.handle(conn, req)
        while app.tasks:
            await asyncio.gather(*list(app.tasks))
        assert len(conn.responses) == 1, conn.responses
        return conn.responses[0]
    return asyncio.run(run())


class Aborted(Exception):
    pass


class FakeContext:
    """A grpc.aio context whose abort records the status and raises, like the real one."""

    def __init__(self):
        self.code = None
        self.details = None

    async def abort(self, code, details=""):
        self.code, self.details = code, details
        raise Aborted(details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


def rpc(service: InferenceService, method: str, request):
    """(response, None) or (None, (code, details)) for one unary RPC."""
    async def run():
        ctx = FakeContext()
        try:
            return await getattr(service, method)(request, ctx), None
        except Aborted:
            return None, (ctx.code, ctx.details)
    return asyncio.run(run())
