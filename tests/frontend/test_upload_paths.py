"""Model upload in the frontend (engine/lifecycle/upload_files.py): which 'file:' names are paths inside
the model directory, the checks made before a byte is written, and what the writer leaves on
disk. The real server's side: tests/e2e/test_model_upload.py."""
import asyncio
import base64
import os
import stat

import pytest
from frontend_fakes import FakeClient, http, make_service

from shmserve.engine.lifecycle.upload_files import ModelUploads, check_layout, file_path, shown
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.http.server import HttpRequest
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ControlAction, ErrorCode
from shmserve.ipc.messages.to_frontend import ControlReply

POLL = "failed to load 'm', failed to poll from model repository: "


def refusal(call, *args, code=ErrorCode.INVALID_ARG) -> str:
    with pytest.raises(InferError) as e:
        call(*args)
    assert e.value.code == code, e.value.message
    return e.value.message


# ---- paths ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, parts", [
    ("file:1/model.onnx", ("1", "model.onnx")),
    ("file:labels.txt", ("labels.txt",)),
    ("file:1/sub dir/.hidden", ("1", "sub dir", ".hidden")),
    ("file:1/...", ("1", "...")),
    ("file:2/модель.onnx", ("2", "модель.onnx")),
    # Triton joins the path to the model directory: one leading '/' is that directory
    ("file:/1/model.py", ("1", "model.py")),
    ("file:/etc/passwd", ("etc", "passwd")),
])
def test_plain_relative_paths_are_accepted(key, parts):
    assert file_path("m", key) == parts


@pytest.mark.parametrize("key, why", [
    ("file:", "names no file"),
    ("file:/", "names no file"),
    ("file://x", "empty path component"),
    ("file:/../x", "'..' component"),
    ("file:../x", "'..' component"),
    ("file:1/../../root/.bashrc", "'..' component"),
    ("file:1/..", "'..' component"),
    ("file:./1/model.onnx", "'.' or '..' component"),
    ("file:1//model.onnx", "empty path component"),
    ("file:1/", "empty path component"),
    ("file:1\\model.onnx", "backslash"),
    ("file:..\\..\\x", "backslash"),
    ("file:1/model\0.onnx", "NUL byte"),
    ("file:1/model\n.onnx", "control character"),
    # 3,000 components were a RecursionError (500) in os.makedirs
    ("file:" + "a/" * 2999 + "x", "has 3000 path components, more than the 32"),
])
def test_paths_that_leave_or_bend_the_model_directory_are_refused(key, why):
    msg = refusal(file_path, "m", key)
    assert msg.startswith(POLL) and why in msg
    assert f"load parameter '{shown(key)}'" in msg         # names the parameter
    assert "\0" not in msg and "\n" not in msg


def test_a_file_where_another_needs_a_directory_is_refused():
    paths = {"file:1": ("1",), "file:1/model.onnx": ("1", "model.onnx")}
    msg = refusal(check_layout, "m", paths)
    assert "load parameter 'file:1' names a file where 'file:1/model.onnx' needs a directory" in msg
    check_layout("m", {"file:1/a": ("1", "a"), "file:1/b": ("1", "b"), "file:c": ("c",)})


# ---- checks before writing ------------------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_files_need_a_config(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    for params in ({"file:1/model.onnx": b64(b"x")},
                   {"config": "", "file:1/model.onnx": b64(b"x")},
                   {"config": "  ", "file:1/model.onnx": b64(b"x")}):
        msg = refusal(up.check, "m", params, True)
        assert msg.startswith(POLL)
        assert "load parameter 'config' must be given with 'file:1/model.onnx'" in msg


def test_the_upload_limit_counts_every_file_and_names_the_one_past_it(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 10)
    ok = {"config": "{}", "file:a": b64(b"12345"), "file:b": b64(b"12345")}
    assert [k for k, _, _ in up.check("m", ok, True)] == ["file:a", "file:b"]
    msg = refusal(up.check, "m", {**ok, "file:c": b64(b"1")}, True)
    assert "load parameter 'file:c' takes the upload past --model-upload-max-bytes (10" in msg
    # raw bytes (gRPC) are counted the same
    msg = refusal(up.check, "m", {"config": "{}", "file:1/x": b"x" * 11}, False)
    assert "'file:1/x' takes the upload past" in msg
    assert not os.path.exists(up.root)          # nothing written for a refused load


def test_each_protocol_sends_files_its_own_way(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    msg = refusal(up.check, "m", {"config": "{}", "file:x": b"raw"}, True)
    assert "'file:x' must be the file's content as a base64 string" in msg
    msg = refusal(up.check, "m", {"config": "{}", "file:x": "text"}, False)
    assert "'file:x' must be a bytes_param" in msg


@pytest.mark.parametrize("model", ["", "  ", "../etc", "a/b", "a\nb"])
def test_an_uploaded_model_needs_a_plain_name(tmp_path, model):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    msg = refusal(up.check, model, {"config": "{}", "file:x": b"1"}, False)
    assert msg.startswith(f"invalid model name '{shown(model)}'")


def test_uploads_can_be_switched_off(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 0)
    msg = refusal(up.check, "m", {"config": "{}", "file:x": b"1"}, False,
                  code=ErrorCode.UNSUPPORTED)
    assert "--model-upload-max-bytes 0" in msg and "'file:x'" in msg


# ---- writing --------------------------------------------------------------------------------------
def write(up: ModelUploads, params: dict, base64_text: bool = True) -> str:
    return up.write("m", up.check("m", {"config": "{}", **params}, base64_text), base64_text)


def test_files_land_in_a_private_directory_of_their_own(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    a = write(up, {"file:1/model.onnx": b64(b"onnx"), "file:labels.txt": b64(b"a\nb\n")})
    b = write(up, {"file:1/model.py": b"py"}, base64_text=False)
    assert a != b and {os.path.dirname(a), os.path.dirname(b)} == {os.path.realpath(up.root)}
    with open(os.path.join(a, "1", "model.onnx"), "rb") as f:
        assert f.read() == b"onnx"
    with open(os.path.join(a, "labels.txt"), "rb") as f:
        assert f.read() == b"a\nb\n"
    for d in (up.root, a, os.path.join(a, "1")):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(a, "1", "model.onnx")).st_mode) == 0o600
    up.discard(a)
    assert not os.path.exists(a) and os.path.exists(b)


@pytest.mark.parametrize("value, why", [
    ("eA", "length is not a multiple of 4"),
    ("e A=", "not valid base64"),
    ("eA=*", "not valid base64"),
    ("ü===", "not valid base64"),
])
def test_invalid_base64_is_refused_and_leaves_nothing(tmp_path, value, why):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    msg = refusal(write, up, {"file:0/a": b64(b"fine"), "file:1/model.onnx": value})
    assert msg.startswith(POLL) and "load parameter 'file:1/model.onnx' is " in msg and why in msg
    assert os.listdir(up.root) == []


def test_a_name_the_file_system_refuses_is_an_internal_error_as_in_triton(tmp_path):
    # Triton's simple_grpc_model_control.py expects INTERNAL and "failed to poll" for this
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    key = "file:" + "A" * 256
    msg = refusal(write, up, {key: b"a"}, False, code=ErrorCode.INTERNAL)
    assert msg.startswith(POLL) and f"'{key}' could not be written: File name too long" in msg
    assert os.listdir(up.root) == []


def test_discard_touches_only_upload_directories(tmp_path):
    up = ModelUploads(str(tmp_path / "up"), 1 << 20)
    outside = tmp_path / "keep"
    outside.mkdir()
    up.discard(str(outside))
    assert outside.exists()


# ---- the service and HTTP -------------------------------------------------------------------------
def test_load_hands_the_written_directory_to_the_scheduler(tmp_path):
    client = FakeClient()
    svc = make_service(client)
    svc.uploads = ModelUploads(str(tmp_path / "up"), 1 << 20)
    asyncio.run(svc.load("m", {"config": "{}", "file:1/model.py": b"x"}))
    assert client.controls == [(ControlAction.LOAD, "m", "{}", False)]
    (path,) = client.upload_dirs
    assert os.path.isfile(os.path.join(path, "1", "model.py"))     # the scheduler removes it
    client.control_reply = ControlReply(0, "load failed for model 'm': boom", ErrorCode.INVALID_ARG)
    with pytest.raises(InferError):
        asyncio.run(svc.load("m", {"config": "{}", "file:1/model.py": b"x"}))
    assert len(os.listdir(svc.uploads.root)) == 2       # the scheduler's to remove, not ours


def test_an_upload_that_never_reached_the_scheduler_is_removed(tmp_path):
    client = FakeClient()
    client.control_raises = RuntimeError("the scheduler's socket is gone")
    svc = make_service(client)
    svc.uploads = ModelUploads(str(tmp_path / "up"), 1 << 20)
    with pytest.raises(RuntimeError):
        asyncio.run(svc.load("m", {"config": "{}", "file:1/model.py": b"x"}))
    assert os.listdir(svc.uploads.root) == []


def test_http_load_bodies_may_carry_the_upload_limit_as_base64(tmp_path):
    svc = make_service()
    app = KServeHttpApp(svc, 1000)
    load = HttpRequest("POST", b"/v2/repository/models/m/load", {})
    assert "--http-max-input-size" in app.check_body_size(load, 1001)   # no uploads: as before
    svc.uploads = ModelUploads(str(tmp_path / "up"), 3000)
    assert app.check_body_size(load, 1000 + 4000) == ""
    assert "--model-upload-max-bytes" in app.check_body_size(load, 1000 + 4001)
    unload = HttpRequest("POST", b"/v2/repository/models/m/unload", {})
    assert app.check_body_size(unload, 1001)


def test_http_load_decodes_base64_files(tmp_path):
    client = FakeClient()
    svc = make_service(client)
    svc.uploads = ModelUploads(str(tmp_path / "up"), 1 << 20)
    body = ('{"parameters": {"config": "{}", "file:1/model.py": "%s"}}' % b64(b"code")).encode()
    status, _, _ = http(KServeHttpApp(svc, 1 << 20), "POST", "/v2/repository/models/m/load", body)
    assert status == 200
    with open(os.path.join(client.upload_dirs[0], "1", "model.py"), "rb") as f:
        assert f.read() == b"code"
    body = b'{"parameters": {"config": "{}", "file:1/model.py": "not base64!"}}'
    status, answer, _ = http(KServeHttpApp(svc, 1 << 20), "POST", "/v2/repository/models/m/load",
                             body)
    assert status == 400 and b"'file:1/model.py' is not valid base64" in answer
