"""Compressed bodies (frontend/http/inflate.py): inflated exactly, never past the limit, corrupt or
cut data refused, and off the event loop."""
import asyncio
import gzip
import zlib

import pytest

from shmserve.frontend.http import inflate

BODIES = [b"", b"abc", bytes(3 << 20), bytes(range(256)) * 9000]


def _compress(raw: bytes, encoding: str) -> bytes:
    return gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("raw", BODIES, ids=["empty", "short", "zeros", "pattern"])
def test_a_body_inflates_to_exactly_what_was_compressed(raw, encoding):
    assert inflate.inflate_now(_compress(raw, encoding), encoding, len(raw)) == raw


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_one_byte_past_the_limit_is_too_large(encoding):
    raw = bytes(3 << 20)
    with pytest.raises(inflate.TooLarge):
        inflate.inflate_now(_compress(raw, encoding), encoding, len(raw) - 1)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_cut_or_corrupt_data_is_refused(encoding):
    data = _compress(bytes(range(256)) * 100, encoding)
    with pytest.raises(inflate.Corrupt, match="truncated"):
        inflate.inflate_now(data[:-6], encoding, 1 << 20)
    with pytest.raises(inflate.Corrupt):
        inflate.inflate_now(b"\x1f\x8b" + bytes(30) if encoding == "gzip" else b"\x78\x9c\xff\xff",
                            encoding, 1 << 20)


def test_inflating_runs_on_a_thread_of_its_own():
    import threading
    seen = []
    real = inflate.inflate_now

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    async def run():
        return await inflate.inflate(gzip.compress(b"x" * 100), "gzip", 100)

    inflate.inflate_now = spy
    try:
        assert asyncio.run(run()) == b"x" * 100
    finally:
        inflate.inflate_now = real
    assert seen and seen[0].startswith("inflate")
