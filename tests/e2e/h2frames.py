"""A raw HTTP/2 client for conformance and flood tests of the gRPC port: frames written by hand
(so that they can be wrong), HPACK by the ``hpack`` library, the server's frames read with
``hyperframe``. Independent of the server's own HTTP/2 code."""
from __future__ import annotations

import socket
import struct
import time

import hpack
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe import frame as hf
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, RstStreamFrame

# the protocol's vocabulary, from the h2 library (independent of the server's own)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = (c.type for c in (hf.DataFrame, hf.HeadersFrame, hf.PriorityFrame,
                                     hf.RstStreamFrame, hf.SettingsFrame, hf.PushPromiseFrame,
                                     hf.PingFrame, hf.GoAwayFrame, hf.WindowUpdateFrame,
                                     hf.ContinuationFrame))
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20   # flag bits
E = ErrorCodes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, \
    ENHANCE_YOUR_CALM = (int(c) for c in (
        E.NO_ERROR, E.PROTOCOL_ERROR, E.INTERNAL_ERROR, E.FLOW_CONTROL_ERROR, E.SETTINGS_TIMEOUT,
        E.STREAM_CLOSED, E.FRAME_SIZE_ERROR, E.REFUSED_STREAM, E.CANCEL, E.COMPRESSION_ERROR,
        E.CONNECT_ERROR, E.ENHANCE_YOUR_CALM))
S = SettingCodes
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = (int(c) for c in (
        S.HEADER_TABLE_SIZE, S.ENABLE_PUSH, S.MAX_CONCURRENT_STREAMS, S.INITIAL_WINDOW_SIZE,
        S.MAX_FRAME_SIZE, S.MAX_HEADER_LIST_SIZE))
# the identity model the HTTP/2 suites call
IDENTITY_CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
'''
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"
LIVE_BODY = b"\x00\x00\x00\x00\x00"         # an empty ServerLiveRequest, gRPC-framed
LIVE_ANSWER = b"\x00\x00\x00\x00\x02\x08\x01"    # live: true


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + \
        struct.pack(">I", sid) + payload


def settings(*pairs: tuple[int, int], ack: bool = False) -> bytes:
    return frame(SETTINGS, ACK if ack else 0, 0, b"".join(struct.pack(">HI", k, v)
                                                          for k, v in pairs))


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", increment))


def rst(sid: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, sid, struct.pack(">I", code))


def ping(payload: bytes = b"conform!", flags: int = 0) -> bytes:
    return frame(PING, flags, 0, payload)


def request(path: str = LIVE, **extra: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", "localhost"), ("content-type", "application/grpc"),
            ("te", "trailers"), *extra.items()]


class Closed(Exception):
    pass


class Conn:
    """One connection: the preface and SETTINGS exchanged unless ``handshake`` is false."""

    def __init__(self, port: int, *client_settings: tuple[int, int], handshake: bool = True,
                 timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.encoder = hpack.Encoder()
        self.buf = b""
        self.frames: list = []          # every frame read
        self.closed = False
        if handshake:
            self.send(PREFACE + settings(*client_settings))
            got = self.until(lambda f: f.type == SETTINGS and "ACK" not in f.flags)
            assert got is not None, "no SETTINGS from the server"
            self.server_settings = dict(got.settings)
            self.send(settings(ack=True))

    def close(self) -> None:
        self.sock.close()

    def send(self, *data: bytes) -> None:
        self.sock.sendall(b"".join(data))

    def block(self, headers) -> bytes:
        return self.encoder.encode(headers)

    def headers(self, sid: int, headers, flags: int = END_HEADERS) -> bytes:
        return frame(HEADERS, flags, sid, self.block(headers))

    def call(self, sid: int, path: str = LIVE, body: bytes = LIVE_BODY) -> bytes:
        """HEADERS and one DATA frame ending the stream: a unary gRPC call."""
        return self.headers(sid, request(path)) + frame(DATA, END_STREAM, sid, body)

    def _read(self, deadline: float):
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                raise Closed
            self.buf += data
        f, length = Frame.parse_frame_header(memoryview(self.buf[:9]))
        f.parse_body(memoryview(self.buf[9:9 + length]))
        self.buf = self.buf[9 + length:]
        self.frames.append(f)
        return f

    def until(self, match, timeout: float | None = None):
        """The first frame read that ``match``es; None if the connection closes first."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                f = self._read(deadline)
            except Closed:
                return None
            if match(f):
                return f

    def goaway(self, code: int) -> None:
        """A connection error: GOAWAY with ``code``, then the server closes the connection."""
        f = self.until(lambda f: isinstance(f, GoAwayFrame))
        assert f is not None, f"closed without GOAWAY; frames: {self.frames}"
        assert f.error_code == code, f"GOAWAY {f.error_code} ({f.additional_data!r}), not {code}"
        assert self.until(lambda f: False) is None          # closed
        assert self.closed

    def stream_error(self, sid: int, code: int) -> None:
        """RST_STREAM with ``code`` on ``sid``, and the connection goes on (a PING answered)."""
        f = self.until(lambda f: isinstance(f, (RstStreamFrame, GoAwayFrame)) and
                       (isinstance(f, GoAwayFrame) or f.stream_id == sid))
        assert isinstance(f, RstStreamFrame), f"no RST_STREAM on {sid}: {self.frames}"
        assert f.error_code == code, f"RST_STREAM {f.error_code}, not {code}"
        self.alive()

    def alive(self) -> None:
        payload = b"alive?" + struct.pack(">H", len(self.frames) & 0xFFFF)
        self.send(ping(payload))
        f = self.until(lambda f: isinstance(f, (PingFrame, GoAwayFrame)) and
                       (isinstance(f, GoAwayFrame) or ("ACK" in f.flags and f.opaque_data == payload)))
        assert isinstance(f, PingFrame), f"the connection ended: {self.frames}"

    def answer(self, sid: int) -> dict:
        """The answer on ``sid`` once it ended: its header blocks, decoded, and DATA bytes."""
        while not any(f.stream_id == sid and "END_STREAM" in f.flags for f in self.frames):
            f = self.until(lambda f: f.stream_id == sid or isinstance(f, GoAwayFrame))
            assert f is not None and not isinstance(f, GoAwayFrame), f"no answer: {self.frames}"
        mine = [f for f in self.frames if f.stream_id == sid]
        decoder = hpack.Decoder()       # the server's blocks use no dynamic table
        return {"headers": [dict(decoder.decode(f.data)) for f in mine if f.type == HEADERS],
                "data": b"".join(f.data for f in mine if f.type == DATA)}
