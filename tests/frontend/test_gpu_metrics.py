"""GPU gauges (frontend/observability/system_metrics.py) without a GPU: none at all, and no crash, when
nvidia-ml-py is missing or NVML does not start; with a fake NVML, Triton's families, labels and
units, a GPU that lacks a reading keeping the others, and nv_energy_consumption as Triton's
counter (joules since the server started, no _total suffix). The real NVML:
tests/e2e/test_metrics.py::test_gpu_gauges_per_device (gpu)."""
from __future__ import annotations

import logging
import sys
import types

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shmserve.frontend.observability.metrics import exposition
from shmserve.frontend.observability.system_metrics import SystemSampler

GPU_FAMILIES = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"}


class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict], init_error: Exception | None = None) -> types.ModuleType:
    """devices: per GPU, uuid and readings; a reading that is an exception is raised."""
    m = types.ModuleType("pynvml")

    def init():
        if init_error is not None:
            raise init_error

    def reading(key):
        def get(h):
            value = devices[h][key]
            if isinstance(value, Exception):
                raise value
            return value() if callable(value) else value
        return get

    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = reading("uuid")
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=reading("util")(h))
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=reading("total")(h),
                                                                used=reading("used")(h))
    m.nvmlDeviceGetPowerUsage = reading("power_mw")
    m.nvmlDeviceGetEnforcedPowerLimit = reading("limit_mw")
    m.nvmlDeviceGetTotalEnergyConsumption = reading("energy_mj")
    return m


def _page(sampler: SystemSampler) -> str:
    registry = CollectorRegistry()
    registry.register(sampler)
    return exposition(registry).decode()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("module", [None, fake_nvml([], init_error=NVMLError("Driver Not Loaded"))],
                         ids=["no nvidia-ml-py", "NVML does not start"])
def test_no_gpu_no_gpu_families_and_no_crash(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    sampler = SystemSampler(1.0, cpu=True, gpu=True)
    sampler.sample()
    names = set(_families(_page(sampler)))
    assert "nv_cpu_utilization" in names
    assert not names & {n.replace("_total", "") for n in GPU_FAMILIES}


def test_gpu_families_from_nvml(monkeypatch, caplog):
    energy = iter([5_000_000, 5_002_500, 5_010_000])     # mJ since the driver loaded
    devices = [
        {"uuid": b"GPU-aaaa", "util": 37, "total": 80 << 30, "used": 1 << 30,
         "power_mw": 123_456, "limit_mw": 700_000, "energy_mj": lambda: next(energy)},
        # a board that reports neither power nor energy
        {"uuid": "GPU-bbbb", "util": 0, "total": 16 << 30, "used": 0,
         "power_mw": NVMLError("Not Supported"), "limit_mw": NVMLError("Not Supported"),
         "energy_mj": NVMLError("Not Supported")},
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(devices))
    caplog.set_level(logging.WARNING, "shmserve.metrics")
    sampler = SystemSampler(1.0, cpu=False, gpu=True)      # first sample: energy 0 J
    sampler.sample()                                        # +2.5 J
    text = _page(sampler)
    fams = _families(text)
    assert GPU_FAMILIES <= set(fams)

    def value(name, uuid):
        got = [s.value for s in fams[name].samples if s.labels == {"gpu_uuid": uuid}]
        return got[0] if got else None
    assert value("nv_gpu_utilization", "GPU-aaaa") == pytest.approx(0.37)
    assert value("nv_gpu_memory_total_bytes", "GPU-aaaa") == 80 << 30
    assert value("nv_gpu_memory_used_bytes", "GPU-bbbb") == 0
    assert value("nv_gpu_power_usage", "GPU-aaaa") == pytest.approx(123.456)
    assert value("nv_gpu_power_limit", "GPU-aaaa") == pytest.approx(700.0)
    assert value("nv_gpu_power_usage", "GPU-bbbb") is None          # not supported: absent
    assert value("nv_gpu_utilization", "GPU-bbbb") == 0.0
    assert value("nv_energy_consumption", "GPU-aaaa") == pytest.approx(2.5)
    assert value("nv_energy_consumption", "GPU-bbbb") is None
    # Triton's counter name on the wire
    assert "# TYPE nv_energy_consumption counter" in text
    assert 'nv_energy_consumption{gpu_uuid="GPU-aaaa"} 2.5' in text
    assert "nv_energy_consumption_total" not in text
    sampler.sample()                                        # +10 J since the start
    fams = _families(_page(sampler))
    assert value("nv_energy_consumption", "GPU-aaaa") == pytest.approx(10.0)
    # each unsupported reading is logged once, not at every interval
    warned = [r.getMessage() for r in caplog.records if "GPU-bbbb" in r.getMessage()]
    assert len(warned) == 3, warned
