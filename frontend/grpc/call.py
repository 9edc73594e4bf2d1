"""What one gRPC call on the loop server (``grpc/loop.py``) needs besides HTTP/2: the length-prefixed
message framing, compression, ``grpc-timeout``, the status trailers, and the servicer context
that the handlers of ``grpc/service.py`` are written against (the part of grpc.aio's
``ServicerContext`` they use, with grpc.aio's behaviour).
"""
from __future__ import annotations

import base64
import time
from urllib.parse import quote

import grpc

from shmserve.frontend.grpc.status import grpc_status
from shmserve.frontend.http import inflate as inflating
from shmserve.frontend.http2 import connection as http2
from shmserve.frontend.peer_uid import peer_name  # noqa: F401 (the call's peer, as grpc_loop names it)
from shmserve.ipc.errors import InferError

PREFIX = 5                  # compressed flag (1 byte) + message length (4 bytes, big endian)
ACCEPT_ENCODING = b"identity,deflate,gzip"
# a compressed message up to this size is inflated on the loop (at most ~1 MiB out, deflate's
# ratio being under 1:1032); a larger one on the inflating thread (frontend/http/inflate.py)
INFLATE_INLINE = 1024
# the request headers that are HTTP/2's or gRPC's own, not the caller's metadata
RESERVED = frozenset((b"content-type", b"te", b"grpc-timeout", b"grpc-encoding",
                      b"grpc-accept-encoding", b"grpc-message-type", b"content-length"))
_TIMEOUT_UNIT = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


class CallError(Exception):
    """Ends a call with this gRPC status (what ``ServicerContext.abort`` raises)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def frame_prefix(size: int) -> bytes:
    """What comes before a message of ``size`` bytes (uncompressed)."""
    return b"\x00" + size.to_bytes(4, "big")


class Compressed:
    """A compressed message as it came: inflated by ``inflate``, once its call runs."""

    __slots__ = ("payload", "encoding")

    def __init__(self, payload: bytes | bytearray, encoding: str):
        self.payload = payload
        self.encoding = encoding

    def __len__(self) -> int:
        return len(self.payload)


async def inflate(message: Compressed, limit: int) -> bytes | bytearray:
    """The message inflated, never past ``limit`` bytes, with grpc's statuses and texts (a
    grpcio server answers the same)."""
    try:
        if len(message.payload) <= INFLATE_INLINE:
            return inflating.inflate_now(message.payload, message.encoding, limit)
        return await inflating.inflate(message.payload, message.encoding, limit)
    except inflating.TooLarge:
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "Decompressed message larger than max") from None
    except inflating.Corrupt as e:      # zlib refused it, or it stops before its end
        why = "data" if str(e) == "truncated" else "zlib"
        raise CallError(grpc.StatusCode.INTERNAL,
                        f"Decompression failed due to {why} error") from None


class MessageReader:
    """Cuts a call's DATA into messages; ``limit`` is --grpc-max-message-size."""

    def __init__(self, limit: int, encoding: bytes):
        self.limit = limit
        self.encoding = encoding
        self.buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> list[bytes | bytearray | Compressed]:
        buf = self.buffer
        if not buf and len(data) >= PREFIX:            # the usual case: one whole message
            size = int.from_bytes(data[1:5], "big")
            if len(data) == PREFIX + size:
                return [self._message(data[0], size, data[PREFIX:])]
        buf += data
        out = []
        while len(buf) >= PREFIX:
            size = int.from_bytes(buf[1:5], "big")
            if size > self.limit:
                raise self._too_large(size)
            if len(buf) < PREFIX + size:
                break
            out.append(self._message(buf[0], size, bytes(buf[PREFIX:PREFIX + size])))
            del buf[:PREFIX + size]
        return out

    def pending(self) -> bool:
        return bool(self.buffer)

    def _too_large(self, size: int) -> CallError:
        return CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Received message larger than max ({size} vs. {self.limit})")

    def _message(self, flag: int, size: int, payload: bytes | bytearray) -> bytes | bytearray | Compressed:
        if size > self.limit:
            raise self._too_large(size)
        if not flag:
            return payload
        if self.encoding in (b"", b"identity"):
            raise CallError(grpc.StatusCode.INTERNAL,
                            "a compressed message arrived without grpc-encoding")
        encoding = self.encoding.decode("latin-1")
        if encoding not in inflating.WBITS:
            raise CallError(grpc.StatusCode.UNIMPLEMENTED,
                            f"Compression algorithm '{encoding}' is not supported (identity, "
                            f"deflate, gzip)")
        return Compressed(payload, encoding)


def timeout_seconds(value: bytes) -> float | None:
    """``grpc-timeout``: up to 8 digits and a unit; None when it cannot be read (no deadline)."""
    unit = _TIMEOUT_UNIT.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def trailers(code: grpc.StatusCode, details: str = "") -> bytes:
    """The status as an HPACK header block (literal fields)."""
    out = http2.encode_literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        # printable ASCII but '%' as itself, everything else percent-encoded UTF-8
        out += http2.encode_literal(b"grpc-message", quote(
            details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return out


def metadata_pairs(headers) -> tuple[tuple[str, str | bytes], ...]:
    pairs: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name[:1] == b":" or name in RESERVED:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            pairs.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            pairs.append((key, value.decode("latin-1")))
    return tuple(pairs)


class CallContext:
    """grpc.aio's ``ServicerContext`` as far as shmserve's handlers use it."""

    __slots__ = ("_headers", "_metadata", "_peer", "deadline", "code", "details", "cancelled_")

    def __init__(self, headers, peer: str, deadline: float | None):
        self._headers = headers
        self._metadata: tuple | None = None
        self._peer = peer
        self.deadline = deadline            # time.monotonic() or None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.cancelled_ = False

    def invocation_metadata(self):
        if self._metadata is None:
            self._metadata = metadata_pairs(self._headers)
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self.cancelled_

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise CallError(code, details)


def failure_status(e: BaseException, context: CallContext | None = None
                   ) -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception ends its call with, as grpc.aio words it."""
    if isinstance(e, CallError):
        return e.code, e.details
    if context is not None and context.code is not None:    # set_code() before raising
        return context.code, context.details
    if isinstance(e, InferError):       # a handler that let one through
        return grpc_status(e.code), e.message
    return grpc.StatusCode.UNKNOWN, f"Unexpected {type(e)}: {e}"
