"""When each request the frontend holds must be answered by: the bookkeeping behind the
frontend's last line of defence (``EngineClient`` answers a request whose deadline passed with
"Request timeout expired" and cancels it in the scheduler).

A request's deadline is its receive time plus ``--request-deadline-secs``, or, when the request
carries Triton's ``timeout`` parameter and that ends sooner, the timeout plus a grace (the
scheduler answers a request whose queue timeout expired itself; the grace leaves it the time).

Pure: no loop and no clock of its own (times are monotonic ns, passed in). Default deadlines are
appended in the order requests arrive, so they sit in a deque in deadline order; the rarer
earlier ones from a request's own timeout sit in a heap. An answered request is not looked for:
its entry is dropped when it reaches the front, and the whole set is compacted when answered
entries outnumber the live ones, so memory follows the requests held, not the request rate.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Collection

# Added to a request's own timeout: the scheduler rejects a request whose queue timeout expired,
# and a model may honour the timeout itself; the frontend steps in only after this much more.
TIMEOUT_GRACE_S = 2.0
# Compaction runs when the entries exceed twice the live requests plus this.
_SLACK = 1024


class Deadlines:
    def __init__(self, default_s: float, grace_s: float = TIMEOUT_GRACE_S):
        self.default_ns = int(default_s * 1e9)
        self.grace_ns = int(grace_s * 1e9)
        self.default_s = default_s
        self.grace_s = grace_s
        self.fifo: deque[tuple[int, int]] = deque()      # (deadline ns, request id)
        self.heap: list[tuple[int, int]] = []            # from a request's own timeout

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def add(self, req_id: int, received_ns: int, timeout_us: int = 0) -> int:
        """Track a request; returns its deadline (monotonic ns)."""
        deadline = received_ns + self.default_ns
        if timeout_us > 0:
            own = received_ns + timeout_us * 1000 + self.grace_ns
            if own < deadline:
                heapq.heappush(self.heap, (own, req_id))
                return own
        self.fifo.append((deadline, req_id))
        return deadline

    def expired(self, now_ns: int, live: Collection[int]) -> list[tuple[int, bool]]:
        """(request id, whether its own timeout set the deadline) for each request still in
        ``live`` whose deadline has passed. Those are forgotten, as are entries at the front of
        requests no longer live."""
        out: list[tuple[int, bool]] = []
        fifo = self.fifo
        while fifo and (fifo[0][0] <= now_ns or fifo[0][1] not in live):
            deadline, rid = fifo.popleft()
            if deadline <= now_ns and rid in live:
                out.append((rid, False))
        heap = self.heap
        while heap and (heap[0][0] <= now_ns or heap[0][1] not in live):
            deadline, rid = heapq.heappop(heap)
            if deadline <= now_ns and rid in live:
                out.append((rid, True))
        return out

    def compact(self, live: Collection[int]) -> None:
        """Drop the entries of answered requests once they outnumber the live ones."""
        if len(self) <= 2 * len(live) + _SLACK:
            return
        self.fifo = deque(e for e in self.fifo if e[1] in live)
        self.heap = [e for e in self.heap if e[1] in live]
        heapq.heapify(self.heap)

    def next_ns(self) -> int | None:
        """The earliest deadline tracked (perhaps of a request answered since)."""
        fronts = [q[0][0] for q in (self.fifo, self.heap) if q]
        return min(fronts) if fronts else None

    def clear(self) -> None:
        self.fifo.clear()
        self.heap.clear()

    def message(self, own_timeout: bool) -> str:
        """What the client reads; Triton's text for a timed-out request comes first."""
        if own_timeout:
            return (f"Request timeout expired: no answer within the request's timeout and a "
                    f"grace of {self.grace_s:g} s")
        return (f"Request timeout expired: no answer within the request deadline of "
                f"{self.default_s:g} s (--request-deadline-secs)")
