"""FrontendService: the rules both protocols share, and that HTTP and gRPC translate the same
InferError through their one map each (the control timeout included)."""
import _posixshmem
import asyncio
import json
import os
import secrets

import grpc
import pytest
from frontend_fakes import FakeClient, http, make_service, rpc, table
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend import service as service_mod
from shmserve.frontend.grpc.service import InferenceService
from shmserve.frontend.grpc.status import grpc_status
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.ipc.errors import InferError, http_status
from shmserve.ipc.messages.common import ControlAction, ErrorCode, InferPayload, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import ControlReply, InferResult


def run(coro):
    return asyncio.run(coro)


def raises(code: ErrorCode, call, *args):
    with pytest.raises(InferError) as e:
        result = call(*args)
        if asyncio.iscoroutine(result):
            run(result)
    assert e.value.code == code, e.value.message
    return e.value.message


# ---- readiness ----------------------------------------------------------------------------------
def test_index_waits_for_the_first_model_table():
    client = FakeClient()
    client.catalog = ModelCatalog()             # nothing heard from the scheduler yet
    client.table_event.clear()
    svc = make_service(client)

    async def scenario():
        pending = asyncio.ensure_future(svc.index(False))
        await asyncio.sleep(0)                  # let it start waiting
        assert not pending.done()
        client.catalog.update(table())
        client.table_event.set()
        return await asyncio.wait_for(pending, 5)
    assert [e["name"] for e in run(scenario())] == ["never", "simple", "simple"]


def test_index_without_a_model_table_is_unavailable(monkeypatch):
    client = FakeClient()
    client.table_event.clear()
    monkeypatch.setattr(service_mod, "FIRST_TABLE_WAIT_S", 0.01)
    text = raises(ErrorCode.UNAVAILABLE, make_service(client).index, False)
    assert text == "the model repository has not been read yet; try again"


def test_server_ready_rules():
    svc = make_service()
    assert not svc.server_ready()           # strict: 'simple' version 2 is still loading
    svc.strict_readiness = False
    assert svc.server_ready()
    svc.accepting = False                   # shutting down
    assert not svc.server_ready()


@pytest.mark.parametrize("version, ready", [("", True), ("1", True), ("2", False), ("7", False)])
def test_model_ready_versions(version, ready):
    assert make_service().model_ready("simple", version) is ready


def test_model_ready_of_a_model_without_versions_is_false():
    assert make_service().model_ready("never", "") is False


def test_model_ready_unknown_model_and_bad_version_are_errors():
    svc = make_service()
    assert "no_such" in raises(ErrorCode.NOT_FOUND, svc.model_ready, "no_such", "")
    assert raises(ErrorCode.INVALID_ARG, svc.model_ready, "simple", "x") == VERSION_WORDS


def test_infer_target_refuses_once_shutdown_begins():
    svc = make_service()
    assert svc.infer_target("simple", "")[1] == 1
    svc.accepting = False
    assert "shutting down" in raises(ErrorCode.UNAVAILABLE, svc.infer_target, "simple", "")


def test_infer_target_refuses_once_the_launcher_marks_the_stop(tmp_path):
    """Before this frontend's own SIGTERM is handled: the launcher's mark is read per request."""
    from shmserve.ipc.proc import StoppingMark
    launcher, frontend = StoppingMark(str(tmp_path), create=True), StoppingMark(str(tmp_path))
    svc = make_service()
    svc.stopping = frontend.is_set
    assert svc.infer_target("simple", "")[1] == 1
    launcher.set()
    assert "shutting down" in raises(ErrorCode.UNAVAILABLE, svc.infer_target, "simple", "")
    launcher.close()
    frontend.close()


# ---- model control ------------------------------------------------------------------------------
def test_load_sends_the_config_override():
    client = FakeClient()
    run(make_service(client).load("simple", {"config": '{"backend": "python"}'}))
    assert client.controls == [(ControlAction.LOAD, "simple", '{"backend": "python"}', False)]


@pytest.mark.parametrize("params, text", [
    ({"config": 5}, "load parameter 'config' must be a string"),
    ({"config": True}, "load parameter 'config' must be a string"),
])
def test_load_parameter_checks(params, text):
    client = FakeClient()
    assert text in raises(ErrorCode.INVALID_ARG, make_service(client).load, "simple", params)
    assert client.controls == []            # refused before anything reached the scheduler


def test_load_files_without_an_upload_directory_are_unsupported():
    # model upload itself: tests/frontend/test_upload_paths.py, tests/e2e/test_model_upload.py
    client = FakeClient()
    msg = raises(ErrorCode.UNSUPPORTED, make_service(client).load, "simple",
                 {"config": "{}", "file:1/model.py": b"x"})
    assert "'file:<path>' are not supported" in msg and client.controls == []


@pytest.mark.parametrize("value", [True, False])
def test_unload_dependents_is_accepted(value):
    client = FakeClient()
    run(make_service(client).unload("simple", {"unload_dependents": value}))
    assert client.controls == [(ControlAction.UNLOAD, "simple", "", value)]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_unload_dependents_must_be_a_boolean(value):
    client = FakeClient()
    msg = raises(ErrorCode.INVALID_ARG, make_service(client).unload, "simple",
                 {"unload_dependents": value})
    assert "'unload_dependents' must be a boolean" in msg and repr(value) in msg
    assert client.controls == []


def test_repository_names_are_unsupported():
    svc = make_service()
    for call in (svc.load, svc.unload):
        assert "repository names are not supported" in raises(
            ErrorCode.UNSUPPORTED, call, "simple", {}, "repo")


def test_control_reply_error_keeps_its_code():
    client = FakeClient()
    client.control_reply = ControlReply(0, "explicit model load / unload is not allowed",
                                        ErrorCode.UNAVAILABLE)
    raises(ErrorCode.UNAVAILABLE, make_service(client).load, "simple", {})
    client.control_reply = ControlReply(0, "no code given")
    raises(ErrorCode.INTERNAL, make_service(client).unload, "simple", {})


def test_control_timeout_is_unavailable():
    client = FakeClient()
    client.control_raises = asyncio.TimeoutError()
    msg = raises(ErrorCode.UNAVAILABLE, make_service(client).load, "simple", {})
    assert msg == "load of 'simple' did not finish in time"


# ---- statistics ---------------------------------------------------------------------------------
def test_statistics_queries_the_version_asked_for():
    client = FakeClient()
    svc = make_service(client)
    assert [m.name for m in run(svc.statistics("", ""))] == ["simple"]
    run(svc.statistics("simple", "1"))
    assert client.stats_queries == [("", -1), ("simple", 1)]


def test_statistics_errors():
    client = FakeClient()
    svc = make_service(client)
    assert "failed to get model version from specified version string '1a'" in raises(ErrorCode.INVALID_ARG, svc.statistics,
                                                  "simple", "1a")
    assert "is not available" in raises(ErrorCode.INVALID_ARG, svc.statistics, "nope", "")
    client.stats_raises = asyncio.TimeoutError()
    assert "did not finish in time" in raises(ErrorCode.UNAVAILABLE, svc.statistics, "", "")


# ---- client shared memory ----------------------------------------------------------------------
@pytest.fixture
def segment():
    name = f"shmserve-unit-{secrets.token_hex(4)}"
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    yield name
    _posixshmem.shm_unlink("/" + name)


def test_unregister_forgets_the_segment(segment):
    client = FakeClient()
    svc = make_service(client)
    # registering needs no message: a re-created segment is noticed by its readers (inode)
    svc.register_system("r", "/" + segment, 0, 4096)
    assert client.forgotten == []
    assert svc.status_system("r") == [{"name": "r", "key": "/" + segment, "offset": 0,
                                       "byte_size": 4096}]
    svc.unregister_system("r")                  # workers let go of their mappings
    assert client.forgotten == [[segment]]
    svc.unregister_system("r")                  # unknown: not an error, nothing to forget
    assert len(client.forgotten) == 1


def test_shared_memory_errors():
    svc = make_service()
    raises(ErrorCode.NOT_FOUND, svc.status_system, "nope")
    raises(ErrorCode.INTERNAL, svc.register_system, "r", "/no-such-segment-here", 0, 8)   # Triton's
    raises(ErrorCode.INVALID_ARG, svc.register_cuda, "c", b"", 0, 8)
    raises(ErrorCode.NOT_FOUND, svc.status_cuda, "c")
    assert svc.status_cuda("") == []
    off = make_service(allow_shm=False)
    raises(ErrorCode.UNSUPPORTED, off.register_system, "r", "/x", 0, 8)
    raises(ErrorCode.UNSUPPORTED, off.unregister_cuda, "")


# ---- both protocols translate the same error the same way ---------------------------------------
def _param(**kw):
    return pb.ModelRepositoryParameter(**kw)


# (what goes wrong, fake client setup, HTTP request, gRPC method and request, expected code)
PARITY = [
    ("load timeout", lambda c: setattr(c, "control_raises", asyncio.TimeoutError()),
     ("POST", "/v2/repository/models/simple/load", b""),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="simple")),
     ErrorCode.UNAVAILABLE),
    ("unload timeout", lambda c: setattr(c, "control_raises", asyncio.TimeoutError()),
     ("POST", "/v2/repository/models/simple/unload", b""),
     ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="simple")),
     ErrorCode.UNAVAILABLE),
    ("statistics timeout", lambda c: setattr(c, "stats_raises", asyncio.TimeoutError()),
     ("GET", "/v2/models/simple/stats", b""),
     ("ModelStatistics", pb.ModelStatisticsRequest(name="simple")), ErrorCode.UNAVAILABLE),
    ("load failed", lambda c: setattr(c, "control_reply", ControlReply(
        0, "failed to load 'x', failed to poll from model repository", ErrorCode.INTERNAL)),
     ("POST", "/v2/repository/models/x/load", b""),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="x")), ErrorCode.INTERNAL),
    ("config not a string", None,
     ("POST", "/v2/repository/models/simple/load", b'{"parameters": {"config": 5}}'),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(
         model_name="simple", parameters={"config": _param(int64_param=5)})),
     ErrorCode.INVALID_ARG),
    ("unload_dependents not a boolean", None,
     ("POST", "/v2/repository/models/simple/unload",
      b'{"parameters": {"unload_dependents": "yes"}}'),
     ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(
         model_name="simple", parameters={"unload_dependents": _param(string_param="yes")})),
     ErrorCode.INVALID_ARG),
    ("repository name", None,
     ("POST", "/v2/repository/repo/models/simple/load", b""),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(repository_name="repo",
                                                           model_name="simple")),
     ErrorCode.UNSUPPORTED),
    ("stats of an unknown model", None, ("GET", "/v2/models/nope/stats", b""),
     ("ModelStatistics", pb.ModelStatisticsRequest(name="nope")), ErrorCode.INVALID_ARG),
    ("ready of an unknown model", None, ("GET", "/v2/models/nope/ready", b""),
     ("ModelReady", pb.ModelReadyRequest(name="nope")), ErrorCode.NOT_FOUND),
    ("stats of a version past 64 bits", None,
     ("GET", "/v2/models/simple/versions/99999999999999999999/stats", b""),
     ("ModelStatistics", pb.ModelStatisticsRequest(name="simple", version="99999999999999999999")),
     ErrorCode.INVALID_ARG),
    ("config of an unknown version", None, ("GET", "/v2/models/simple/versions/7/config", b""),
     ("ModelConfig", pb.ModelConfigRequest(name="simple", version="7")), ErrorCode.NOT_FOUND),
    ("status of an unknown region", None,
     ("GET", "/v2/systemsharedmemory/region/nope/status", b""),
     ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name="nope")),
     ErrorCode.NOT_FOUND),
    ("CUDA register", None,
     ("POST", "/v2/cudasharedmemory/region/c/register", b'{"raw_handle": {"b64": ""}}'),
     ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(name="c")),
     ErrorCode.INVALID_ARG),
]


@pytest.mark.parametrize("case", PARITY, ids=[c[0] for c in PARITY])
def test_http_and_grpc_answer_alike(case):
    _, setup, (method, path, body), (rpc_name, request), code = case
    client = FakeClient()
    if setup is not None:
        setup(client)
    svc = make_service(client)
    status, http_body, _ = http(KServeHttpApp(svc, 1 << 20), method, path, body)
    _, aborted = rpc(InferenceService(svc), rpc_name, request)
    assert aborted is not None, f"{rpc_name} did not fail"
    grpc_code, details = aborted
    assert status == http_status(code)
    assert grpc_code == grpc_status(code)
    assert json.loads(http_body) == {"error": details}


def test_control_timeout_is_unavailable_over_grpc():
    """It used to escape the RPC as an uncaught exception (UNKNOWN)."""
    client = FakeClient()
    client.control_raises = asyncio.TimeoutError()
    _, (code, details) = rpc(InferenceService(make_service(client)), "RepositoryModelLoad",
                             pb.RepositoryModelLoadRequest(model_name="simple"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details == "load of 'simple' did not finish in time"


def test_model_ready_not_ready_is_an_answer_not_an_error():
    svc = make_service()
    resp, aborted = rpc(InferenceService(svc), "ModelReady",
                        pb.ModelReadyRequest(name="simple", version="2"))
    assert aborted is None and resp.ready is False
    assert http(KServeHttpApp(svc, 1 << 20), "GET", "/v2/models/simple/versions/2/ready") == \
        (400, b'{"error":"Model version not ready"}', {})


VERSION_WORDS = ("failed to get model version from specified version string 'x' (details: stol), "
                 "version should be an integral value > 0")


@pytest.mark.parametrize("path, rpc_name, message", [
    ("/v2/models/simple/versions/x/stats", "ModelStatistics",
     pb.ModelStatisticsRequest(name="simple", version="x")),
    ("/v2/models/simple/versions/x", "ModelMetadata",
     pb.ModelMetadataRequest(name="simple", version="x")),
    ("/v2/models/simple/versions/x/ready", "ModelReady",
     pb.ModelReadyRequest(name="simple", version="x")),
])
def test_a_version_that_is_not_digits(path, rpc_name, message):
    """As Triton: no HTTP route has such a path (404), and gRPC refuses the version string."""
    svc = make_service()
    assert http(KServeHttpApp(svc, 1 << 20), "GET", path) == (404, b'{"error":"Not Found"}', {})
    _, aborted = rpc(InferenceService(svc), rpc_name, message)
    assert aborted == (grpc.StatusCode.INVALID_ARGUMENT, VERSION_WORDS)


@pytest.mark.parametrize("action", ["load", "unload"])
def test_control_parameters_not_an_object_read_as_tritons(action):
    status, body, _ = http(KServeHttpApp(make_service(), 1 << 20), "POST",
                           f"/v2/repository/models/simple/{action}", b'{"parameters": 5}')
    assert (status, json.loads(body)["error"]) == (
        400, f"attempt to get members for non-object ({action} request 'parameters' must be a JSON "
             f"object)")


def test_unload_dependents_true_unloads_over_both():
    client = FakeClient()
    svc = make_service(client)
    assert http(KServeHttpApp(svc, 1 << 20), "POST", "/v2/repository/models/simple/unload",
                b'{"parameters": {"unload_dependents": true}}')[0] == 200
    resp, aborted = rpc(InferenceService(svc), "RepositoryModelUnload",
                        pb.RepositoryModelUnloadRequest(
                            model_name="simple",
                            parameters={"unload_dependents": _param(bool_param=True)}))
    assert aborted is None
    assert client.controls == [(ControlAction.UNLOAD, "simple", "", True)] * 2


# ---- an infer whose caller goes away ---------------------------------------------------------------
class AnsweringClient(FakeClient):
    """Takes requests and lets the test answer them, as the EngineClient's inbox would."""

    def __init__(self):
        super().__init__()
        self.handlers: dict[int, object] = {}
        self.released: list[tuple[str, list]] = []

    def submit(self, model, version, prepared, on_result, ordered=False):
        rid = len(self.handlers) + 1
        self.handlers[rid] = on_result
        return rid

    def drain_abandoned(self, req_id, handler):
        self.handlers[req_id] = handler

    def release(self, worker, refs):
        self.released.append((worker, refs))


def _answer(rid: int):
    out = Tensor("OUT0", "INT32", [16], shm=ShmRef("seg", 64 * rid, 64))
    return InferResult(rid, "simple", 1, [out], worker="w")


def _prepared():
    return PreparedRequest(InferPayload("", [], []), batch_size=1, outputs={}, request_id="")


@pytest.mark.parametrize("when", ["after the cancel", "between the cancel and the task's step"])
def test_an_abandoned_infer_gives_its_answers_slots_back(when):
    client = AnsweringClient()
    svc = make_service(client)
    view, v = svc.infer_target("simple", "1")

    async def scenario():
        task = asyncio.ensure_future(svc.infer(view, v, _prepared()))
        await asyncio.sleep(0)                      # submitted, waiting
        task.cancel()
        if when != "after the cancel":
            client.handlers[1](_answer(1))          # the answer wins the race
        with pytest.raises(asyncio.CancelledError):
            await task
        if when == "after the cancel":
            assert client.cancelled == [1]
            client.handlers[1](_answer(1))          # the late answer
        return client.released

    released = run(scenario())
    assert released == [("w", [_answer(1).outputs[0].shm])]


def test_an_infer_answered_in_time_returns_its_answer():
    client = AnsweringClient()
    svc = make_service(client)
    view, v = svc.infer_target("simple", "1")

    async def scenario():
        task = asyncio.ensure_future(svc.infer(view, v, _prepared()))
        await asyncio.sleep(0)
        client.handlers[1](_answer(1))
        return await task

    assert run(scenario()) == _answer(1)
    assert client.released == []                   # the caller gives them back once sent
