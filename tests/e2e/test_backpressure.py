"""A client that sends and never reads must not grow the server (issue 13): HTTP requests
pipelined on one keep-alive connection, and a gRPC ModelStreamInfer stream. Each sends many small
requests whose answers are large, reads nothing while another client is served, and then reads
everything and finds every answer, in order.

What is measured: the resident memory of the whole server (every process: a worker holds the
output slots of unsent answers, the frontend the answers it built) and how many of the silent
client's requests were executed. Without back-pressure the server runs one of them for every
request of the other client (they share the model's queue), so executions and memory grow with
the other client's traffic; with it they stop at a bound.
"""
import json
import socket
import threading

import grpc
import numpy as np
import pytest
import requests
from limit_models import write_sized
from serverproc import Server, descendants
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

BIG = 512 << 10             # bytes of a large answer
N_BIG = 192                 # the silent client's large answers come first (96 MiB in all)...
N_SMALL = 2000              # ...then thousands of small ones
OTHER = 100                 # requests of the other client while the silent one reads nothing
MAX_EXECUTED = 40           # the silent client's executions allowed meanwhile (unbounded: ~OTHER)
MAX_GROWTH = 40 << 20       # server memory growth allowed meanwhile (unbounded: N_BIG * BIG)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("bp"))
    write_sized(repo)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _sizes() -> list[int]:
    return [BIG] * N_BIG + [16 + i % 7 for i in range(N_SMALL)]


def server_rss(server) -> dict[int, int]:
    """VmRSS in bytes of every process of the server."""
    out = {}
    for pid in [server.proc.pid, *descendants(server.proc.pid)]:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) * 1024
        except OSError:
            pass
    return out


def executed(server) -> int:
    r = requests.get(f"{server.base}/v2/models/sized/stats", timeout=30)
    (s,) = r.json()["model_stats"]
    return s["inference_stats"]["success"]["count"]


def _growth(base: dict[int, int], now: dict[int, int]) -> tuple[int, str]:
    """How much the server's processes grew, in all and (for the message) each."""
    each = {pid: rss - base.get(pid, 0) for pid, rss in now.items()}
    return sum(each.values()), ", ".join(f"{pid}: {d / 2**20:+.1f} MiB" for pid, d in each.items())


def _other_client(server, base: dict[int, int], before: int) -> tuple[int, str, int]:
    """OTHER requests from another connection, one at a time, each answered within its timeout.
    Returns the most the server grew meanwhile (bytes, and a text per process), and how many of
    the silent client's requests ran: the model's executions since ``before``, less the other
    client's."""
    peak, text = 0, ""
    body = {"inputs": [{"name": "SIZE", "shape": [1], "datatype": "INT32", "data": [8]}]}
    with requests.Session() as other:
        for i in range(OTHER):
            r = other.post(f"{server.base}/v2/models/sized/infer", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [8] * 8
            if i % 10 == 9:
                grown, each = _growth(base, server_rss(server))
                if grown > peak:
                    peak, text = grown, each
    return peak, text, executed(server) - before - OTHER


def _warm_up(server) -> dict[int, int]:
    body = {"inputs": [{"name": "SIZE", "shape": [1], "datatype": "INT32", "data": [BIG]}],
            "parameters": {"binary_data_output": True}}
    for _ in range(4):
        assert requests.post(f"{server.base}/v2/models/sized/infer", json=body,
                             timeout=30).status_code == 200
    return server_rss(server)


# ---- HTTP pipelining ---------------------------------------------------------------------------
def _pipelined(sizes: list[int]) -> bytes:
    out = []
    for i, n in enumerate(sizes):
        body = json.dumps({"id": str(i), "inputs": [{"name": "SIZE", "shape": [1],
                                                      "datatype": "INT32", "data": [n]}],
                           "parameters": {"binary_data_output": True}}).encode()
        out.append(b"POST /v2/models/sized/infer HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return b"".join(out)


class _Responses:
    """HTTP/1.1 responses read one by one off a socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            self.buf += chunk

    def next(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill(len(self.buf) + 1)
        head, _, _ = bytes(self.buf).partition(b"\r\n\r\n")
        del self.buf[:len(head) + 4]
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        n = int(headers["Content-Length"])
        self._fill(n)
        body = bytes(self.buf[:n])
        del self.buf[:n]
        return int(lines[0].split()[1]), headers, body


def test_pipelining_without_reading_is_bounded(server):
    base = _warm_up(server)
    sizes = _sizes()
    data = _pipelined(sizes)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)     # before connect: the window
    s.settimeout(60)
    s.connect(("127.0.0.1", server.http_port))
    before = executed(server)
    sender = threading.Thread(target=s.sendall, args=(data,), daemon=True)
    sender.start()
    try:
        grown, each, silent = _other_client(server, base, before)
        print(f"HTTP pipelining: the server grew by {grown / 2**20:.1f} MiB ({each}); "
              f"{silent} of the silent client's requests ran")
        assert silent <= MAX_EXECUTED
        assert grown <= MAX_GROWTH, each
        responses = _Responses(s)
        for i, n in enumerate(sizes):
            status, headers, body = responses.next()
            assert status == 200, body[:200]
            hlen = int(headers["Inference-Header-Content-Length"])
            doc = json.loads(body[:hlen])
            assert doc["id"] == str(i)
            out = body[hlen:]
            assert len(out) == n and out[:1] == bytes([n % 251])
        sender.join(30)
        assert not sender.is_alive()
    finally:
        s.close()


# ---- gRPC stream -------------------------------------------------------------------------------
def _stream_request(i: int, n: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="sized", id=str(i))
    req.inputs.add(name="SIZE", datatype="INT32", shape=[1])
    req.raw_input_contents.append(np.array([n], dtype=np.int32).tobytes())
    return req


def test_unread_stream_is_bounded(server):
    base = _warm_up(server)
    sizes = _sizes()
    pulled = []

    def requests_():
        for i, n in enumerate(sizes):
            pulled.append(i)
            yield _stream_request(i, n)

    before = executed(server)
    with grpc.insecure_channel(server.grpc_url, options=[
            ("grpc.max_receive_message_length", 1 << 30)]) as channel:
        stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests_(),
                                                                            timeout=120)
        grown, each, silent = _other_client(server, base, before)
        print(f"gRPC stream: the server grew by {grown / 2**20:.1f} MiB ({each}); {silent} of "
              f"the silent stream's requests ran, {len(pulled)} were sent")
        assert silent <= MAX_EXECUTED
        assert grown <= MAX_GROWTH, each
        for i, n in enumerate(sizes):
            resp = next(stream)
            assert not resp.error_message, resp.error_message
            assert resp.infer_response.id == str(i)
            out = resp.infer_response.raw_output_contents[0]
            assert len(out) == n and out[:1] == bytes([n % 251])
        stream.cancel()


def test_answers_queued_behind_a_slow_request_are_all_given(server):
    """Requests answered at once, pipelined behind one that waits for its model: each answer
    started the next inside the previous one's call, and 2,000 of them overflowed the stack
    (RecursionError in the frontend, the connection wedged)."""
    s = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    try:
        s.sendall(_pipelined([BIG]) + b"GET /v2/health/live HTTP/1.1\r\n\r\n" * 2000)
        responses = _Responses(s)
        status, headers, body = responses.next()
        assert status == 200 and len(body) > BIG
        for _ in range(2000):
            assert responses.next()[0] == 200
    finally:
        s.close()
