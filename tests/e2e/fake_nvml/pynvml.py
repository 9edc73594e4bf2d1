"""A stand-in for nvidia-ml-py in a server's processes (tests put this folder on PYTHONPATH):
NVML shows FAKE_NVML_GPUS GPUs with fixed readings. Nothing here initialises CUDA, like NVML."""
import os
from types import SimpleNamespace


class NVMLError(Exception):
    pass


def _count() -> int:
    return int(os.environ.get("FAKE_NVML_GPUS", "0"))


def nvmlInit():
    if _count() < 0:
        raise NVMLError("Driver Not Loaded")


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return _count()


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < _count():
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetUUID(handle):
    return f"GPU-fake-{handle}"


def nvmlDeviceGetUtilizationRates(handle):
    return SimpleNamespace(gpu=10 * (handle + 1), memory=0)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=80 << 30, used=(handle + 1) << 30, free=(79 - handle) << 30)


def nvmlDeviceGetPowerUsage(handle):
    return 100_000          # mW


def nvmlDeviceGetEnforcedPowerLimit(handle):
    return 700_000


def nvmlDeviceGetTotalEnergyConsumption(handle):
    return 1_000_000        # mJ
