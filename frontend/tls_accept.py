"""A TLS connection counted from its accept, before its handshake.

With ``create_server(ssl=...)`` the protocol hears of a connection only once its handshake is
done, and never of one whose handshake fails: a budget of connections could not count the
ones still shaking hands, and a client that never finishes one would hold a descriptor
uncounted. So the server accepts plain TCP, counts it, and starts TLS itself (``start_tls``),
within ``handshake_s``; the connection's protocol (``make()``, which takes an attribute
``budgeted``: it gives the budget back when it ends) takes over once TLS is up.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Callable

from shmserve.frontend.connections import Budget

log = logging.getLogger("shmserve.grpc")
_HANDSHAKES: set[asyncio.Task] = set()


class TlsAccept(asyncio.Protocol):
    """A TLS connection from its accept: counted in the budget before its handshake (which may
    take the handshake time), then handed to ``make()``'s connection. The event loop reads the
    socket from the accept on, so what arrives before start_tls takes the transport (the
    ClientHello, often) is kept here and handed to the TLS protocol before it begins."""

    def __init__(self, make: Callable[[], asyncio.Protocol], tls: ssl.SSLContext,
                 budget: Budget | None, handshake_s: float):
        self.make, self.tls, self.budget, self.handshake_s = make, tls, budget, handshake_s
        self.task: asyncio.Task | None = None
        self.counted = False
        self.early: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        budget = self.budget
        if budget is not None:
            if not budget.take():
                transport.abort()
                return
            self.counted = True
        self.transport = transport
        self.task = asyncio.get_running_loop().create_task(self.handshake(transport))
        _HANDSHAKES.add(self.task)          # the loop keeps only weak references to tasks
        self.task.add_done_callback(_HANDSHAKES.discard)

    def data_received(self, data: bytes) -> None:
        self.early.append(data)
        assert self.transport is not None
        self.transport.pause_reading()      # start_tls reads again; one piece is enough

    def connection_lost(self, exc) -> None:     # before start_tls took the transport
        if self.task is not None:
            self.task.cancel()
        self.give()

    def give(self) -> None:
        if self.counted and self.budget is not None:
            self.counted = False
            self.budget.give()

    def _hand_early(self, transport) -> None:
        """Runs after start_tls has set its protocol and before that protocol starts: bytes
        given to it now only go into its input buffer, where the handshake will read them."""
        tls = transport.get_protocol()
        for data in self.early:
            view = memoryview(data)
            while view:
                buf = tls.get_buffer(len(view))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                tls.buffer_updated(n)
                view = view[n:]
        self.early = []

    async def handshake(self, transport) -> None:
        early = _Early()
        loop = asyncio.get_running_loop()
        if self.early:
            loop.call_soon(self._hand_early, transport)
        why: BaseException | None = None
        try:
            tls = await loop.start_tls(transport, early, self.tls, server_side=True,
                                       ssl_handshake_timeout=self.handshake_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError) as e:
            tls, why = None, e
        if tls is None:         # refused, cut off or too slow: the client sees the socket close
            log.debug("TLS handshake failed: %s", why)
            transport.abort()
            self.give()
            return
        conn = self.make()
        conn.budgeted, self.counted = self.counted, False     # type: ignore[attr-defined]
        tls.set_protocol(conn)
        conn.connection_made(tls)
        early.hand_over(conn)


class _Early(asyncio.Protocol):
    """What arrives between the end of the handshake and the connection taking over."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.lost: tuple | None = None

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def connection_lost(self, exc) -> None:
        self.lost = (exc,)

    def hand_over(self, conn: asyncio.Protocol) -> None:
        for data in self.data:
            conn.data_received(data)
        if self.lost is not None:
            conn.connection_lost(self.lost[0])
