"""A wake-up at a precise time for a zmq poll loop.

zmq_poll counts whole milliseconds, so a batch delay of 100 us would either spin the loop or
wait a full millisecond. The alarm thread sleeps with the precision of the OS timer and then
makes an inproc socket readable, which wakes the poll at once.
"""
from __future__ import annotations

import itertools
import threading
import time

import zmq

_ids = itertools.count()


class Alarm:
    def __init__(self, context: zmq.Context):
        addr = f"inproc://shmserve-alarm-{next(_ids)}"
        self.socket = context.socket(zmq.PAIR)       # the poll loop reads this one
        self.socket.bind(addr)
        self._ring = context.socket(zmq.PAIR)        # only the alarm thread writes this one
        self._ring.connect(addr)
        self._cond = threading.Condition()
        self._deadline_ns: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmserve-alarm", daemon=True)
        self._thread.start()

    def set(self, deadline_ns: int | None) -> None:
        """Ring at ``deadline_ns`` (time.monotonic_ns); None cancels."""
        with self._cond:
            if deadline_ns != self._deadline_ns:
                self._deadline_ns = deadline_ns
                self._cond.notify()

    def clear(self) -> None:
        """Consume pending rings (call when the socket polled readable)."""
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _run(self) -> None:
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
                self._ring.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=1)
        self._ring.close(0)
        self.socket.close(0)
