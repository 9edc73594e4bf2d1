"""Stand-in for python_backend's compiled ``triton_shm_monitor`` module, which Triton's
``qa/common/shm_util.py`` imports to watch the free space of the python backend's shared memory
pools (/dev/shm/triton_python_backend_shm_region_*). shmserve has no such pools, so the leak
detector finds no region to watch; should a stray region of that name exist, it reads as
constant (no leak is ever reported through this module).
"""


class SharedMemoryManager:
    def __init__(self, name):
        self.name = name

    def free_memory(self):
        return 0
