"""The HTTP/2 core's limits (frontend/http2*.py), in-process with raw frames: what a client can
make it do for nothing is budgeted, what it holds is bounded, SETTINGS apply once per frame, a
call reset in the read that brought it never starts."""
import gc
import struct
import tracemalloc

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from test_http2 import SETTINGS, Owner, Pair, _raw

from shmserve.frontend.http2 import connection as http2
from shmserve.frontend.http2 import headers as http2_headers
from shmserve.frontend.http2.connection import ConnectionError_, Http2Server
from shmserve.frontend.http2.frames import GLITCH_BURST, MAX_CONTINUATIONS, MAX_OWED, RESET_BURST

REQUEST = b"\x83\x86\x84" + http2.encode_literal(b"content-type", b"application/grpc")


def frame(kind, flags, sid, payload=b""):
    return http2.frame_header(len(payload), kind, flags, sid) + payload


def headers(sid, flags=http2.END_HEADERS, block=REQUEST):
    return frame(http2.HEADERS, flags, sid, block)


def ping(payload=b"12345678"):
    return frame(http2.PING, 0, 0, payload)


def feed(server, frames):
    """``frames`` as one read, taken whole: the core stops after DECODE_PER_READ bytes of
    header blocks and is called again (as its owner does on a later turn of the loop)."""
    server.receive(frames)
    while server.more:
        server.receive(b"")


def calm(server, frames):
    with pytest.raises(ConnectionError_) as e:
        feed(server, frames)
    assert e.value.code == http2.ENHANCE_YOUR_CALM, e.value
    return str(e.value)


def started(settings=SETTINGS, owner=None, clock=lambda: 0.0):
    """A connection whose budgets see no time pass (``clock``), whatever the machine's load."""
    server = Http2Server(owner or Owner(), settings, 1 << 20, clock)
    _raw(server, b"")
    server.take()
    return server


FLOODS = [
    ("PING", ping() * (GLITCH_BURST + 10)),
    ("SETTINGS", frame(http2.SETTINGS, 0, 0) * (GLITCH_BURST + 10)),
    ("PRIORITY", frame(http2.PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10") * (GLITCH_BURST + 10)),
    ("empty DATA", headers(1) + frame(http2.DATA, 0, 1) * (GLITCH_BURST + 10)),
    ("empty header block fragments", b"".join(headers(sid, 0, b"") + frame(http2.CONTINUATION, http2.END_HEADERS, sid, REQUEST)
                                              for sid in range(1, 2 * GLITCH_BURST + 20, 2))),
    ("frames on closed streams", headers(1) + frame(http2.RST_STREAM, 0, 1, bytes(4))
     + frame(http2.WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x01") * (GLITCH_BURST + 10)),
    ("stream errors", b"".join(headers(sid, http2.END_HEADERS | http2.END_STREAM, b"\x83\x86")   # no :path
                               for sid in range(1, 2 * GLITCH_BURST + 20, 2))),
]


@pytest.mark.parametrize("what, flood", FLOODS, ids=[f[0] for f in FLOODS])
def test_floods_of_frames_that_cost_and_give_nothing_are_cut_off(what, flood):
    server = started()
    # what is owed is taken as it comes (a reading client): the budget, not MAX_OWED, stops it
    pieces = [flood[i:i + 4000] for i in range(0, len(flood), 4000)]
    with pytest.raises(ConnectionError_) as e:
        for piece in pieces:
            server.receive(piece)
            server.take()
    assert e.value.code == http2.ENHANCE_YOUR_CALM


def test_a_few_control_frames_are_fine():
    server = started()
    for _ in range(10):
        server.receive(ping() * 50 + frame(http2.SETTINGS, 0, 0))
        server.take()


def test_control_frames_owed_to_a_client_that_reads_nothing_are_bounded():
    """PING ACKs pile up only while the owner takes them (writes them out)."""
    server = started()
    server.receive(ping() * (MAX_OWED // 2))
    assert len(server.out) == 17 * (MAX_OWED // 2)
    calm(server, ping() * (MAX_OWED // 2 + 1))
    server = started()
    for _ in range(3):
        server.receive(ping() * (MAX_OWED // 2))
        server.take()


def test_rapid_reset_is_budgeted():
    owner = Owner()
    server = started(owner=owner)
    pairs = b"".join(headers(sid) + frame(http2.RST_STREAM, 0, sid, b"\x00\x00\x00\x08")
                     for sid in range(1, 2 * RESET_BURST + 20, 2))
    message = calm(server, pairs)
    assert "reset" in message and len(owner.resets) >= RESET_BURST - 1


def test_a_call_reset_in_the_same_read_never_hears_its_end():
    owner = Owner()
    server = started(owner=owner)
    server.receive(headers(1) + frame(http2.DATA, http2.END_STREAM, 1, b"body")
                   + frame(http2.RST_STREAM, 0, 1, b"\x00\x00\x00\x08")
                   + headers(3) + frame(http2.DATA, http2.END_STREAM, 3, b"kept"))
    assert 1 in owner.headers and owner.resets == [1]
    assert 1 not in owner.data and 1 not in owner.ended          # never told to start
    assert owner.data[3] == b"kept" and 3 in owner.ended
    assert server.recv_window == (1 << 20) - 4        # stream 1's bytes given back, not 3's


def test_a_settings_frame_is_applied_once():
    class Counting(dict):
        walks = 0

        def values(self):
            Counting.walks += 1
            return super().values()

    server = started()
    server.streams = Counting(server.streams)
    server.receive(b"".join(headers(sid) for sid in range(1, 41, 2)))
    entries = b"".join(struct.pack(">HI", http2.INITIAL_WINDOW_SIZE, 1000 + i) for i in range(32))
    server.receive(frame(http2.SETTINGS, 0, 0, entries))
    assert Counting.walks == 1
    assert all(s.send_window == 1031 for s in server.streams.values())
    calm(server, frame(http2.SETTINGS, 0, 0, entries * 2))      # 64 entries: past MAX_SETTINGS


def test_initial_window_size_overflowing_a_stream_is_a_flow_control_error():
    server = started()
    server.receive(headers(1) + frame(http2.WINDOW_UPDATE, 0, 1, struct.pack(">I", (1 << 31) - 1 - 65535)))
    with pytest.raises(ConnectionError_) as e:
        server.receive(frame(http2.SETTINGS, 0, 0, struct.pack(">HI", http2.INITIAL_WINDOW_SIZE, 65536)))
    assert e.value.code == http2.FLOW_CONTROL_ERROR


def test_a_header_block_is_bounded_in_frames_and_bytes():
    server = started()
    block = headers(1, 0, REQUEST[:2]) + frame(http2.CONTINUATION, 0, 1, REQUEST[2:3])
    message = calm(server, block + frame(http2.CONTINUATION, 0, 1, b"\x82") * MAX_CONTINUATIONS)
    assert "frames" in message
    server = started({**SETTINGS, http2.MAX_HEADER_LIST_SIZE: 1000})
    message = calm(server, headers(1, 0, b"\x82" * 600) + frame(http2.CONTINUATION, 0, 1, b"\x82" * 600))
    assert "past 1064 bytes" in message


def test_a_stream_that_overruns_its_own_window_is_refused():
    server = started({http2.INITIAL_WINDOW_SIZE: 1000, http2.MAX_FRAME_SIZE: 16384})
    with pytest.raises(ConnectionError_) as e:
        server.receive(headers(1) + frame(http2.DATA, 0, 1, bytes(600)) + frame(http2.DATA, 0, 1, bytes(600)))
    assert e.value.code == http2.FLOW_CONTROL_ERROR


def test_an_incomplete_frame_or_block_is_reported():
    server = started()
    assert not server.incomplete and server.pending_bytes == 0
    server.receive(headers(1)[:5])
    assert server.incomplete and server.pending_bytes == 5
    server.receive(headers(1)[5:])
    assert not server.incomplete
    server.receive(headers(3, 0, REQUEST[:3]))
    assert server.incomplete and server.pending_bytes == 3
    server.receive(frame(http2.CONTINUATION, http2.END_HEADERS, 3, REQUEST[3:]))
    assert not server.incomplete and server.pending_bytes == 0


def test_our_headers_follow_a_smaller_header_table_size():
    """RFC 7541 §4.2: a client that shrinks its table hears that ours fits (h2 checks it)."""
    p = Pair({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    sid = p.request()
    p.server.send_headers(sid, b"\x88", end_stream=True)
    p.pump()
    assert p.of(h2.events.ResponseReceived)


def test_after_goaway_new_streams_are_not_taken():
    owner = Owner()
    server = started(owner=owner)
    server.receive(headers(1))
    server.go_away()
    server.receive(headers(3) + frame(http2.DATA, http2.END_STREAM, 3, b"x"))
    assert list(owner.headers) == [1]
    assert server.take().endswith(b"\x00\x00\x00\x01\x00\x00\x00\x00")     # GOAWAY: last 1


class Forgetful(Owner):
    def stream_headers(self, sid, headers, end):
        pass


def test_the_decode_cache_holds_no_large_blocks():
    """Distinct blocks of indexed fields: before, 256 whole blocks and their decoding were kept
    per connection (~1 GiB for 15 MB of headers over 40 connections)."""
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        servers = []
        for _ in range(3):
            server = started({**SETTINGS, http2.MAX_HEADER_LIST_SIZE: 1 << 16}, Forgetful())
            for i in range(60):
                block = REQUEST[:3] + b"\x90" * (200 + i)     # accept-encoding, many times
                server.receive(headers(2 * i + 1, http2.END_HEADERS | http2.END_STREAM, block))
                server.streams.clear()
            servers.append(server)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, grown


def test_the_decode_cache_is_bounded_across_connections():
    gc.collect()
    base = http2_headers.cache_used()
    servers = []
    for _ in range(2 * http2_headers.CACHE_BUDGET // (http2_headers.CACHED_PER_CONNECTION * 4000)):
        server = started()
        for k in range(10):
            block = REQUEST[:3] + b"\x90" * (50 + k)
            server.receive(headers(2 * k + 1, http2.END_HEADERS | http2.END_STREAM, block))
            server.streams.clear()
        assert len(server.decoder.cache) <= http2_headers.CACHED_PER_CONNECTION
        servers.append(server)
    assert base < http2_headers.cache_used() <= http2_headers.CACHE_BUDGET
    assert not servers[-1].decoder.cache                # the budget was spent before it came
    servers[0].close()
    assert not servers[0].decoder.cache
    del servers, server
    gc.collect()
    assert http2_headers.cache_used() == base         # a connection gone gives its share back


def test_repeated_blocks_are_still_decoded_once():
    owner = Owner()
    server = started(owner=owner)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.data_to_send()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", "/a.B/C"),
              (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]
    for sid in (1, 3, 5):
        client.send_headers(sid, fields, end_stream=True)
    server.receive(client.data_to_send())
    assert len(server.decoder.cache) == 1 and len(owner.headers) == 3


class Refusing(Owner):
    """An owner that refuses every call as it starts (a frontend holding all it may hold)."""

    def __init__(self):
        super().__init__()
        self.server = None

    def stream_headers(self, sid, headers, end):
        self.server.reset(sid, http2.REFUSED_STREAM)


@pytest.mark.parametrize("how", ["reset by the owner", "ended by the owner"])
def test_what_a_client_sent_before_it_heard_of_our_close_costs_it_nothing(how):
    """A correct client with many calls in flight that the server refuses or answers early
    still has their DATA (and WINDOW_UPDATEs) on the way: RFC 9113 §5.1 says to drop them.
    Counted as glitches, they cut a well-behaved client off (ENHANCE_YOUR_CALM)."""
    owner = Refusing() if how == "reset by the owner" else Owner()
    server = started(owner=owner)
    owner.server = server
    for round_ in range(8):     # 1,600 calls in all, past GLITCH_BURST
        # 200 calls a round, below the 256 a connection may have open
        sids = range(1 + 400 * round_, 401 + 400 * round_, 2)
        server.receive(b"".join(headers(sid) for sid in sids))
        if how == "ended by the owner":
            for sid in sids:
                server.send_headers(sid, b"\x88", end_stream=True)     # answered at once
        server.take()
        # each call's message was already on its way, and the client's window updates
        server.receive(b"".join(frame(http2.DATA, 0, sid, b"x" * 100)
                                + frame(http2.WINDOW_UPDATE, 0, sid, b"\x00\x00\x00\x10")
                                for sid in sids))
        server.take()


def test_one_read_of_large_header_blocks_is_decoded_over_several_turns():
    """hpack decodes about a byte a microsecond: one 256 KiB read of large header blocks held
    the loop (every other client) for 100 ms and more. The core stops after DECODE_PER_READ
    bytes decoded and says so (``more``); the rest waits in its buffer for ``receive(b"")``."""
    from shmserve.frontend.http2.frames import DECODE_PER_READ
    owner = Owner()
    server = started(owner=owner)
    blocks = [REQUEST + http2.encode_literal(b"x-pad", b"%05d" % sid + b"p" * 2000)
              for sid in range(1, 81, 2)]           # 40 blocks of ~2 KB, none cached
    server.receive(b"".join(headers(sid, block=b) for sid, b in zip(range(1, 81, 2), blocks)))
    first = len(owner.headers)
    assert server.more and 0 < first < 40
    assert first * 2000 <= DECODE_PER_READ + 4000
    turns = 1
    while server.more:
        server.receive(b"")
        turns += 1
        assert turns < 10
    assert len(owner.headers) == 40 and turns >= 3
    assert [v for k, v in owner.headers[79] if k == b"x-pad"][0].startswith(b"00079")
