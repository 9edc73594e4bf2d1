"""Triton's generate extension on the real server: POST .../generate answers one JSON object,
POST .../generate_stream one Server-Sent Event per response as the model sends it. The cases of
Triton's qa/L0_http/generate_endpoint_test.py with its words, plus a client that leaves mid-stream
(the model's request is cancelled), pipelining after a chunked stream and HTTP/1.0."""
import json
import os
import shutil
import socket
import textwrap

import pytest
import requests
from repo_builder import write_model
from serverproc import REPO_ROOT, Server, wait_for

MAX_INPUT = 1_000_000       # --http-max-input-size: small, so the size checks cost little
SSE = "text/event-stream; charset=utf-8"

# The interface of Triton's generate test model (mock_llm): PROMPT comes back as TEXT, once, or
# REPETITION times when STREAM; parameters steer it.
LLM = textwrap.dedent('''
    import json, os, threading, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                p = json.loads(r.parameters())
                prompt = pb_utils.get_input_tensor_by_name(r, "PROMPT").as_numpy().copy()
                stream = bool(pb_utils.get_input_tensor_by_name(r, "STREAM").as_numpy().flat[0])
                threading.Thread(target=self.answer, daemon=True,
                                 args=(r.get_response_sender(), prompt, stream, p)).start()
            return None

        @staticmethod
        def answer(sender, prompt, stream, p):
            text = pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", prompt)])
            deadline = time.monotonic() + 30
            if "cancel_flag" in p:          # one answer, then silence until the client leaves
                sender.send(text)
                while not sender.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.02)
                with open(p["cancel_flag"], "w") as f:
                    f.write("cancelled" if sender.is_cancelled() else "never cancelled")
                sender.send(flags=FINAL)
                return
            if not stream:
                sender.send(text, flags=FINAL)
                return
            for i in range(p.get("REPETITION", 1)):
                if i == 1 and "gate" in p:  # the rest only once the client has the first
                    while not os.path.exists(p["gate"]) and time.monotonic() < deadline:
                        time.sleep(0.01)
                sender.send(text)
            if p.get("FAIL_LAST", False):
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("An Error Occurred")), flags=FINAL)
            else:
                sender.send(flags=FINAL)
''')

# one answer per request: text_output upper-cased, the request's parameters, a response parameter
ECHO = textwrap.dedent('''
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy()
                upper = np.array([[t.upper() for t in row] for row in text], dtype=object)
                params = np.array([[r.parameters().encode()]] * len(text), dtype=object)
                out.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("text_output", upper), pb_utils.Tensor("params", params)],
                    parameters={"finish_reason": "stop"}))
            return out
''')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("generate"))
    shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", "repeat_int32"),
                    os.path.join(repo, "repeat_int32"))
    write_model(repo, "llm", '''
        backend: "python"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [
          { name: "PROMPT", data_type: TYPE_STRING, dims: [ 1, 1 ] },
          { name: "STREAM", data_type: TYPE_BOOL, dims: [ 1, 1 ] },
          { name: "input_ids", data_type: TYPE_INT32, dims: [ 1, -1 ], optional: true }
        ]
        output [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1, -1 ] } ]
    ''', LLM)
    write_model(repo, "echo", '''
        backend: "python"
        max_batch_size: 4
        input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
        output [
          { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] },
          { name: "params", data_type: TYPE_STRING, dims: [ 1 ] }
        ]
    ''', ECHO)
    s = Server(repo, "--http-max-input-size", str(MAX_INPUT))
    yield s
    assert s.stop() == 0


def _url(srv, model, route):
    return f"{srv.base}/v2/models/{model}/{route}"


def _post(srv, model, route, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(_url(srv, model, route), data=data, timeout=30, **kw)


def _events(response) -> list[dict]:
    """The SSE events of a whole response body."""
    text = response.content.decode()
    assert text.endswith("\n\n") or text == ""
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: "):]))
    return events


def _stream_events(response):
    """SSE events as they arrive (each chunk the server writes is read as it comes)."""
    buf = b""
    for chunk in response.iter_content(chunk_size=None):
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            assert block.startswith(b"data: ")
            yield json.loads(block[len(b"data: "):])
    assert buf == b""


# ---- answers ------------------------------------------------------------------------------------
def test_generate_one_json_answer(srv):
    r = _post(srv, "echo", "generate", {"id": "42", "text_input": "hello", "temperature": 0.5,
                                        "parameters": {"max_tokens": 5, "stream": False}})
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    doc = r.json()
    params = json.loads(doc.pop("params"))
    assert doc == {"id": "42", "model_name": "echo", "model_version": "1",
                   "text_output": "HELLO", "finish_reason": "stop"}
    # every key that is not an input reaches the model as a parameter, "id" too (as in Triton)
    assert params == {"id": "42", "temperature": 0.5, "max_tokens": 5, "stream": False}


def test_request_id(srv):
    for body in ({"PROMPT": "hello world", "STREAM": False},
                 {"PROMPT": "hello world", "STREAM": False, "id": ""}):
        r = _post(srv, "llm", "generate", body)
        assert r.status_code == 200 and "id" not in r.json()
        assert r.json()["TEXT"] == "hello world"


def test_version_in_the_path_and_unknown_models(srv):
    r = requests.post(f"{srv.base}/v2/models/echo/versions/1/generate_stream",
                      data=json.dumps({"text_input": "v"}), timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"] == SSE
    assert [e["text_output"] for e in _events(r)] == ["V"]
    r = requests.post(f"{srv.base}/v2/models/echo/versions/7/generate", data="{}", timeout=30)
    assert r.status_code == 404 and "version 7 is not found" in r.json()["error"]
    for route in ("generate", "generate_stream"):
        r = _post(srv, "nope", route, {"text_input": "x"})
        assert r.status_code == 404 and r.headers["Content-Type"] == "application/json"
        assert "Request for unknown model: 'nope' is not found" in r.json()["error"]
    assert requests.get(_url(srv, "echo", "generate"), timeout=30).status_code == 405


def test_stream_of_a_decoupled_model(srv):
    r = _post(srv, "repeat_int32", "generate_stream", {"IN": [4, 5, 6], "DELAY": [1, 1, 1],
                                                       "WAIT": 0})
    assert r.status_code == 200 and r.headers["Content-Type"] == SSE
    assert r.headers.get("Transfer-Encoding") == "chunked"
    assert _events(r) == [{"model_name": "repeat_int32", "model_version": "1", "OUT": v,
                           "IDX": i} for i, v in enumerate([4, 5, 6])]


def test_stream_of_a_model_with_one_answer(srv):
    r = _post(srv, "echo", "generate_stream", {"text_input": "one"})
    assert r.status_code == 200 and r.headers["Content-Type"] == SSE
    assert [e["text_output"] for e in _events(r)] == ["ONE"]
    r = _post(srv, "llm", "generate_stream", {"PROMPT": "x", "STREAM": False})
    assert [e["TEXT"] for e in _events(r)] == ["x"]


def test_events_are_written_as_the_model_sends_them(srv, tmp_path):
    """The model sends its second response only once the client holds the first: a server that
    held the events back would never let this stream end."""
    gate = str(tmp_path / "gate")
    with requests.post(_url(srv, "llm", "generate_stream"), stream=True, timeout=30,
                       data=json.dumps({"PROMPT": ["hi"], "STREAM": True, "REPETITION": 3,
                                        "gate": gate})) as r:
        assert r.status_code == 200
        events = _stream_events(r)
        assert next(events)["TEXT"] == "hi"
        open(gate, "w").close()
        assert [e["TEXT"] for e in events] == ["hi", "hi"]


def test_parameters_reach_the_model(srv):
    r = _post(srv, "llm", "generate_stream", {"PROMPT": ["hello world"], "STREAM": True,
                                              "parameters": {"REPETITION": 3}})
    assert r.status_code == 200 and [e["TEXT"] for e in _events(r)] == ["hello world"] * 3
    r = _post(srv, "llm", "generate_stream", {"PROMPT": ["hello world"], "STREAM": True,
                                              "REPETITION": 2, "input_ids": [100, 200]})
    assert [e["TEXT"] for e in _events(r)] == ["hello world"] * 2


def test_generate_on_a_decoupled_model(srv):
    # one response (with FINAL, or FINAL alone after it): the answer
    for stream in (False, True):
        r = _post(srv, "llm", "generate", {"PROMPT": "hello world", "STREAM": stream})
        assert r.status_code == 200 and r.json()["TEXT"] == "hello world"
    # none, or more than one: Triton's error
    for reps in (0, 2):
        r = _post(srv, "llm", "generate", {"PROMPT": "p", "STREAM": True, "REPETITION": reps})
        assert r.status_code == 500 and r.headers["Content-Type"] == "application/json"
        assert "generate expects model to produce exactly 1 response" in r.json()["error"]


def test_errors_of_the_model_in_the_stream(srv):
    body = {"PROMPT": ["hello world"], "STREAM": True, "REPETITION": 0, "FAIL_LAST": True}
    # the first response fails: it sets the status
    r = _post(srv, "llm", "generate_stream", body)
    assert r.status_code == 500 and r.headers["Content-Type"] == SSE
    assert _events(r) == [{"error": "An Error Occurred"}]
    # after a good one the status is already 200: the client reads the error in the stream
    r = _post(srv, "llm", "generate_stream", dict(body, REPETITION=1))
    assert r.status_code == 200
    assert _events(r) == [{"model_name": "llm", "model_version": "1", "TEXT": "hello world"},
                          {"error": "An Error Occurred"}]
    r = _post(srv, "llm", "generate", dict(body, REPETITION=0))
    assert r.status_code == 500 and r.json() == {"error": "An Error Occurred"}


def test_a_stream_that_ends_without_responses(srv):
    r = _post(srv, "llm", "generate_stream", {"PROMPT": "p", "STREAM": True, "REPETITION": 0})
    assert r.status_code == 200 and r.headers["Content-Type"] == SSE and r.content == b""


# ---- refusals, in Triton's words ----------------------------------------------------------------
BIG = "x" * (MAX_INPUT // 2)
REFUSALS = [
    ({}, "expected number of inputs between 2 and 3 but got 0"),
    ({"abc": 123}, "expected number of inputs between 2 and 3 but got 0"),
    ({"PROMPT": "hello"}, "expected number of inputs between 2 and 3 but got 1"),
    ({"STREAM": False, "other": "param"}, "expected number of inputs between 2 and 3 but got 1"),
    ({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
    ({"PROMPT": "hello", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
    ({"PROMPT": True, "STREAM": 123}, "attempt to access JSON non-string as string"),
    ({"STREAM": 123, "PROMPT": True}, "attempt to access JSON non-boolean as boolean"),
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate"}',
     "input 'PROMPT' already exists in request"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": true, "PROMPT": "duplicate"}',
     "input 'STREAM' already exists in request"),
    ({"PROMPT": "hello world", "STREAM": True, "PARAMS": {"PARAM_0": 0, "PARAM_1": True}},
     "parameter 'PARAMS' has invalid type"),
    ({"PROMPT": {"USER": "hello world", "BOT": "world hello"}, "STREAM": True},
     "attempt to access JSON non-string as string"),
    ({"PROMPT": ["x"], "STREAM": True, "parameters": 1},
     "Expected JSON object for keyword: 'parameters'"),
    ({"PROMPT": ["x"], "STREAM": True, "parameters": {"nested": {"twice": 1}}},
     "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
    # two halves that pass the body limit but not together as input bytes
    ({"PROMPT": BIG, "input_ids": [1] * (MAX_INPUT // 8), "STREAM": False},
     " bytes exceeds the maximum allowed input size of "),
    ("not json", "failed to parse the request JSON buffer"),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_refusals(srv, route):
    for body, text in REFUSALS:
        r = _post(srv, "llm", route, body)
        assert r.status_code == 400, (body, r.text)
        assert r.headers["Content-Type"] == "application/json"
        assert text in r.json()["error"], (body, r.json())
    r = _post(srv, "llm", route, {"PROMPT": "x" * MAX_INPUT, "STREAM": False})
    assert r.status_code == 413
    assert " bytes exceeds the maximum allowed input size of " in r.json()["error"]
    r = _post(srv, "llm", route, b"{}", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert r.json()["error"] == "Unsupported content-encoding, only 'identity' is supported."
    # and the server goes on serving
    r = _post(srv, "llm", "generate", {"PROMPT": "still here", "STREAM": False})
    assert r.status_code == 200 and r.json()["TEXT"] == "still here"


# ---- the connection -----------------------------------------------------------------------------
def _request(path: str, body: dict, version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
            .encode() + data)


def test_a_client_that_leaves_cancels_the_request(srv, tmp_path):
    """The stream comes second on its connection: the first request's end must not make the
    server forget whom to cancel."""
    flag = str(tmp_path / "cancelled")
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as s:
        s.sendall(_request("/v2/models/echo/generate", {"text_input": "first"})
                  + _request("/v2/models/llm/generate_stream",
                             {"PROMPT": "tok", "STREAM": True, "cancel_flag": flag}))
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"FIRST" in got
    wait_for(lambda: os.path.exists(flag) and open(flag).read(), 30, "the model to see the cancel")
    assert open(flag).read() == "cancelled"
    assert requests.get(f"{srv.base}/v2/health/live", timeout=30).status_code == 200


def _read_response(f) -> tuple[bytes, dict, bytes]:
    """One HTTP/1.1 response off a socket file: status line, headers, body (chunked or sized)."""
    status = f.readline()
    headers = {}
    while (line := f.readline()) != b"\r\n":
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline(), 16)) != 0:
            body += f.read(size)
            assert f.read(2) == b"\r\n"
        assert f.readline() == b"\r\n"
        return status, headers, body
    return status, headers, f.read(int(headers.get("content-length", 0)))


def test_pipelined_requests_after_a_stream(srv):
    stream = {"IN": [1, 2], "DELAY": [1, 1], "WAIT": 0}
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as s:
        s.sendall(_request("/v2/models/repeat_int32/generate_stream", stream)
                  + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
                  + _request("/v2/models/echo/generate", {"text_input": "after"}))
        f = s.makefile("rb")
        status, headers, body = _read_response(f)
        assert status.startswith(b"HTTP/1.1 200") and headers["content-type"] == SSE
        assert body.count(b"data: ") == 2 and body.endswith(b"\n\n")
        assert _read_response(f)[0].startswith(b"HTTP/1.1 200")
        status, _, body = _read_response(f)
        assert status.startswith(b"HTTP/1.1 200") and json.loads(body)["text_output"] == "AFTER"


def test_http10_client_reads_to_the_close(srv):
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as s:
        s.sendall(_request("/v2/models/repeat_int32/generate_stream",
                           {"IN": [7, 8], "DELAY": [1, 1], "WAIT": 0}, version="1.0"))
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    events = [json.loads(b[len(b"data: "):]) for b in body.split(b"\n\n")[:-1]]
    assert [e["OUT"] for e in events] == [7, 8]
