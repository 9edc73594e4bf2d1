"""Whether an ensemble whose steps could run side by side runs worker to worker now.

Worker to worker (workers/leases/chain.py) its steps run one after the other: a request saves
the scheduler's hops and passes (N + 1 sockets instead of 2N + 2), and loses the overlap of the
steps that could have run at once. Light steps (pre- and post-processing in python, an identity)
gain; two heavy branches (two networks on one image) would lose what they gain from running
together. So the scheduler runs such an ensemble until its steps' statistics show what they
cost, and lends it to run worker to worker while the overlap lost is less than the hops saved,
which it checks again every second (``EnsembleCosts.review``, from housekeeping). A change
publishes the model table, whose route tells the frontends.

Pure: the statistics are read, not kept; no clock of its own.
"""
from __future__ import annotations

from typing import Callable, Iterable

from shmserve.engine.ensemble.plan import EnsemblePlan, serial_cost_ns

# What running a step worker to worker saves a request, against the scheduler's path: two
# socket hops and a pass through the scheduler (measured at c=1 on 2 cores: a three-step
# pipeline went from about 830 µs to 450).
SAVED_PER_STEP_NS = 100_000
# A step's cost is its mean compute time over at least this many requests since the last look.
MIN_REQUESTS = 8


def serial_ok(was: bool, lost_ns: float, steps: int) -> bool:
    """Run one after the other while the overlap lost is under what the hops save; once on, off
    again only past twice that (a step whose time wavers around the line does not flip the
    route every second)."""
    saved = SAVED_PER_STEP_NS * steps
    return lost_ns < (2 * saved if was else saved)


class EnsembleCosts:
    def __init__(self) -> None:
        # (model, version) -> (requests, compute ns) at the last look, and the mean since
        self.seen: dict[tuple[str, int], tuple[int, int]] = {}
        self.mean_ns: dict[tuple[str, int], float] = {}

    def cost(self, key: tuple[str, int], requests: int, compute_ns: int) -> float | None:
        """A step version's mean compute time per request, from its cumulative statistics:
        over the requests since the last look when there are enough of them, else the last
        mean; None before any."""
        last = self.seen.get(key, (0, 0))
        if requests < last[0]:          # a new load's statistics: start again
            last = (0, 0)
            self.mean_ns.pop(key, None)
        if requests - last[0] >= MIN_REQUESTS:
            self.mean_ns[key] = (compute_ns - last[1]) / (requests - last[0])
            last = (requests, compute_ns)
        self.seen[key] = last
        return self.mean_ns.get(key)

    def review(self, plans: Iterable[EnsemblePlan],
               stats: Callable[[str, int], tuple[int, int] | None],
               serving: Callable[[str, int], int | None]) -> bool:
        """Decide ``serial_ok`` for each plan whose steps could run side by side; whether any
        changed. ``serving(model, version)``: the version serving a step (None: none);
        ``stats(model, version)``: its (requests, compute ns) so far."""
        changed = False
        looked: set[tuple[str, int]] = set()
        for p in plans:
            if not p.side_by_side or not p.chain:
                continue
            costs: dict[int, float] = {}
            for s in p.chain:
                v = serving(s.model, s.version)
                if v is not None:
                    looked.add((s.model, v))
                got = stats(s.model, v) if v is not None else None
                cost = self.cost((s.model, v), *got) if got is not None and v is not None \
                    else None
                if cost is None:
                    break
                costs[s.index] = cost
            ok = len(costs) == len(p.chain) and \
                serial_ok(p.serial_ok, serial_cost_ns(p, costs), len(p.chain))
            if ok != p.serial_ok:
                p.serial_ok = ok
                changed = True
        for key in [k for k in self.seen if k not in looked]:   # versions no longer a step's
            del self.seen[key]
            self.mean_ns.pop(key, None)
        return changed
