"""The --log-* flags and the logging extension (GET/POST /v2/logging, gRPC LogSettings) against a
real server, with tritonclient (HTTP and gRPC) and raw HTTP: lines in the chosen format in the
chosen place, levels switched on and off, a change reaching every process (a python model's
pb_utils.Logger included), Triton's errors for bad settings, and the restricted API group."""
import queue
import re
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

# Logs at every level, verbose first, then "done <tag>" at the level INPUT0[1] names (0 info,
# 1 warning, 2 error): a line that marks the request's lines as written (one writer thread per
# process writes them in order), so a test can tell a line that was left out from one not yet
# written. It also prints, which must not go to the log file.
CHATTY = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            pb_utils.Logger.log_warn("chatty initialized")

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                tag = int(x[0])
                pb_utils.Logger.log_verbose(f"chatty verbose {tag}")
                pb_utils.Logger.log_info(f"chatty info {tag}")
                pb_utils.Logger.log_warn(f"chatty warning {tag}")
                pb_utils.Logger.log_error(f"chatty error {tag}")
                print(f"chatty print {tag}", flush=True)
                level = [pb_utils.LogLevel.INFO, pb_utils.LogLevel.WARNING,
                         pb_utils.LogLevel.ERROR][int(x[1])]
                pb_utils.Logger.log(f"chatty done {tag}", level)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')

DEFAULT_LINE = re.compile(r'^([IWE])(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) (\d+) ([\w.]+):(\d+)\] (.*)$')
ISO_LINE = re.compile(r'^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z ([IWE]) (\d+) ([\w.]+):(\d+)\] (.*)$')
INFO, WARNING, ERROR = 0, 1, 2
WAIT_S = 30
ADMIN = {"admin-key": "s3cret"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("logging_models"))
    write_model(path, "chatty", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 2 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 2 ] } ]
    ''', CHATTY)
    return path


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("logging_file") / "server.log")


START = {"log_file": None, "log_info": False, "log_warning": True, "log_error": True,
         "log_verbose_level": 0, "log_format": "ISO8601"}


@pytest.fixture(scope="module")
def server(repo, log_path):
    with open(log_path, "w") as f:
        f.write("a line that was there before\n")   # --log-file appends
    s = Server(repo, "--log-file", log_path, "--log-format", "ISO8601", "--log-info", "false")
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def _back_to_start(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        restore = {k: v for k, v in START.items() if k != "log_file"}
        r = requests.post(f"{srv.base}/v2/logging", json=restore, timeout=WAIT_S)
        assert r.status_code == 200, r.text


def _read(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _run(server, path: str, tag: int, marker_level: int) -> list[str]:
    """One request to chatty; the lines of the log file at ``path`` once its marker is there."""
    c = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("INPUT0", [2], "INT32")
    inp.set_data_from_numpy(np.array([tag, marker_level], dtype=np.int32))
    c.infer("chatty", [inp])
    marker = f'"chatty done {tag}"'
    return wait_for(lambda: (lines := _read(path)) and
                    any(line.endswith(marker) for line in lines) and lines,
                    WAIT_S, f"the line {marker} in the log file")


def _line(lines: list[str], message: str) -> str | None:
    found = [line for line in lines if line.endswith(f'"{message}"')]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_the_flags_take_effect(server, log_path):
    lines = _run(server, log_path, 1, ERROR)
    assert lines[0] == "a line that was there before"       # appended, not truncated
    for line in lines[1:]:
        assert ISO_LINE.match(line), line                   # --log-format ISO8601
    # --log-info false: the startup's info lines (every process has some) are left out;
    # warnings and errors still come
    for message in ("loading model 'chatty'", "HTTP service listening", "is READY"):
        assert not [line for line in lines if message in line]
    init = _line(lines, "chatty initialized")
    assert init and ISO_LINE.match(init)[7] == "W" and ISO_LINE.match(init)[9] == "model.py"
    assert _line(lines, "chatty warning 1") and _line(lines, "chatty error 1")
    assert _line(lines, "chatty info 1") is None and _line(lines, "chatty verbose 1") is None
    # the server's own output gets no log lines; what the model prints still goes there
    out = server.log_text().splitlines()
    assert "chatty print 1" in out
    assert not [line for line in out if ISO_LINE.match(line) or DEFAULT_LINE.match(line)]
    r = requests.get(f"{server.base}/v2/logging", timeout=WAIT_S)
    assert r.status_code == 200 and r.json() == {**START, "log_file": log_path}


def test_a_verbose_level_set_over_http_reaches_every_process(server, log_path):
    c = httpclient.InferenceServerClient(server.url)
    assert _line(_run(server, log_path, 2, ERROR), "chatty verbose 2") is None
    before = len(_read(log_path))
    now = c.update_log_settings({"log_verbose_level": 1})
    assert now == {**START, "log_file": log_path, "log_verbose_level": 1}
    assert c.get_log_settings() == now
    # the answer comes once the frontend and the scheduler took the change; the scheduler
    # passes it on to the workers, and a request may reach a leased worker first: poll
    tags = iter(range(300, 1000))

    def verbose_line() -> str | None:
        tag = next(tags)
        return _line(_run(server, log_path, tag, ERROR), f"chatty verbose {tag}")
    verbose = wait_for(verbose_line, WAIT_S, "the model's verbose line once its worker took the level")
    assert ISO_LINE.match(verbose)[7] == "I"                # a verbose line is an I line
    # each process that took the change says so at verbose level 1: the frontend, the
    # scheduler and the worker (three pids at least). Each writes its log from a thread of its
    # own, so the scheduler's line can land after the answer the worker sent: wait for it.

    def said() -> set[str] | None:
        pids = {ISO_LINE.match(line)[8] for line in _read(log_path)[before:]
                if line.endswith("log_verbose_level=1 log_format=ISO8601\"")}
        return pids if len(pids) >= 3 else None
    assert ISO_LINE.match(verbose)[8] in wait_for(said, WAIT_S, "three processes to log the change")
    c.update_log_settings({"log_verbose_level": 0})
    assert _line(_run(server, log_path, 4, ERROR), "chatty verbose 4") is None


def test_failed_requests_are_logged_at_verbose_level(server, log_path):
    """As Triton's verbose log does, and its log-injection check relies on: the error of a
    failed request is written, with the client's text in it escaped."""
    c = httpclient.InferenceServerClient(server.url)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    name = 'evil\nI0205 18:34:18.707423 1 file.cc:123] "INJECTED"'

    def bad_input(mod):
        i = mod.InferInput(name, [2], "INT32")
        i.set_data_from_numpy(np.array([0, 0], dtype=np.int32))
        return i
    with pytest.raises(InferenceServerException):
        c.infer("chatty", [bad_input(httpclient)])          # verbose off: not logged
    c.update_log_settings({"log_verbose_level": 1})
    for client, mod in ((c, httpclient), (g, grpcclient)):
        with pytest.raises(InferenceServerException):
            client.infer("chatty", [bad_input(mod)])
    lines = _run(server, log_path, 50, ERROR)
    failed = [line for line in lines if "INJECTED" in line]
    assert len(failed) == 2, failed
    assert all(ISO_LINE.match(line) and "\\n" in line for line in failed)    # one line each
    assert "/v2/models/chatty/infer failed (400)" in failed[0]
    assert "INVALID_ARGUMENT" in failed[1]


def test_a_cancelled_grpc_call_is_logged_at_verbose_level(server, log_path):
    """Triton's verbose 'Cancellation notification received for' line (its request
    cancellation test counts it): a stream the client cancels."""
    c = httpclient.InferenceServerClient(server.url)
    c.update_log_settings({"log_verbose_level": 1})
    g = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    # one answer first: the stream is open at the server (a stream cancelled at once may be
    # reset before its headers ever leave the client, and then the server has nothing to log)
    inp = grpcclient.InferInput("INPUT0", [2], "INT32")
    inp.set_data_from_numpy(np.array([907, 0], dtype=np.int32))
    g.async_stream_infer("chatty", [inp])
    result, error = answers.get(timeout=WAIT_S)
    assert error is None, error
    g.stop_stream(cancel_requests=True)         # the open stream is reset by the client
    g.close()
    wait_for(lambda: any("Cancellation notification received for" in line
                         for line in _read(log_path)), WAIT_S, "the cancellation line")


def test_format_and_levels_set_over_grpc(server, log_path):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    resp = c.update_log_settings({"log_format": "default", "log_info": True, "log_error": False},
                                 as_json=True)
    assert resp == {"settings": {
        "log_file": {"string_param": log_path}, "log_info": {"bool_param": True},
        "log_warning": {"bool_param": True}, "log_error": {"bool_param": False},
        "log_verbose_level": {"uint32_param": 0}, "log_format": {"string_param": "default"}}}
    got = c.get_log_settings().settings
    assert got["log_format"].string_param == "default" and got["log_info"].bool_param
    lines = _run(server, log_path, 5, WARNING)
    info = _line(lines, "chatty info 5")
    assert info and DEFAULT_LINE.match(info) and DEFAULT_LINE.match(info)[1] == "I"
    assert DEFAULT_LINE.match(_line(lines, "chatty warning 5"))[1] == "W"
    assert _line(lines, "chatty error 5") is None          # log_error false
    # an empty request reads the settings
    assert c.get_log_settings(as_json=True) == resp


BAD_HTTP = [
    ({"log_info": "yes"}, 400, "expect boolean for 'log_info'"),
    ({"log_warning": 1}, 400, "expect boolean for 'log_warning'"),
    ({"log_error": None, "log_info": []}, 400, "expect boolean for 'log_info'"),
    ({"log_verbose_level": True}, 400, "expect int32 for 'log_verbose_level'"),
    ({"log_verbose_level": 1.5}, 400, "expect int32 for 'log_verbose_level'"),
    ({"log_verbose_level": -1}, 400, "invalid argument for log_verbose_level, got: -1"),
    ({"log_format": 8601}, 400, "expect string for 'log_format'"),
    ({"log_format": "iso8601"}, 400, "invalid argument for log_format, got: iso8601"),
    ({"log_levels": 1}, 400, "unknown log setting 'log_levels'"),
    # checked whole: the good verbose level beside the bad format does not apply either
    ({"log_verbose_level": 3, "log_format": "json"}, 400, "invalid argument for log_format"),
    ({"log_file": "/tmp/elsewhere.log"}, 501,
     "log file location can not be updated through network protocol"),
]


@pytest.mark.parametrize("body,status,message", BAD_HTTP)
def test_bad_settings_over_http_name_the_key(server, log_path, body, status, message):
    r = requests.post(f"{server.base}/v2/logging", json=body, timeout=WAIT_S)
    assert r.status_code == status and message in r.json()["error"], r.text
    r = requests.get(f"{server.base}/v2/logging", timeout=WAIT_S)
    assert r.json() == {**START, "log_file": log_path}         # nothing changed


def test_malformed_bodies_and_the_server_keeps_serving(server, log_path):
    for body in (b"[1, 2]", b'"log_info"', b"{not json"):
        r = requests.post(f"{server.base}/v2/logging", data=body, timeout=WAIT_S)
        assert r.status_code == 400, r.text
    # null leaves a setting as it is (log_file included); an empty body changes nothing
    r = requests.post(f"{server.base}/v2/logging", json={"log_file": None, "log_info": None},
                      timeout=WAIT_S)
    assert r.status_code == 200 and r.json() == {**START, "log_file": log_path}
    r = requests.post(f"{server.base}/v2/logging", timeout=WAIT_S)
    assert r.status_code == 200 and r.json() == {**START, "log_file": log_path}
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException, match="expect boolean for 'log_error'"):
        c.update_log_settings({"log_error": "false"})
    assert _line(_run(server, log_path, 6, WARNING), "chatty warning 6")
    assert server.ready()


def test_bad_settings_over_grpc(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        c.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "log file location can not be updated through network protocol" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.update_log_settings({"log_format": "iso"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid argument for log_format, got: iso" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.update_log_settings({"log_info": None})       # a SettingValue with nothing in it
    assert "expect boolean for 'log_info'" in e.value.message()
    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for key, field, value, message in (
                ("log_info", "string_param", "true", "expect boolean for 'log_info'"),
                ("log_verbose_level", "bool_param", True, "expect int32 for 'log_verbose_level'"),
                ("log_format", "uint32_param", 1, "expect string for 'log_format'"),
                ("verbose", "uint32_param", 1, "unknown log setting 'verbose'")):
            req = service_pb2.LogSettingsRequest()
            setattr(req.settings[key], field, value)
            with pytest.raises(grpc.RpcError) as e:
                stub.LogSettings(req, timeout=WAIT_S)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in e.value.details()
    assert c.get_log_settings(as_json=True)["settings"]["log_format"] == {"string_param": "ISO8601"}


# ---- a second server: the defaults, on stderr, with the logging group restricted ----------
@pytest.fixture(scope="module")
def restricted_server(repo):
    s = Server(repo, "--http-restricted-api", "logging:admin-key=s3cret",
               "--grpc-restricted-protocol", "logging:admin-key=s3cret")
    yield s
    assert s.stop() == 0


DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": 0, "log_format": "default"}


def test_default_lines_go_to_stderr(restricted_server):
    text = wait_for(lambda: (t := restricted_server.log_text()) and "service listening" in t and t,
                    WAIT_S, "the frontend's first lines")
    line = next(x for x in text.splitlines() if "HTTP service listening" in x)
    m = DEFAULT_LINE.match(line)
    assert m and m[1] == "I" and m[9] == "main.py" and m[11].startswith('"HTTP service listening')
    assert int(m[8]) != restricted_server.proc.pid          # the frontend's pid, not the launcher's


def test_restricted_logging_needs_the_header(restricted_server):
    base = restricted_server.base
    for method in ("get", "post"):
        r = requests.request(method, f"{base}/v2/logging", timeout=WAIT_S)
        assert r.status_code == 403
        assert r.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    r = requests.get(f"{base}/v2/logging", headers=ADMIN, timeout=WAIT_S)
    assert r.status_code == 200 and r.json() == DEFAULTS
    h = httpclient.InferenceServerClient(restricted_server.url)
    with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
        h.get_log_settings()
    assert h.update_log_settings({"log_warning": True}, headers=ADMIN) == DEFAULTS
    g = grpcclient.InferenceServerClient(restricted_server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.get_log_settings()
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    assert "expecting header 'triton-grpc-protocol-admin-key'" in e.value.message()
    got = g.get_log_settings(headers={"triton-grpc-protocol-admin-key": "s3cret"}, as_json=True)
    assert got["settings"]["log_format"] == {"string_param": "default"}
    # other groups are not restricted
    assert h.is_server_ready() and g.is_server_ready()


def test_metadata_lists_the_extension(restricted_server):
    meta = requests.get(f"{restricted_server.base}/v2", timeout=WAIT_S).json()
    assert "logging" in meta["extensions"]
    g = grpcclient.InferenceServerClient(restricted_server.grpc_url)
    assert "logging" in g.get_server_metadata().extensions


@pytest.mark.parametrize("args,message", [
    (["--log-format", "iso8601"], "invalid choice: 'iso8601'"),
    (["--log-verbose", "-1"], "--log-verbose must be >= 0"),
    (["--log-info", "maybe"], "expected a boolean"),
    (["--log-file", "/nonexistent-dir/x/server.log"], "--log-file: cannot open"),
])
def test_bad_flags_stop_the_start(args, message):
    p = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", "/tmp",
                        *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr
