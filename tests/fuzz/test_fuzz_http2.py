"""The HTTP/2 core (frontend/http2*.py) under arbitrary bytes, frame sequences and HPACK blocks,
in-process with an owner that answers what it is given. Whatever comes, only ConnectionError_
escapes (the connection's GOAWAY), what the core holds stays bounded (streams, the incomplete
frame, the header block, the decode cache) and what it writes is well-formed frames."""
import struct

import hpack
from hyperframe.frame import Frame
from hypothesis import given
from hypothesis import strategies as st

from shmserve.frontend.http2 import connection as http2
from shmserve.frontend.http2 import headers as http2_headers
from shmserve.frontend.http2.connection import ConnectionError_, Http2Server

LIMITS = {http2.MAX_CONCURRENT_STREAMS: 4, http2.INITIAL_WINDOW_SIZE: 1 << 16,
          http2.MAX_FRAME_SIZE: 16384, http2.MAX_HEADER_LIST_SIZE: 4096}
START = http2.PREFACE + http2.frame_header(0, http2.SETTINGS, 0, 0)
FIELDS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/a.B/C"),
          (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]


class Owner:
    """Takes and answers like grpc_loop: every byte acknowledged, a stream's end answered with
    headers, data and trailers; resets forget the stream."""

    def __init__(self):
        self.core: Http2Server | None = None

    def stream_headers(self, sid, headers, end):
        assert isinstance(headers, list)
        if end:
            self.answer(sid)

    def stream_data(self, sid, data, length, end):
        assert length >= len(data)
        self.core.ack(sid, length)
        if end:
            self.answer(sid)

    def answer(self, sid):
        self.core.send_headers(sid, b"\x88")
        self.core.send_data(sid, b"\x00" * 20000)
        self.core.send_headers(sid, http2.encode_literal(b"grpc-status", b"0"), end_stream=True)

    def stream_reset(self, sid):
        pass

    def window_opened(self):
        pass

    def peer_going_away(self):
        pass

    def ping_acked(self, payload):
        assert len(payload) == 8


def _check_output(out: bytes) -> None:
    """Whole frames that hyperframe parses (sizes follow the client's SETTINGS, which the
    fuzzer changes mid-stream: only the protocol's bound is checked)."""
    pos = 0
    while pos < len(out):
        assert len(out) - pos >= 9, "a cut frame header"
        f, length = Frame.parse_frame_header(memoryview(out[pos:pos + 9]))
        assert length < 1 << 24, (f, length)
        assert pos + 9 + length <= len(out), "a cut frame"
        f.parse_body(memoryview(out[pos + 9:pos + 9 + length]))
        pos += 9 + length


def _feed(chunks) -> None:
    owner = Owner()
    server = owner.core = Http2Server(owner, LIMITS, 1 << 20)
    try:
        for chunk in chunks:
            server.receive(chunk)
            assert len(server.streams) <= LIMITS[http2.MAX_CONCURRENT_STREAMS]
            assert len(server.buf) < 9 + LIMITS[http2.MAX_FRAME_SIZE] + len(START)
            assert len(server.block) <= server.max_block
            assert len(server.decoder.cache) <= http2_headers.CACHED_PER_CONNECTION
            assert http2_headers.cache_used() <= http2_headers.CACHE_BUDGET
            _check_output(bytes(server.take()))
    except ConnectionError_ as e:
        assert 0 < e.code <= http2.ENHANCE_YOUR_CALM
        server.go_away(e.code, str(e))
        _check_output(bytes(server.take()))
    finally:
        server.close()


def _chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:])]


# ---- structured input -----------------------------------------------------------------------
stream_ids = st.one_of(st.sampled_from([0, 1, 3, 5, 7, 2, 4]), st.integers(0, (1 << 32) - 1))
header_lists = st.lists(st.one_of(
    st.sampled_from(FIELDS),
    st.tuples(st.binary(max_size=12), st.binary(max_size=24))), max_size=12)


@st.composite
def hpack_blocks(draw, encoder: hpack.Encoder):
    kind = draw(st.integers(0, 3))
    if kind == 0:                               # what a client would send
        return encoder.encode(draw(header_lists), huffman=draw(st.booleans()))
    if kind == 1:                               # a real block, bytes flipped or cut
        block = bytearray(encoder.encode(FIELDS + draw(header_lists)))
        for i in draw(st.lists(st.integers(0, 1 << 16), max_size=4)):
            if block:
                block[i % len(block)] ^= draw(st.integers(1, 255))
        return bytes(block[:draw(st.integers(0, len(block)))])
    if kind == 2:                               # indexed fields only (the cached kind)
        return bytes(draw(st.lists(st.integers(0x80, 0xFF), max_size=70)))
    return draw(st.binary(max_size=64))


@st.composite
def frames(draw):
    encoder = hpack.Encoder()
    out = [START]
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.one_of(st.integers(0, 9), st.integers(10, 255)))
        flags = draw(st.one_of(st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x25, 0x2D]), st.integers(0, 255)))
        sid = draw(stream_ids)
        if kind in (http2.HEADERS, http2.CONTINUATION):
            payload = draw(hpack_blocks(encoder))
            if kind == http2.HEADERS and flags & http2.PRIORITY_FLAG:
                payload = draw(st.binary(min_size=5, max_size=5)) + payload
            if flags & http2.PADDED and kind == http2.HEADERS:
                payload = bytes((draw(st.integers(0, 255)),)) + payload
        elif kind == http2.SETTINGS:
            payload = b"".join(struct.pack(">HI", draw(st.integers(0, 8)), draw(st.integers(0, (1 << 32) - 1)))
                               for _ in range(draw(st.integers(0, 5))))
        elif kind in (http2.WINDOW_UPDATE, http2.RST_STREAM):
            payload = struct.pack(">I", draw(st.integers(0, (1 << 32) - 1)))
        elif kind == http2.PING:
            payload = draw(st.binary(min_size=8, max_size=8))
        elif kind == http2.DATA:
            payload = draw(st.binary(max_size=300))
        else:
            payload = draw(st.binary(max_size=20))
        if draw(st.integers(0, 15)) == 0:           # a length field that lies
            out.append(http2.frame_header(draw(st.integers(0, (1 << 24) - 1)), kind, flags, sid) + payload)
        else:
            out.append(http2.frame_header(len(payload), kind, flags, sid) + payload)
    return b"".join(out)


@given(frames(), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_frame_sequences(data, cuts):
    _feed(_chunked(data, cuts))


@given(st.binary(max_size=600), st.lists(st.integers(0, 1 << 10), max_size=4))
def test_random_bytes_after_the_preface(data, cuts):
    _feed(_chunked(START + data, cuts))


@given(st.binary(max_size=64))
def test_random_bytes_instead_of_a_preface(data):
    _feed([data])


@st.composite
def block_lists(draw):
    encoder = hpack.Encoder()           # one per connection, as a client's
    return [draw(hpack_blocks(encoder)) for _ in range(draw(st.integers(1, 8)))]


@given(block_lists())
def test_hpack_blocks_on_new_streams(blocks):
    out = [START]
    for i, block in enumerate(blocks):
        out.append(http2.frame_header(len(block), http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 2 * i + 1) + block)
    _feed([b"".join(out)])
