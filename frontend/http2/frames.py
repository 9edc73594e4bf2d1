"""The vocabulary of HTTP/2 frames (RFC 9113) for the core in ``http2``: types, flags, error
codes, settings, the limits a correct client never reaches, and the budgets of what a client can
make the server do for nothing (as nghttp2, h2o and Go bound them after the DoS advisories
CVE-2019-9512..9518, CVE-2023-44487 and CVE-2024-27316)."""
from __future__ import annotations

import struct
import time
from typing import Callable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, \
    ENHANCE_YOUR_CALM = range(12)
# settings identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
# limits a correct client never reaches (nghttp2's are of the same size)
MAX_CONTINUATIONS = 16          # CONTINUATION frames in one header block
MAX_SETTINGS = 32               # entries in one SETTINGS frame
GLITCH_BURST, GLITCH_RATE = 1000, 100.0      # frames that cost us and give the client nothing
RESET_BURST, RESET_RATE = 1000, 100.0        # client resets of open streams, per second
MAX_OWED = 512                  # control frames answered and not yet taken by the owner
# header block bytes decoded (not from the cache) in one ``receive``: past it the rest of the
# read waits for the next turn of the loop (``Http2Server.more``), so that one read of large
# blocks (hpack decodes ~1 byte a µs) cannot hold every other client for 100 ms and more
DECODE_PER_READ = 32 << 10
# streams we closed lately, remembered so that what a client sent before it heard of the close
# (DATA on a stream we reset, WINDOW_UPDATE or RST_STREAM on one we ended: RFC 9113 §5.1) is
# dropped quietly instead of costing it glitches; older ones are treated as any closed stream.
# Twice the concurrent streams we allow: a correct client has no more in flight
RECENT_CLOSED = 512
HEADER = struct.Struct(">BHBBI")           # length (24 bits as 8 + 16), type, flags, stream id
SETTING = struct.Struct(">HI")
Buffer = bytes | bytearray                  # frames cut from a held incomplete frame: bytearray


class ConnectionError_(Exception):
    """A connection error (RFC 9113 §5.4.1): the owner sends GOAWAY with ``code`` and closes."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def frame_header(length: int, kind: int, flags: int, sid: int) -> bytes:
    return HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, sid)


class Budget:
    """A token bucket: ``burst`` events at once, ``rate`` more per second; ``spend`` past it
    ends the connection (ENHANCE_YOUR_CALM)."""

    __slots__ = ("burst", "rate", "tokens", "at", "clock")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float] = time.monotonic):
        self.burst, self.rate, self.tokens = burst, rate, float(burst)
        self.clock = clock          # seconds; a test's own clock, so that its floods are exact
        self.at = clock()

    def spend(self, what: str) -> None:
        now = self.clock()
        tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - 1
        self.at = now
        if tokens < 0:
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"too many {what}")
        self.tokens = tokens


def unpad(payload: Buffer, fixed: int = 0) -> Buffer:
    """A PADDED frame's payload without its padding (and ``fixed`` bytes of fields after the
    pad length stay in front)."""
    if len(payload) < 1 + fixed:
        raise ConnectionError_(FRAME_SIZE_ERROR, "a padded frame too short for its fields")
    pad = payload[0]
    if pad > len(payload) - 1 - fixed:
        raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - pad]
