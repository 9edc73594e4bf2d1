"""The server side of one HTTP/2 connection (RFC 9113): bytes in, calls to its owner, bytes out.

No sockets and no event loop: ``grpc_loop`` owns the transport and the calls. Written here,
not taken from ``h2``, because h2 cost ~200 µs of Python per unary gRPC call on the machines
measured (bench/http2_cost.py), more than the whole HTTP/1.1 path; this core costs a tenth of
that. HPACK decoding (Huffman, the dynamic table) is the ``hpack`` library's; a header block
made only of indexed fields (what gRPC clients send from their second call on) cannot change the
dynamic table, so its decoding is remembered until a block that could change it arrives. Our
own header blocks use no dynamic table (literal fields without indexing), so they are built
once or by ``encode_literal``.

What the owner implements: ``stream_headers(sid, headers, end_stream)``,
``stream_data(sid, data, flow_length, end_stream)``, ``stream_reset(sid)``,
``window_opened()``, ``peer_going_away()``, ``ping_acked(payload)``.
"""
from __future__ import annotations

import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM = 0, 1, 3, 6, 7
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
# settings identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
_HEADER = struct.Struct(">BHBBI")           # length (24 bits as 8 + 16), type, flags, stream id
_SETTING = struct.Struct(">HI")
_ALL_HIGH = bytes(range(128, 256))          # bytes that can only be single-byte indexed fields
Buffer = bytes | bytearray                  # frames cut from a held incomplete frame: bytearray


class ConnectionError_(Exception):
    """A connection error (RFC 9113 §5.4.1): the owner sends GOAWAY with ``code`` and closes."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def frame_header(length: int, kind: int, flags: int, sid: int) -> bytes:
    return _HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, sid)


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1 integer with an N-bit prefix; ``first`` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""
    return b"\x00" + encode_int(len(name), 7) + name + encode_int(len(value), 7) + value


class Stream:
    __slots__ = ("send_window", "unacked", "remote_closed")

    def __init__(self, send_window: int):
        self.send_window = send_window
        self.unacked = 0                    # bytes received and taken, not yet given back
        self.remote_closed = False


class Http2Server:
    def __init__(self, owner, settings: dict[int, int], connection_window: int):
        self.owner = owner
        self.out = bytearray()
        self.buf = bytearray()                      # an incomplete frame, kept until whole
        self.preface_seen = False
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.max_frame = settings.get(MAX_FRAME_SIZE, 16384)     # what we accept
        self.stream_window = settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
        self.connection_window = connection_window
        self.recv_window = connection_window       # once our WINDOW_UPDATE below is read
        self.conn_unacked = 0
        # the peer's side
        self.send_window = DEFAULT_WINDOW           # connection
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16384
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = settings.get(MAX_HEADER_LIST_SIZE, 1 << 16)
        # a header block's bytes before decoding (CONTINUATION frames cannot grow it for ever)
        self.max_block = 2 * self.decoder.max_header_list_size
        self.max_streams = settings.get(MAX_CONCURRENT_STREAMS, 1 << 31)
        self.decoded: dict[bytes, list] = {}         # all-indexed blocks, decoded
        self.block = bytearray()                    # a header block continued
        self.block_stream = 0
        self.block_end = False
        self.going_away = False
        payload = b"".join(_SETTING.pack(k, v) for k, v in settings.items())
        self.out += frame_header(len(payload), SETTINGS, 0, 0) + payload
        if connection_window > DEFAULT_WINDOW:
            self._window_update(0, connection_window - DEFAULT_WINDOW)

    # ---- input ----------------------------------------------------------------------------------
    def receive(self, data: Buffer) -> None:
        if self.buf:
            # a frame arrives in pieces: append (amortised), never re-copy what is held
            self.buf += data
            data, self.buf = self.buf, bytearray()
        if not self.preface_seen:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf = bytearray(data)
                return
            if not data.startswith(PREFACE):
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface_seen = True
            data = data[len(PREFACE):]
        pos, size = 0, len(data)
        while size - pos >= 9:
            hi, lo, kind, flags, sid = _HEADER.unpack_from(data, pos)
            length = (hi << 16) | lo
            if length > self.max_frame:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = pos + 9 + length
            if end > size:
                break
            sid &= MAX_WINDOW
            payload = data[pos + 9:end] if length else b""
            pos = end
            if self.block_stream and kind != CONTINUATION:
                raise ConnectionError_(PROTOCOL_ERROR, "a header block was not continued")
            if kind == DATA:
                self._data(sid, flags, payload, length)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window(sid, payload)
            elif kind == PING:
                self._ping(flags, payload)
            elif kind == SETTINGS:
                self._settings(flags, payload, sid)
            elif kind == RST_STREAM:
                if self.streams.pop(sid, None) is not None:
                    self.owner.stream_reset(sid)
            elif kind == GOAWAY:
                self.going_away = True
                self.owner.peer_going_away()
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
            # PRIORITY and unknown frame types are ignored (RFC 9113 §5.5)
        if pos < size:
            if pos == 0 and isinstance(data, bytearray):
                self.buf = data                 # nothing taken: keep it, no copy
            else:
                self.buf = bytearray(data[pos:])

    def _data(self, sid: int, flags: int, payload: Buffer, length: int) -> None:
        self.recv_window -= length
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the client overran the window")
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]] if payload else b""
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            self.ack(0, length)             # a stream we forgot: give the window back
            return
        end = bool(flags & END_STREAM)
        if end:
            stream.remote_closed = True
        self.owner.stream_data(sid, payload, length, end)

    def _headers(self, sid: int, flags: int, payload: Buffer) -> None:
        if not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]] if payload else b""
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(sid, bytes(payload), bool(flags & END_STREAM))
        else:
            self.block = bytearray(payload)
            self.block_stream = sid
            self.block_end = bool(flags & END_STREAM)

    def _continuation(self, sid: int, flags: int, payload: Buffer) -> None:
        if sid != self.block_stream:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION out of place")
        self.block += payload
        if len(self.block) > self.max_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM,
                                   f"a header block past {self.max_block} bytes")
        if flags & END_HEADERS:
            self.block_stream = 0
            self._header_block(sid, bytes(self.block), self.block_end)
            self.block = bytearray()

    def _header_block(self, sid: int, block: bytes, end: bool) -> None:
        headers = self.decoded.get(block)
        if headers is None:
            try:
                headers = list(self.decoder.decode(block, raw=True))
            except hpack.HPACKError as e:
                raise ConnectionError_(COMPRESSION_ERROR, f"header block: {e}") from None
            if block.translate(None, _ALL_HIGH):
                self.decoded.clear()        # the block may have changed the dynamic table
            elif len(self.decoded) < 256:
                self.decoded[block] = headers
        stream = self.streams.get(sid)
        if stream is not None:              # trailers from the client
            if end:
                stream.remote_closed = True
                self.owner.stream_data(sid, b"", 0, True)
            return
        if sid <= self.last_stream:
            return                          # a stream we already ended: nothing to do
        self.last_stream = sid
        if self.going_away:
            return
        if len(self.streams) >= self.max_streams:
            self.out += frame_header(4, RST_STREAM, 0, sid) + REFUSED_STREAM.to_bytes(4, "big")
            return
        stream = self.streams[sid] = Stream(self.peer_initial_window)
        stream.remote_closed = end
        self.owner.stream_headers(sid, headers, end)

    def _window(self, sid: int, payload: Buffer) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if sid == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "a zero WINDOW_UPDATE")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the window overflowed")
        else:
            stream = self.streams.get(sid)
            if stream is None:
                return
            if not increment or stream.send_window + increment > MAX_WINDOW:
                self.reset(sid, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
                self.owner.stream_reset(sid)
                return
            stream.send_window += increment
        self.owner.window_opened()

    def _ping(self, flags: int, payload: Buffer) -> None:
        if len(payload) != 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & ACK:
            self.out += frame_header(8, PING, ACK, 0) + payload
        else:
            self.owner.ping_acked(payload)

    def ping(self, payload: bytes) -> None:
        self.out += frame_header(8, PING, 0, 0) + payload

    def _settings(self, flags: int, payload: Buffer, sid: int) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not 16384 <= value <= (1 << 24) - 1:
                    raise ConnectionError_(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
        self.out += frame_header(0, SETTINGS, ACK, 0)
        self.owner.window_opened()

    # ---- output ---------------------------------------------------------------------------------
    def ack(self, sid: int, length: int) -> None:
        """``length`` bytes of DATA (as counted by flow control) were taken: give them back."""
        if not length:
            return
        self.recv_window += length
        self.conn_unacked += length
        if self.conn_unacked >= self.connection_window >> 1:
            self._window_update(0, self.conn_unacked)
            self.conn_unacked = 0
        stream = self.streams.get(sid) if sid else None
        if stream is not None and not stream.remote_closed:
            stream.unacked += length
            if stream.unacked >= self.stream_window >> 1:
                self._window_update(sid, stream.unacked)
                stream.unacked = 0

    def _window_update(self, sid: int, increment: int) -> None:
        self.out += frame_header(4, WINDOW_UPDATE, 0, sid) + increment.to_bytes(4, "big")

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        if len(block) <= self.peer_max_frame:
            self.out += frame_header(len(block), HEADERS, END_HEADERS | (end_stream and END_STREAM),
                                     sid)
            self.out += block
        else:
            first, rest = block[:self.peer_max_frame], block[self.peer_max_frame:]
            self.out += frame_header(len(first), HEADERS, END_STREAM if end_stream else 0, sid)
            self.out += first
            while rest:
                piece, rest = rest[:self.peer_max_frame], rest[self.peer_max_frame:]
                self.out += frame_header(len(piece), CONTINUATION, 0 if rest else END_HEADERS,
                                         sid)
                self.out += piece
        if end_stream:
            self._close_local(sid)

    def room(self, sid: int) -> int:
        """How many bytes of DATA may go to stream ``sid`` now."""
        stream = self.streams.get(sid)
        if stream is None:
            return 0
        return min(self.send_window, stream.send_window)

    def send_data(self, sid: int, data: bytes) -> int:
        """Sends as much of ``data`` as the windows allow, in frames the peer accepts."""
        stream = self.streams.get(sid)
        if stream is None:
            return 0
        room = min(self.send_window, stream.send_window, len(data))
        sent = 0
        while sent < room:
            n = min(room - sent, self.peer_max_frame)
            self.out += frame_header(n, DATA, 0, sid)
            self.out += data[sent:sent + n] if n != len(data) else data
            sent += n
        self.send_window -= sent
        stream.send_window -= sent
        return sent

    def reset(self, sid: int, code: int = NO_ERROR) -> None:
        self.out += frame_header(4, RST_STREAM, 0, sid) + code.to_bytes(4, "big")
        self.streams.pop(sid, None)

    def go_away(self, code: int = NO_ERROR, message: str = "") -> None:
        self.going_away = True
        payload = self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + message.encode()
        self.out += frame_header(len(payload), GOAWAY, 0, 0) + payload

    def _close_local(self, sid: int) -> None:
        """We ended the stream: forget it; a client still sending is told to stop."""
        stream = self.streams.pop(sid, None)
        if stream is not None and not stream.remote_closed:
            self.out += frame_header(4, RST_STREAM, 0, sid) + NO_ERROR.to_bytes(4, "big")

    def take(self) -> bytearray:
        """What to write, handed over (the transport may keep it): no copy."""
        out, self.out = self.out, bytearray()
        return out
