"""The frontend's CPU priority under load (--frontend-priority).

The frontend is the one serial stage of a request's path: one event-loop thread reads every
request and writes every answer. On a machine whose CPUs are all busy, each answer it writes
wakes the client, and each request it forwards wakes a worker; the woken thread then takes the
CPU from the frontend, which waits with its other answers in hand (docs/performance.md, seventh
and eighth rounds: at concurrency 32 it waited for a CPU a third of the time while a CPU sat
idle). Run at the lowest real-time priority (SCHED_FIFO 1), the frontend finishes its turn of
the loop before the threads it woke run, so a burst leaves it in one go.

That pays only when the frontend holds many requests: with a few in flight, preempting the
worker or the client costs more than it saves (4 MiB requests at concurrency 4 lost a fifth of
their throughput). So ``auto`` turns it on while the frontend holds, on average over the last
ten ticks, ENTER_INFLIGHT requests or more, and off again below LEAVE_INFLIGHT.

The governor is pure (fed counts, says when to change); the shell owns the timer and the
system call, and gives up quietly where the process may not raise its priority (no
CAP_SYS_NICE and no RLIMIT_RTPRIO).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections import deque
from typing import Callable

log = logging.getLogger("shmserve.frontend")

ENTER_INFLIGHT = 8.0      # mean requests held over the window to turn real-time on
LEAVE_INFLIGHT = 4.0      # ... and below which it goes back to normal
WINDOW = 10               # ticks the mean is taken over
TICK_S = 0.01             # while requests are held (the window is then 100 ms)
IDLE_TICK_S = 0.1         # while at most one is and the thread is at normal priority
BUSY_INFLIGHT = 2
RT_PRIORITY = 1           # the lowest SCHED_FIFO priority: above every normal thread, only


class Priority(enum.Enum):
    NORMAL = "normal"
    REALTIME = "realtime"


class PriorityMode(enum.Enum):
    AUTO = "auto"
    NORMAL = "normal"
    REALTIME = "realtime"


class PriorityGovernor:
    """Decides the frontend thread's priority from the number of requests it holds."""

    def __init__(self, mode: PriorityMode, enter: float = ENTER_INFLIGHT,
                 leave: float = LEAVE_INFLIGHT, window: int = WINDOW):
        if not 0 <= leave <= enter:
            raise ValueError(f"need 0 <= leave ({leave}) <= enter ({enter})")
        self.mode = mode
        self.enter, self.leave = enter, leave
        self.current = Priority.NORMAL
        self.samples: deque[int] = deque(maxlen=window)

    def sample(self, inflight: int) -> Priority | None:
        """One tick: the priority to change to, or None to stay."""
        if self.mode is PriorityMode.NORMAL:
            return None
        if self.mode is PriorityMode.REALTIME:
            want = Priority.REALTIME
        else:
            self.samples.append(inflight)
            if len(self.samples) < (self.samples.maxlen or 1):
                return None
            mean = sum(self.samples) / len(self.samples)
            want = self.current
            if self.current is Priority.NORMAL and mean >= self.enter:
                want = Priority.REALTIME
            elif self.current is Priority.REALTIME and mean < self.leave:
                want = Priority.NORMAL
        if want is self.current:
            return None
        self.current = want
        return want


def set_thread_priority(priority: Priority) -> None:
    """Set the calling thread's scheduling class (Linux: pid 0 is the calling thread). Reset on
    fork, so that nothing the frontend starts inherits it."""
    if priority is Priority.REALTIME:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                              os.sched_param(RT_PRIORITY))
    else:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class PriorityShell:
    """Ticks the governor on the event loop and applies its changes to the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, governor: PriorityGovernor,
                 inflight: Callable[[], int],
                 apply: Callable[[Priority], None] = set_thread_priority):
        self.loop, self.governor, self.inflight, self.apply = loop, governor, inflight, apply
        self.changes = 0
        self.handle: asyncio.TimerHandle | None = None
        if governor.mode is not PriorityMode.NORMAL:
            self.handle = loop.call_soon(self.tick)

    def tick(self) -> None:
        n = self.inflight()
        change = self.governor.sample(n)
        if change is not None and not self._apply(change):
            return      # not allowed: stop ticking, the thread stays as it is
        if self.governor.mode is PriorityMode.REALTIME:
            self.handle = None      # set once, nothing to watch
            return
        # one request at a time cannot make it real-time: tick rarely then, for a timer that
        # fires while the loop waits is one more wake-up on the path of that request
        busy = n >= BUSY_INFLIGHT or self.governor.current is Priority.REALTIME
        self.handle = self.loop.call_later(TICK_S if busy else IDLE_TICK_S, self.tick)

    def _apply(self, priority: Priority) -> bool:
        try:
            self.apply(priority)
        except OSError as e:
            level = logging.WARNING if self.governor.mode is PriorityMode.REALTIME else logging.INFO
            log.log(level, "the frontend stays at normal priority: it may not use real-time "
                    "scheduling here (%s; needs CAP_SYS_NICE or an RLIMIT_RTPRIO of 1 or more)",
                    e.strerror or e)
            self.governor.current = Priority.NORMAL
            self.handle = None
            return False
        self.changes += 1
        log.debug("frontend priority: %s", priority.value)
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.governor.current is Priority.REALTIME:
            self._apply(Priority.NORMAL)
            self.governor.current = Priority.NORMAL
