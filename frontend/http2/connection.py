"""The server side of one HTTP/2 connection (RFC 9113): bytes in, calls to its owner, bytes out.

No sockets and no event loop: ``grpc/loop.py`` owns the transport and the calls. Written here,
not taken from ``h2``, because h2 cost ~200 µs of Python per unary gRPC call on the machines
measured (bench/http2_cost.py), more than the whole HTTP/1.1 path; this core costs a tenth of
that. HPACK is ``http2/headers.py`` (the ``hpack`` library, a bounded decode cache, the checks of
a request's fields).

Stream states without per-stream memory once a stream ends: ``streams`` holds the open and
half-closed (remote) ones; a client stream id at most ``highest`` that is not there is closed,
one above it (or an even one: we never push) is idle.

What a client can make us do for nothing is budgeted (the DoS advisories CVE-2019-9512..9518,
CVE-2023-44487, CVE-2024-27316, as nghttp2, h2o and Go bound them): control and empty frames,
frames on closed streams, refused and malformed streams ("glitches"), resets of open streams
(rapid reset); past a budget the connection ends with ENHANCE_YOUR_CALM. A header block is
bounded in bytes and frames before it is decoded; SETTINGS apply once per frame. The end of a
stream followed by more frames in the same read is told to the owner after them, so that a
call reset in the read that brought it is never started.

What the owner implements: ``stream_headers(sid, headers, end_stream)``,
``stream_data(sid, data, flow_length, end_stream)``, ``stream_reset(sid)``,
``window_opened()``, ``peer_going_away()``, ``ping_acked(payload)``.
"""
# ruff: noqa: F405
from __future__ import annotations

import time
from typing import Callable

import hpack

# the vocabulary, used throughout and re-exported (by name: a compiled module's namespace holds
# what it imports by name, not what a * brings)
from shmserve.frontend.http2.frames import (  # noqa: F401
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONNECT_ERROR,
    CONTINUATION,
    DATA,
    DECODE_PER_READ,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GLITCH_BURST,
    GLITCH_RATE,
    GOAWAY,
    HEADER,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    INTERNAL_ERROR,
    MAX_CONCURRENT_STREAMS,
    MAX_CONTINUATIONS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_OWED,
    MAX_SETTINGS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECENT_CLOSED,
    REFUSED_STREAM,
    RESET_BURST,
    RESET_RATE,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_TIMEOUT,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Budget,
    Buffer,
    ConnectionError_,
    frame_header,
    unpad,
)
from shmserve.frontend.http2.headers import HeaderDecoder, check_trailers, encode_int, encode_literal
from shmserve.frontend.http2.send import Sender, Stream

__all__ = ["Http2Server", "encode_int", "encode_literal"]

_SELF_DEPENDENT = 0x100         # not on the wire: a HEADERS frame that depends on its stream


class Http2Server(Sender):
    def __init__(self, owner, settings: dict[int, int], connection_window: int,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW), connection_window)
        self.owner = owner
        self.buf = bytearray()                      # an incomplete frame, kept until whole
        self.preface_seen = False
        self.highest = 0                            # the highest client stream id seen
        self.max_frame = settings.get(MAX_FRAME_SIZE, 16384)     # what we accept
        self.max_streams = settings.get(MAX_CONCURRENT_STREAMS, 1 << 31)
        max_list = settings.get(MAX_HEADER_LIST_SIZE, 1 << 16)
        self.decoder = HeaderDecoder(max_list)
        self.decoded = self.decoder.cache           # looked up here: the hot path
        # a header block's bytes before decoding: its encoding is never larger than the header
        # list it decodes to (plus a few table size updates)
        self.max_block = max_list + 64
        self.block = bytearray()                    # a header block continued
        self.block_stream = 0
        self.block_flags = 0
        self.continuations = 0
        self.glitches = Budget(GLITCH_BURST, GLITCH_RATE, clock)
        self.resets = Budget(RESET_BURST, RESET_RATE, clock)
        self.acks_due = 1                           # SETTINGS ACKs we expect
        self.rst_closed = 0                         # the closed stream we last told so
        self.ended: list[Stream] = []               # streams the client ended in this read
        self.table_limit = 4096                     # the peer's HEADER_TABLE_SIZE, lowest seen
        self.decode_work = 0                        # header bytes decoded in this receive
        # the last receive stopped at DECODE_PER_READ: the owner calls ``receive(b"")`` on a
        # later turn of its loop (and reads no more meanwhile)
        self.more = False
        payload = b"".join(SETTING.pack(k, v) for k, v in settings.items())
        self.out += frame_header(len(payload), SETTINGS, 0, 0) + payload
        if connection_window > DEFAULT_WINDOW:
            self._window_update(0, connection_window - DEFAULT_WINDOW)

    @property
    def incomplete(self) -> bool:
        """Part of a frame or of a header block is held: the owner bounds how long."""
        return bool(self.buf) or bool(self.block_stream)

    @property
    def pending_bytes(self) -> int:
        """Bytes held for an incomplete frame or header block."""
        return len(self.buf) + len(self.block)

    # ---- input ----------------------------------------------------------------------------------
    def receive(self, data: Buffer) -> None:
        if self.buf:
            # a frame arrives in pieces: append (amortised), never re-copy what is held
            self.buf += data
            data, self.buf = self.buf, bytearray()
        if not self.preface_seen:
            # the preface, then a SETTINGS frame (RFC 9113 §3.4)
            if len(data) < len(PREFACE) + 9:
                if not (PREFACE.startswith(data[:len(PREFACE)])):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf = bytearray(data)
                return
            if not data.startswith(PREFACE):
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if data[len(PREFACE) + 3] != SETTINGS or data[len(PREFACE) + 4] & ACK:
                raise ConnectionError_(PROTOCOL_ERROR, "the preface is not followed by SETTINGS")
            self.preface_seen = True
            data = data[len(PREFACE):]
        pos, size = 0, len(data)
        self.decode_work = 0
        self.more = False
        while size - pos >= 9:
            if self.decode_work >= DECODE_PER_READ:
                self.more = True            # the rest on a later turn: others go first
                break
            hi, lo, kind, flags, sid = HEADER.unpack_from(data, pos)
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
                self._data(sid, flags, payload, length, pos == size)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window(sid, payload)
            elif kind == PING:
                self._ping(flags, payload, sid)
            elif kind == SETTINGS:
                self._settings(flags, payload, sid)
            elif kind == RST_STREAM:
                self._rst_stream(sid, payload)
            elif kind == PRIORITY:
                self._priority(sid, payload)
            elif kind == GOAWAY:
                if sid:
                    raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
                if length < 8:
                    raise ConnectionError_(FRAME_SIZE_ERROR, "GOAWAY of the wrong size")
                self.going_away = True
                self.owner.peer_going_away()
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
            # unknown frame types are ignored (RFC 9113 §5.5)
        if pos < size:
            if pos == 0 and isinstance(data, bytearray):
                self.buf = data                 # nothing taken: keep it, no copy
            else:
                self.buf = bytearray(data[pos:])
        if self.ended:
            self._deliver_ends()

    def _deliver_ends(self) -> None:
        """Streams the client ended with more frames behind them in the read: the owner hears
        of each once the whole read is taken, unless a reset among them ended it (rapid
        reset: its call is never started)."""
        ended, self.ended = self.ended, []
        streams = self.streams
        for stream in ended:
            if streams.get(stream.sid) is stream:
                self.owner.stream_data(stream.sid, stream.last, stream.last_length, True)
            else:                           # reset meanwhile: its bytes are given back
                self.ack(0, stream.last_length)
            stream.last = b""

    def _idle(self, sid: int) -> bool:
        return sid > self.highest or not sid & 1

    def _data(self, sid: int, flags: int, payload: Buffer, length: int, last: bool) -> None:
        self.recv_window -= length
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the client overran the window")
        if flags & PADDED:
            payload = unpad(payload)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            self._data_elsewhere(sid, stream, length)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, f"the client overran stream {sid}'s window")
        end = flags & END_STREAM == END_STREAM
        if not payload and not end:
            self.glitches.spend("empty DATA frames")
        if stream.expect >= 0:
            stream.expect -= len(payload)
            if stream.expect < 0 or (end and stream.expect):
                self.ack(0, length)
                self._stream_error(sid, PROTOCOL_ERROR)     # §8.1.1: a malformed request
                return
        if end:
            stream.remote_closed = True
            if not last or self.ended:      # frames follow: the owner hears of it after them
                stream.last, stream.last_length = payload, length
                self.ended.append(stream)
                return
        self.owner.stream_data(sid, payload, length, end)

    def _data_elsewhere(self, sid: int, stream: Stream | None, length: int) -> None:
        """DATA on a stream that takes none (RFC 9113 §6.1, §5.1)."""
        if stream is None and self._idle(sid):
            raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        self.ack(0, length)                 # the connection's window is given back
        if self.going_away and sid > self.last_stream:
            return                          # a stream after our GOAWAY: ignored (§6.8)
        if stream is None and self.closed_lately(sid) == 2:
            return                          # we reset it: sent before the client knew (§5.1)
        if stream is not None:              # half-closed (remote): the client ended it
            self._stream_error(sid, STREAM_CLOSED)
        elif sid != self.rst_closed:        # closed: said once per stream, not per frame
            self.rst_closed = sid
            self._stream_error(sid, STREAM_CLOSED)

    def _headers(self, sid: int, flags: int, payload: Buffer) -> None:
        if not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        if sid <= self.highest and sid not in self.streams:
            # §5.1.1: a new stream below one already opened (closed streams are not
            # remembered, so trailers on one we ended are taken for this)
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on closed stream {sid}")
        if flags & PADDED:
            payload = unpad(payload, 5 if flags & PRIORITY_FLAG else 0)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if int.from_bytes(payload[:4], "big") & MAX_WINDOW == sid:
                flags |= _SELF_DEPENDENT
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(sid, bytes(payload), flags)
        else:
            if not payload:
                self.glitches.spend("empty header block fragments")
            if len(payload) > self.max_block:
                raise ConnectionError_(ENHANCE_YOUR_CALM, f"a header block past {self.max_block} bytes")
            self.block = bytearray(payload)
            self.block_stream = sid
            self.block_flags = flags
            self.continuations = 0

    def _continuation(self, sid: int, flags: int, payload: Buffer) -> None:
        if not sid or sid != self.block_stream:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION out of place")
        self.continuations += 1
        if self.continuations > MAX_CONTINUATIONS:
            raise ConnectionError_(ENHANCE_YOUR_CALM,
                                   f"a header block in more than {MAX_CONTINUATIONS} frames")
        end = flags & END_HEADERS
        if not payload and not end:
            self.glitches.spend("empty CONTINUATION frames")
        self.block += payload
        if len(self.block) > self.max_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM,
                                   f"a header block past {self.max_block} bytes")
        if end:
            self.block_stream = 0
            block, self.block = bytes(self.block), bytearray()
            self._header_block(sid, block, self.block_flags)

    def _header_block(self, sid: int, block: bytes, flags: int) -> None:
        decoded = self.decoded.get(block)       # the decoder's cache, looked up here: hot
        if decoded is None:
            self.decode_work += len(block)
            try:                    # decoded whatever follows: the table must stay in step
                decoded = self.decoder.decode(block)
            except (hpack.HPACKError, ValueError, IndexError) as e:
                raise ConnectionError_(COMPRESSION_ERROR, f"header block: {e}") from None
        headers, problem, length = decoded
        end = flags & END_STREAM == END_STREAM
        stream = self.streams.get(sid)
        if stream is not None:              # trailers from the client
            if stream.remote_closed:
                self._stream_error(sid, STREAM_CLOSED)
            elif not end or check_trailers(headers) or flags & _SELF_DEPENDENT or stream.expect > 0:
                self._stream_error(sid, PROTOCOL_ERROR)     # §8.1: malformed
            else:
                stream.remote_closed = True
                stream.last, stream.last_length = b"", 0
                self.ended.append(stream)
            return
        self.highest = sid
        if self.going_away:
            return                          # §6.8: streams after a GOAWAY are not taken
        self.last_stream = sid
        if problem or flags & _SELF_DEPENDENT:
            self._stream_error(sid, PROTOCOL_ERROR)         # §8.1.1, §5.3.1
            return
        if len(self.streams) >= self.max_streams:
            self._stream_error(sid, REFUSED_STREAM)
            return
        stream = self.streams[sid] = Stream(sid, self.peer_initial_window, self.stream_window)
        if length >= 0:
            if end and length:
                self._stream_error(sid, PROTOCOL_ERROR)     # §8.1.1: less than declared
                return
            stream.expect = length
        stream.remote_closed = end
        self.owner.stream_headers(sid, headers, end)

    def _stream_error(self, sid: int, code: int) -> None:
        """RFC 9113 §5.4.2: the stream ends with RST_STREAM; the owner forgets its call."""
        self.glitches.spend("stream errors")
        self._owe(frame_header(4, RST_STREAM, 0, sid) + code.to_bytes(4, "big"))
        self._closed(sid, True)             # refused or failed: its DATA in flight is dropped
        if self.streams.pop(sid, None) is not None:
            self.owner.stream_reset(sid)

    def _rst_stream(self, sid: int, payload: Buffer) -> None:
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        if self.streams.pop(sid, None) is not None:
            self.resets.spend("streams reset by the client")     # rapid reset
            self.owner.stream_reset(sid)
        elif self._idle(sid):
            raise ConnectionError_(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        elif not self.closed_lately(sid):   # one we closed lately: it crossed our end (§5.1)
            self.glitches.spend("frames on closed streams")

    def _priority(self, sid: int, payload: Buffer) -> None:
        """Priority signals are deprecated (RFC 9113 §5.3.2) and ignored; errors still count."""
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
        self.glitches.spend("PRIORITY frames")
        if len(payload) != 5:
            self._stream_error(sid, FRAME_SIZE_ERROR)
        elif int.from_bytes(payload[:4], "big") & MAX_WINDOW == sid:
            self._stream_error(sid, PROTOCOL_ERROR)

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
                if self._idle(sid):
                    raise ConnectionError_(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
                if not self.closed_lately(sid):     # closed lately: it crossed our end (§5.1)
                    self.glitches.spend("frames on closed streams")
                return
            if not increment or stream.send_window + increment > MAX_WINDOW:
                self._stream_error(sid, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
                return
            stream.send_window += increment
        self.owner.window_opened()

    def _ping(self, flags: int, payload: Buffer, sid: int) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & ACK:
            self.glitches.spend("PING frames")
            self._owe(frame_header(8, PING, ACK, 0) + payload)
        elif payload == self.ping_out:
            self.ping_out = b""
            self.owner.ping_acked(bytes(payload))
        else:
            self.glitches.spend("PING ACKs of no PING")

    def _settings(self, flags: int, payload: Buffer, sid: int) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            if self.acks_due:
                self.acks_due -= 1
            else:
                self.glitches.spend("SETTINGS ACKs of no SETTINGS")
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        if len(payload) > 6 * MAX_SETTINGS:
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"a SETTINGS frame of more than "
                                   f"{MAX_SETTINGS} entries")
        self.glitches.spend("SETTINGS frames")
        window = -1
        for i in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                window = value              # §6.5.3: the last value wins
            elif key == MAX_FRAME_SIZE:
                if not 16384 <= value <= (1 << 24) - 1:
                    raise ConnectionError_(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == ENABLE_PUSH:
                if value > 1:
                    raise ConnectionError_(PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            elif key == HEADER_TABLE_SIZE and value < self.table_limit:
                # our blocks use no dynamic table, but the peer's decoder must hear that
                # ours is within its new limit
                self.table_limit = value
                self.table_update = encode_int(value, 5, 0x20)
        if window >= 0:
            delta = window - self.peer_initial_window       # applied once per frame
            self.peer_initial_window = window
            if delta:
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ConnectionError_(FLOW_CONTROL_ERROR,
                                               "INITIAL_WINDOW_SIZE overflows a stream's window")
        self._owe(frame_header(0, SETTINGS, ACK, 0))
        self.owner.window_opened()

    def close(self) -> None:
        """The connection is gone: what it held of shared budgets goes back."""
        self.decoder.forget()
