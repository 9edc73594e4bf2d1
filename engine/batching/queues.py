"""Per-version request queues: pure objects that decide which requests run together on which
idle instance, behind one small interface (``RequestQueue``) that the default queue and the
dynamic batcher both implement.

No sockets, no processes: the scheduler core feeds them requests and idle instances and sends
whatever batches they return. The clock is injectable so deadlines can be tested without sleeping.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Protocol

# Queued requests per model version before new ones are refused with 503 (Triton's default
# scheduler has no bound; an unbounded queue turns overload into memory growth).
DEFAULT_MAX_QUEUE = 4096

@dataclass(slots=True)
class QueuedRequest:
    req_id: int
    frontend: int
    batch_size: int
    payload: Any                # opaque payload frame, forwarded to the worker untouched
    enqueued_ns: int = 0
    priority: int = 0           # the request's `priority` parameter; 0 = the default level
    timeout_us: int = 0         # the request's `timeout` parameter; 0 = none given
    shape_key: str = ""         # requests batch together only with an equal key
    received_ns: int = 0        # when the frontend received it (CLOCK_MONOTONIC, system-wide)
    deadline_ns: int = 0        # queue timeout; 0 = none
    dispatched_ns: int = 0
    alone: bool = False         # its worker died: it runs again once, in a batch of its own
    sequence_id: int | str = 0  # the sequence batcher's correlation id (0: none)
    flags: int = 0              # SEQUENCE_START 1 | SEQUENCE_END 2
    trace: bool = False         # traced: its worker reports the execution's times


def shape_key(tensors, variable_inputs: frozenset, has_optional: bool,
              batched: bool) -> str:
    """Requests may share a batch only if the shapes of their variable-dim inputs agree (and,
    with optional inputs, the same inputs are present): this key says which ones can. The
    frontend computes it for a client's request, the ensemble runner for a step's."""
    if not variable_inputs and not has_optional:
        return ""
    parts = []
    for t in sorted(tensors, key=lambda t: t.name):
        if t.name in variable_inputs:
            parts.append(f"{t.name}{t.shape[1:] if batched else t.shape}")
        elif has_optional:
            parts.append(t.name)
    return ";".join(parts)


class QueueFull(Exception):
    pass


class RequestQueue(Protocol):
    """What the scheduler core asks of a version's queue (DefaultQueue, DynamicBatcher)."""

    idle: list[Hashable]        # idle instances (IdleInstances)

    def enqueue(self, req: QueuedRequest) -> None: ...          # raises QueueFull
    def next_batches(self) -> list[tuple[Any, list[QueuedRequest]]]: ...     # (instance, batch)
    def next_deadline_ns(self) -> int | None: ...
    def take_expired(self) -> list[QueuedRequest]: ...
    def requeue(self, req: QueuedRequest) -> None: ...
    def take_failed(self) -> list[tuple[QueuedRequest, str]]: ...
    def cancel(self, frontend: int, req_id: int) -> QueuedRequest | None: ...
    def take_cancelled(self, frontend: int, req_id: int) -> list[QueuedRequest]: ...
    def drain(self) -> list[QueuedRequest]: ...
    def pending(self) -> Iterable[QueuedRequest]: ...     # queued, without taking them out
    def instance_idle(self, key: Hashable) -> None: ...
    def instance_gone(self, key: Hashable) -> None: ...
    def __len__(self) -> int: ...


class IdleInstances:
    """The idle instances of a model version, most recently idle last."""

    idle: list[Hashable]

    def instance_idle(self, key: Hashable) -> None:
        if key not in self.idle:
            self.idle.append(key)

    def instance_gone(self, key: Hashable) -> None:
        if key in self.idle:
            self.idle.remove(key)

    def take_failed(self) -> list[tuple[QueuedRequest, str]]:
        """Queued requests that can no longer run, with why (the sequence batcher's)."""
        return []

    def cancel(self, frontend: int, req_id: int) -> QueuedRequest | None:
        raise NotImplementedError

    def take_cancelled(self, frontend: int, req_id: int) -> list[QueuedRequest]:
        """What a client's cancel of a queued request takes out of the queue: that request
        (the sequence batcher's also takes its sequence's other queued requests)."""
        r = self.cancel(frontend, req_id)
        return [] if r is None else [r]


class DefaultQueue(IdleInstances):
    """Triton's default scheduler: one request per execution, on the next idle instance.

    Idle instances are reused most-recently-idle first, which keeps the hottest process (warm
    caches, resident pages) busy when load is light, and still spreads a burst over all of them.
    """

    def __init__(self, max_queue_size: int = 0, clock: Callable[[], int] = time.monotonic_ns):
        self.max_queue_size = max_queue_size
        self.clock = clock
        self.queue: deque[QueuedRequest] = deque()
        self.idle: list[Hashable] = []

    def enqueue(self, req: QueuedRequest) -> None:
        if self.max_queue_size and len(self.queue) >= self.max_queue_size:
            raise QueueFull("Exceeds maximum queue size")
        req.enqueued_ns = self.clock()
        self.queue.append(req)

    def next_batches(self) -> list[tuple[Any, list[QueuedRequest]]]:
        out = []
        while self.queue and self.idle:
            req = self.queue.popleft()
            req.dispatched_ns = self.clock()
            out.append((self.idle.pop(), [req]))
        return out

    def next_deadline_ns(self) -> int | None:
        return None

    def take_expired(self) -> list[QueuedRequest]:
        return []

    def requeue(self, req: QueuedRequest) -> None:
        """Back to the head of the queue (its worker died before answering)."""
        self.queue.appendleft(req)

    def cancel(self, frontend: int, req_id: int) -> QueuedRequest | None:
        for r in self.queue:
            if r.req_id == req_id and r.frontend == frontend:
                self.queue.remove(r)
                return r
        return None

    def pending(self) -> Iterable[QueuedRequest]:
        return self.queue

    def drain(self) -> list[QueuedRequest]:
        """Take every queued request out (the model is going away)."""
        out = list(self.queue)
        self.queue.clear()
        return out

    def __len__(self) -> int:
        return len(self.queue)
