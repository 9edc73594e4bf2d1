"""gRPC's message framing, compression, timeouts and status trailers on the loop server
(frontend/grpc/call.py)."""
import asyncio
import gzip
import zlib

import grpc
import hpack
import pytest

from shmserve.frontend.grpc import call as grpc_call
from shmserve.frontend.grpc.call import CallContext, CallError, MessageReader
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode


def test_messages_are_cut_from_any_split_of_the_bytes():
    wire = b"".join(grpc_call.frame(m) for m in (b"one", b"", b"three" * 100))
    for step in (1, 2, 5, 7, 64, len(wire)):
        reader = MessageReader(1 << 20, b"")
        got = []
        for i in range(0, len(wire), step):
            got += reader.feed(wire[i:i + step])
        assert got == [b"one", b"", b"three" * 100] and not reader.pending()


def _inflated(reader: MessageReader, wire: bytes) -> list[bytes]:
    async def run():
        return [await grpc_call.inflate(m, reader.limit) for m in reader.feed(wire)]
    return asyncio.run(run())


@pytest.mark.parametrize("encoding, compress", [(b"gzip", gzip.compress),
                                                (b"deflate", zlib.compress)])
@pytest.mark.parametrize("size", [50, 50_000])      # inflated on the loop, on the thread
def test_compressed_messages_are_inflated(encoding, compress, size):
    body = compress(b"payload" * size)
    wire = b"\x01" + len(body).to_bytes(4, "big") + body
    assert _inflated(MessageReader(1 << 20, encoding), wire) == [b"payload" * size]


def test_a_message_past_the_limit_is_refused_before_it_is_read_whole():
    reader = MessageReader(100, b"")
    with pytest.raises(CallError) as e:
        reader.feed(b"\x00" + (101).to_bytes(4, "big") + b"x" * 10)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details == "Received message larger than max (101 vs. 100)"


@pytest.mark.parametrize("size, limit", [(10_000, 1000), (64 << 20, 100_000)])
def test_a_compressed_message_is_held_to_the_limit_once_inflated(size, limit):
    """grpcio's status and text; the inflated bytes never pass the limit (a 64 MiB bomb of 65
    KB is cut at 100,001 bytes, not inflated whole first)."""
    body = gzip.compress(b"\x00" * size)
    wire = b"\x01" + len(body).to_bytes(4, "big") + body
    with pytest.raises(CallError) as e:
        _inflated(MessageReader(limit, b"gzip"), wire)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details == "Decompressed message larger than max"


@pytest.mark.parametrize("body, why", [(b"\x1f\x8b\x08garbage", "zlib"), (b"garbage" * 300, "zlib"),
                                       (gzip.compress(b"x" * 5000, mtime=0)[:-20], "data")])
def test_a_corrupt_compressed_message_is_internal_as_grpcio_says(body, why):
    wire = b"\x01" + len(body).to_bytes(4, "big") + body
    with pytest.raises(CallError) as e:
        _inflated(MessageReader(1 << 20, b"gzip"), wire)
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert e.value.details == f"Decompression failed due to {why} error"


@pytest.mark.parametrize("encoding, code", [(b"snappy", grpc.StatusCode.UNIMPLEMENTED),
                                            (b"", grpc.StatusCode.INTERNAL)])
def test_a_compressed_message_it_cannot_read_fails_the_call(encoding, code):
    with pytest.raises(CallError) as e:
        MessageReader(1000, encoding).feed(b"\x01\x00\x00\x00\x02ab")
    assert e.value.code == code


@pytest.mark.parametrize("value, seconds", [(b"5S", 5.0), (b"250m", 0.25), (b"3H", 10800.0),
                                            (b"100u", 1e-4), (b"2M", 120.0), (b"7n", 7e-9),
                                            (b"5x", None), (b"S", None), (b"123456789S", None)])
def test_grpc_timeout_values(value, seconds):
    got = grpc_call.timeout_seconds(value)
    assert got == pytest.approx(seconds) if seconds is not None else got is None


def test_status_trailers_percent_encode_what_is_not_printable():
    block = grpc_call.trailers(grpc.StatusCode.NOT_FOUND, "model 'ü' 100% gone\n")
    headers = dict(hpack.Decoder().decode(block))
    assert headers == {"grpc-status": "5", "grpc-message": "model '%C3%BC' 100%25 gone%0A"}


def test_invocation_metadata_leaves_out_protocol_headers_and_decodes_binary():
    headers = [(b":path", b"/x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
               (b"grpc-timeout", b"1S"), (b"triton-grpc-protocol-k", b"v"),
               (b"trace-bin", b"AAEC")]
    ctx = CallContext(headers, "ipv4:127.0.0.1:5", None)
    assert ctx.invocation_metadata() == (("triton-grpc-protocol-k", "v"),
                                         ("trace-bin", b"\x00\x01\x02"))
    assert ctx.peer() == "ipv4:127.0.0.1:5" and ctx.time_remaining() is None


def test_abort_raises_the_status():
    with pytest.raises(CallError) as e:
        asyncio.run(CallContext([], "", None).abort(grpc.StatusCode.UNAVAILABLE, "restricted"))
    assert grpc_call.failure_status(e.value) == (grpc.StatusCode.UNAVAILABLE, "restricted")


def test_failure_status_of_other_exceptions():
    ctx = CallContext([], "", None)
    assert grpc_call.failure_status(ValueError("bad"), ctx) == (
        grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>: bad")
    assert grpc_call.failure_status(InferError(ErrorCode.NOT_FOUND, "gone"), ctx) == (
        grpc.StatusCode.NOT_FOUND, "gone")
    ctx.set_code(grpc.StatusCode.UNIMPLEMENTED)
    ctx.set_details("Method not implemented!")
    assert grpc_call.failure_status(NotImplementedError(), ctx) == (
        grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")


@pytest.mark.parametrize("address, name", [(("127.0.0.1", 5), "ipv4:127.0.0.1:5"),
                                           (("::1", 6, 0, 0), "ipv6:[::1]:6"),
                                           ("/tmp/s", "unix:/tmp/s"), (None, "")])
def test_peer_names_read_as_grpcs(address, name):
    assert grpc_call.peer_name(address) == name
