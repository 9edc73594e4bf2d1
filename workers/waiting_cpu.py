"""Where the worker waits for its next request: on the CPU its frontend names, while requests
come one at a time (frontend/colocation.py has why and when).

Only the worker's own thread is pinned, and only while it waits: it takes its full mask back
the moment it wakes, before anything runs, so a thread the model starts (an onnxruntime or
torch pool made on first use) never inherits a mask of one CPU, and the model itself computes
on every CPU it may use.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

log = logging.getLogger("shmserve.worker")


def _pin(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)       # Linux: pid 0 is the calling thread


class WaitingCpu:
    def __init__(self, pin: Callable[[set[int]], None] = _pin,
                 everywhere: set[int] | None = None):
        self.pin = pin
        self.everywhere = os.sched_getaffinity(0) if everywhere is None else everywhere
        self.cpu = -1               # the last hint: -1, wait anywhere
        self.pinned = False
        self.enabled = len(self.everywhere) > 1

    def hint(self, cpu: int) -> None:
        """The CPU named by the last request (-1: none)."""
        self.cpu = cpu

    def before_wait(self) -> None:
        if self.cpu < 0 or not self.enabled:
            return
        try:
            self.pin({self.cpu})
        except (OSError, ValueError) as e:      # not ours to use (a cgroup's cpuset)
            log.warning("cannot wait on CPU %d (%s); the worker waits anywhere", self.cpu, e)
            self.enabled = False
            return
        self.pinned = True

    def after_wait(self) -> None:
        if self.pinned:
            self.pinned = False
            self.pin(self.everywhere)
