"""One budget of connections per frontend process, shared by its HTTP, gRPC and metrics ports.

Each connection holds a file descriptor, and so does everything else the frontend opens: its
shared-memory chunks, ZeroMQ sockets, log files. With a cap on one port only, connections to another could take every
descriptor, and then nothing could be accepted or opened on any port. So every port counts its
connections against one total: the process's open-file limit (RLIMIT_NOFILE, its soft limit
raised toward what the ports want, up to the hard limit) less a reserve for the rest. Each
frontend of ``--frontends N`` is a process with a limit and a budget of its own.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger("shmserve.frontend")

RESERVE_MIN = 256           # descriptors kept out of the budget, at least (a frontend uses ~40)
UNLIMITED = 1 << 20         # the budget when the open-file limit is unlimited


def allow_fds(wanted: int) -> int:
    """Raise the soft limit on open files toward ``wanted`` (up to the hard limit); returns the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return UNLIMITED if soft == resource.RLIM_INFINITY else soft


def reserve(limit: int) -> int:
    """Descriptors left out of the budget: an eighth of the limit, at least RESERVE_MIN, at most
    half (a tiny limit still admits connections)."""
    return min(max(RESERVE_MIN, limit // 8), limit // 2)


class Budget:
    """Connections open on all of one frontend's ports together."""

    __slots__ = ("total", "used")

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def take(self) -> bool:
        if self.used >= self.total:
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used -= 1

    def refusal(self) -> str:
        return (f"too many connections ({self.total} on this server's HTTP, gRPC and metrics "
                f"ports together, set by its open-file limit); try again later")


def for_process(http_max_connections: int) -> Budget:
    """The frontend's budget: room for --http-max-connections HTTP connections and as many again
    on the other ports, where the hard open-file limit allows it."""
    limit = allow_fds(2 * http_max_connections + 1024)
    budget = Budget(limit - reserve(limit))
    log.info("connections: at most %d on all ports together (open-file limit %d)",
             budget.total, limit)
    return budget
