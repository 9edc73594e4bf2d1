"""HPACK for the HTTP/2 core (``http2``): decoding a client's header blocks, with a bounded cache,
and the checks RFC 9113 §8.2-8.3 make of a request's (or trailers') fields.

Decoding (Huffman, the dynamic table) is the ``hpack`` library's. It costs ~14 µs for the
8-field block a gRPC client sends from its second call on, three times what the rest of the
core spends on a call (bench/http2_cost.py); such a block, made only of indexed fields, cannot
change the dynamic table, so its decoding (and its checks) is remembered until a block that
could change the table arrives. The cache is small on purpose: only short blocks, a few per
connection, and a byte budget shared by every connection of the process, so that header
traffic cannot grow memory (a cache of whole blocks once held ~1 GiB for ~15 MB of headers).

Our own header blocks use no dynamic table (literal fields without indexing), so they are
built once or by ``encode_literal``.
"""
from __future__ import annotations

import re
from typing import cast

import hpack

# a block of only indexed fields: every byte is one of these (or the tail of a large index)
_ALL_HIGH = bytes(range(128, 256))
CACHED_BLOCK_MAX = 64           # bytes: a gRPC client's repeated block is ~8-20
CACHED_PER_CONNECTION = 8       # blocks (a client calling a few methods or models)
CACHE_BUDGET = 4 << 20          # bytes, estimated, held by the caches of all connections
_ENTRY_COST = 200               # a dict slot, a tuple, the key's object header
_FIELD_COST = 64                # a HeaderTuple and its list slot (its bytes are the table's)
_used = 0                       # what all caches hold now (one event loop: no lock needed)

# RFC 9113 §8.2.1: lowercase token characters only (the pseudo-headers' colon apart)
_NAME_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
# A regular field's value may start or end with whitespace, although RFC 9113 §8.2.1 says it
# must not: gRPC's own server takes it (so Triton does), and gRPC clients send what their user
# gave (Triton's header-forwarding tests send a value that ends with a space). NUL, CR and LF,
# what could split a field when it is passed on, stay refused.
_BAD_REGULAR_VALUE = re.compile(rb"[\x00\r\n]")
_CONNECTION_SPECIFIC = frozenset((b"connection", b"proxy-connection", b"keep-alive",
                                  b"transfer-encoding", b"upgrade"))
_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))

Headers = list          # of (name, value) byte pairs, as hpack gives them
Decoded = tuple         # (headers, what is malformed in them as a request or "", content-length)


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


def cache_used() -> int:
    """Bytes (estimated) that the decode caches of all connections hold."""
    return _used


class HeaderDecoder:
    """One connection's HPACK decoder and its cache of decoded all-indexed blocks."""

    __slots__ = ("decoder", "cache", "cost")

    def __init__(self, max_header_list_size: int):
        self.decoder = hpack.Decoder(max_header_list_size)
        self.cache: dict[bytes, Decoded] = {}
        self.cost = 0

    def decode(self, block: bytes) -> Decoded:
        """The block's fields, checked as a request's; raises hpack.HPACKError."""
        hit = self.cache.get(block)
        if hit is not None:
            return hit
        headers = cast(Headers, self.decoder.decode(block, raw=True))     # a list, in fact
        problem, length = check_request(headers)
        decoded = (headers, problem, length)
        if block.translate(None, _ALL_HIGH):
            self.forget()           # the block may have changed the dynamic table
        elif len(block) <= CACHED_BLOCK_MAX and len(self.cache) < CACHED_PER_CONNECTION:
            global _used
            cost = _ENTRY_COST + len(block) + _FIELD_COST * len(headers)
            if _used + cost <= CACHE_BUDGET:
                self.cache[block] = decoded
                self.cost += cost
                _used += cost
        return decoded

    def forget(self) -> None:
        if self.cache:
            global _used
            self.cache.clear()
            _used -= self.cost
            self.cost = 0

    def __del__(self) -> None:          # the connection is gone: its share of the budget too
        self.forget()


def _field_problem(name: bytes, value: bytes) -> str:
    if not name or name.translate(None, _NAME_CHARS):
        return f"the field name {name[:40]!r} is not a lowercase token"
    if _BAD_REGULAR_VALUE.search(value):
        return f"the value of {name[:40]!r} has NUL, CR or LF"
    if name in _CONNECTION_SPECIFIC:
        return f"connection-specific field {name!r}"
    if name == b"te" and value != b"trailers":
        return "te other than 'trailers'"
    return ""


def check_request(headers: Headers) -> tuple[str, int]:
    """What makes ``headers`` a malformed request (RFC 9113 §8.2-8.3), or ""; and the
    content-length it declares (-1: none)."""
    pseudo: set[bytes] = set()
    regular = False
    length = -1
    method = b""
    for name, value in headers:
        if name[:1] == b":":
            if regular:
                return f"pseudo-header {name!r} after a regular field", -1
            if name not in _PSEUDO:
                return f"pseudo-header {name[:40]!r} is not a request's", -1
            if name in pseudo:
                return f"pseudo-header {name!r} twice", -1
            pseudo.add(name)
            if _BAD_VALUE.search(value):
                return f"the value of {name!r} has NUL, CR, LF or surrounding whitespace", -1
            if name == b":method":
                method = value
            elif name == b":path" and not value:
                return "an empty :path", -1
            continue
        regular = True
        problem = _field_problem(name, value)
        if problem:
            return problem, -1
        if name == b"content-length":
            if not value.isdigit() or (length >= 0 and int(value) != length):
                return "a bad content-length", -1
            length = int(value)
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
            return "a CONNECT request's pseudo-headers", -1
    elif len(pseudo & {b":method", b":scheme", b":path"}) != 3:
        return "a request without :method, :scheme or :path", -1
    return "", length


def check_trailers(headers: Headers) -> str:
    """What makes ``headers`` malformed trailers (no pseudo-headers), or ""."""
    for name, value in headers:
        if name[:1] == b":":
            return f"pseudo-header {name[:40]!r} in trailers"
        problem = _field_problem(name, value)
        if problem:
            return problem
    return ""
