"""A wake-up at a precise time for a loop that blocks in a ZeroMQ receive.

ZeroMQ's receive timeout counts whole milliseconds, so a batch delay of 100 us would either spin
the loop or wait a full millisecond. The alarm thread sleeps with the precision of the OS timer
and then sends a ``Wake`` message into the loop's own inbox (over inproc), which ends the
receive at once.
"""
from __future__ import annotations

import threading
import time

import zmq

from shmserve.ipc import messages
from shmserve.ipc.messages.to_scheduler import Wake


class Alarm:
    def __init__(self, context: zmq.Context, address: str):
        self._context = context
        self._address = address             # an inproc endpoint the loop's inbox is bound to
        self._cond = threading.Condition()
        self._deadline_ns: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmserve-alarm", daemon=True)
        self._thread.start()

    def set(self, deadline_ns: int | None) -> None:
        """Ring at ``deadline_ns`` (time.monotonic_ns); None cancels."""
        if deadline_ns == self._deadline_ns:    # the common case: no lock, no notify
            return
        with self._cond:
            self._deadline_ns = deadline_ns
            self._cond.notify()

    def _run(self) -> None:
        ring = self._context.socket(zmq.PUSH)   # made and used only in this thread
        ring.setsockopt(zmq.LINGER, 0)
        ring.connect(self._address)
        wake = messages.encode(Wake())
        try:
            with self._cond:
                while not self._closed:
                    deadline = self._deadline_ns
                    if deadline is None:
                        self._cond.wait()
                        continue
                    remaining = (deadline - time.monotonic_ns()) / 1e9
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue            # re-check: the deadline may have moved
                    self._deadline_ns = None
                    try:
                        ring.send(wake, zmq.NOBLOCK)
                    except zmq.Again:       # the inbox is full: the loop is awake anyway
                        pass
        finally:
            ring.close(0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=1)
