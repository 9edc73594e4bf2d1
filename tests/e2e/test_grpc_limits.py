"""What one gRPC client may hold on the loop server (frontend/grpc/guard.py), and the connection
budget the frontend's ports share (frontend/connections.py): raw sockets and the h2 library
against the real server, with small configured limits so that a few hundred sockets and a few
hundred MiB show what thousands once did."""
import gzip
import os
import socket
import time
import zlib

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from limit_models import write_sized
from serverproc import Server, connections, frontend_pids, peak_rss, peak_rss_reset, wait_for
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"          # an empty SETTINGS frame
INFER = "/inference.GRPCInferenceService/ModelInfer"
TIMEOUTS = ("--http-request-timeout-secs", "1", "--http-idle-timeout-secs", "1")


def _headers(path: str = INFER, **extra) -> list:
    return [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", path),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra.items()]


class Client:
    """An HTTP/2 client (h2) on a plain socket; ``window`` opens the client's receive windows
    that wide (a client that lets the server send all it likes)."""

    def __init__(self, port: int, window: int = 0):
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        if window:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            self.conn.increment_flow_control_window(window - 65535)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(self.conn.data_to_send())
        self.events: list = []
        self.closed = False

    def read(self, timeout: float) -> bool:
        """One read within ``timeout`` s; False if none came."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError):
            return False
        finally:
            self.sock.settimeout(30)
        if not data:
            self.closed = True
            return True
        self.events += self.conn.receive_data(data)
        self.sock.sendall(self.conn.data_to_send())
        return True

    def read_until(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and not self.closed:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; events so far: {self.events[-20:]}"
            self.read(left)

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def close(self) -> None:
        self.sock.close()


def _established(port: int) -> int:
    """Server-side TCP connections on ``port`` (from /proc/net, so no extra dependency)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    n += 1
    return n


def _closed_by_server(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes; fails if it has not closed within ``timeout``."""
    sock.settimeout(timeout)
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk
    raise AssertionError("the server kept the connection open")


def _accepted(port: int) -> socket.socket:
    """A gRPC connection the server has taken (it has sent its SETTINGS), with the preface."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(PREFACE + SETTINGS)
    assert sock.recv(9)[3] == 4
    return sock


def _goaway(data: bytes) -> tuple[int, bytes] | None:
    """The (error code, debug text) of the first GOAWAY frame in ``data``, if any."""
    pos = 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        if data[pos + 3] == 7:
            body = data[pos + 9:pos + 9 + length]
            return int.from_bytes(body[4:8], "big"), body[8:]
        pos += 9 + length
    return None


def _frontend(server) -> int:
    (pid,) = frontend_pids(server)
    return pid


def _identity_request(n: int) -> bytes:
    req = pb.ModelInferRequest(model_name="identity_fp32")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, n])
    req.raw_input_contents.append(np.ones(n, np.float32).tobytes())
    return req.SerializeToString()


def _identity(client) -> None:
    values = np.arange(8, dtype=np.float32).reshape(1, -1)
    x = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
    x.set_data_from_numpy(values)
    np.testing.assert_array_equal(client.infer("identity_fp32", [x]).as_numpy("OUTPUT0"), values)


@pytest.fixture(scope="module")
def timed(example_repo):
    """A server whose request and idle timeouts are 1 s."""
    s = Server(example_repo, *TIMEOUTS)
    yield s
    assert s.stop() == 0


# ---- time ----------------------------------------------------------------------------------------
def test_a_connection_that_sends_no_preface_is_closed(timed):
    """5,000 silent connections once stayed open for good: now each is closed once the
    handshake time (here the 1 s request timeout) has passed, as is one that stops halfway
    through the preface, while other clients are served."""
    silent = [socket.create_connection(("127.0.0.1", timed.grpc_port), timeout=30)
              for _ in range(20)]
    half = socket.create_connection(("127.0.0.1", timed.grpc_port), timeout=30)
    half.sendall(PREFACE[:10])
    with grpcclient.InferenceServerClient(timed.grpc_url) as c:
        _identity(c)
    for s in [*silent, half]:
        got = _closed_by_server(s, 20)
        assert _goaway(got) is not None and b"no HTTP/2 preface within 1 s" in got
        s.close()


@pytest.mark.parametrize("what", ["frame", "header block"])
def test_a_frame_begun_and_not_finished_is_cut_off(timed, what):
    """A frame (here a DATA frame that announces 16 KiB and brings 10 bytes) or a header block
    (HEADERS without END_HEADERS, no CONTINUATION) left unfinished held its memory for good."""
    c = Client(timed.grpc_port)
    if what == "frame":
        c.conn.send_headers(1, _headers())
        c.sock.sendall(c.conn.data_to_send())
        c.sock.sendall(b"\x00\x40\x00\x00\x00\x00\x00\x00\x01" + b"x" * 10)
    else:
        block = c.conn.encoder.encode(_headers())
        c.sock.sendall(len(block).to_bytes(3, "big") + b"\x01\x00\x00\x00\x00\x01" + block)
    got = _closed_by_server(c.sock, 20)
    assert b"did not arrive whole within 1 s (--http-request-timeout-secs)" in got
    c.close()


def test_a_message_begun_and_not_finished_fails_its_call(timed):
    """Half a request message, then nothing: the call fails (the connection stays)."""
    c = Client(timed.grpc_port)
    c.conn.send_headers(1, _headers())
    c.conn.send_data(1, b"\x00\x00\x00\x10\x00" + b"\x0a" * 100)     # 100 bytes of 4096
    c.sock.sendall(c.conn.data_to_send())
    c.read_until(lambda: c.of(h2.events.StreamEnded), 20)
    (trailers,) = [dict(e.headers) for e in c.of(h2.events.ResponseReceived)]
    assert trailers[b"grpc-status"] == b"4", trailers           # DEADLINE_EXCEEDED
    assert b"did not arrive whole within 1 s" in trailers[b"grpc-message"]
    c.close()


def test_an_idle_connection_gets_goaway_and_tritonclient_reconnects(timed):
    """No call for the idle time: GOAWAY (NO_ERROR) and the connection closes. A tritonclient
    whose connection was closed so serves its next call on a new one, without an error."""
    c = Client(timed.grpc_port)
    c.read_until(lambda: c.of(h2.events.ConnectionTerminated), 20)
    (goaway,) = c.of(h2.events.ConnectionTerminated)
    assert goaway.error_code == 0 and b"idle for 1 s" in goaway.additional_data
    c.read_until(lambda: False, 20)                 # then the server closes
    c.close()
    with grpcclient.InferenceServerClient(timed.grpc_url) as client:
        _identity(client)
        wait_for(lambda: _established(timed.grpc_port) == 0, 30,
                 "the idle connection to be closed by the server")
        _identity(client)
        assert client.is_server_live()


# ---- back-pressure -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sized(tmp_path_factory, example_repo):
    repo = str(tmp_path_factory.mktemp("sized"))
    write_sized(repo)
    s = Server([example_repo, repo], "--http-idle-timeout-secs", "3")
    yield s
    assert s.stop() == 0


def _sized_request(n: int) -> bytes:
    req = pb.ModelInferRequest(model_name="sized")
    req.inputs.add(name="SIZE", datatype="INT32", shape=[1])
    req.raw_input_contents.append(np.array([n], np.int32).tobytes())
    return req.SerializeToString()


def test_a_client_that_reads_nothing_is_not_read_from_then_dropped(sized):
    """A client with wide-open windows asks for a 64 MiB answer and reads none of it: the
    server once buffered all of it and went on reading whatever the client sent. Now, with
    1 MiB waiting for the client, the client is not read from (what it sends stays in the
    kernel, the sender blocks), and once nothing has been taken for the idle time (3 s here)
    the connection is dropped."""
    c = Client(sized.grpc_port, window=(1 << 31) - 1)
    c.read_until(lambda: c.of(h2.events.RemoteSettingsChanged), 30)
    body = _sized_request(64 << 20)
    c.conn.send_headers(1, _headers())
    c.conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    c.sock.sendall(c.conn.data_to_send())
    c.read_until(lambda: c.of(h2.events.DataReceived), 60)     # the answer is under way
    # frames of an unknown type, which the server reads and drops (RFC 9113 §5.5)
    junk = (b"\x00\x40\x00\xfa\x00\x00\x00\x00\x00" + bytes(1 << 14)) * 64     # 1 MiB
    c.sock.settimeout(5)
    sent = 0
    with pytest.raises((TimeoutError, ConnectionError)):
        while sent < 256 << 20:
            c.sock.sendall(junk)
            sent += len(junk)
    assert sent < 128 << 20, f"the server read {sent >> 20} MiB from a client that reads nothing"
    wait_for(lambda: _established(sized.grpc_port) == 0, 30,
             "the server to drop a client that took nothing for the idle time")
    c.close()
    with grpcclient.InferenceServerClient(sized.grpc_url) as client:
        assert client.is_server_live()


# ---- lingering close -----------------------------------------------------------------------------
def test_goaway_reaches_a_client_that_is_still_sending(timed):
    """A connection error (here a PUSH_PROMISE from the client) while the client is still
    sending: the server once closed at once, the kernel answered the unread bytes with a
    reset, and the client lost the GOAWAY. Now it stops writing, reads and drops what still
    comes for a while, then closes: the client reads the GOAWAY and an orderly end."""
    s = socket.create_connection(("127.0.0.1", timed.grpc_port), timeout=30)
    junk = (b"\x00\x40\x00\xfa\x00\x00\x00\x00\x00" + bytes(1 << 14)) * 16     # 256 KiB
    s.sendall(PREFACE + SETTINGS + b"\x00\x00\x04\x05\x04\x00\x00\x00\x01" + bytes(4))
    for _ in range(8):
        s.sendall(junk)
    got = _closed_by_server(s, 20)
    code = _goaway(got)
    assert code is not None and code[0] == 1, got[-200:]       # PROTOCOL_ERROR
    s.close()


# ---- request bytes held in part ------------------------------------------------------------------
def _send_parts(c: Client, streams: list[int], message: int, part: int) -> int:
    """Sends ``part`` bytes of a ``message``-byte ModelInfer message on each of ``streams``,
    round robin, as the server's windows allow; returns what the server let through."""
    prefix = b"\x00" + message.to_bytes(4, "big")
    sent = {sid: 0 for sid in streams}
    for sid in streams:
        c.conn.send_headers(sid, _headers())
        c.conn.send_data(sid, prefix)
    c.sock.sendall(c.conn.data_to_send())
    chunk = bytes(c.conn.max_outbound_frame_size)
    while True:
        moved = False
        for sid in streams:
            stream = c.conn.streams.get(sid)
            if stream is None or stream.closed:
                continue                # ended by the server
            n = min(len(chunk), part - sent[sid], c.conn.local_flow_control_window(sid))
            if n > 0:
                c.conn.send_data(sid, chunk[:n])
                sent[sid] += n
                moved = True
        c.sock.sendall(c.conn.data_to_send())
        if all(v >= part for v in sent.values()):
            break
        # as a client does, it hears of streams the server ended before it sends more on them
        if not c.read(0.0 if moved else 1) and not moved:
            break                       # no window came back: the server holds the client
    return sum(sent.values())


def test_a_connection_cannot_hold_many_messages_in_part(example_repo):
    """Thirty calls each send 12 MiB of a 13 MiB message and stop: the server once gave the
    window back for every byte (one connection made it hold 777 MiB). Past its 64 MiB share
    a connection's window now comes back for its oldest message only, so the client is held
    near the share plus a window; the server's memory stays bounded, and it serves on."""
    s = Server(example_repo, "--grpc-max-message-size", str(16 << 20))
    try:
        pid = _frontend(s)
        before = peak_rss_reset(pid)
        c = Client(s.grpc_port)
        c.read_until(lambda: c.of(h2.events.RemoteSettingsChanged), 30)
        sent = _send_parts(c, list(range(1, 61, 2)), 13 << 20, 12 << 20)
        assert sent < 200 << 20, f"the server took {sent >> 20} MiB of messages in part"
        grown = peak_rss(pid) - before
        assert grown < 400 << 20, f"the frontend's peak RSS grew by {grown >> 20} MiB"
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            _identity(client)
        c.close()
    finally:
        assert s.stop() == 0


def test_the_process_refuses_what_it_cannot_hold(example_repo):
    """Three such connections hold more than the process's 256 MiB for messages in part: the
    calls that would hold more fail with RESOURCE_EXHAUSTED, and while it holds that much a
    new call is refused (REFUSED_STREAM, which a client may retry). Once they are gone, the
    server serves as before."""
    s = Server(example_repo, "--grpc-max-message-size", str(16 << 20))
    try:
        clients = []
        for _ in range(3):
            c = Client(s.grpc_port)
            c.read_until(lambda: c.of(h2.events.RemoteSettingsChanged), 30)
            _send_parts(c, list(range(1, 61, 2)), 13 << 20, 12 << 20)
            clients.append(c)
        for c in clients:
            while c.read(0.2) and not c.closed:
                pass
        failed = [dict(e.headers) for c in clients for e in c.of(h2.events.TrailersReceived)]
        failed += [dict(e.headers) for c in clients for e in c.of(h2.events.ResponseReceived)
                   if (b"grpc-status", b"8") in e.headers]
        assert failed and all(h[b"grpc-status"] == b"8" for h in failed), failed[:3]
        assert b"gRPC requests not yet read whole" in failed[0][b"grpc-message"]
        late = Client(s.grpc_port)
        late.conn.send_headers(1, _headers())
        body = _identity_request(4)
        late.conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
        late.sock.sendall(late.conn.data_to_send())
        late.read_until(lambda: late.of(h2.events.StreamReset), 30)
        assert late.of(h2.events.StreamReset)[0].error_code == 7        # REFUSED_STREAM
        for c in [*clients, late]:
            c.close()
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            wait_for(lambda: client.is_server_live(), 30, "the server to serve again")
            _identity(client)
    finally:
        assert s.stop() == 0


# ---- compressed messages -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bomb() -> bytes:
    """256 MiB of zeros as gzip (~250 KB)."""
    z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zero = bytes(1 << 20)
    return b"".join(z.compress(zero) for _ in range(256)) + z.flush()


def _compressed_call(port: int, payload: bytes) -> dict:
    c = Client(port)
    c.conn.send_headers(1, _headers(**{"grpc-encoding": "gzip"}))
    message = b"\x01" + len(payload).to_bytes(4, "big") + payload
    pos = 0
    while pos < len(message):
        n = min(len(message) - pos, c.conn.local_flow_control_window(1),
                c.conn.max_outbound_frame_size)
        if n:
            c.conn.send_data(1, message[pos:pos + n], end_stream=pos + n == len(message))
            pos += n
            c.sock.sendall(c.conn.data_to_send())
        else:
            c.read(10)
    c.read_until(lambda: c.of(h2.events.StreamEnded), 60)
    c.close()
    blocks = [e.headers for e in c.events
              if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived))]
    return {k.decode(): v.decode() for k, v in blocks[-1]}


@pytest.mark.parametrize("kind", ["loop", "aio"])
def test_compressed_messages_are_held_to_the_limit_as_grpc_holds_them(example_repo, bomb, kind):
    """A 250 KB gzip message that inflates to 256 MiB, with --grpc-max-message-size 4 MiB:
    the loop server once inflated all of it on the event loop before the size check. Now it
    stops at the limit, off the loop, and answers as grpcio does (the aio server, compared
    here): RESOURCE_EXHAUSTED for too large, INTERNAL for corrupt data, never UNKNOWN."""
    s = Server(example_repo, "--grpc-max-message-size", str(4 << 20), "--grpc-server", kind)
    try:
        pid = _frontend(s)
        before = peak_rss_reset(pid)
        trailers = _compressed_call(s.grpc_port, bomb)
        assert trailers["grpc-status"] == "8", trailers
        assert trailers["grpc-message"] == "Decompressed message larger than max"
        grown = peak_rss(pid) - before
        assert grown < 128 << 20, f"the frontend's peak RSS grew by {grown >> 20} MiB"
        for corrupt, why in ((b"\x1f\x8b\x08garbage", "zlib"),
                             (gzip.compress(bytes(5000))[:-30], "data")):      # cut short
            trailers = _compressed_call(s.grpc_port, corrupt)
            assert trailers["grpc-status"] == "13", trailers
            assert trailers["grpc-message"] == f"Decompression failed due to {why} error"
        good = gzip.compress(_identity_request(8))
        assert _compressed_call(s.grpc_port, good)["grpc-status"] == "0"
    finally:
        assert s.stop() == 0


# ---- one budget of connections -------------------------------------------------------------------
NOFILE = 400        # open-file limit: 200 kept in reserve, 200 connections on all ports


def test_the_ports_share_one_budget_of_connections(example_repo):
    """21,000 gRPC connections once took all 20,000 descriptors and both ports were down until
    they closed. The frontend's connections on all ports now count against one budget, its
    open-file limit less a reserve (200 of 400 here): past it an HTTP connection gets 503 and
    a gRPC one GOAWAY saying why, the process keeps its descriptors, and once connections
    close both ports serve again."""
    s = Server(example_repo, prefix=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"))
    held = []
    try:
        for _ in range(200):
            held.append(_accepted(s.grpc_port))
        # beyond the budget: each is refused, however many come
        for _ in range(3):
            r = requests.get(f"{s.base}/v2/health/live", timeout=30)
            assert r.status_code == 503 and "too many connections (200" in r.text
        refused = []
        for _ in range(250):
            sock = socket.create_connection(("127.0.0.1", s.grpc_port), timeout=30)
            sock.sendall(PREFACE + SETTINGS)
            refused.append(sock)
        for sock in refused[:3]:
            got = _closed_by_server(sock, 20)
            code = _goaway(got)
            assert code is not None and code[0] == 11 and b"too many connections" in code[1]
        for sock in refused:
            sock.close()
        for sock in held[:20]:
            sock.close()
        wait_for(lambda: requests.get(f"{s.base}/v2/health/live", timeout=30).status_code == 200,
                 30, "HTTP to serve again")
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            _identity(client)
        fds = len(os.listdir(f"/proc/{_frontend(s)}/fd"))
        assert fds < NOFILE - 100, fds
        assert "at most 200 on all ports together" in s.log_text()
    finally:
        for sock in held:
            sock.close()
        assert s.stop() == 0


def test_a_refused_grpc_client_sees_unavailable(example_repo):
    """A gRPC client past the budget: its call fails UNAVAILABLE at once, with the server's
    reason (a GOAWAY alone would have it reconnect and retry until its deadline)."""
    s = Server(example_repo, prefix=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"))
    held = []
    try:
        for _ in range(200):
            held.append(_accepted(s.grpc_port))
        with grpc.insecure_channel(s.grpc_url) as ch:
            live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                  request_serializer=pb.ServerLiveRequest.SerializeToString,
                                  response_deserializer=pb.ServerLiveResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                live(pb.ServerLiveRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "too many connections (200" in e.value.details()
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            with pytest.raises(InferenceServerException) as refused:
                client.is_server_live()
            assert "too many connections" in refused.value.message()
    finally:
        for sock in held:
            sock.close()
        assert s.stop() == 0


def test_each_frontend_has_a_budget_of_its_own(example_repo):
    """With --frontends 2 each frontend process has its open-file limit and its budget (200
    here): 300 gRPC connections, spread over both by the kernel (SO_REUSEPORT), all have their
    calls answered, where one budget for the server, or one shared out, would refuse a hundred
    or more (UNAVAILABLE)."""
    s = Server(example_repo, "--frontends", "2",
               prefix=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"))
    clients = []
    try:
        wait_for(lambda: s.log_text().count("at most 200 on all ports together") == 2, 30,
                 "both frontends to start")
        clients = [Client(s.grpc_port) for _ in range(300)]
        for c in clients:
            c.conn.send_headers(1, _headers("/inference.GRPCInferenceService/ServerLive"))
            c.conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
            c.sock.sendall(c.conn.data_to_send())
        statuses = []
        for c in clients:
            c.read_until(lambda: c.of(h2.events.StreamEnded), 30)
            blocks = [dict(e.headers) for e in c.events
                      if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived))]
            statuses.append(blocks[-1][b"grpc-status"])
        assert statuses.count(b"0") == 300, statuses.count(b"14")
    finally:
        for c in clients:
            c.close()
        assert s.stop() == 0


def test_tls_handshakes_are_counted_and_timed(example_repo, tmp_path):
    """--grpc-use-ssl: a connection that never starts its TLS handshake once held a descriptor
    for asyncio's 60 s, uncounted. It now counts against the budget from its accept (200
    silent ones: HTTP gets 503) and is closed once the handshake time has passed (here the
    5 s request timeout); then HTTP and TLS clients are served again."""
    from certs import make_certs
    certs = make_certs(str(tmp_path))
    s = Server(example_repo, "--grpc-use-ssl", "true", "--grpc-server-cert", certs.server_cert,
               "--grpc-server-key", certs.server_key, "--http-request-timeout-secs", "5",
               prefix=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"))
    silent = []
    try:
        silent = [socket.create_connection(("127.0.0.1", s.grpc_port), timeout=30)
                  for _ in range(200)]
        # an HTTP request the frontend accepts before the last silent connection takes that
        # one's place (which is then refused): ask only once the frontend holds all 200
        pid = _frontend(s)
        wait_for(lambda: connections([pid], s.grpc_port)[pid] == 200, 30,
                 "the frontend to accept the silent ones")
        r = requests.get(f"{s.base}/v2/health/live", timeout=30)
        assert r.status_code == 503 and "too many connections (200" in r.text
        for sock in silent[:5]:
            try:
                _closed_by_server(sock, 20)
            except ConnectionResetError:
                pass                        # closed with a reset: as good
        wait_for(lambda: requests.get(f"{s.base}/v2/health/live", timeout=30).status_code == 200,
                 30, "HTTP to serve again")
        with grpcclient.InferenceServerClient(s.grpc_url, ssl=True,
                                              root_certificates=certs.ca) as client:
            assert client.is_server_live()
    finally:
        for sock in silent:
            sock.close()
        assert s.stop() == 0
