"""Triton's dynamic batcher (docs/triton-compat.md §5.2) as a pure core: queues per priority level, queue
policies, preferred batch sizes, the delay measured from the oldest request, shape grouping.

A config may declare any number of priority levels (Triton takes up to 2^64 - 1), so a level's
queue exists only while requests wait at it: memory follows the requests, not the config.

The shell asks ``next_batches()`` whenever a request arrives or an instance frees up, and sleeps
until ``next_deadline_ns()`` otherwise: there is no polling tick.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

from shmserve.engine.batching.queues import IdleInstances, QueuedRequest, QueueFull
from shmserve.engine.batching.rule import BatchGrowth, BatchRule


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    max_queue_size: int = 0             # 0 = unbounded (the shell still applies a global bound)
    timeout_us: int = 0                 # default queue timeout; 0 = none
    allow_override: bool = False
    delay_on_timeout: bool = False      # timeout_action DELAY instead of REJECT


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    max_batch_size: int
    preferred: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_policy: QueuePolicy = QueuePolicy()
    level_policies: tuple[tuple[int, QueuePolicy], ...] = ()


class _Level:
    __slots__ = ("policy", "ready", "delayed")

    def __init__(self, policy: QueuePolicy):
        self.policy = policy
        self.ready: deque[QueuedRequest] = deque()
        self.delayed: deque[QueuedRequest] = deque()    # timed out with action DELAY

    def __len__(self):
        return len(self.ready) + len(self.delayed)


class DynamicBatcher(IdleInstances):
    def __init__(self, cfg: BatcherConfig, max_queue_size: int = 0,
                 clock: Callable[[], int] = time.monotonic_ns):
        self.cfg = cfg
        self.clock = clock
        self.max_queue_size = max_queue_size
        self.policies = dict(cfg.level_policies)
        self.levels: dict[int, _Level] = {}     # level index -> its queue, while not empty
        self.order: list[int] = []              # their indexes, highest priority (lowest) first
        self.rule = BatchRule.of(cfg.max_batch_size, cfg.preferred, cfg.max_queue_delay_us)
        self.delay_ns = self.rule.delay_ns
        self.idle: list[Hashable] = []
        self.count = 0
        # earliest queue timeout of any request (may be stale-early after dispatch: that only
        # costs one extra scan, which recomputes it)
        self.earliest_deadline = 0
        self._version = 0           # bumped by every change to the queues
        self._scanned = -1          # the version _scan_result was computed at
        self._scan_result: tuple[list[QueuedRequest], BatchGrowth, int] = \
            ([], self.rule.grow(), 0)

    # ---- queueing ------------------------------------------------------------------------------
    def level_of(self, priority: int) -> int:
        levels = self.cfg.priority_levels
        if levels and 1 <= priority <= levels:
            return priority - 1
        if levels and 1 <= self.cfg.default_priority_level <= levels:
            return self.cfg.default_priority_level - 1
        return 0

    def _level(self, key: int) -> _Level:
        level = self.levels.get(key)
        if level is None:
            level = self.levels[key] = _Level(self.policies.get(key + 1, self.cfg.default_policy))
            bisect.insort(self.order, key)
        return level

    def _prune(self, key: int) -> None:
        """Forget level ``key`` if nothing waits at it any more."""
        level = self.levels.get(key)
        if level is not None and not level.ready and not level.delayed:
            del self.levels[key]
            self.order.remove(key)

    def _queues(self) -> Iterator[_Level]:
        levels = self.levels
        for key in self.order:
            yield levels[key]

    def enqueue(self, req: QueuedRequest) -> None:
        key = self.level_of(req.priority)
        level = self._level(key)
        policy = level.policy
        if (policy.max_queue_size and len(level) >= policy.max_queue_size) or \
                (self.max_queue_size and self.count >= self.max_queue_size):
            self._prune(key)
            raise QueueFull("Exceeds maximum queue size")
        now = self.clock()
        req.enqueued_ns = now
        timeout = policy.timeout_us
        if policy.allow_override and req.timeout_us > 0:
            # a request may ask for a shorter wait than the model's default, or for one where
            # the model sets none
            timeout = min(timeout, req.timeout_us) if timeout else req.timeout_us
        req.deadline_ns = now + timeout * 1000 if timeout else 0
        if req.deadline_ns and (not self.earliest_deadline or req.deadline_ns < self.earliest_deadline):
            self.earliest_deadline = req.deadline_ns
        level.ready.append(req)
        self.count += 1
        self._version += 1

    def take_expired(self) -> list[QueuedRequest]:
        """Requests whose queue timeout passed: REJECT ones are returned (to be failed), DELAY
        ones move behind the requests that have not expired."""
        now = self.clock()
        rejected: list[QueuedRequest] = []
        if not self.earliest_deadline or self.earliest_deadline > now:
            return rejected
        self.earliest_deadline = 0
        for key in list(self.order):
            level = self.levels[key]
            keep: deque[QueuedRequest] = deque()
            for r in level.ready:
                if r.deadline_ns and r.deadline_ns <= now:
                    if level.policy.delay_on_timeout:
                        r.deadline_ns = 0
                        level.delayed.append(r)
                    else:
                        rejected.append(r)
                        self.count -= 1
                else:
                    keep.append(r)
                    if r.deadline_ns and (not self.earliest_deadline
                                          or r.deadline_ns < self.earliest_deadline):
                        self.earliest_deadline = r.deadline_ns
            level.ready = keep
            self._prune(key)
        self._version += 1
        return rejected

    # ---- forming batches -----------------------------------------------------------------------------
    def pending(self) -> Iterator[QueuedRequest]:
        """The queued requests, highest priority first, without taking them out."""
        for level in self._queues():
            yield from level.ready
            yield from level.delayed

    def _scan(self) -> tuple[list[QueuedRequest], BatchGrowth, int]:
        """The batch the queue head can form by the rule (engine/batching/rule.py), how it grew,
        and its oldest enqueue time. Remembered until the queue changes: the shell asks twice
        per message (next_batches, next_deadline_ns)."""
        if self._scanned == self._version:
            return self._scan_result
        batch: list[QueuedRequest] = []
        growth = self.rule.grow()
        oldest = 0
        for r in self.pending():
            if not growth.add(r.batch_size, r.shape_key, r.alone):
                break
            batch.append(r)
            if not oldest or r.enqueued_ns < oldest:
                oldest = r.enqueued_ns
            if growth.closed:
                break
        self._scan_result = (batch, growth, oldest)
        self._scanned = self._version
        return self._scan_result

    def _candidate(self) -> tuple[list[QueuedRequest], bool]:
        """The batch the queue head can form, and whether it must wait no longer."""
        batch, growth, oldest = self._scan()
        if not batch:
            return batch, False
        n = growth.due(self.clock() - oldest)
        return (batch[:n], True) if n else (batch, False)

    def next_batches(self) -> list[tuple[Any, list[QueuedRequest]]]:
        out = []
        while self.idle and self.count:
            batch, due = self._candidate()
            if not due:
                break
            now = self.clock()
            for r in batch:
                self._remove(r)
                r.dispatched_ns = now
            out.append((self.idle.pop(), batch))
        return out

    def _remove(self, r: QueuedRequest) -> None:
        key = self.level_of(r.priority)
        level = self.levels[key]
        if level.ready and level.ready[0] is r:
            level.ready.popleft()
        elif level.delayed and level.delayed[0] is r:
            level.delayed.popleft()
        else:   # batches take a prefix of the pending order, so this is not reached; be safe
            (level.ready if r in level.ready else level.delayed).remove(r)
        if not level.ready and not level.delayed:
            self._prune(key)
        self.count -= 1
        self._version += 1

    def next_deadline_ns(self) -> int | None:
        """When the shell must look again: the oldest request's delay, or a queue timeout."""
        deadlines = [self.earliest_deadline] if self.earliest_deadline else []
        if self.count and self.idle:
            # without an idle instance nothing can go anyway; one becoming idle wakes the shell
            batch, due = self._candidate()
            if batch:
                deadlines.append(self.clock() if due else self._scan()[2] + self.delay_ns)
        return min(deadlines) if deadlines else None

    def requeue(self, req: QueuedRequest) -> None:
        """Back to the head of its level (its worker died before answering)."""
        self._level(self.level_of(req.priority)).ready.appendleft(req)
        self.count += 1
        self._version += 1

    def cancel(self, frontend: int, req_id: int) -> QueuedRequest | None:
        for key in self.order:
            level = self.levels[key]
            for q in (level.ready, level.delayed):
                for r in q:
                    if r.req_id == req_id and r.frontend == frontend:
                        q.remove(r)
                        self._prune(key)
                        self.count -= 1
                        self._version += 1
                        return r
        return None

    def drain(self) -> list[QueuedRequest]:
        out = list(self.pending())
        self.levels.clear()
        self.order.clear()
        self.count = 0
        self._version += 1
        return out

    def __len__(self) -> int:
        return self.count


def batcher_config(cfg) -> BatcherConfig:
    """From a normalized ModelConfig with ``dynamic_batching`` set."""
    db = cfg.dynamic_batching

    def policy(p) -> QueuePolicy:
        return QueuePolicy(p.max_queue_size, p.default_timeout_microseconds,
                           p.allow_timeout_override, p.timeout_action == p.DELAY)

    return BatcherConfig(
        max_batch_size=max(1, cfg.max_batch_size), preferred=tuple(db.preferred_batch_size),
        max_queue_delay_us=db.max_queue_delay_microseconds, preserve_ordering=db.preserve_ordering,
        priority_levels=db.priority_levels, default_priority_level=db.default_priority_level,
        default_policy=policy(db.default_queue_policy),
        level_policies=tuple((int(k), policy(v)) for k, v in db.priority_queue_policy.items()))
