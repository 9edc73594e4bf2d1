"""What one HTTP client may hold: header bytes and fields, time to send a request, idle time,
connections. Raw sockets, since a well-behaved client never hits these (issue 13)."""
import socket
import subprocess
import sys
import time

import pytest
import requests
from serverproc import Server, wait_for

LIMITS = ("--http-max-header-size", "4096", "--http-request-timeout-secs", "1",
          "--http-idle-timeout-secs", "2", "--http-max-connections", "8")


@pytest.fixture(scope="module")
def server(example_repo):
    s = Server(example_repo, *LIMITS)
    yield s
    assert s.stop() == 0


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _serves(server) -> None:
    assert requests.get(f"{server.base}/v2/health/ready", timeout=30).status_code == 200


def test_header_bytes_past_the_limit_are_a_431(server):
    s = _connect(server)
    s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
    answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--http-max-header-size" in answer
    s.close()
    s = _connect(server)
    s.sendall(b"GET /v2/" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n")     # a 5 KB URL
    assert _read_all(s).startswith(b"HTTP/1.1 431 ")
    s.close()
    _serves(server)


def test_too_many_header_fields_are_a_431(server):
    s = _connect(server)
    s.sendall(b"GET /v2 HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n")
    answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"more than 256 header fields" in answer
    s.close()


def test_a_slow_client_cannot_hold_a_connection(server):
    """Half a request, then silence: 408 once the request timeout passes, while everyone else
    is served."""
    s = _connect(server)
    s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    _serves(server)
    answer = _read_all(s)              # the server closes it; recv's timeout is the deadline
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--http-request-timeout-secs" in answer
    s.close()


def test_an_idle_connection_is_closed(server):
    s = _connect(server)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    t = time.monotonic()
    assert s.recv(65536) == b""         # closed by the server, not by us
    assert time.monotonic() - t < 30
    s.close()


def test_connections_past_the_limit_are_refused_then_served_again(server):
    held = [_connect(server) for _ in range(9)]      # one more than --http-max-connections
    try:
        refused = []
        for s in held:
            s.settimeout(0.1)          # all nine read well within the 2 s idle timeout
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue                # accepted, waiting for a request
            refused.append(data)
        assert len(refused) == 1, refused
        assert refused[0].startswith(b"HTTP/1.1 503 ") and b"--http-max-connections" in refused[0]
    finally:
        for s in held:
            s.close()
    wait_for(lambda: requests.get(f"{server.base}/v2/health/live", timeout=30).status_code == 200,
             30, "new connections to be served once the others closed")


def test_expect_100_continue_is_answered_at_once(server):
    """curl sends it for bodies over 1 KiB and waited a second for an answer that never came."""
    s = _connect(server)
    body = b'{"ready": true}'
    s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nExpect: 100-continue\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    s.settimeout(10)                    # without the answer, this recv times out
    assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.settimeout(30)
    s.sendall(body)
    assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    s.close()


def _answer_while_sending(s: socket.socket, piece: bytes, most: int) -> tuple[bytes, int]:
    """Send ``piece`` over and over (never ending the line it is part of) until the server
    answers or ``most`` bytes went out; returns the answer's start and the bytes sent."""
    sent = 0
    s.setblocking(False)
    try:
        while sent < most:
            try:
                answer = s.recv(65536)
            except BlockingIOError:
                answer = None
            if answer is not None:
                return answer, sent
            try:
                sent += s.send(piece)
            except BlockingIOError:
                # the server is not reading: wait for its answer (or a reset) a little
                socket.socket.settimeout(s, 5)
                try:
                    return s.recv(65536), sent
                finally:
                    s.setblocking(False)
    finally:
        s.setblocking(True)
        s.settimeout(30)
    return b"", sent


def test_a_header_line_that_never_ends_is_a_431_without_waiting_for_it(server):
    """A header line is handed to us by httptools only once it ends: a 48 MB line was joined
    piece by piece (1.5-2.7 s of the loop, every client waiting) and refused only at its end."""
    s = _connect(server)
    s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: ")
    answer, sent = _answer_while_sending(s, b"a" * 16384, 32 << 20)
    assert answer.startswith(b"HTTP/1.1 431 "), (answer[:80], sent)
    # refused while the line went on: the client stopped with what the socket buffers on both
    # sides hold (a few MB, more when the server is slow to be scheduled), not at 32 MB
    assert sent < 32 << 20, f"{sent} bytes sent before the answer"
    s.close()
    _serves(server)


def test_an_error_reaches_a_client_that_is_still_sending(server):
    """The answer to a refused request is read by a client still sending its body: the socket
    is not closed under it (which resets the connection and loses the answer) but lingers,
    dropping what arrives, then closes."""
    s = _connect(server)
    # a 5 KB header: refused at once, while the client goes on with 2 MiB of body
    s.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000
              + b"\r\nContent-Length: 2097152\r\n\r\n")
    for _ in range(32):
        s.sendall(b"\0" * 65536)
    answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--http-max-header-size" in answer
    s.close()
    _serves(server)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_max_input_size_that_is_not_positive_stops_the_start(value):
    # Triton's words: its L0_http test greps the server log for them
    p = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", "/tmp",
                        f"--http-max-input-size={value}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Error: --http-max-input-size must be greater than 0." in p.stderr


def _chunked(server, chunks: int) -> bytes:
    """A raw-binary request to ``simple`` whose body is ``chunks`` chunks of one byte."""
    s = _connect(server)
    s.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
              b"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"
              b"Connection: close\r\n\r\n")
    try:
        s.sendall(b"1\r\nA\r\n" * chunks + b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                # refused while sending: the answer is still there to read
    try:
        return _read_all(s)
    except ConnectionResetError:
        return b""
    finally:
        s.close()


def test_a_body_of_too_many_chunks_is_refused_with_triton_s_words(server):
    """Each chunk costs a callback and an object: Triton's bound (65,536 non-empty chunks)."""
    words = (b"Chunked request body exceeds maximum of 65536 non-empty chunks. Send fewer or "
             b"larger HTTP chunks.")
    at_most = _chunked(server, 65536)         # read whole: refused by what it says instead
    assert at_most.startswith(b"HTTP/1.1 400 ") and words not in at_most
    assert b"Raw request must only have 1 input" in at_most
    for chunks in (65537, 400_000):
        answer = _chunked(server, chunks)
        assert answer.startswith(b"HTTP/1.1 400 ") and words in answer, answer[:300]
    _serves(server)


def test_a_chunked_body_is_held_to_the_input_size_as_it_arrives(example_repo):
    """A chunked body's length is known only as it comes: each piece counts (a Content-Length
    was checked before its body, which is not counted again piece by piece)."""
    s = Server(example_repo, "--http-max-input-size", "65536")
    try:
        sock = _connect(s)
        sock.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        try:
            for _ in range(40):         # 160 KiB in all, past the limit after 16 pieces
                sock.sendall(b"1000\r\n" + b"x" * 4096 + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = _read_all(sock)
        except ConnectionResetError:
            answer = b""
        sock.close()
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
        assert b"exceeds the maximum allowed input size of 65536 bytes" in answer
        # a Content-Length past it: refused from its head, before any of the body
        big = requests.post(f"{s.base}/v2/repository/index", data=b"x" * 70000, timeout=30)
        assert big.status_code == 413 and "request JSON size of 70000 bytes" in big.text
        # within it, both ways: answered (an empty index request)
        assert requests.post(f"{s.base}/v2/repository/index", data=b"{}",
                             timeout=30).status_code == 200
        assert requests.post(f"{s.base}/v2/repository/index", data=iter([b"{", b"}"]),
                             timeout=30).status_code == 200
    finally:
        assert s.stop() == 0
