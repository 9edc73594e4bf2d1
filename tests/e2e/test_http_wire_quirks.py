"""HTTP requests Triton accepts that a strict reading would refuse, as Triton's own L0_http tests
send them: a raw-binary body for a BYTES input (the element without its length), and a chunked
body that also carries Content-Length (python's requests adds it)."""
import json
import socket

import numpy as np
import pytest
import requests
from repo_builder import write_model
from serverproc import Server

IDENTITY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                for r in requests]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("quirks"))
    write_model(repo, "bytes_one", '''
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ 1 ] } ]
    ''', IDENTITY)
    write_model(repo, "fp32_any", '''
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    ''', IDENTITY)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _raw(server, model: str, body: bytes, headers: dict | None = None) -> requests.Response:
    return requests.post(f"{server.base}/v2/models/{model}/infer", data=body, timeout=30,
                         headers={"Inference-Header-Content-Length": "0", **(headers or {})})


@pytest.mark.parametrize("element", [b"427", b"", bytes(range(256)) * 1024],
                         ids=["short", "empty", "past-the-inline-size"])
def test_a_raw_binary_bytes_body_is_the_one_element(server, element):
    r = _raw(server, "bytes_one", element)
    assert r.status_code == 200, r.text
    hlen = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:hlen])
    assert header["outputs"][0]["shape"] == [1] and header["outputs"][0]["datatype"] == "BYTES"
    # the answer is in the binary extension's form: the element's length, then its bytes
    assert r.content[hlen:hlen + 4] == len(element).to_bytes(4, "little")
    assert r.content[hlen + 4:] == element


def _chunked(data: bytes) -> bytes:
    return f"{len(data):X}\r\n".encode() + data + b"\r\n0\r\n\r\n"


def test_a_chunked_body_with_content_length_is_read_as_chunked(server):
    data = np.arange(8, dtype=np.float32).tobytes()
    # requests sends Content-Length (of the encoded body) beside the Transfer-Encoding given
    r = _raw(server, "fp32_any", _chunked(data), {"Transfer-Encoding": "chunked"})
    assert r.status_code == 200, r.text
    assert r.headers.get("Connection", "").lower() == "close"
    hlen = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[hlen:] == data


def _read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_nothing_after_a_body_with_both_lengths_is_answered(server):
    """A request smuggled behind the chunked body (where a proxy reading Content-Length would
    see it as part of the body, or the other way round) is never answered: the connection
    closes after the first answer."""
    data = np.arange(4, dtype=np.float32).tobytes()
    body = _chunked(data)
    smuggled = (b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    head = (f"POST /v2/models/fp32_any/infer HTTP/1.1\r\nHost: x\r\n"
            f"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"
            f"Content-Length: {len(body) + len(smuggled)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(head + body + smuggled)
        answer = _read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert answer.endswith(data)
    assert requests.get(f"{server.base}/v2/health/ready", timeout=10).status_code == 200
