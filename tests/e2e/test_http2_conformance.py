"""HTTP/2 conformance of the gRPC port, frame by frame against the real server: h2spec's cases
(h2spec itself cannot be installed here) for RFC 9113 §3.4, 4.1-4.3, 5.1-5.5, 6.1-6.10, 8.1-8.4
and HPACK (RFC 7541) §2.3.3, 4.2, 5.2, 6.1, 6.3. Each case opens its own connection; a
connection error must be GOAWAY with the RFC's code and then the close, a stream error
RST_STREAM with its code and the connection still answering.

Where the RFC leaves a choice the server takes the stricter one, as Go's x/net does: HEADERS
on a closed stream is a connection error PROTOCOL_ERROR (closed streams are not remembered, so
a reused id and a stream closed earlier look the same); DATA on a closed stream is a stream
error STREAM_CLOSED; a frame larger than SETTINGS_MAX_FRAME_SIZE is a connection error."""
import struct

import pytest
from h2frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    IDENTITY_CONFIG,
    INFER,
    INITIAL_WINDOW_SIZE,
    LIVE,
    LIVE_ANSWER,
    LIVE_BODY,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    STREAM_CLOSED,
    Conn,
    frame,
    ping,
    request,
    rst,
    settings,
    window_update,
)
from hyperframe.frame import DataFrame, PingFrame, SettingsFrame
from repo_builder import IDENTITY, write_model
from serverproc import Server

SLOW = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                for r in requests]
'''
MODEL = IDENTITY_CONFIG


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("h2conf"))
    write_model(repo, "identity", MODEL, IDENTITY)
    write_model(repo, "slow", MODEL, SLOW)
    srv = Server([repo])
    yield srv.grpc_port
    assert srv.stop() == 0


def _slow_call(c: Conn, sid: int) -> bytes:
    """A ModelInfer call ending its stream at once and answered 0.3 s later: its stream stays
    half-closed (remote) meanwhile."""
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name="slow")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    req.raw_input_contents.append(b"\x00" * 4)
    body = req.SerializeToString()
    return c.headers(sid, request(INFER)) + \
        frame(DATA, END_STREAM, sid, b"\x00" + len(body).to_bytes(4, "big") + body)


def _open(c: Conn, sid: int) -> bytes:
    """HEADERS of a call whose request has not come yet: the stream stays open."""
    return c.headers(sid, request(INFER))


def _literal(name: bytes, value: bytes) -> bytes:
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


# ---- a case: (id, what it sends given a connection, what must follow) ----------------------------
def goaway(code):
    return lambda c: c.goaway(code)


def stream_error(sid, code):
    return lambda c: c.stream_error(sid, code)


def alive(c: Conn) -> None:
    c.alive()


def live_answered(sid):
    def check(c: Conn) -> None:
        got = c.answer(sid)
        assert got["data"] == LIVE_ANSWER and got["headers"][-1]["grpc-status"] == "0", got
    return check


CASES = [
    # §3.4: the connection preface
    ("3.4/1 preface and SETTINGS", lambda c: b"", alive),
    ("3.4/2 a preface not followed by SETTINGS", None, None),
    ("3.4/3 an invalid preface", None, None),
    # §4.1: frame format
    ("4.1/1 an unknown frame type is ignored", lambda c: frame(0x16, 0, 0, b"x" * 8), alive),
    ("4.1/2 undefined flags are ignored", lambda c: ping(b"flags!!!", 0x16 & ~ACK), alive),
    ("4.1/3 the reserved bit is ignored", lambda c: frame(PING, 0, 1 << 31, b"reserved"), alive),
    # §4.2: frame size
    ("4.2/1 DATA of 16,384 octets", lambda c: _open(c, 1) + frame(DATA, END_STREAM, 1, b"\x00" * 16384),
     lambda c: c.answer(1)),
    ("4.2/2 DATA past SETTINGS_MAX_FRAME_SIZE", lambda c: _open(c, 1) + frame(DATA, 0, 1, b"\x00" * 16385),
     goaway(FRAME_SIZE_ERROR)),
    ("4.2/3 HEADERS past SETTINGS_MAX_FRAME_SIZE", lambda c: frame(HEADERS, END_HEADERS, 1, b"\x82" * 16385),
     goaway(FRAME_SIZE_ERROR)),
    ("4.2/4 a frame header announcing 1 MiB", lambda c: b"\x10\x00\x00\x00\x00\x00\x00\x00\x01",
     goaway(FRAME_SIZE_ERROR)),
    # §4.3: field section compression
    ("4.3/1 an undecodable header block", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x80"),
     goaway(COMPRESSION_ERROR)),
    ("4.3/2 PRIORITY inside a header block", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"), goaway(PROTOCOL_ERROR)),
    ("4.3/3 HEADERS of another stream inside a header block", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + c.headers(3, request()), goaway(PROTOCOL_ERROR)),
    # §5.1: stream states
    ("5.1/1 idle: DATA", lambda c: frame(DATA, END_STREAM, 1, b"x"), goaway(PROTOCOL_ERROR)),
    ("5.1/2 idle: RST_STREAM", lambda c: rst(1), goaway(PROTOCOL_ERROR)),
    ("5.1/3 idle: WINDOW_UPDATE", lambda c: window_update(1, 100), goaway(PROTOCOL_ERROR)),
    ("5.1/4 idle: CONTINUATION", lambda c: frame(CONTINUATION, END_HEADERS, 1, c.block(request())),
     goaway(PROTOCOL_ERROR)),
    ("5.1/5 half-closed (remote): DATA", lambda c: _slow_call(c, 1) + frame(DATA, END_STREAM, 1, b"x"),
     stream_error(1, STREAM_CLOSED)),
    ("5.1/6 half-closed (remote): HEADERS", lambda c: _slow_call(c, 1) + c.headers(1, [("x-t", "1")], END_HEADERS | END_STREAM),
     stream_error(1, STREAM_CLOSED)),
    ("5.1/7 half-closed (remote): CONTINUATION", lambda c: _slow_call(c, 1)
     + frame(CONTINUATION, END_HEADERS, 1, c.block([("x-t", "1")])), goaway(PROTOCOL_ERROR)),
    ("5.1/8 closed by RST_STREAM: DATA", lambda c: _open(c, 1) + rst(1) + frame(DATA, 0, 1, b"x"),
     stream_error(1, STREAM_CLOSED)),
    ("5.1/9 closed by RST_STREAM: HEADERS", lambda c: _open(c, 1) + rst(1) + c.headers(1, request()),
     goaway(PROTOCOL_ERROR)),
    ("5.1/10 closed by RST_STREAM: CONTINUATION", lambda c: _open(c, 1) + rst(1)
     + frame(CONTINUATION, END_HEADERS, 1, c.block([("x-t", "1")])), goaway(PROTOCOL_ERROR)),
    ("5.1/11 closed: DATA", "closed", lambda c: (c.send(frame(DATA, 0, 1, b"x")), c.stream_error(1, STREAM_CLOSED))),
    ("5.1/12 closed: HEADERS", "closed", lambda c: (c.send(c.headers(1, request())), c.goaway(PROTOCOL_ERROR))),
    ("5.1/13 closed: CONTINUATION", "closed", lambda c: (c.send(frame(CONTINUATION, END_HEADERS, 1, b"\x82")),
                                                          c.goaway(PROTOCOL_ERROR))),
    # §5.1.1: stream identifiers
    ("5.1.1/1 an even stream id", lambda c: c.headers(2, request(), END_HEADERS | END_STREAM), goaway(PROTOCOL_ERROR)),
    ("5.1.1/2 a stream id below one used", lambda c: c.headers(5, request(), END_HEADERS | END_STREAM)
     + c.headers(3, request(), END_HEADERS | END_STREAM), goaway(PROTOCOL_ERROR)),
    # §5.1.2: stream concurrency
    ("5.1.2/1 streams past SETTINGS_MAX_CONCURRENT_STREAMS", "concurrency", None),
    # §5.3.1: stream dependencies
    ("5.3.1/1 HEADERS depending on itself", lambda c: frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1,
                                                         b"\x00\x00\x00\x01\x10" + c.block(request())),
     stream_error(1, PROTOCOL_ERROR)),
    ("5.3.1/2 PRIORITY depending on itself", lambda c: frame(PRIORITY, 0, 1, b"\x00\x00\x00\x01\x10"),
     stream_error(1, PROTOCOL_ERROR)),
    # §5.4.1: connection errors
    ("5.4.1/1 GOAWAY then close on a connection error", lambda c: ping(b"short"), goaway(FRAME_SIZE_ERROR)),
    # §5.5: extending HTTP/2
    ("5.5/1 an unknown extension frame", lambda c: frame(0xEE, 0xFF, 1, b"ext"), alive),
    ("5.5/2 an unknown frame inside a header block", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + frame(0xEE, 0, 1, b"ext"), goaway(PROTOCOL_ERROR)),
    # §6.1: DATA
    ("6.1/1 DATA on stream 0", lambda c: frame(DATA, 0, 0, b"x"), goaway(PROTOCOL_ERROR)),
    ("6.1/2 DATA on a half-closed (remote) stream", lambda c: _slow_call(c, 1) + frame(DATA, 0, 1, b"x"),
     stream_error(1, STREAM_CLOSED)),
    ("6.1/3 DATA padding past the payload", lambda c: _open(c, 1) + frame(DATA, PADDED, 1, b"\x06" + b"x" * 5),
     goaway(PROTOCOL_ERROR)),
    # §6.2: HEADERS
    ("6.2/1 HEADERS without END_HEADERS, then PRIORITY", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"), goaway(PROTOCOL_ERROR)),
    ("6.2/2 HEADERS of another stream inside a header block", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + c.headers(3, request()), goaway(PROTOCOL_ERROR)),
    ("6.2/3 HEADERS on stream 0", lambda c: c.headers(0, request()), goaway(PROTOCOL_ERROR)),
    ("6.2/4 HEADERS padding past the payload", lambda c: frame(HEADERS, END_HEADERS | PADDED, 1, b"\xff" + c.block(request())),
     goaway(PROTOCOL_ERROR)),
    # §6.3: PRIORITY
    ("6.3/1 PRIORITY on stream 0", lambda c: frame(PRIORITY, 0, 0, b"\x00\x00\x00\x01\x10"), goaway(PROTOCOL_ERROR)),
    ("6.3/2 PRIORITY of the wrong size", lambda c: _open(c, 1) + frame(PRIORITY, 0, 1, b"\x00\x00\x00\x03"),
     stream_error(1, FRAME_SIZE_ERROR)),
    # §6.4: RST_STREAM
    ("6.4/1 RST_STREAM on stream 0", lambda c: rst(0), goaway(PROTOCOL_ERROR)),
    ("6.4/2 RST_STREAM on an idle stream", lambda c: rst(7), goaway(PROTOCOL_ERROR)),
    ("6.4/3 RST_STREAM of the wrong size", lambda c: _open(c, 1) + frame(RST_STREAM, 0, 1, b"\x00\x00\x00"),
     goaway(FRAME_SIZE_ERROR)),
    # §6.5: SETTINGS
    ("6.5/1 SETTINGS ACK with a payload", lambda c: frame(4, ACK, 0, b"\x00\x01\x00\x00\x10\x00"), goaway(FRAME_SIZE_ERROR)),
    ("6.5/2 SETTINGS on a stream", lambda c: frame(4, 0, 1, b"\x00\x01\x00\x00\x10\x00"), goaway(PROTOCOL_ERROR)),
    ("6.5/3 SETTINGS of the wrong size", lambda c: frame(4, 0, 0, b"\x00\x01\x00\x00\x10"), goaway(FRAME_SIZE_ERROR)),
    ("6.5.2/1 SETTINGS_ENABLE_PUSH of 2", lambda c: settings((ENABLE_PUSH, 2)), goaway(PROTOCOL_ERROR)),
    ("6.5.2/2 SETTINGS_INITIAL_WINDOW_SIZE past 2^31-1", lambda c: settings((INITIAL_WINDOW_SIZE, 1 << 31)),
     goaway(FLOW_CONTROL_ERROR)),
    ("6.5.2/3 SETTINGS_MAX_FRAME_SIZE below 16,384", lambda c: settings((MAX_FRAME_SIZE, 16383)), goaway(PROTOCOL_ERROR)),
    ("6.5.2/4 SETTINGS_MAX_FRAME_SIZE past 2^24-1", lambda c: settings((MAX_FRAME_SIZE, 1 << 24)), goaway(PROTOCOL_ERROR)),
    ("6.5.2/5 an unknown setting", lambda c: settings((0xFF, 1)),
     lambda c: c.until(lambda f: isinstance(f, SettingsFrame) and "ACK" in f.flags)),
    ("6.5.3/1 the last of several values applies", lambda c: settings((INITIAL_WINDOW_SIZE, 100), (INITIAL_WINDOW_SIZE, 1))
     + c.call(1), lambda c: _first_data(c, 1, 1)),
    ("6.5.3/2 SETTINGS is acknowledged", lambda c: settings((HEADER_TABLE_SIZE, 4096)),
     lambda c: c.until(lambda f: isinstance(f, SettingsFrame) and "ACK" in f.flags)),
    # §6.7: PING
    ("6.7/1 PING is answered with its payload", lambda c: b"", alive),
    ("6.7/2 a PING ACK is not answered", lambda c: ping(b"ackackac", ACK) + ping(b"after!!!"), lambda c: _one_pong(c)),
    ("6.7/3 PING on a stream", lambda c: frame(PING, 0, 1, b"12345678"), goaway(PROTOCOL_ERROR)),
    ("6.7/4 PING of the wrong size", lambda c: frame(PING, 0, 0, b"123456789"), goaway(FRAME_SIZE_ERROR)),
    # §6.8: GOAWAY
    ("6.8/1 GOAWAY on a stream", lambda c: frame(GOAWAY, 0, 1, bytes(8)), goaway(PROTOCOL_ERROR)),
    # §6.9: WINDOW_UPDATE
    ("6.9/1 a zero WINDOW_UPDATE on the connection", lambda c: window_update(0, 0), goaway(PROTOCOL_ERROR)),
    ("6.9/2 a zero WINDOW_UPDATE on a stream", lambda c: _open(c, 1) + window_update(1, 0), stream_error(1, PROTOCOL_ERROR)),
    ("6.9/3 WINDOW_UPDATE of the wrong size", lambda c: frame(8, 0, 0, b"\x00\x00\x01"), goaway(FRAME_SIZE_ERROR)),
    ("6.9.1/1 SETTINGS_INITIAL_WINDOW_SIZE of 1", lambda c: settings((INITIAL_WINDOW_SIZE, 1)) + c.call(1),
     lambda c: _first_data(c, 1, 1)),
    ("6.9.1/2 the connection window past 2^31-1", lambda c: window_update(0, (1 << 31) - 1), goaway(FLOW_CONTROL_ERROR)),
    ("6.9.1/3 a stream window past 2^31-1", lambda c: _open(c, 1) + window_update(1, (1 << 31) - 1),
     stream_error(1, FLOW_CONTROL_ERROR)),
    ("6.9.2/1 SETTINGS_INITIAL_WINDOW_SIZE changed after HEADERS", lambda c: settings((INITIAL_WINDOW_SIZE, 0))
     + c.call(1), lambda c: (c.send(settings((INITIAL_WINDOW_SIZE, 100))), live_answered(1)(c))),
    ("6.9.2/2 a negative window", lambda c: settings((INITIAL_WINDOW_SIZE, 3)) + c.call(1), lambda c: _negative(c)),
    ("6.9.2/3 SETTINGS_INITIAL_WINDOW_SIZE past 2^31-1", lambda c: settings((INITIAL_WINDOW_SIZE, (1 << 31))),
     goaway(FLOW_CONTROL_ERROR)),
    ("6.9.2/4 SETTINGS_INITIAL_WINDOW_SIZE overflowing a stream window", lambda c: _open(c, 1)
     + window_update(1, (1 << 31) - 1 - 65535) + settings((INITIAL_WINDOW_SIZE, 65536)), goaway(FLOW_CONTROL_ERROR)),
    # §6.10: CONTINUATION
    ("6.10/1 HEADERS and several CONTINUATION", lambda c: _split_call(c, 1), live_answered(1)),
    ("6.10/2 CONTINUATION followed by a non-CONTINUATION", lambda c: frame(HEADERS, END_STREAM, 1, b"")
     + frame(CONTINUATION, 0, 1, c.block(request())) + frame(DATA, 0, 1, b"x"), goaway(PROTOCOL_ERROR)),
    ("6.10/3 CONTINUATION on stream 0", lambda c: frame(HEADERS, END_STREAM, 1, c.block(request()))
     + frame(CONTINUATION, END_HEADERS, 0, b""), goaway(PROTOCOL_ERROR)),
    ("6.10/4 CONTINUATION after END_HEADERS", lambda c: c.headers(1, request(), END_HEADERS | END_STREAM)
     + frame(CONTINUATION, END_HEADERS, 1, b"\x82"), goaway(PROTOCOL_ERROR)),
    ("6.10/5 CONTINUATION after a CONTINUATION with END_HEADERS", lambda c: frame(HEADERS, END_STREAM, 1, b"")
     + frame(CONTINUATION, END_HEADERS, 1, c.block(request())) + frame(CONTINUATION, END_HEADERS, 1, b"\x82"),
     goaway(PROTOCOL_ERROR)),
    ("6.10/6 CONTINUATION after DATA", lambda c: _open(c, 1) + frame(DATA, 0, 1, b"x")
     + frame(CONTINUATION, END_HEADERS, 1, b"\x82"), goaway(PROTOCOL_ERROR)),
    # §8.1: HTTP message framing
    ("8.1/1 trailers without END_STREAM", lambda c: _open(c, 1) + frame(DATA, 0, 1, LIVE_BODY)
     + c.headers(1, [("x-trailer", "1")]), stream_error(1, PROTOCOL_ERROR)),
    ("8.1.1/1 content-length above the DATA", lambda c: c.headers(1, request(**{"content-length": "10"}))
     + frame(DATA, END_STREAM, 1, LIVE_BODY), stream_error(1, PROTOCOL_ERROR)),
    ("8.1.1/2 content-length below several DATA", lambda c: c.headers(1, request(**{"content-length": "3"}))
     + frame(DATA, 0, 1, LIVE_BODY[:2]) + frame(DATA, END_STREAM, 1, LIVE_BODY[2:]), stream_error(1, PROTOCOL_ERROR)),
    # §8.2: HTTP fields
    ("8.2/1 an uppercase field name", lambda c: c.headers(1, request(**{"X-Upper": "1"}), END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.2/2 a field value with CR LF", lambda c: c.headers(1, request(**{"x-bad": "a\r\nb"}), END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.2/3 an empty field name (CVE-2019-9516)", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                                  c.block(request()) + _literal(b"", b"")),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.2.2/1 a connection-specific field", lambda c: c.headers(1, request(connection="keep-alive"), END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.2.2/2 TE other than trailers", lambda c: c.headers(1, [*request()[:5], ("te", "gzip")], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    # §8.3: pseudo-header fields
    ("8.3/1 an unknown pseudo-header", lambda c: c.headers(1, [(":foo", "x"), *request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3/2 a response pseudo-header", lambda c: c.headers(1, [(":status", "200"), *request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3/3 a pseudo-header in trailers", lambda c: _open(c, 1) + frame(DATA, 0, 1, LIVE_BODY)
     + c.headers(1, [(":method", "POST")], END_HEADERS | END_STREAM), stream_error(1, PROTOCOL_ERROR)),
    ("8.3/4 a pseudo-header after a regular field", lambda c: c.headers(1, [*request(), (":authority", "x")], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/1 an empty :path", lambda c: c.headers(1, [(k, "" if k == ":path" else v) for k, v in request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/2 no :method", lambda c: c.headers(1, request()[1:], END_HEADERS | END_STREAM), stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/3 no :scheme", lambda c: c.headers(1, [h for h in request() if h[0] != ":scheme"], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/4 no :path", lambda c: c.headers(1, [h for h in request() if h[0] != ":path"], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/5 :method twice", lambda c: c.headers(1, [(":method", "POST"), *request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/6 :scheme twice", lambda c: c.headers(1, [(":scheme", "http"), *request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    ("8.3.1/7 :path twice", lambda c: c.headers(1, [(":path", LIVE), *request()], END_HEADERS | END_STREAM),
     stream_error(1, PROTOCOL_ERROR)),
    # §8.4: server push
    ("8.4/1 PUSH_PROMISE from a client", lambda c: frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02\x82"),
     goaway(PROTOCOL_ERROR)),
    # HPACK (RFC 7541)
    ("hpack 2.3.3/1 an index past the tables", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xff\x7f"),
     goaway(COMPRESSION_ERROR)),
    ("hpack 2.3.3/2 a name index past the tables", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                                    b"\x7f\x7f\x01a"), goaway(COMPRESSION_ERROR)),
    ("hpack 4.2/1 a table size update at the end of a block", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                                               c.block(request()) + b"\x20"),
     goaway(COMPRESSION_ERROR)),
    ("hpack 5.2/1 Huffman padding past 7 bits", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                                 b"\x00\x82\x1f\xff\x00"), goaway(COMPRESSION_ERROR)),
    ("hpack 5.2/2 Huffman padding not of EOS", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                                b"\x00\x81\x18\x00"), goaway(COMPRESSION_ERROR)),
    ("hpack 5.2/3 a Huffman string with EOS", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                               b"\x00\x84\xff\xff\xff\xff\x00"), goaway(COMPRESSION_ERROR)),
    ("hpack 6.1/1 index 0", lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x80"), goaway(COMPRESSION_ERROR)),
    ("hpack 6.3/1 a table size update past SETTINGS_HEADER_TABLE_SIZE", lambda c: frame(
        HEADERS, END_HEADERS | END_STREAM, 1, b"\x3f\xe2\x1f" + c.block(request())), goaway(COMPRESSION_ERROR)),
    ("hpack our table follows a smaller SETTINGS_HEADER_TABLE_SIZE", lambda c: settings((HEADER_TABLE_SIZE, 0)) + c.call(1),
     lambda c: _table_size_update_first(c, 1)),
]


def _first_data(c: Conn, sid: int, size: int) -> None:
    f = c.until(lambda f: isinstance(f, DataFrame) and f.stream_id == sid)
    assert f is not None and len(f.data) == size, c.frames


def _one_pong(c: Conn) -> None:
    """Only the PING without ACK is answered."""
    c.alive()
    pongs = [f for f in c.frames if isinstance(f, PingFrame)]
    assert [f.opaque_data for f in pongs][:1] == [b"after!!!"] and len(pongs) == 2, pongs


def _negative(c: Conn) -> None:
    """3 bytes of the 7-byte answer come, the window goes to -1 and back to 1: 1 byte more."""
    _first_data(c, 1, 3)
    c.send(settings((INITIAL_WINDOW_SIZE, 2)), window_update(1, 2))
    _first_data(c, 1, 1)
    c.send(window_update(1, 100))
    assert c.answer(1)["data"] == LIVE_ANSWER


def _split_call(c: Conn, sid: int) -> bytes:
    block = c.block(request())
    third = len(block) // 3
    return frame(HEADERS, 0, sid, block[:third]) + frame(CONTINUATION, 0, sid, block[third:2 * third]) \
        + frame(CONTINUATION, END_HEADERS, sid, block[2 * third:]) + frame(DATA, END_STREAM, sid, LIVE_BODY)


def _table_size_update_first(c: Conn, sid: int) -> None:
    """RFC 7541 §4.2: the first block after the limit came down starts with a size update."""
    c.answer(sid)
    first = next(f for f in c.frames if f.type == HEADERS)
    assert first.data[:1] == b"\x20", first.data[:8]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_conformance(port, case):
    name, send, check = case
    if name.startswith("3.4/2"):
        c = Conn(port, handshake=False)
        c.send(PREFACE + ping())
        c.goaway(PROTOCOL_ERROR)
        return
    if name.startswith("3.4/3"):
        c = Conn(port, handshake=False)
        c.send(PREFACE.replace(b"SM", b"XX") + settings())
        c.goaway(PROTOCOL_ERROR)
        return
    c = Conn(port)
    try:
        if send == "closed":                # a stream both sides ended: a whole call answered
            c.send(c.call(1))
            live_answered(1)(c)
            check(c)
        elif send == "concurrency":
            limit = c.server_settings[3]
            assert limit <= 256
            c.send(b"".join(_open(c, sid) for sid in range(1, 2 * limit + 2, 2)))
            c.stream_error(2 * limit + 1, REFUSED_STREAM)
        else:
            c.send(send(c))
            check(c)
    finally:
        c.close()


def test_padding_and_priority_fields_are_read(port):
    """A padded HEADERS with a priority and a padded DATA make a call as any other."""
    c = Conn(port)
    block = c.block(request())
    c.send(frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, b"\x03" + struct.pack(">IB", 0, 15) + block + b"\x00" * 3),
           frame(DATA, END_STREAM | PADDED, 1, b"\x02" + LIVE_BODY + b"\x00\x00"))
    live_answered(1)(c)
    c.close()
