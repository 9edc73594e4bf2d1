"""Compressed request bodies, inflated with a bound and off the event loop.

A few hundred KiB of gzip can stand for a gigabyte of zeros, and inflating even 64 MiB takes
the loop 0.2-0.4 s on the machines measured: every other client would wait that long. So a body
is inflated on one thread of its own (zlib lets go of the GIL while it works), a piece at a
time and never past ``limit`` bytes, one body at a time: what is held at once is one inflated
body, whatever the number of clients sending them.
"""
from __future__ import annotations

import asyncio
import zlib
from concurrent.futures import ThreadPoolExecutor

WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
PIECE = 1 << 20                 # inflated at a time

_pool: ThreadPoolExecutor | None = None


class TooLarge(Exception):
    """The body inflates to more than the limit."""


class Corrupt(Exception):
    """The body is not valid compressed data, or stops before its end."""


def inflate_now(data, encoding: str, limit: int) -> bytearray:
    """``data`` inflated; raises TooLarge past ``limit`` bytes, Corrupt for bad or cut data.
    Inflated a piece at a time into one growing buffer: what is held at the peak is the
    output and one piece (inflating in one call would hold zlib's blocks and their join)."""
    d = zlib.decompressobj(WBITS[encoding])
    out = bytearray()
    tail = data
    try:
        while True:
            piece = d.decompress(tail, PIECE)
            out += piece
            if len(out) > limit:
                raise TooLarge
            tail = d.unconsumed_tail
            if d.eof or (not tail and len(piece) < PIECE):
                break
        out += d.flush()
    except zlib.error as e:
        raise Corrupt(str(e)) from None
    if len(out) > limit:
        raise TooLarge
    if not d.eof:
        raise Corrupt("truncated")
    return out


async def inflate(data, encoding: str, limit: int) -> bytearray:
    """``inflate_now`` on the inflating thread."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="inflate")
    return await asyncio.get_running_loop().run_in_executor(_pool, inflate_now, data, encoding,
                                                            limit)
