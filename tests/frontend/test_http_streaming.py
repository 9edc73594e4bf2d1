"""HttpConnection's streamed answers (the generate extension's Server-Sent Events), in-process:
chunked framing that keeps the connection usable for the next pipelined request, a close-delimited
body for HTTP/1.0 clients, and back-pressure on the writer."""
import asyncio

from shmserve.frontend.http.server import HttpApp, HttpConnection, Limits


class Transport:
    def __init__(self):
        self.out = bytearray()
        self.unsent = 0             # bytes written and not yet taken by the client
        self.closed = self.aborted = False

    def write(self, data):
        self.out += data
        self.unsent += len(data)

    def get_write_buffer_size(self):
        return self.unsent

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True

    def get_extra_info(self, name, default=None):
        return default


class StreamApp(HttpApp):
    """/stream requests are kept for the test to stream; others are answered at once."""

    def __init__(self):
        self.streams: list = []

    def handle(self, conn, req):
        if req.path == "/stream":
            self.streams.append(req)
        else:
            conn.respond(req, 200, b"ok", content_type="text/plain")


def _connect(**limits):
    app = StreamApp()
    conn = HttpConnection(app, Limits(**limits))
    t = Transport()
    conn.connection_made(t)
    return app, conn, t


def test_chunked_stream_then_the_next_pipelined_request():
    app, conn, t = _connect()
    conn.data_received(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
                       b"GET /next HTTP/1.1\r\n\r\n")
    req = app.streams[0]
    assert len(conn.queue) == 1             # the next one waits for the stream to end
    conn.start_stream(req, 200, "text/event-stream; charset=utf-8")
    conn.send_chunk(req, b"data: {}\n\n")
    conn.send_chunk(req, b"")               # nothing: no chunk (an empty one would end it)
    conn.send_chunk(req, b"data: {\"a\":1}\n\n")
    assert len(conn.queue) == 1
    conn.end_stream(req)
    head, _, rest = bytes(t.out).partition(b"\r\n\r\n")
    assert head.split(b"\r\n") == [b"HTTP/1.1 200 OK",
                                   b"Content-Type: text/event-stream; charset=utf-8",
                                   b"Transfer-Encoding: chunked"]
    body, _, after = rest.partition(b"0\r\n\r\n")
    assert body == b"a\r\ndata: {}\n\n\r\nf\r\ndata: {\"a\":1}\n\n\r\n"
    assert after.startswith(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n") and after.endswith(b"ok")
    assert not t.closed and not conn.busy


def test_http10_client_gets_a_close_delimited_body():
    app, conn, t = _connect()
    conn.data_received(b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    req = app.streams[0]
    conn.start_stream(req, 400, "text/event-stream; charset=utf-8")
    conn.send_chunk(req, b"data: {\"error\":\"x\"}\n\n")
    conn.end_stream(req)
    head, _, body = bytes(t.out).partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    assert head.startswith(b"HTTP/1.1 400 Bad Request")
    assert body == b"data: {\"error\":\"x\"}\n\n" and t.closed and conn.closed


def test_writer_waits_for_a_slow_client():
    async def run():
        app, conn, t = _connect(write_high_water=100)
        conn.data_received(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        req = app.streams[0]
        conn.start_stream(req, 200, "text/event-stream")
        assert await conn.writable(5)            # little unsent: go on at once
        conn.send_chunk(req, b"x" * 200)
        waiting = asyncio.ensure_future(conn.writable(5))
        await asyncio.sleep(0)
        assert not waiting.done()                # past the high-water mark: wait for the client
        t.unsent = 0
        conn.resume_writing()                    # the client took it all
        assert await asyncio.wait_for(waiting, 5) is True
        conn.send_chunk(req, b"x" * 200)
        assert await conn.writable(0.01) is False  # a client that takes nothing is cut off
        assert t.aborted and conn.closed
        conn.connection_lost(None)
        assert await conn.writable(5) is False
    asyncio.run(run())


def test_a_lost_connection_wakes_the_writer():
    async def run():
        app, conn, t = _connect(write_high_water=10)
        conn.data_received(b"POST /stream HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        req = app.streams[0]
        conn.start_stream(req, 200, "text/event-stream")
        conn.send_chunk(req, b"x" * 200)
        waiting = asyncio.ensure_future(conn.writable(30))
        await asyncio.sleep(0)
        conn.connection_lost(None)
        assert await asyncio.wait_for(waiting, 5) is False
        conn.send_chunk(req, b"more")            # nothing is written on a closed connection
        conn.end_stream(req)
        assert not bytes(t.out).endswith(b"more\r\n")
    asyncio.run(run())
