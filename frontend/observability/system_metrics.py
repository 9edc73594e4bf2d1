"""CPU, memory and (where nvidia-ml-py finds one) GPU gauges, sampled on an interval."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

log = logging.getLogger("shmserve.metrics")

ENERGY = "nv_energy_consumption"


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)     # idle + iowait
    return sum(fields), idle


def _memory() -> tuple[int, int]:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return total, total - info.get("MemAvailable", info.get("MemFree", 0))


class _Gpus:
    """nvidia-ml-py, if installed and a driver answers; otherwise no GPU gauges at all. Each
    reading is taken on its own: a GPU that does not report one (power on some boards) lacks
    that family, and keeps the others."""

    def __init__(self):
        self.nvml: Any = None
        self.handles = []
        self.energy_start: dict[str, float] = {}       # uuid -> mJ at the first sample
        self.failed: set[tuple[str, str]] = set()       # (uuid, reading) already logged
        try:
            import pynvml
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception as e:  # no package, no driver, no device: CPU-only server
            log.debug("no GPU metrics: %s", e)
            self.nvml = None
            self.handles = []

    def sample(self) -> list[tuple[str, dict[str, float]]]:
        out = []
        nv = self.nvml
        for h in self.handles:
            try:
                uuid = nv.nvmlDeviceGetUUID(h)
            except Exception as e:
                self._failed("?", "uuid", e)
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            values: dict[str, float] = {}
            readings: tuple[tuple[str, Callable[[], Any]], ...] = (
                ("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                ("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h)),
                ("power_usage", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("power_limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
                ("energy", lambda: float(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
            )
            for key, read in readings:
                try:
                    value = read()
                except Exception as e:
                    self._failed(uuid, key, e)
                    continue
                if key == "memory":
                    values["memory_total"], values["memory_used"] = float(value.total), float(value.used)
                elif key == "energy":    # Triton's: joules since the server started
                    start = self.energy_start.setdefault(uuid, value)
                    values["energy"] = (value - start) / 1000.0
                else:
                    values[key] = value
            out.append((uuid, values))
        return out

    def _failed(self, uuid: str, reading: str, error: Exception) -> None:
        if (uuid, reading) not in self.failed:      # once per GPU and reading, not every interval
            self.failed.add((uuid, reading))
            log.warning("reading GPU %s %s failed: %s", uuid, reading, error)


class SystemSampler:
    """A prometheus_client collector whose values a background task refreshes."""

    def __init__(self, interval_s: float, cpu: bool = True, gpu: bool = True):
        self.interval_s = interval_s
        self.cpu = cpu
        self.gpus = _Gpus() if gpu else None
        self.utilization = 0.0
        self.memory = (0, 0)
        self.gpu_values: list[tuple[str, dict[str, float]]] = []
        self._last = _cpu_times() if cpu else (0, 0)
        self.sample()

    def sample(self) -> None:
        if self.cpu:
            total, idle = _cpu_times()
            dt, di = total - self._last[0], idle - self._last[1]
            if dt > 0:
                self.utilization = max(0.0, min(1.0, 1.0 - di / dt))
            self._last = (total, idle)
            self.memory = _memory()
        if self.gpus is not None and self.gpus.handles:
            self.gpu_values = self.gpus.sample()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()

    def collect(self):
        if self.cpu:
            g = GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]")
            g.add_metric([], self.utilization)
            yield g
            g = GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes")
            g.add_metric([], self.memory[0])
            yield g
            g = GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes")
            g.add_metric([], self.memory[1])
            yield g
        if self.gpu_values:
            names = {
                "utilization": ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
                "memory_total": ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
                "memory_used": ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
                "power_usage": ("nv_gpu_power_usage", "GPU power usage in watts"),
                "power_limit": ("nv_gpu_power_limit", "GPU power management limit in watts"),
            }
            for key, (name, doc) in names.items():
                g = GaugeMetricFamily(name, doc, labels=["gpu_uuid"])
                for uuid, values in self.gpu_values:
                    if key in values:
                        g.add_metric([uuid], values[key])
                yield g
            # a counter, named as Triton names it (no _total: metrics.exposition knows ENERGY)
            energy = Metric(ENERGY, "GPU energy consumption in joules since the Triton Server "
                                    "started", "counter")
            for uuid, values in self.gpu_values:
                if "energy" in values:
                    energy.add_sample(ENERGY, {"gpu_uuid": uuid}, values["energy"])
            yield energy
