"""The loop server's keep-alive cycle in process (frontend/grpc/loop.py): however many pings a
long-lived connection answers, it holds one pending timer for the cycle, and closing it
cancels what is pending (tests/e2e/test_grpc_loop.py drives the same over real sockets)."""
import asyncio

from shmserve.frontend.grpc import loop as grpc_loop

OPTIONS = {"grpc.keepalive_time_ms": 2, "grpc.keepalive_timeout_ms": 5000,
           "grpc.keepalive_permit_without_calls": 1, "grpc.max_connection_age_ms": 600_000}


class Transport:
    def __init__(self):
        self.written = bytearray()

    def get_extra_info(self, name):
        return ("127.0.0.1", 5) if name == "peername" else None

    def write(self, data):
        self.written += data

    def close(self):
        pass

    def set_write_buffer_limits(self, high=None, low=None):
        pass


def _timer_handles(conn) -> int:
    held = 0
    # (the connection is a compiled class: its attributes are its names, it has no __dict__)
    for value in (getattr(conn, name, None) for name in dir(conn) if not name.startswith("__")):
        for v in value if isinstance(value, (list, tuple, set)) else (value,):
            held += isinstance(v, asyncio.TimerHandle)
    return held


def test_a_long_lived_connection_holds_one_keepalive_timer():
    async def scenario():
        conn = grpc_loop.Connection(grpc_loop.GrpcLoopServer([], 1 << 20, OPTIONS))
        conn.connection_made(Transport())
        for _ in range(40):             # forty pings, each answered
            deadline = asyncio.get_running_loop().time() + 5
            while not conn.ping_sent:
                assert asyncio.get_running_loop().time() < deadline, "no keep-alive ping"
                await asyncio.sleep(0.001)
            conn.ping_acked(b"shmkeepa")
        held = _timer_handles(conn)     # the next ping and the connection's age
        pending = [conn.ping_timer, conn.age_timer]
        conn.connection_lost(None)
        return held, pending

    held, pending = asyncio.run(scenario())
    assert held == 2
    assert all(t is not None and t.cancelled() for t in pending)
