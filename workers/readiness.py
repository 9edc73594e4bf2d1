"""Readiness a model decides itself (a python model's ``is_ready()``), as a worker answers it.

The scheduler sends CheckReadiness; the worker calls the model on a thread of its own, as
Triton's stub does, so that a slow ``is_ready()`` (Triton allows it 5 s) never holds up the
batches the main thread executes, and a batch never holds up a check. One call at a time: the
checks that arrive while one runs are answered with its result.
"""
from __future__ import annotations

import threading
from typing import Callable

from shmserve.ipc.messages.to_scheduler import ReadinessReport


class ReadinessCalls:
    def __init__(self, spawn_id: int, tell: Callable[[ReadinessReport], None]):
        self.spawn_id = spawn_id
        self.tell = tell
        self.lock = threading.Lock()
        self.waiting: list[int] = []        # checks the running call answers
        self.running = False

    def check(self, check: int, model_ready: Callable[[], bool]) -> None:
        with self.lock:
            self.waiting.append(check)
            if self.running:
                return
            self.running = True
        threading.Thread(target=self._call, args=(model_ready,), name="is_ready",
                         daemon=True).start()

    def _call(self, model_ready: Callable[[], bool]) -> None:
        ready = model_ready()
        with self.lock:     # a check that comes after this starts a call of its own
            answered, self.waiting = self.waiting, []
            self.running = False
        for check in answered:
            self.tell(ReadinessReport(self.spawn_id, check, ready))
