"""The sending half of the HTTP/2 core (``http2``): what goes to the client, in frames it
accepts, as its windows allow; and the windows we give back for what it sent."""
from __future__ import annotations

from array import array

from shmserve.frontend.http2.frames import (
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    MAX_OWED,
    NO_ERROR,
    PING,
    RECENT_CLOSED,
    RST_STREAM,
    WINDOW_UPDATE,
    ConnectionError_,
    frame_header,
)


class Stream:
    __slots__ = ("sid", "send_window", "recv_window", "unacked", "remote_closed", "expect",
                 "last", "last_length")
    # the DATA that ended the stream, held to the end of the read that brought it
    # (``Http2Server.receive``); set only then
    last: bytes | bytearray
    last_length: int

    def __init__(self, sid: int, send_window: int, recv_window: int):
        self.sid = sid
        self.send_window = send_window
        self.recv_window = recv_window      # what the client may send before our next update
        self.unacked = 0                    # bytes received and taken, not yet given back
        self.remote_closed = False
        self.expect = -1                    # content-length bytes still to come (-1: none)


class Sender:
    """The output state of a connection; ``Http2Server`` adds the input."""

    def __init__(self, stream_window: int, connection_window: int):
        self.out = bytearray()
        self.streams: dict[int, Stream] = {}        # open and half-closed (remote)
        self.last_stream = 0                        # the highest stream we took (GOAWAY names it)
        self.going_away = False
        self.stream_window = stream_window          # what we let each stream send
        self.connection_window = connection_window
        self.recv_window = connection_window       # once our first WINDOW_UPDATE is read
        self.conn_unacked = 0
        # the peer's side
        self.send_window = DEFAULT_WINDOW           # connection
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16384
        self.table_update = b""                     # owed to the peer's decoder (RFC 7541 §4.2)
        self.owed = 0                               # control frames answered since take()
        self.ping_out = b""                         # the payload of our last PING
        # streams we closed lately, a ring of RECENT_CLOSED slots by stream id (fixed size, made
        # on the first close): the id where we ended the stream, the id + 1 (even: never a
        # client stream) where we reset one the client was still sending on
        self.recent: array | None = None

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
                stream.recv_window += stream.unacked
                stream.unacked = 0

    def _window_update(self, sid: int, increment: int) -> None:
        self.out += frame_header(4, WINDOW_UPDATE, 0, sid) + increment.to_bytes(4, "big")

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        if self.table_update:
            block, self.table_update = self.table_update + block, b""
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

    def send_data(self, sid: int, data: bytes | memoryview) -> int:
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
        if self.streams.pop(sid, None) is not None:
            self._closed(sid, True)

    def _closed(self, sid: int, reset: bool) -> None:
        ring = self.recent
        if ring is None:
            ring = self.recent = array("I", bytes(4 * RECENT_CLOSED))
        ring[(sid >> 1) % RECENT_CLOSED] = sid + 1 if reset else sid

    def closed_lately(self, sid: int) -> int:
        """0: not a stream we closed lately; 1: we ended it; 2: we reset it."""
        ring = self.recent
        if ring is None:
            return 0
        mark = ring[(sid >> 1) % RECENT_CLOSED]
        return 1 if mark == sid else 2 if mark == sid + 1 else 0

    def go_away(self, code: int = NO_ERROR, message: str = "") -> None:
        self.going_away = True
        payload = self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + message.encode()
        self.out += frame_header(len(payload), GOAWAY, 0, 0) + payload

    def _close_local(self, sid: int) -> None:
        """We ended the stream: forget it; a client still sending is told to stop."""
        stream = self.streams.pop(sid, None)
        if stream is None:
            return
        if not stream.remote_closed:
            self.out += frame_header(4, RST_STREAM, 0, sid) + NO_ERROR.to_bytes(4, "big")
        self._closed(sid, not stream.remote_closed)

    def take(self) -> bytearray:
        """What to write, handed over (the transport may keep it): no copy."""
        out, self.out = self.out, bytearray()
        self.owed = 0
        return out

    def ping(self, payload: bytes) -> None:
        self.ping_out = payload
        self.out += frame_header(8, PING, 0, 0) + payload

    def _owe(self, frame: bytes) -> None:
        """A control frame answering the client: past MAX_OWED not taken, it floods us."""
        self.owed += 1
        if self.owed > MAX_OWED:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "control frames answered but not read")
        self.out += frame
