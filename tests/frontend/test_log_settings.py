"""frontend/observability/log_settings.py: the logging extension's checks, its two wire forms, and the HTTP
and gRPC handlers on a fake scheduler link."""
import asyncio
import json
import logging

import grpc
import pytest
from frontend_fakes import FakeClient, http, make_service, rpc
from tritonclient.grpc import service_pb2 as pb

from shmserve.frontend.grpc.service import InferenceService
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.observability import log_settings as ls
from shmserve.ipc import logs
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, LogFormat, LogSettings

START = LogSettings()


def test_render_has_every_key_in_order():
    doc = ls.render(LogSettings(info=False, verbose=3, format=LogFormat.ISO8601), "/var/log/x")
    assert list(doc) == list(ls.KEYS)
    assert doc == {"log_file": "/var/log/x", "log_info": False, "log_warning": True,
                   "log_error": True, "log_verbose_level": 3, "log_format": "ISO8601"}


def test_updates_apply_only_the_given_keys():
    new = ls.updated(START, {"log_warning": False, "log_verbose_level": 2,
                             "log_format": "ISO8601", "log_error": None, "log_file": None})
    assert new == LogSettings(warning=False, verbose=2, format=LogFormat.ISO8601)
    assert ls.updated(new, {}) == new


@pytest.mark.parametrize("changes,code,message", [
    ({"log_file": ""}, ErrorCode.UNSUPPORTED, "log file location can not be updated"),
    # the log file is refused before anything else is looked at, as in Triton
    ({"bogus": 1, "log_file": "x"}, ErrorCode.UNSUPPORTED, "log file location"),
    ({"log_info": 1}, ErrorCode.INVALID_ARG, "expect boolean for 'log_info'"),
    ({"log_error": ls.NOT_SET}, ErrorCode.INVALID_ARG, "expect boolean for 'log_error'"),
    ({"log_verbose_level": False}, ErrorCode.INVALID_ARG, "expect int32 for 'log_verbose_level'"),
    ({"log_verbose_level": "1"}, ErrorCode.INVALID_ARG, "expect int32 for 'log_verbose_level'"),
    ({"log_verbose_level": 2 ** 31}, ErrorCode.INVALID_ARG, "invalid argument for log_verbose_level"),
    ({"log_format": None, "log_info": True, "log_format ": "x"}, ErrorCode.INVALID_ARG,
     "unknown log setting 'log_format '"),
    ({"log_format": b"default"}, ErrorCode.INVALID_ARG, "expect string for 'log_format'"),
    ({"log_format": "Default"}, ErrorCode.INVALID_ARG, "invalid argument for log_format, got: Default"),
])
def test_refusals_name_the_key(changes, code, message):
    with pytest.raises(InferError) as e:
        ls.updated(START, changes)
    assert e.value.code == code and message in e.value.message


def test_grpc_forms():
    req = pb.LogSettingsRequest()
    req.settings["log_info"].bool_param = False
    req.settings["log_verbose_level"].uint32_param = 0      # a zero that was set is still set
    req.settings["log_format"].string_param = "ISO8601"
    req.settings["log_error"]                               # present, holding nothing
    assert ls.from_grpc(req) == {"log_info": False, "log_verbose_level": 0,
                                 "log_format": "ISO8601", "log_error": ls.NOT_SET}
    resp = ls.to_grpc(LogSettings(verbose=5), "")
    assert {k: v.WhichOneof("parameter_choice") for k, v in resp.settings.items()} == {
        "log_file": "string_param", "log_info": "bool_param", "log_warning": "bool_param",
        "log_error": "bool_param", "log_verbose_level": "uint32_param",
        "log_format": "string_param"}
    assert resp.settings["log_verbose_level"].uint32_param == 5


def test_a_request_body_must_be_an_object():
    assert ls.from_json({"log_info": True}) == {"log_info": True}
    for doc in ([], "log_info", 3, None):
        with pytest.raises(InferError, match="must be a JSON object"):
            ls.from_json(doc)


# ---- the handlers ----------------------------------------------------------------------------------
@pytest.fixture
def client():
    """A fake scheduler link; this process's log settings are put back afterwards."""
    root = logging.getLogger()
    level, before = root.level, logs.current()
    yield FakeClient()
    logs.apply(before, announce=False)
    root.setLevel(level)


def test_http_get_and_post(client):
    app = KServeHttpApp(make_service(client), 1 << 20)
    status, body, _ = http(app, "GET", "/v2/logging")
    assert status == 200 and json.loads(body) == ls.render(logs.current(), logs.log_file())
    status, body, _ = http(app, "POST", "/v2/logging", b'{"log_verbose_level": 2}')
    assert status == 200 and json.loads(body)["log_verbose_level"] == 2
    assert logs.current().verbose == 2 and client.log_changes == [logs.current()]
    status, body, _ = http(app, "POST", "/v2/logging", b'{"log_info": "no"}')
    assert status == 400 and json.loads(body) == {"error": "expect boolean for 'log_info'"}
    assert len(client.log_changes) == 1                  # a refused change goes nowhere
    status, body, _ = http(app, "PUT", "/v2/logging")
    assert status == 405


def test_grpc_get_and_update(client):
    svc = InferenceService(make_service(client))
    resp, err = rpc(svc, "LogSettings", pb.LogSettingsRequest())
    assert err is None and resp.settings["log_format"].string_param == logs.current().format.value
    assert client.log_changes == []                     # reading sends nothing
    req = pb.LogSettingsRequest()
    req.settings["log_warning"].bool_param = False
    resp, err = rpc(svc, "LogSettings", req)
    assert err is None and resp.settings["log_warning"].bool_param is False
    assert client.log_changes == [logs.current()] and not logs.current().warning
    req = pb.LogSettingsRequest()
    req.settings["log_file"].string_param = "x"
    resp, err = rpc(svc, "LogSettings", req)
    assert resp is None and err[0] == grpc.StatusCode.UNIMPLEMENTED


def test_a_scheduler_that_does_not_confirm_is_unavailable(client):
    client.log_raises = asyncio.TimeoutError()
    app = KServeHttpApp(make_service(client), 1 << 20)
    status, body, _ = http(app, "POST", "/v2/logging", b'{"log_error": false}')
    assert status == 503 and "did not confirm" in json.loads(body)["error"]
