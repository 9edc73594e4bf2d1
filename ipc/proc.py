"""Process plumbing shared by every shmserve process: parent-death signal, flag-only handlers,
waking a loop that blocks when a stop signal arrives, and a heap the collector leaves alone."""
from __future__ import annotations

import ctypes
import gc
import mmap
import os
import signal
import sys
from typing import Callable

import zmq

from shmserve.ipc import channel, messages, packets
from shmserve.ipc.messages.to_scheduler import Wake

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL us when our parent exits, and exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != expected_parent:
        os._exit(1)


class StopFlag:
    """SIGTERM/SIGINT only set a flag; the process loop notices it and shuts down in order.

    ``on_signal(signum)`` runs on the first signal, after the flag is set: it wakes a loop that
    blocks (see ``InboxWaker``), so the flag is seen at once instead of at the next timeout.
    ``on_repeat(signum)`` runs on every later signal: the operator insists, force the exit.
    Both run as Python-level handlers, in the main thread between bytecodes; on Linux a
    process-directed signal interrupts the main thread's blocking call (EINTR), so the handler
    runs while the loop is still blocked, not after it wakes.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT),
                 on_signal: Callable[[int], None] | None = None,
                 on_repeat: Callable[[int], None] | None = None):
        self.set = False
        self.signum = 0
        self.on_signal = on_signal
        self.on_repeat = on_repeat
        for s in signals:
            signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        if self.set:
            if self.on_repeat is not None:
                self.on_repeat(signum)
            return
        self.set = True
        self.signum = signum
        if self.on_signal is not None:
            self.on_signal(signum)


class StoppingMark:
    """One byte in the run directory, shared by mapping it: the launcher sets it in its signal
    handler, the moment a stop signal arrives; each frontend reads it before taking a request.
    A frontend learns of the stop a hop and a turn of its loop later (the launcher's SIGTERM),
    and would take meanwhile the requests a client sent after its signal; Triton, one process,
    refuses those (its gRPC state-cleanup test sends 15 within 2 ms of its SIGINT).

    With ``--exit-grace-secs`` the stop has a step before that: draining, when the server
    answers "not ready" but still takes requests, so that a load balancer's health check moves
    traffic away before any request is refused."""

    NAME = "stopping"
    STOPPING, DRAINING = 1, 2

    def __init__(self, run_dir: str, create: bool = False):
        path = os.path.join(run_dir, self.NAME)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)

    def set(self) -> None:
        """New requests are refused from now on."""
        self._map[0] = self.STOPPING

    def drain(self) -> None:
        """Not ready from now on; requests are still taken (until ``set``)."""
        if self._map[0] == 0:
            self._map[0] = self.DRAINING

    def is_set(self) -> bool:
        return self._map[0] == self.STOPPING

    def draining(self) -> bool:
        """Draining or stopping: the server is not ready."""
        return self._map[0] != 0

    def close(self) -> None:
        self._map.close()


class InboxWaker:
    """An ``on_signal`` for a loop that blocks in ``Inbox.recv``: posts ``Wake`` into that inbox.

    It connects a PUSH socket to an inproc endpoint; the owner binds its inbox to it as well
    (``inbox.bind_also(waker.address)``, before or after: inproc allows either order). The loop's
    blocking receive then ends with a ``Wake`` and the loop sees the stop flag. Nothing is added
    to the receive path: the loop keeps one socket and one blocking receive.

    Call ``close`` before the ZeroMQ context is terminated.
    """

    def __init__(self, name: str):
        self.address = f"inproc://{name}-signal"
        self.socket = channel.context().socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.address)
        self._wake = messages.encode(Wake())

    def __call__(self, signum: int = 0) -> None:
        try:
            self.socket.send(self._wake, zmq.NOBLOCK)
        except zmq.ZMQError:    # a full inbox is awake anyway; a closed socket: we are exiting
            pass

    def close(self) -> None:
        self.socket.close(0)


def freeze_startup_heap() -> None:
    """Once a process has started (modules imported, model loaded, sockets open), what it holds
    lives as long as the process: take it out of the collector's reach. A full collection over
    a frontend's ~45,000 startup objects stopped it for 33 ms mid-load (a gc.callbacks probe,
    HTTP c=32 on 2 cores); after the freeze a collection walks only what was made since."""
    gc.freeze()


def failure_path(args_path: str) -> str:
    """Where a worker that failed to load writes why, beside its arguments file."""
    return args_path + ".failed"


class PacketWaker:
    """``InboxWaker`` for a ``packets.PacketInbox``: a connection to the inbox itself, on
    which a signal handler posts ``Wake``. ``attach`` it once the inbox exists; a signal
    before that only sets the stop flag, which the loop reads before it blocks."""

    def __init__(self) -> None:
        self.box: packets.PacketOutbox | None = None

    def attach(self, inbox: packets.PacketInbox) -> None:
        self.box = packets.PacketOutbox(inbox.address)

    def __call__(self, signum: int = 0) -> None:
        if self.box is not None:
            try:
                self.box.send(Wake(), (), packets.NOBLOCK)
            except (zmq.Again, packets.PeerGone):   # a full inbox is awake anyway
                pass

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
