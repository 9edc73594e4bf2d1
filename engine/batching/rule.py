"""Triton's dynamic batching rule, in one place: how large a batch grows and when it goes.

Two places form batches by it: the scheduler's queue (engine/batching/dynamic.py) and a leased
worker's inbox (workers/leases/batch.py), which gets the requests a frontend sends it under a
lease. Both grow a batch request by request through a ``BatchGrowth`` and ask it how much of it
goes now:

- a batch takes requests in order while they fit: the same shape key (equal variable
  dimensions), at most the largest preferred batch size (or ``max_batch_size`` without one), and
  a request that must run alone (a retry after a worker death) runs by itself;
- once the oldest request has waited ``max_queue_delay_microseconds``, the whole batch goes;
- before that, a batch that has reached a preferred size goes cut back to its longest prefix of
  a preferred size (the rest stays first in line);
- any other batch goes when it cannot grow (full, or the next request does not fit), or at once
  when there is no delay; otherwise it waits for more.

Pure: no clock of its own (the caller says what time it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class BatchRule:
    max_batch: int
    preferred: tuple[int, ...] = ()     # sorted, each within 1..max_batch
    delay_ns: int = 0

    @classmethod
    def of(cls, max_batch: int, preferred, delay_us: int) -> "BatchRule":
        return cls(max_batch, tuple(sorted({int(p) for p in preferred
                                            if 0 < int(p) <= max_batch})), delay_us * 1000)

    @property
    def limit(self) -> int:
        """Past the largest preferred size a batch is not worth growing further."""
        return self.preferred[-1] if self.preferred else self.max_batch

    def grow(self) -> "BatchGrowth":
        return BatchGrowth(self)


class BatchGrowth:
    __slots__ = ("rule", "total", "count", "best", "closed", "key")

    def __init__(self, rule: BatchRule):
        self.rule = rule
        self.total = 0          # inferences
        self.count = 0          # requests
        self.best = 0           # the longest prefix whose size is a preferred size
        self.closed = False     # it cannot grow: full, or the next request did not fit
        self.key: Hashable = None

    def add(self, size: int, key: Hashable, alone: bool = False) -> bool:
        """Whether the next request (``size`` inferences, shape key ``key``) joins the batch;
        one that does not closes it."""
        if self.closed:
            return False
        if self.count and (alone or key != self.key or self.total + size > self.rule.limit):
            self.closed = True
            return False
        self.count += 1
        self.total += size
        self.key = key
        if alone:
            self.closed = True
        elif self.total in self.rule.preferred:
            self.best = self.count
        if self.total >= self.rule.max_batch:
            self.closed = True
        return True

    def due(self, waited_ns: int) -> int:
        """How many of its requests go now, the oldest having waited ``waited_ns``; 0: wait
        for more."""
        if not self.count:
            return 0
        delay = self.rule.delay_ns
        if delay and waited_ns >= delay:
            return self.count
        if self.best:
            return self.best
        return self.count if self.closed or not delay else 0
