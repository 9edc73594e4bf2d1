"""The BLS client's inbox, read by the thread that waits for an answer.

A background thread that reads the inbox and hands each answer to the waiting thread costs a
second wake-up on every call: the reader wakes for the answer, then wakes the caller. Here
whoever holds the reading token reads: the background thread while no call waits, or the
caller itself while it waits for its answer, handling on the way whatever else arrives (other
callers' answers go to their queues, lease news, tables). A caller that finds the background
thread holding the token asks it to let go (a Wake in the inbox: one wake-up, the first call
after a quiet spell); the thread then stays parked while calls keep coming, and takes the
inbox back once none has read it for ``PARK_S``, so answers nobody waits for (late ones, news)
are still read.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import zmq

from shmserve.ipc import packets
from shmserve.ipc.messages.to_scheduler import Wake

# How long the background thread stays parked after a caller last read the inbox.
PARK_S = 0.005
# How long a caller waits for the background thread to let go before it waits on its queue.
TOKEN_WAIT_S = 1.0


class SharedInbox:
    def __init__(self, inbox: packets.PacketInbox, handle: Callable[[Any], None],
                 drained: Callable[[], None], pending: Callable[[], bool],
                 flush: Callable[[], None]):
        """``handle(msg)``: what a read message does; ``drained()``: called when the inbox has
        nothing more to read; ``flush()``: the background thread's chore once ``pending()``
        things have waited ``PARK_S`` (completion records no answer took)."""
        self.inbox = inbox
        self.handle = handle
        self.drained = drained
        self.pending = pending
        self.flush = flush
        self.token = threading.Lock()
        self.lock = threading.Lock()
        self.wanting = 0            # callers waiting for the token
        self.reading = False        # a caller holds the token
        self.last_read = 0.0        # when a caller last let go of the token
        self.parked = threading.Condition()
        self.waker: packets.PacketOutbox | None = None
        self.closed = False
        self.thread: threading.Thread | None = None

    # ---- the background thread ----------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="bls-receiver", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.closed:
            with self.token:
                # (a caller may have read meanwhile: then it is not quiet yet)
                if self._quiet() and not self._read_until_wanted():
                    return
            with self.parked:       # a caller reads now; back when none has for PARK_S
                while not self.closed:
                    self.parked.wait(PARK_S)
                    if self.pending():
                        self.flush()
                    if self._quiet():
                        break

    def _quiet(self) -> bool:
        """No caller holds the token or wants it, and none has let go of it for PARK_S."""
        with self.lock:
            return not self.wanting and not self.reading and \
                time.monotonic() - self.last_read >= PARK_S

    def _read_until_wanted(self) -> bool:
        """Read until a caller wants the token (True) or the inbox is closed (False)."""
        armed = None
        while not self.closed:
            with self.lock:
                if self.wanting:
                    return True
            timed = self.pending()
            if timed != armed:
                armed = timed
                self.inbox.set_timeout(int(PARK_S * 1000) if timed else -1)
            try:
                msg, _ = self.inbox.recv()
            except zmq.Again:
                self.flush()
                continue
            except Exception:       # closed: the worker is stopping
                return False
            self._handle(msg)
        return False

    def _handle(self, msg) -> None:
        if type(msg) is not Wake:
            self.handle(msg)
        if not self.inbox.has_message():
            self.drained()

    # ---- a caller -------------------------------------------------------------------------------
    def wait(self, answers, deadline: float | None):
        """The next item of the caller's queue ``answers``, reading the inbox meanwhile;
        raises queue.Empty at ``deadline`` (monotonic seconds; None: no limit)."""
        if not answers.empty():
            return answers.get_nowait()
        with self.lock:
            self.wanting += 1
        try:
            got = self.token.acquire(blocking=False)
            if not got:
                self._wake()
                got = self.token.acquire(timeout=self._left(deadline, TOKEN_WAIT_S) or 0.0)
        finally:
            with self.lock:
                self.wanting -= 1
        if not got:     # (closing, or a thread of the model holds it) the queue fills anyway
            return answers.get(timeout=self._left(deadline, None))
        with self.lock:
            self.reading = True
        try:
            while answers.empty():
                left = self._left(deadline, None)
                if left is not None and left <= 0:
                    return answers.get_nowait()         # raises queue.Empty
                self.inbox.set_timeout(-1 if left is None else max(1, int(left * 1000)))
                try:
                    msg, _ = self.inbox.recv()
                except zmq.Again:
                    continue
                self._handle(msg)
            return answers.get_nowait()
        finally:
            with self.lock:
                self.reading = False
                self.last_read = time.monotonic()
            self.token.release()

    def _wake(self) -> None:
        try:
            if self.waker is None:
                self.waker = packets.PacketOutbox(self.inbox.address)
            self.waker.send(Wake(), flags=packets.NOBLOCK)
        except (packets.PeerGone, zmq.Again):
            pass            # its buffer is full: it is awake and reading anyway

    @staticmethod
    def _left(deadline: float | None, cap: float | None) -> float | None:
        if deadline is None:
            return cap if cap is not None else None
        left = max(0.0, deadline - time.monotonic())
        return min(left, cap) if cap is not None else left

    def close(self, timeout_s: float = 1.0) -> None:
        """The background thread ends, woken where it reads or waits (call before the inbox
        closes: a closed inbox does not wake a thread that waits in it)."""
        self.closed = True
        with self.parked:
            self.parked.notify_all()
        self._wake()
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self.waker is not None:
            self.waker.close()
