"""Which way each sequence's requests go, so that none overtakes another.

A request of a sequence (it has a correlation id) reaches its model's worker one of two ways:
straight, under a lease (engine/leases.py), or through the scheduler, which runs it itself or,
while the frontend holds the lease, forwards it to the leased worker on its own channel. Each
way keeps order; two ways at once do not (a request sent straight could reach the worker before
an earlier one still passing through the scheduler, or one the worker hands back after its
lease ended could reach the scheduler after a later one). So a sequence's requests take one way
at a time:

- while some of them are on their way through the scheduler, the next one goes there too;
- while some are on their way under a lease, the next one goes under the same lease, and waits
  here if that lease has ended, until they are answered or handed back (then sent on to the
  scheduler, in order);
- with none on the way, the next one goes the best way there is.

Pure: it keeps counts; the caller (frontend/engine_client.py) sends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

HOLD = "hold"           # ``choose``: keep the request here for now


@dataclass(eq=False)
class _Flight:
    through_scheduler: int = 0
    under_lease: int = 0
    lease_id: int = 0                   # the lease ``under_lease`` went under
    held: deque = field(default_factory=deque)      # request ids waiting here, in order


class SequencePaths:
    def __init__(self) -> None:
        self.flights: dict[Hashable, _Flight] = {}
        self.of: dict[int, tuple[Hashable, int]] = {}   # request -> (sequence, lease id | 0)

    def __bool__(self) -> bool:
        return bool(self.of)

    def choose(self, key: Hashable, lease: Any) -> Any:
        """How the next request of sequence ``key`` goes, given the lease the caller would
        use (None: none): that lease, None (the scheduler), or HOLD."""
        f = self.flights.get(key)
        if f is None:
            return lease
        if f.held:
            return HOLD
        if f.through_scheduler:
            return None
        if f.under_lease:
            return lease if lease is not None and lease.lease_id == f.lease_id else HOLD
        return lease

    def track(self, key: Hashable, req_id: int) -> None:
        """A request of sequence ``key``, before it is sent (``went``) or held (``hold``)."""
        self.flights.setdefault(key, _Flight())
        self.of[req_id] = (key, -1)

    def hold(self, req_id: int) -> None:
        self.flights[self.of[req_id][0]].held.append(req_id)

    def went(self, req_id: int, lease_id: int) -> None:
        """The request was sent under lease ``lease_id`` (0: to the scheduler), first or again
        (handed back, lost with its worker, forwarded by the scheduler)."""
        entry = self.of.get(req_id)
        if entry is None:
            return
        key, was = entry
        f = self.flights[key]
        self._leave(f, was)
        if lease_id:
            f.under_lease += 1
            f.lease_id = lease_id
        else:
            f.through_scheduler += 1
        self.of[req_id] = (key, lease_id)

    def finished(self, req_id: int) -> list[int]:
        """The request was answered: the requests of its sequence held here that may go now,
        in order (the caller sends each through ``choose`` again)."""
        entry = self.of.pop(req_id, None)
        if entry is None:
            return []
        key, was = entry
        f = self.flights[key]
        if was == -1 and req_id in f.held:
            f.held.remove(req_id)
        self._leave(f, was)
        released: list[int] = []
        if f.held and not f.under_lease:
            released = list(f.held)
            f.held.clear()
            for rid in released:
                self.of[rid] = (key, -1)
        if not (f.through_scheduler or f.under_lease or f.held or released):
            del self.flights[key]
        return released

    def clear(self) -> None:
        self.flights.clear()
        self.of.clear()

    @staticmethod
    def _leave(f: _Flight, was: int) -> None:
        if was > 0:
            f.under_lease -= 1
        elif was == 0:
            f.through_scheduler -= 1
