"""Fixtures the frontend's in-process tests share."""
import pytest

from shmserve.ipc import shm


@pytest.fixture
def arena():
    """A real ShmArena of its own, every segment unlinked afterwards."""
    prefix = shm.new_server_prefix()
    a = shm.ShmArena(prefix, chunk_size=2 << 20)
    yield a
    a.close()
    shm.unlink_prefixed(prefix)
