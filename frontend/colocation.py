"""Where the frontend and the worker it feeds run: on one CPU while requests come one at a
time, on different CPUs while they overlap (--colocate).

At concurrency 1 a request crosses two processes of ours: the frontend wakes the worker and the
worker wakes the frontend. Left to itself the kernel wakes each on whichever CPU is idle, which
at concurrency 1 is always the other one, so every hop is a wake-up of an idle CPU (an
inter-processor interrupt, and on a virtual machine the host waking a halted virtual CPU), and
each process starts with the other's data in another CPU's cache. On one CPU the same hop is a
switch from the process that has just gone to sleep to the one it woke. Measured on a 2-CPU
virtual machine (docs/performance.md, ninth round): identity over HTTP at concurrency 1, p50
334-362 µs with both processes on one CPU against 414-417 µs left to the kernel; gRPC
2,308-2,373 infer/s against 1,993-2,035.

It only pays while nothing runs in parallel: with two requests in flight the frontend and the
worker have work at the same time, and one CPU would serialise them. It only matters while
requests are short: a hop costs tens of microseconds, nothing beside a request of milliseconds
(4 MiB over HTTP), whose frontend is better left free to move. And whether it pays at all
depends on the machine: where waking an idle CPU is cheap (measured on a 2-CPU AMD EPYC virtual
machine: identity over HTTP at concurrency 1, p50 120 µs spread against 141 paired; the
3-step ensemble 184 against 212), the two processes serialised on one CPU, each starting with
the other's data in its cache, cost more than the wake-ups they save. So ``Colocation`` watches
how many requests are in flight when each new one arrives and how often they come, and tries
both ways before it keeps one:

- SPREAD (the start): nothing pinned. After ``ENTER`` requests in a row that each found no
  other in flight and came at most ``MAX_GAP_NS`` apart on average, the frontend's loop thread
  is pinned to the CPU it is on, and the state is PAIRED, on trial.
- PAIRED: each request sent straight to a worker (under a lease) names that CPU, and the worker
  waits for its next request pinned there (workers/worker.py pins only its own thread, only while
  it waits, and gives its full mask back before it runs the model, so threads a model starts
  are never confined).
- The trial: the time from each request's arrival to its answer (``on_answer``) is kept for
  the requests that came alone before the pairing and for ``ENTER`` after it. Unless the paired
  ones' median is ``KEEP_GAIN`` lower, the frontend is unpinned and stays SPREAD, without
  trying again, until ``REPICK_NS`` has passed.
- The first request that finds another in flight unpins the frontend, ends any trial and starts
  the count again; so does the passing of ``REPICK_NS``, so that a CPU that another program has
  since taken is not kept, and a choice made under other traffic is made again.
- APART, while requests overlap: each request names "any CPU but the frontend's", the one it is
  sent from (``apart_from``), and the worker waits for its next request off that CPU. Where no
  CPU is idle (another program busy on one) the kernel wakes a process on its waker's CPU,
  since a socket's wake-up says the waker is about to sleep; the frontend is not, with other
  requests to read, and the frontend, the worker and the client's threads all ended up on the
  one CPU the busy program did not hold while that program kept the other to itself. Measured
  on B (2 CPUs, one held by a busy loop): ensemble3 over HTTP at c=16 5,900-6,100 infer/s
  against 11,100-11,200 apart, identity at c=32 10,800-11,700 against 14,900. With an idle CPU
  the kernel picks it anyway, and the hint changes nothing.

The core decides; the system calls (which CPU the thread is on, pinning and unpinning it) are
injected and the time comes with each call, so tests drive it without moving their own threads.
Where the calls fail (a CPU taken away by a cgroup) it says so once and stays SPREAD.
"""
from __future__ import annotations

import ctypes
import enum
import logging
import os
from typing import Callable

from shmserve.ipc.messages.to_worker import ANYWHERE, apart_from

log = logging.getLogger("shmserve.frontend")

ENTER = 32                      # requests in a row with no other in flight before pairing
REPICK_NS = 1_000_000_000       # how long a pairing holds before the CPU is chosen again
MAX_GAP_NS = 1_000_000          # mean time between those requests, at most
# A trial keeps the pairing only if its answers came at least this much sooner: a pairing costs
# the worker two system calls a request, and medians 2-3% apart are noise (seen: 64 against
# 65 µs, where most trials on that machine gave 64 against 57)
KEEP_GAIN = 0.05


class Pairing(enum.Enum):
    SPREAD = "spread"
    PAIRED = "paired"


class ColocateMode(enum.Enum):
    AUTO = "auto"               # pair while requests come one at a time, apart while they overlap
    OFF = "off"                 # never


def _proc_cpu() -> int:
    """The CPU the calling thread runs on (field 39 of /proc/thread-self/stat); -1 if unknown."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _current_cpu() -> Callable[[], int]:
    """The C library's sched_getcpu (60 ns a call through ctypes, against 5 µs for reading
    /proc), where there is one. It answers -1 on failure."""
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return _proc_cpu


current_cpu = _current_cpu()


def pin_thread(cpu: int | None, everywhere: set[int]) -> None:
    """Confine the calling thread to ``cpu``, or (None) give it ``everywhere`` back. Linux: pid
    0 is the calling thread, not the process."""
    os.sched_setaffinity(0, everywhere if cpu is None else {cpu})


class Colocation:
    """Decides, per request, where its worker waits next: on the frontend's CPU, off it, or
    anywhere (the hint of ipc/messages/to_worker.py)."""

    def __init__(self, mode: ColocateMode, enter: int = ENTER, repick_ns: int = REPICK_NS,
                 max_gap_ns: int = MAX_GAP_NS, cpu: Callable[[], int] = current_cpu,
                 pin: Callable[[int | None], None] | None = None):
        self.mode, self.enter, self.repick_ns = mode, enter, repick_ns
        self.max_gap_ns = max_gap_ns
        self.cpu = cpu
        if pin is None:
            everywhere = os.sched_getaffinity(0)
            pin = lambda c: pin_thread(c, everywhere)   # noqa: E731
            if len(everywhere) < 2:
                self.mode = ColocateMode.OFF            # nothing to choose between
        self.pin = pin
        self.state = Pairing.SPREAD
        self.paired_cpu = ANYWHERE
        self.alone = 0              # requests in a row that found no other in flight
        self.first_ns = 0           # when the first of them came
        self.since_ns = 0
        self.pairings = 0
        self.trial = False          # PAIRED, but not yet shown to be the faster way
        self.spread_until_ns = 0    # the trial chose SPREAD: no other until then
        # the way the request now in flight alone went, while its answer is wanted
        self.measuring: Pairing | None = None
        self.times: dict[Pairing, list[int]] = {Pairing.SPREAD: [], Pairing.PAIRED: []}

    def on_request(self, in_flight: int, now_ns: int) -> int:
        """A new request arrives at ``now_ns`` (monotonic) with ``in_flight`` others still
        unanswered: the hint to send with it to a worker (ANYWHERE: none)."""
        if self.mode is ColocateMode.OFF:
            return ANYWHERE
        if in_flight:
            self.alone, self.measuring = 0, None
            if self.state is Pairing.PAIRED:
                self._spread()
            return apart_from(self.cpu())
        if self.state is Pairing.PAIRED:
            if now_ns - self.since_ns < self.repick_ns:
                if self.trial:
                    self.measuring = Pairing.PAIRED
                return self.paired_cpu
            self._spread()
        elif now_ns < self.spread_until_ns:
            return ANYWHERE
        if not self.alone:
            self.first_ns = now_ns
            self.times[Pairing.SPREAD].clear()
        self.alone += 1
        self.measuring = Pairing.SPREAD
        if self.alone >= self.enter:
            if now_ns - self.first_ns <= (self.enter - 1) * self.max_gap_ns:
                self._pair(now_ns)
            else:                   # alone, but far apart: start counting from this one
                self.alone, self.first_ns = 1, now_ns
                self.times[Pairing.SPREAD].clear()
        return self.paired_cpu

    def on_answer(self, arrived_ns: int, now_ns: int) -> None:
        """The answer of the request that came alone at ``arrived_ns`` (wanted while
        ``measuring`` is set): a time for the trial."""
        way, self.measuring = self.measuring, None
        if way is None:
            return
        times = self.times[way]
        times.append(now_ns - arrived_ns)
        if way is Pairing.SPREAD or len(times) < self.enter:
            return
        self.trial = False
        spread = self.times[Pairing.SPREAD]
        paired_ns, spread_ns = _median(times), _median(spread) if spread else 0
        log.debug("colocation trial: median %d µs paired, %d µs spread", paired_ns // 1000,
                  spread_ns // 1000)
        if spread and paired_ns > spread_ns * (1 - KEEP_GAIN):
            self._spread()
            self.spread_until_ns = now_ns + self.repick_ns

    def _pair(self, now_ns: int) -> None:
        try:
            cpu = self.cpu()
            self.pin(cpu)
        except (OSError, ValueError, IndexError) as e:
            log.warning("cannot keep the frontend on one CPU (%s); --colocate is off", e)
            self.mode = ColocateMode.OFF
            return
        self.state, self.paired_cpu, self.since_ns = Pairing.PAIRED, cpu, now_ns
        self.pairings += 1
        self.trial, self.measuring = True, Pairing.PAIRED
        self.times[Pairing.PAIRED].clear()

    def _spread(self) -> None:
        self.state, self.paired_cpu, self.alone = Pairing.SPREAD, ANYWHERE, 0
        self.trial = False
        try:
            self.pin(None)
        except OSError as e:
            log.warning("cannot give the frontend its CPUs back (%s); --colocate is off", e)
            self.mode = ColocateMode.OFF

    def close(self) -> None:
        if self.state is Pairing.PAIRED:
            self._spread()


def _median(times: list[int]) -> int:
    return sorted(times)[len(times) // 2]
