"""``ModelResidency``: which models of an on-demand repository are in memory, which load next and
which make room for them (``--model-control-mode=on_demand``).

Every model of the repository can be loaded; a model is loaded at its first request and unloaded
when it has been idle for ``idle_unload_s``, or when loading another would pass the memory
budget. Pure: no sockets, no processes, no /proc; times are seconds on the injected clock, and
what the policy needs to know about the world (is a model busy, what a model's workers measure)
is handed in. ``engine/lifecycle/on_demand.py`` wires it into the scheduler core; tests drive it directly
(tests/engine/test_residency.py).

Accounting. A model is charged against the budget from the moment its load starts until its
last worker has exited:
- loading: its estimate (below), plus whatever its workers still alive from an earlier load
  measured;
- loaded or unloading: what its workers measured last (PSS from /proc/<pid>/smaps_rollup, read
  right after the load, half a second later and then every three seconds), or its estimate
  until the first reading.
A load starts only when ADMIT_SHARE (95%) of the budget minus everything charged covers its
estimate; the other 5% absorb what workers grow between two readings. So the sum of what the
workers measure stays under the budget.

The estimate of a model's need is its own last measured size, from an earlier load; else the
mean per instance of the models measured so far times its instance count; else
``default_estimate`` per instance. An ensemble has no workers and needs nothing itself (its
composing models are loaded as models of their own).

Eviction. Loads wait in arrival order. When the head does not fit, the least recently used
loaded models are unloaded until it would, never one that is busy (requests queued, executing,
held for its own load, or a lease in use), one that is loading, one waiting to load, nor a
composing model of an ensemble that is loaded or loading: the ensemble, once it is the least
recently used itself, is unloaded first, which frees its composing models to go after it. If
even every such model would not make room, nothing is unloaded and the load waits (the caller
bounds the wait). An evicted model's memory counts until its workers have exited; only then
does the waiting load start.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Iterable

MIB = 1 << 20
# What one instance of a model is assumed to need before any model has been measured.
DEFAULT_ESTIMATE = 128 * MIB
# After a model failed to load, its requests fail at once with that failure for this long; the
# next request after it tries again (a load API request always does).
LOAD_RETRY_S = 5.0
# Loaded models are measured this often (reading smaps_rollup costs a few hundred µs), and
# once more this soon after the reading that follows their load: a worker grows as it serves
# its first requests.
MEASURE_INTERVAL_S = 3.0
SECOND_READING_S = 0.5
# Loads are admitted while everything charged stays under this share of the budget: the rest
# absorbs what workers grow between two readings, and the shift of shared pages' shares as
# other workers come and go (a few percent with small python models).
ADMIT_SHARE = 0.95
# Bounds (µs) of the histogram of how long the requests that triggered a load waited for it.
WAIT_BOUNDS_US = (1e3, 5e3, 1e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7, 3e7, 6e7, 1.2e8)


class Residence(enum.Enum):
    OUT = "out"                 # no worker alive
    LOADING = "loading"         # a load in progress
    IN = "in"                   # loaded: a version is READY
    LEAVING = "leaving"         # unloaded, failed or evicted; its workers have not all exited


@dataclass(eq=False)
class Resident:
    name: str
    instances: int = 1              # workers one load starts
    composing: tuple[str, ...] = ()     # an ensemble's composing models
    state: Residence = Residence.OUT
    size: int = 0                   # bytes its workers measured while it was loaded; 0 = never
    live: int = 0                   # bytes its live workers measured last (charged)
    reserve: int = 0                # bytes charged for a load in progress
    measured_at: float = -math.inf
    readings: int = 0               # since its load ended
    last_used: float = 0.0
    waiting_since: float = 0.0      # > 0: its load waits for room
    failed: str = ""                # why its last load failed
    failed_at: float = -math.inf
    loads: int = 0
    evictions: int = 0              # unloaded to make room for another model
    idle_unloads: int = 0

    @property
    def ensemble(self) -> bool:
        return bool(self.composing)

    @property
    def charged(self) -> int:
        return self.reserve + self.live


@dataclass
class Plan:
    """What ``ModelResidency.plan`` decided: start these loads now, unload these models (their
    memory is freed once their workers have exited), and fail the requests of these models
    with the reason (a model larger than what loads may take of the budget)."""
    load: list[str] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    refuse: list[tuple[str, str]] = field(default_factory=list)
    short: int = 0      # bytes the waiting loads still lack after these evictions


class ModelResidency:
    def __init__(self, budget: int, idle_unload_s: float, clock: Callable[[], float],
                 default_estimate: int = DEFAULT_ESTIMATE):
        self.budget = budget                # bytes; 0 = no budget
        self.idle_unload_s = idle_unload_s  # 0 = never
        self.clock = clock                  # seconds
        self.default_estimate = default_estimate
        self.models: dict[str, Resident] = {}
        self.queue: list[str] = []          # loads waiting for room, in arrival order
        self.wait_counts = [0] * (len(WAIT_BOUNDS_US) + 1)
        self.wait_sum_us = 0.0
        self._per_instance: float | None = None     # mean bytes per instance measured

    # ---- what the repository holds -----------------------------------------------------------
    def add(self, name: str, instances: int = 1, composing: Iterable[str] = ()) -> Resident:
        """A model of the repository (again, when its config changed: the new shape counts)."""
        m = self.models.get(name)
        if m is None:
            m = self.models[name] = Resident(name)
        if m.instances != max(0, instances) or m.composing != tuple(composing):
            m.instances = max(0, instances)
            m.composing = tuple(composing)
            self._per_instance = None
        return m

    def get(self, name: str) -> Resident:
        m = self.models.get(name)
        return m if m is not None else self.add(name)

    # ---- what happens to a model ---------------------------------------------------------------
    def use(self, name: str) -> None:
        """A request for the model arrived or finished: it is the most recently used."""
        m = self.models.get(name)
        if m is not None:
            m.last_used = self.clock()

    def request(self, name: str) -> str:
        """A request (or a load request, or an ensemble) needs ``name`` loaded. Returns "" when
        it is queued or already on its way, else why it fails now."""
        m = self.get(name)
        now = self.clock()
        m.last_used = now
        if m.failed and now - m.failed_at < LOAD_RETRY_S:
            return m.failed
        if self.budget and m.size > self.limit:
            return self.too_large(m)
        if m.state in (Residence.OUT, Residence.LEAVING) and not m.waiting_since:
            m.waiting_since = now
            self.queue.append(name)
        return ""

    def too_large(self, m: Resident) -> str:
        return (f"model '{m.name}' needs about {mib(m.size)} (measured when it was last "
                f"loaded), more than the {mib(self.limit)} loads may take of the "
                f"--model-memory-budget of {mib(self.budget)}")

    def retry_now(self, name: str) -> None:
        """An explicit load request: a recent failure does not stop it."""
        self.get(name).failed = ""

    def drop(self, name: str) -> None:
        """Nobody waits for its load any more."""
        m = self.models.get(name)
        if m is not None and m.waiting_since:
            m.waiting_since = 0.0
            self.queue.remove(name)

    def waiting(self, name: str) -> bool:
        m = self.models.get(name)
        return m is not None and m.waiting_since > 0

    def set_state(self, name: str, state: Residence) -> None:
        """The lifecycle's view of the model changed (see ``Residence``)."""
        m = self.get(name)
        old = m.state
        if state == old:
            return
        m.state = state
        if state == Residence.LOADING:
            if m.waiting_since:
                self.drop(name)
            m.reserve = self.estimate(name)
            m.loads += 1
            return
        if old == Residence.LOADING:
            # until the first reading, a loaded model is charged what its load reserved
            m.live = max(m.live, m.reserve)
            m.reserve = 0
            m.measured_at = -math.inf
            m.readings = 0
        if state == Residence.IN:
            m.failed = ""
        elif state == Residence.OUT:
            m.live = m.reserve = 0
            m.measured_at = -math.inf

    def load_failed(self, name: str, reason: str) -> None:
        m = self.get(name)
        m.failed, m.failed_at = reason, self.clock()

    def evicted(self, name: str, idle: bool) -> None:
        m = self.get(name)
        if idle:
            m.idle_unloads += 1
        else:
            m.evictions += 1

    def measured(self, name: str, nbytes: int) -> None:
        """What the model's live workers measure together now."""
        m = self.get(name)
        m.measured_at = self.clock()
        if m.state == Residence.LOADING:
            return      # a partial load says nothing yet; its reserve stays
        m.readings += 1
        if m.readings == 1:     # the next one soon: it grows as it serves its first requests
            m.measured_at += SECOND_READING_S - MEASURE_INTERVAL_S
        m.live = nbytes
        if m.state == Residence.IN and nbytes > 0 and nbytes != m.size:
            m.size = nbytes
            self._per_instance = None

    def waited(self, seconds: float) -> None:
        """A request that waited for its model's load got it after ``seconds``."""
        us = seconds * 1e6
        self.wait_sum_us += us
        for i, bound in enumerate(WAIT_BOUNDS_US):
            if us <= bound:
                self.wait_counts[i] += 1
                return
        self.wait_counts[-1] += 1

    # ---- decisions -------------------------------------------------------------------------------
    def estimate(self, name: str) -> int:
        m = self.get(name)
        if m.ensemble:
            return 0
        if m.size:
            return m.size
        per = self._per_instance
        if per is None:         # cached until a size or a shape changes
            sized = [r for r in self.models.values() if r.size and r.instances and not r.ensemble]
            per = self._per_instance = (sum(r.size for r in sized) /
                                        sum(r.instances for r in sized) if sized
                                        else self.default_estimate)
        need = int(per * max(1, m.instances))
        # a guess never keeps a model out for good: at most what loads may take
        return min(need, self.limit) if self.budget else need

    @property
    def limit(self) -> int:
        """What everything charged may add up to when a load is admitted (ADMIT_SHARE)."""
        return int(self.budget * ADMIT_SHARE)

    def charged(self) -> int:
        return sum(m.charged for m in self.models.values())

    def pinned(self, excluded: AbstractSet[str] = frozenset()) -> set[str]:
        """Composing models of ensembles that are loaded or loading (and not ``excluded``)."""
        out: set[str] = set()
        for m in self.models.values():
            if m.composing and m.name not in excluded and \
                    m.state in (Residence.IN, Residence.LOADING):
                out.update(m.composing)
        return out

    def plan(self, busy: Callable[[str], bool]) -> Plan:
        """Decide which waiting loads start now and what to evict for the others: enough for
        all of them, so that their evictions overlap, and at least enough for the first one
        that waits, else nothing (``short`` then says what it lacks)."""
        out = Plan()
        if not self.queue:
            return out
        if not self.budget:
            out.load = list(self.queue)
            return out
        free = self.limit - self.charged()
        freeing = sum(m.charged for m in self.models.values() if m.state == Residence.LEAVING)
        head_short = None
        deficit = 0
        for name in list(self.queue):
            m = self.models[name]
            if m.size > self.limit:
                self.drop(name)
                out.refuse.append((name, self.too_large(m)))
                continue
            need = self.estimate(name)
            if head_short is None and (need == 0 or need <= free):
                out.load.append(name)
                free -= need
                continue
            if head_short is None:      # in arrival order: the rest wait behind it
                head_short = need - free - freeing
            deficit += need
        short = deficit - free - freeing
        if head_short is not None and short > 0:
            out.evict = self.victims(short, busy, set(out.load), max(0, head_short))
            out.short = max(0, short - sum(self.models[n].charged for n in out.evict))
        return out

    def victims(self, short: int, busy: Callable[[str], bool],
                starting: AbstractSet[str] = frozenset(), at_least: int = 0) -> list[str]:
        """The least recently used models to unload to free ``short`` bytes, or as many as
        there are if they free at least ``at_least``, else none (see the module's docstring)."""
        chosen: list[str] = []
        taken: set[str] = set()
        freed = 0
        while freed < short:
            pinned = self.pinned(taken)
            best = None
            for m in self.models.values():
                if m.state != Residence.IN or m.name in taken or m.name in pinned or \
                        m.waiting_since or m.name in starting or busy(m.name):
                    continue
                if best is None or m.last_used < best.last_used:
                    best = m
            if best is None:
                break
            chosen.append(best.name)
            taken.add(best.name)
            freed += best.charged
        return chosen if freed >= min(short, at_least) and freed > 0 else []

    def idle(self, busy: Callable[[str], bool]) -> list[str]:
        """Loaded models idle for ``idle_unload_s``: unload them. Ensembles go before their
        composing models, which are pinned while the ensemble is loaded."""
        if self.idle_unload_s <= 0:
            return []
        cutoff = self.clock() - self.idle_unload_s
        stale = [m.name for m in self.models.values() if m.state == Residence.IN and
                 m.last_used <= cutoff and not m.waiting_since and not busy(m.name)]
        if not stale:
            return []
        pinned = self.pinned(set(n for n in stale if self.models[n].ensemble))
        # ensembles first: a composing model unloaded before its ensemble would take the
        # ensemble down with it ("contains models that are not available")
        return sorted((n for n in stale if n not in pinned),
                      key=lambda n: not self.models[n].ensemble)

    def idle_due(self) -> float:
        """Seconds until the next loaded model turns idle (1.0 when none will)."""
        if self.idle_unload_s <= 0:
            return 1.0
        now = self.clock()
        due = [m.last_used + self.idle_unload_s - now for m in self.models.values()
               if m.state == Residence.IN]
        # one already past it is busy (or pinned): look again in a second, not at once
        return min((d if d > 0 else 1.0 for d in due), default=1.0)

    def measure_due(self) -> float:
        """Seconds until the next reading is due (MEASURE_INTERVAL_S when none is)."""
        now = self.clock()
        due = [m.measured_at + MEASURE_INTERVAL_S - now for m in self.models.values()
               if m.state in (Residence.IN, Residence.LEAVING) and not m.ensemble]
        return max(0.0, min(due, default=MEASURE_INTERVAL_S))

    def to_measure(self, limit: int) -> list[str]:
        """Loaded or leaving models whose reading is older than MEASURE_INTERVAL_S, stalest
        first, at most ``limit``."""
        cutoff = self.clock() - MEASURE_INTERVAL_S
        stale = [m for m in self.models.values() if m.state in (Residence.IN, Residence.LEAVING)
                 and not m.ensemble and m.measured_at <= cutoff]
        stale.sort(key=lambda m: m.measured_at)
        return [m.name for m in stale[:limit]]


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def parse_bytes(text: str) -> int:
    """A byte count with an optional binary suffix: 512M, 4G, 1.5G, 100k, 123 (bytes)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"expected a byte count such as 512M or 4G, got '{text}'") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a non-negative byte count, got '{text}'")
    return int(value * mult)
