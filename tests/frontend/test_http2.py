"""The HTTP/2 server core (frontend/http2/connection.py) against an independent implementation: the ``h2``
library as the client, bytes passed by hand, no sockets."""
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from shmserve.frontend.http2 import connection as http2
from shmserve.frontend.http2.connection import ConnectionError_, Http2Server

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/pkg.Svc/Method"),
           (":authority", "localhost"), ("te", "trailers"),
           ("content-type", "application/grpc")]
SETTINGS = {http2.INITIAL_WINDOW_SIZE: 1 << 20, http2.MAX_FRAME_SIZE: 1 << 20,
            http2.MAX_HEADER_LIST_SIZE: 1 << 16}


class Owner:
    def __init__(self):
        self.headers, self.data, self.resets = {}, {}, []
        self.ended, self.windows, self.goaway = set(), 0, False

    def stream_headers(self, sid, headers, end):
        self.headers[sid] = [(bytes(k), bytes(v)) for k, v in headers]
        if end:
            self.ended.add(sid)

    def stream_data(self, sid, data, length, end):
        self.data[sid] = self.data.get(sid, b"") + data
        if end:
            self.ended.add(sid)

    def stream_reset(self, sid):
        self.resets.append(sid)

    def window_opened(self):
        self.windows += 1

    def peer_going_away(self):
        self.goaway = True

    def ping_acked(self, payload):
        self.acked = payload


class Pair:
    """A server core and an h2 client wired back to back."""

    def __init__(self, client_settings=None, settings=SETTINGS, window=1 << 24):
        self.owner = Owner()
        self.server = Http2Server(self.owner, settings, window)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.client.initiate_connection()
        if client_settings:
            self.client.update_settings(client_settings)
        self.events = []
        self.pump()

    def pump(self, chunk: int = 0):
        for _ in range(8):
            out = self.client.data_to_send()
            if out:
                if chunk:
                    for i in range(0, len(out), chunk):
                        self.server.receive(out[i:i + chunk])
                else:
                    self.server.receive(out)
            back = self.server.take()
            if back:
                self.events += self.client.receive_data(back)
            if not out and not back:
                return
        raise AssertionError("the two sides never went quiet")

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def request(self, body=b"hello", headers=REQUEST, chunk=0):
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, headers)
        self.client.send_data(sid, body, end_stream=True)
        self.pump(chunk)
        return sid


def test_settings_are_exchanged_and_acknowledged():
    p = Pair({h2.settings.SettingCodes.MAX_FRAME_SIZE: 32768})
    assert p.of(h2.events.SettingsAcknowledged)         # the server acknowledged ours
    changed = p.of(h2.events.RemoteSettingsChanged)[0].changed_settings
    assert changed[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE].new_value == 1 << 20
    assert p.server.peer_max_frame == 32768
    assert p.client.outbound_flow_control_window == 1 << 24      # the connection window


@pytest.mark.parametrize("chunk", [0, 1, 7])
def test_a_request_and_its_answer(chunk):
    p = Pair()
    sid = p.request(b"x" * 1000, chunk=chunk)
    assert (b":path", b"/pkg.Svc/Method") in p.owner.headers[sid]
    assert p.owner.data[sid] == b"x" * 1000 and sid in p.owner.ended
    p.server.send_headers(sid, b"\x88" + http2.encode_literal(b"content-type", b"application/grpc"))
    assert p.server.send_data(sid, b"answer") == 6
    p.server.send_headers(sid, http2.encode_literal(b"grpc-status", b"0"), end_stream=True)
    p.pump()
    response = p.of(h2.events.ResponseReceived)[0]
    assert (b":status", b"200") in response.headers
    assert b"".join(e.data for e in p.of(h2.events.DataReceived)) == b"answer"
    assert p.of(h2.events.TrailersReceived)[0].headers == [(b"grpc-status", b"0")]
    assert p.of(h2.events.StreamEnded)
    assert sid not in p.server.streams


def test_header_decoding_follows_the_dynamic_table():
    """Blocks of indexed fields are remembered; a block that changes the table forgets them."""
    p = Pair()
    for i in range(40):
        value = f"v{i % 3}"
        sid = p.request(headers=REQUEST + [("x-key", value)])
        assert (b"x-key", value.encode()) in p.owner.headers[sid]
    assert p.server.decoder.cache      # some all-indexed blocks were seen


def test_a_header_block_across_continuation_frames():
    p = Pair({h2.settings.SettingCodes.MAX_FRAME_SIZE: 16384})
    big = [(f"x-meta-{i}", "v" * 500) for i in range(60)]         # ~30 KB: 2+ frames
    sid = p.request(headers=REQUEST + big)
    assert len(p.owner.headers[sid]) == len(REQUEST) + 60
    block = b"".join(http2.encode_literal(f"t{i}".encode(), b"w" * 500) for i in range(60))
    p.server.send_headers(sid, b"\x88" + block, end_stream=True)      # over peer_max_frame
    p.pump()
    assert len(p.of(h2.events.ResponseReceived)[0].headers) == 61


def test_data_is_cut_to_the_peers_frame_size_and_window():
    p = Pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 50_000})
    sid = p.request()
    p.server.send_headers(sid, b"\x88")
    payload = bytes(range(256)) * 400                             # 102,400 bytes
    sent = p.server.send_data(sid, payload)
    assert sent == 50_000 and p.server.room(sid) == 0
    p.pump()
    got = b"".join(e.data for e in p.of(h2.events.DataReceived))
    assert got == payload[:sent]
    assert all(len(e.data) <= 16384 for e in p.of(h2.events.DataReceived))
    opened = p.owner.windows
    for e in p.of(h2.events.DataReceived):
        p.client.acknowledge_received_data(e.flow_controlled_length, sid)
    p.client.increment_flow_control_window(100_000, stream_id=sid)
    p.client.increment_flow_control_window(100_000)                  # the connection's
    p.pump()
    assert p.owner.windows > opened
    assert p.server.send_data(sid, payload[sent:]) == len(payload) - sent


def test_inbound_data_is_given_back_by_window_updates():
    p = Pair(settings={http2.INITIAL_WINDOW_SIZE: 65535}, window=65535)
    sid = p.client.get_next_available_stream_id()
    p.client.send_headers(sid, REQUEST)
    for _ in range(4):
        p.client.send_data(sid, b"y" * 15000)
    p.pump()
    assert p.client.local_flow_control_window(sid) == 5535
    p.server.ack(sid, 60000)
    p.pump()
    assert p.client.local_flow_control_window(sid) == 65535
    assert p.client.outbound_flow_control_window == 65535


def test_ping_is_answered_with_its_payload():
    p = Pair()
    p.client.ping(b"12345678")
    p.pump()
    assert p.of(h2.events.PingAckReceived)[0].ping_data == b"12345678"


def test_our_ping_is_acknowledged_to_the_owner():
    p = Pair()
    p.server.ping(b"keepaliv")
    p.pump()
    assert p.of(h2.events.PingReceived) and p.owner.acked == b"keepaliv"


def test_reset_and_goaway_reach_the_owner():
    p = Pair()
    sid = p.client.get_next_available_stream_id()
    p.client.send_headers(sid, REQUEST)
    p.client.reset_stream(sid, 8)
    p.pump()
    assert p.owner.resets == [sid] and sid not in p.server.streams
    p.client.close_connection()
    p.pump()
    assert p.owner.goaway


def test_an_answer_before_the_request_ended_resets_the_stream():
    p = Pair()
    sid = p.client.get_next_available_stream_id()
    p.client.send_headers(sid, REQUEST)
    p.pump()
    p.server.send_headers(sid, b"\x88", end_stream=True)
    p.pump()
    assert p.of(h2.events.StreamReset)[0].error_code == 0


def test_goaway_names_the_last_stream():
    p = Pair()
    sid = p.request()
    p.server.go_away(http2.NO_ERROR, "bye")
    p.pump()
    ended = p.of(h2.events.ConnectionTerminated)[0]
    assert ended.last_stream_id == sid and ended.additional_data == b"bye"


def _raw(server: Http2Server, frames: bytes):
    server.receive(http2.PREFACE + http2.frame_header(0, http2.SETTINGS, 0, 0) + frames)


@pytest.mark.parametrize("frames, code", [
    (http2.frame_header(2 << 20, http2.DATA, 0, 1), http2.FRAME_SIZE_ERROR),
    (http2.frame_header(4, http2.WINDOW_UPDATE, 0, 0) + bytes(4), http2.PROTOCOL_ERROR),
    (http2.frame_header(3, http2.PING, 0, 0) + b"abc", http2.FRAME_SIZE_ERROR),
    (http2.frame_header(5, http2.SETTINGS, 0, 0) + bytes(5), http2.FRAME_SIZE_ERROR),
    (http2.frame_header(6, http2.SETTINGS, 0, 0) + b"\x00\x04\xff\xff\xff\xff",
     http2.FLOW_CONTROL_ERROR),
    (http2.frame_header(0, http2.PUSH_PROMISE, 0, 1), http2.PROTOCOL_ERROR),
    (http2.frame_header(1, http2.HEADERS, http2.END_HEADERS, 2) + b"\x88",
     http2.PROTOCOL_ERROR),
    (http2.frame_header(1, http2.HEADERS, http2.END_HEADERS, 1) + b"\xff",
     http2.COMPRESSION_ERROR),
    (http2.frame_header(1, http2.HEADERS, 0, 1) + b"\x88"
     + http2.frame_header(0, http2.PING, 0, 0), http2.PROTOCOL_ERROR),
])
def test_protocol_errors_end_the_connection_with_their_code(frames, code):
    with pytest.raises(ConnectionError_) as e:
        _raw(Http2Server(Owner(), SETTINGS, 1 << 20), frames)
    assert e.value.code == code


def test_an_endless_header_block_is_refused():
    """CONTINUATION frames may not grow one header block past twice the header list limit."""
    server = Http2Server(Owner(), SETTINGS, 1 << 20)
    piece = http2.frame_header(16000, http2.CONTINUATION, 0, 1) + b"\x00" * 16000
    frames = http2.frame_header(1, http2.HEADERS, 0, 1) + b"\x88" + piece * 10
    with pytest.raises(ConnectionError_) as e:
        _raw(server, frames)
    assert e.value.code == http2.ENHANCE_YOUR_CALM


def test_streams_past_the_limit_are_refused_and_the_others_go_on():
    owner = Owner()
    server = Http2Server(owner, {**SETTINGS, http2.MAX_CONCURRENT_STREAMS: 2}, 1 << 20)
    block = b"\x83\x86\x84" + http2.encode_literal(b"content-type", b"application/grpc")
    _raw(server, b"".join(http2.frame_header(len(block), http2.HEADERS, http2.END_HEADERS, sid)
                          + block for sid in (1, 3, 5)))
    assert sorted(owner.headers) == [1, 3]
    refused = http2.frame_header(4, http2.RST_STREAM, 0, 5) + \
        http2.REFUSED_STREAM.to_bytes(4, "big")
    assert server.take().endswith(refused)


def test_a_client_that_overruns_the_window_is_refused():
    server = Http2Server(Owner(), {http2.INITIAL_WINDOW_SIZE: 65535,
                                   http2.MAX_FRAME_SIZE: 1 << 20}, 65535)
    block = b"\x83\x86\x84" + http2.encode_literal(b"content-type", b"application/grpc")
    frames = http2.frame_header(len(block), http2.HEADERS, http2.END_HEADERS, 1) + block
    frames += http2.frame_header(70000, http2.DATA, 0, 1) + bytes(70000)
    with pytest.raises(ConnectionError_) as e:
        _raw(server, frames)
    assert e.value.code == http2.FLOW_CONTROL_ERROR


def test_what_is_not_http2_is_refused():
    with pytest.raises(ConnectionError_):
        Http2Server(Owner(), SETTINGS, 1 << 20).receive(b"GET / HTTP/1.1\r\n\r\n")
    server = Http2Server(Owner(), SETTINGS, 1 << 20)
    preface = http2.PREFACE + http2.frame_header(0, http2.SETTINGS, 0, 0)
    server.receive(preface[:10])                    # a preface in pieces is fine
    server.receive(preface[10:30])
    assert not server.preface_seen
    server.receive(preface[30:])
    assert server.preface_seen


@pytest.mark.parametrize("value, bits", [(0, 7), (126, 7), (127, 7), (1337, 5), (1 << 20, 6)])
def test_hpack_integers_round_trip(value, bits):
    import hpack.hpack
    encoded = http2.encode_int(value, bits)
    assert hpack.hpack.decode_integer(encoded, bits) == (value, len(encoded))
