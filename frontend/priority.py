"""The frontend's CPU priority while it hands out answers under load (--frontend-priority).

The frontend is the one serial stage of a request's path: one event-loop thread reads every
request and writes every answer. On a machine whose CPUs are all busy, each answer it writes
wakes a client thread, which then takes the CPU from the frontend while it still holds the
other answers of the same wake-up (docs/performance.md, seventh and eighth rounds: at
concurrency 32 it waited for a CPU a third of the time while a CPU sat idle). Raised to the
lowest real-time priority (SCHED_FIFO 1) for the length of one drain of its inbox, it writes
them all before the threads it woke run.

Only around the drain, and only while it holds THRESHOLD requests or more: kept raised all the
time, it also stops the clients it wakes from sending their next requests in one go, and with
one thread per client (perf_analyzer's sync mode, 32 threads) that cost 6% of throughput where
raising it per drain gained 7%; with a few requests in flight (4 MiB at concurrency 4) any
preemption of the worker costs more than it saves.

``DrainPriority`` decides and counts; the system call is injected, so tests drive it without
changing their own priority. Where the process may not raise itself (no CAP_SYS_NICE, no
RLIMIT_RTPRIO) it says so once and stays normal.
"""
from __future__ import annotations

import enum
import logging
import os
from typing import Callable

log = logging.getLogger("shmserve.frontend")

THRESHOLD = 8             # requests held for a drain to run raised
RT_PRIORITY = 1           # the lowest SCHED_FIFO priority: above every normal thread, only


class Priority(enum.Enum):
    NORMAL = "normal"
    REALTIME = "realtime"


class PriorityMode(enum.Enum):
    AUTO = "auto"             # raised for each drain while THRESHOLD or more are held
    NORMAL = "normal"         # never
    REALTIME = "realtime"     # always, from the start


def set_thread_priority(priority: Priority) -> None:
    """Set the calling thread's scheduling class (Linux: pid 0 is the calling thread). Reset on
    fork, so that no thread or process the frontend starts inherits it."""
    if priority is Priority.REALTIME:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                              os.sched_param(RT_PRIORITY))
    else:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class DrainPriority:
    """Raises the loop's thread around a drain of answers when enough requests are held."""

    def __init__(self, mode: PriorityMode, threshold: int = THRESHOLD,
                 apply: Callable[[Priority], None] = set_thread_priority):
        self.mode, self.threshold, self.apply = mode, threshold, apply
        self.raised_drains = 0
        if mode is PriorityMode.REALTIME:
            self._set(Priority.REALTIME)        # on failure, mode becomes NORMAL

    def raise_for(self, held: int) -> bool:
        """Before a drain: True if the thread was raised (call ``lower`` after it)."""
        if self.mode is not PriorityMode.AUTO or held < self.threshold:
            return False
        if not self._set(Priority.REALTIME):
            return False
        if not self.raised_drains:
            log.info("the frontend answers at real-time priority while %d or more requests "
                     "are held (--frontend-priority auto)", self.threshold)
        self.raised_drains += 1
        return True

    def lower(self) -> None:
        self._set(Priority.NORMAL)

    def close(self) -> None:
        if self.mode is PriorityMode.REALTIME:
            self.mode = PriorityMode.NORMAL
            self._set(Priority.NORMAL)

    def _set(self, priority: Priority) -> bool:
        try:
            self.apply(priority)
        except OSError as e:
            level = logging.WARNING if self.mode is PriorityMode.REALTIME else logging.INFO
            log.log(level, "the frontend stays at normal priority: it may not use real-time "
                    "scheduling here (%s; needs CAP_SYS_NICE or an RLIMIT_RTPRIO of 1 or more)",
                    e.strerror or e)
            self.mode = PriorityMode.NORMAL
            return False
        return True
