"""Run in a child process by test_shm_regions: registers a region in a shared table."""
from shmserve.frontend.shm.regions import RegionTable
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.errors import InferError


def register_in_child(path: str, name: str, segment: str) -> str:
    try:
        ShmRegistry(table=RegionTable(path)).register_system(name, f"/{segment}", 0, 64)
    except InferError as e:
        return str(e)
    return ""
