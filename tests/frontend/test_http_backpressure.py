"""HttpConnection's back-pressure, in-process with a transport whose write buffer the test fills
and drains: a client that pipelines without reading stops being read from, its next requests
wait, and it is served again, in order, once it reads (tests/e2e/test_backpressure.py does the
same through a socket)."""
from shmserve.frontend.http.server import HttpApp, HttpConnection, Limits, sweep


class Transport:
    def __init__(self):
        self.buffered = 0           # bytes written and not yet taken by the client
        self.reading = True
        self.aborted = False

    def write(self, data):
        self.buffered += len(data)

    def get_write_buffer_size(self):
        return self.buffered

    def pause_reading(self):
        assert self.reading
        self.reading = False

    def resume_reading(self):
        assert not self.reading
        self.reading = True

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def close(self):
        pass

    def abort(self):
        self.aborted = True

    def get_extra_info(self, name, default=None):
        return default


class LaterApp(HttpApp):
    """Answers each request when the test says so, with a body of the request's path length."""

    def __init__(self):
        self.started: list[str] = []
        self.waiting: list = []

    def handle(self, conn, req):
        self.started.append(req.path)
        if req.path.startswith("/now"):
            conn.respond(req, 200, b"x" * 100)
        else:
            self.waiting.append((conn, req))

    def answer(self, size: int) -> None:
        conn, req = self.waiting.pop(0)
        conn.respond(req, 200, b"x" * size)


def _connect(app, **limits) -> tuple[HttpConnection, Transport]:
    conn = HttpConnection(app, Limits(**limits))
    t = Transport()
    conn.connection_made(t)
    return conn, t


def _get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\n\r\n" % path.encode()


def test_requests_waiting_past_the_bound_stop_the_reading():
    app = LaterApp()
    conn, t = _connect(app, max_pipelined=4)
    conn.data_received(b"".join(_get(f"/r{i}") for i in range(6)))   # one in hand, five queued
    assert app.started == ["/r0"] and len(conn.queue) == 5 and not t.reading
    app.answer(10)                              # one starts: four wait, still at the bound
    assert app.started == ["/r0", "/r1"] and not t.reading
    app.answer(10)
    assert len(conn.queue) == 3 and t.reading


def test_unread_answers_hold_the_next_requests_and_the_reading():
    app = LaterApp()
    conn, t = _connect(app, write_high_water=1000)
    conn.data_received(_get("/a") + _get("/b") + _get("/c"))
    app.answer(5000)                            # the client does not take it
    assert app.started == ["/a"] and not t.reading and len(conn.queue) == 2
    t.buffered = 0                              # the client read everything
    conn.resume_writing()
    assert app.started == ["/a", "/b"] and t.reading
    app.answer(10)
    assert app.started == ["/a", "/b", "/c"]


def test_answers_given_at_once_do_not_recurse():
    """Thousands of requests answered at once, queued behind one that waits: each answer used
    to start the next inside its own call (RecursionError past about 300)."""
    app = LaterApp()
    conn, t = _connect(app, max_pipelined=10_000, write_high_water=1 << 30)
    conn.data_received(_get("/wait") + _get("/now") * 5000)
    app.answer(10)
    assert len(app.started) == 5001 and not conn.queue


def test_a_client_that_never_reads_is_dropped_after_the_idle_timeout():
    app = LaterApp()
    conn, t = _connect(app, write_high_water=1000, idle_timeout_s=300, request_timeout_s=60)
    conn.data_received(_get("/a") + _get("/b"))
    app.answer(5000)
    held_since = conn.last_active
    sweep(conn.limits, held_since + 200)        # past the request timeout: no 408, still held
    assert not t.aborted and not conn.closed
    sweep(conn.limits, held_since + 301)
    assert t.aborted and conn.closed            # abort: close would wait for the unread bytes
