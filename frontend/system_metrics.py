"""CPU, memory and (where nvidia-ml-py finds one) GPU gauges, sampled on an interval."""
from __future__ import annotations

import asyncio
import logging

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("shmserve.metrics")


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
    """nvidia-ml-py, if installed and a driver answers; otherwise no GPU gauges at all."""

    def __init__(self):
        self.nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:       # no package, no driver, no device: CPU-only server
            self.nvml = None
            self.handles = []

    def sample(self) -> list[tuple[str, dict[str, float]]]:
        out = []
        nv = self.nvml
        for h in self.handles:
            try:
                uuid = nv.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out.append((uuid, {
                    "utilization": nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                    "memory_total": float(mem.total), "memory_used": float(mem.used),
                    "power_usage": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    "power_limit": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                }))
            except Exception as e:
                log.warning("reading GPU metrics failed: %s", e)
        return out


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
                    g.add_metric([uuid], values[key])
                yield g
