"""Run in a child process by test_shm_regions: registers a region in a shared table."""
from shmserve.frontend.errors import InferError
from shmserve.frontend.shm_regions import RegionTable
from shmserve.frontend.shm_registry import ShmRegistry


def register_in_child(path: str, name: str, segment: str) -> str:
    try:
        ShmRegistry(table=RegionTable(path)).register_system(name, f"/{segment}", 0, 64)
    except InferError as e:
        return str(e)
    return ""
