"""What a worker is executing, readable after it died.

When a worker dies, the scheduler must know whether it died running requests (then they, or
something outside, killed it: a crash loop it is not) and, when it ran exactly one, which (that
one is the likely poison: it is failed, not run on another worker to kill that too). For a batch
the scheduler dispatched it knows both already; for requests a frontend sent under a lease
(engine/leases.py) only the worker does. So the worker keeps a 16-byte record in a file it maps
(``w<spawn id>.exec`` in the run directory): the count of requests it is handling, and the
route of the first. Setting it is two stores into a mapped page, no system call; the scheduler
reads the file once the worker has exited, then removes it.
"""
from __future__ import annotations

import mmap
import os
import struct

_FORMAT = struct.Struct("<iiq")     # count, frontend, request id


def record_path(run_dir: str, spawn_id: int) -> str:
    return os.path.join(run_dir, f"w{spawn_id}.exec")


class ExecutionRecord:
    """The worker's side."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _FORMAT.size)
            self.map = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)

    def running(self, count: int, frontend: int, req_id: int) -> None:
        _FORMAT.pack_into(self.map, 0, count, frontend, req_id)

    def idle(self) -> None:
        _FORMAT.pack_into(self.map, 0, 0, 0, 0)

    def close(self) -> None:
        self.map.close()


def read_record(path: str) -> tuple[int, int, int]:
    """(count, frontend, request id) the worker last recorded; (0, 0, 0) if none."""
    try:
        with open(path, "rb") as f:
            data = f.read(_FORMAT.size)
    except OSError:
        return 0, 0, 0
    if len(data) < _FORMAT.size:
        return 0, 0, 0
    count, frontend, req_id = _FORMAT.unpack(data)
    return max(count, 0), frontend, req_id
