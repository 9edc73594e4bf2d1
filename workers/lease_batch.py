"""Dynamic batching of leased requests, in the worker.

The instances of a model with a plain dynamic batcher (no priorities, no queue policy) may be
lent to a frontend (engine/leases.py), which then sends its requests straight to them, any
number in flight, spread over the instances. Those requests cannot meet in the scheduler's
queue, so they meet in each worker's inbox: after a leased request, the requests that follow
it in the inbox join its execution while they fit the config's rules, as the scheduler's
batcher would have formed it from its queue:

- at most ``max_batch_size`` inferences, and never past the largest preferred batch size;
- only requests with the same shape key (equal variable dimensions) and the same lease in
  force, in arrival order (the first that does not fit ends the batch and runs next);
- a batch that has reached a preferred batch size goes as soon as nothing more is waiting,
  cut back to its longest prefix of a preferred size (the rest runs next), as the scheduler's
  batcher sends the longest such prefix of its queue without waiting;
- any other batch that is not full waits for more until ``max_queue_delay_microseconds`` after
  its oldest request reached the frontend (the clock frontends stamp with), as Triton's would.
"""
from __future__ import annotations

import time
from collections import deque

import zmq

from shmserve.ipc import channel
from shmserve.ipc.messages import LeasedExecute

# Below this the wait for a fuller batch sleeps rather than waits on the inbox.
SHORT_S = 0.002


class LeasedBatcher:
    def __init__(self, config: dict):
        db = config.get("dynamic_batching")
        max_batch = int(config.get("max_batch_size") or 0)
        preferred = [int(p) for p in (db or {}).get("preferred_batch_size") or []
                     if 0 < int(p) <= max_batch]
        self.preferred = frozenset(preferred)
        # 0: the model does not batch (nothing joins a leased request)
        self.limit = (max(preferred) if preferred else max_batch) if db is not None else 0
        self.delay_ns = int((db or {}).get("max_queue_delay_microseconds") or 0) * 1000

    def gather(self, first: LeasedExecute, frames: list, inbox, backlog: deque,
               revoked_upto: int) -> list[tuple[LeasedExecute, list]]:
        """``first`` and the leased requests that join its execution, taken from ``backlog``
        (read before, handled first) and then the inbox; what does not join stays at the head
        of ``backlog``."""
        batch = [(first, frames)]
        size = first.head.batch_size
        if size >= self.limit:
            return batch
        key, lease = first.head.shape_key, first.lease_id
        deadline = first.head.received_ns + self.delay_ns
        preferred = self.preferred
        best = 1 if size in preferred else 0    # the longest prefix of a preferred size
        while size < self.limit:
            # nothing more waiting: a preferred size goes now, any other batch waits for more
            if not backlog and not inbox.has_message() and \
                    (best or not self._arrives(inbox, deadline)):
                break
            if not backlog:
                try:
                    backlog.append(inbox.recv(channel.NOBLOCK))
                except zmq.Again:
                    break
            msg, more = backlog[0]
            if type(msg) is not LeasedExecute or msg.lease_id != lease or \
                    msg.lease_id <= revoked_upto or msg.head.shape_key != key or \
                    size + msg.head.batch_size > self.limit:
                break
            backlog.popleft()
            batch.append((msg, more))
            size += msg.head.batch_size
            if size in preferred:
                best = len(batch)
        # as the scheduler's batcher: cut back unless the oldest has waited out a delay
        if best and best < len(batch) and (not self.delay_ns or time.monotonic_ns() < deadline):
            for item in reversed(batch[best:]):     # they run next, in arrival order
                backlog.appendleft(item)
            del batch[best:]
        return batch

    @staticmethod
    def _arrives(inbox, deadline_ns: int) -> bool:
        """Whether a message arrives by ``deadline_ns`` (the caller found none waiting)."""
        while True:
            left = (deadline_ns - time.monotonic_ns()) / 1e9
            if left <= 0:
                return False
            if left > SHORT_S:
                inbox.wait(left - SHORT_S)      # wakes as soon as something arrives
            else:
                # epoll waits whole milliseconds; a shorter rest is slept out (a spin would
                # take the CPU from the frontend that is sending the next requests)
                time.sleep(left)
            if inbox.has_message():
                return True
