"""Where the worker waits for its next request: on the CPU its frontend names while requests
come one at a time, on any CPU but the frontend's while they overlap (frontend/colocation.py
has why and when; ipc/messages/to_worker.py the hint each request carries).

Waiting is what places a process: the kernel wakes a sleeping thread on a CPU its mask allows,
and, left to itself when no CPU is idle, on the waker's (a socket's wake-up tells the kernel
the waker is about to sleep). So only the worker's own thread is pinned, and only while it
waits: it takes its full mask back the moment it wakes, before anything runs, so a thread the
model starts (an onnxruntime or torch pool made on first use) never inherits a narrowed mask,
and the model itself computes on every CPU it may use.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from shmserve.ipc.messages.to_worker import ANYWHERE, waiting_cpus

log = logging.getLogger("shmserve.worker")


def _pin(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)       # Linux: pid 0 is the calling thread


class WaitingCpu:
    def __init__(self, pin: Callable[[set[int]], None] = _pin,
                 everywhere: set[int] | None = None):
        self.pin = pin
        self.everywhere = os.sched_getaffinity(0) if everywhere is None else everywhere
        self.cpu = ANYWHERE         # the last hint
        self.cpus: set[int] | None = None     # what it means for this worker: None, no pin
        self.pinned = False
        self.enabled = len(self.everywhere) > 1

    def hint(self, cpu: int) -> None:
        """The hint of the last request (ipc/messages/to_worker.py)."""
        if cpu != self.cpu:
            self.cpu = cpu
            self.cpus = waiting_cpus(cpu, self.everywhere)

    def before_wait(self) -> None:
        cpus = self.cpus
        if cpus is None or not self.enabled:
            return
        try:
            self.pin(cpus)
        except (OSError, ValueError) as e:      # not ours to use (a cgroup's cpuset)
            log.warning("cannot wait on CPUs %s (%s); the worker waits anywhere",
                        ",".join(map(str, sorted(cpus))), e)
            self.enabled = False
            return
        self.pinned = True

    def after_wait(self) -> None:
        if self.pinned:
            self.pinned = False
            self.pin(self.everywhere)
