"""Dynamic batching of leased requests, in the worker.

The instances of a model with a plain dynamic batcher (no priorities, no queue policy) may be
lent to a frontend (engine/leases.py), which then sends its requests straight to them, any
number in flight, spread over the instances. Those requests cannot meet in the scheduler's
queue, so they meet in each worker's inbox: after a leased request, the requests that follow
it in the inbox join its execution by the rule the scheduler's batcher uses
(engine/batching/rule.py: the same sizes, shape keys, preferred sizes and delay), as it would have
formed the batch from its queue. Only requests of the same lease in force join, in arrival
order (the first that does not fit ends the batch and runs next); the delay counts from when
the oldest request reached the frontend (the clock frontends stamp with), and while it runs
the worker waits for more in its inbox.
"""
from __future__ import annotations

import time
from collections import deque

import zmq

from shmserve.engine.batching.rule import BatchRule
from shmserve.ipc import channel
from shmserve.ipc.messages.to_worker import LeasedExecute

# Below this the wait for a fuller batch sleeps rather than waits on the inbox.
SHORT_S = 0.002


class LeasedBatcher:
    def __init__(self, config: dict):
        db = config.get("dynamic_batching")
        max_batch = int(config.get("max_batch_size") or 0)
        self.rule = BatchRule.of(max(1, max_batch), (db or {}).get("preferred_batch_size") or [],
                                 int((db or {}).get("max_queue_delay_microseconds") or 0))
        # 0: the model does not batch (nothing joins a leased request)
        self.limit = self.rule.limit if db is not None and max_batch > 0 else 0
        self.delay_ns = self.rule.delay_ns

    def gather(self, first: LeasedExecute, frames: list, inbox, backlog: deque,
               revoked_upto: int) -> list[tuple[LeasedExecute, list]]:
        """``first`` and the leased requests that join its execution, taken from ``backlog``
        (read before, handled first) and then the inbox; what does not join stays at the head
        of ``backlog``."""
        batch = [(first, frames)]
        lease = first.lease_id
        growth = self.rule.grow()
        growth.add(first.head.batch_size, first.head.shape_key)
        deadline = first.head.received_ns + self.delay_ns
        while not growth.closed:
            # nothing more waiting: a batch that may go goes, any other waits for more
            if not backlog and not inbox.has_message() and \
                    (growth.best or not self._arrives(inbox, deadline)):
                break
            if not backlog:
                try:
                    backlog.append(inbox.recv(channel.NOBLOCK))
                except zmq.Again:
                    break
            msg, more = backlog[0]
            if type(msg) is not LeasedExecute or msg.lease_id != lease or \
                    msg.lease_id <= revoked_upto or \
                    not growth.add(msg.head.batch_size, msg.head.shape_key):
                break
            backlog.popleft()
            batch.append((msg, more))
        # as the scheduler's batcher: cut back to a preferred size unless the delay ran out
        n = growth.due(time.monotonic_ns() - first.head.received_ns) or len(batch)
        for item in reversed(batch[n:]):        # they run next, in arrival order
            backlog.appendleft(item)
        del batch[n:]
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
