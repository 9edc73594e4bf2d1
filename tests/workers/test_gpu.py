"""ipc/gpu/device.py on a machine without a GPU: its CUDA calls through cuda-python's driver bindings
(faked in fake_cuda.py: host memory as device memory, the driver's rules and error codes),
device counting without cuda-python (NVML, /proc/driver/nvidia/gpus, CUDA_VISIBLE_DEVICES), and
that nothing imports cuda-python or touches CUDA at import. The real driver:
tests/workers/test_gpu_backends.py (gpu)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types

import fake_cuda
import numpy as np
import pytest
from serverproc import REPO_ROOT

from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor


@pytest.fixture
def driver(monkeypatch):
    return fake_cuda.install(monkeypatch, devices=2, names=("Fake H200", "Fake L4"))


def test_nothing_imports_cuda_python_or_nvml_at_import(tmp_path):
    """A worker may be forked from a fork server: CUDA (and the bindings) only once a worker
    asks. Poisoned ``cuda`` and ``pynvml`` packages fail the import if anything touches them."""
    for name in ("cuda", "pynvml"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('{name} imported at import')\n")
    code = textwrap.dedent("""
        import sys
        from shmserve.ipc.gpu import cuda_ipc, device, dlpack
        from shmserve.workers import main
        from shmserve.workers.backends import onnx, tensorrt
        from shmserve.workers.python_backend import pb_utils
        from shmserve.frontend.shm import registry
        assert not [m for m in sys.modules if m.split(".")[0] in ("cuda", "pynvml", "tensorrt")]
        print("clean")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO_ROOT,
                                                        os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "clean" in r.stdout, r.stdout + r.stderr


def test_device_count_through_the_bindings(driver):
    assert gpu.device_count() == (2, "")
    assert driver.calls[:2] == ["cuInit", "cuDeviceGetCount"]


@pytest.mark.parametrize("kw, fail, why", [
    ({"devices": 0}, {}, "the NVIDIA driver finds no CUDA device (CUDA_VISIBLE_DEVICES may hide them)"),
    ({"no_library": True}, {}, "no NVIDIA driver (Failed to dlopen libcuda.so.1)"),
    ({}, {"cuInit": "CUDA_ERROR_INVALID_DEVICE"}, "the CUDA driver failed to initialise (CUDA_ERROR_INVALID_DEVICE)"),
    ({}, {"cuDeviceGetCount": "CUDA_ERROR_INVALID_VALUE"}, "cuDeviceGetCount failed: CUDA_ERROR_INVALID_VALUE"),
])
def test_device_count_says_why_there_is_none(monkeypatch, kw, fail, why):
    drv = fake_cuda.install(monkeypatch, **kw)
    drv.fail.update({k: fake_cuda.CUresult[v] for k, v in fail.items()})
    assert gpu.device_count() == (0, why)


def test_the_driver_api_on_one_device(driver):
    cuda = gpu.cuda(1)
    assert gpu.cuda(1) is cuda and driver.retained == {1: 1}       # one per device and process
    assert cuda.name() == "Fake L4"
    x = np.arange(1000, dtype=np.float32)
    a, b = cuda.alloc(x.nbytes), cuda.alloc(x.nbytes)
    assert isinstance(a, int) and isinstance(b, int)
    stream = cuda.stream()
    assert isinstance(stream, int) and stream != 0
    cuda.htod(a, x.ctypes.data, x.nbytes, stream)
    cuda.dtod(b, a, x.nbytes, stream)
    out = np.empty_like(x)
    cuda.dtoh(out.ctypes.data, b, x.nbytes, stream)
    cuda.synchronize(stream)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(cuda.to_host(DeviceTensor(a, (10, 100), np.float32, 1)), x.reshape(10, 100))
    assert driver.copies == ["htod", "dtod", "dtoh", "dtoh"]
    cuda.htod(a, 0, 0)                      # nothing to copy: no call
    assert cuda.to_host(DeviceTensor(a, (0, 4), np.float32, 1)).shape == (0, 4)
    assert len(driver.copies) == 4
    z = cuda.alloc(0)                       # cuMemAlloc refuses 0 bytes; the wrapper asks for 1
    for p in (a, b, z):
        cuda.free(p)
    cuda.destroy_stream(stream)
    assert driver.allocations == {} and driver.streams == 0


def test_errors_name_the_cuda_error(driver):
    cuda = gpu.cuda(0)
    with pytest.raises(gpu.CudaError, match=r"^cuDeviceGet\(2\) failed: CUDA_ERROR_INVALID_DEVICE$"):
        gpu.Cuda(2)
    with pytest.raises(gpu.CudaError, match=r"^cuMemFree failed: CUDA_ERROR_INVALID_VALUE$"):
        cuda.free(12345)
    stream = cuda.stream()
    cuda.destroy_stream(stream)
    with pytest.raises(gpu.CudaError, match=r"^cuStreamSynchronize failed: CUDA_ERROR_INVALID_HANDLE$"):
        cuda.synchronize(stream)
    driver.fail["cuMemAlloc"] = fake_cuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(gpu.CudaError, match=r"^cuMemAlloc\(1024 bytes\) failed: CUDA_ERROR_OUT_OF_MEMORY$"):
        cuda.alloc(1024)
    host = np.zeros(4, np.uint8)
    with pytest.raises(gpu.CudaError, match=r"^cuMemcpyHtoD failed: CUDA_ERROR_ILLEGAL_ADDRESS$"):
        cuda.htod(1 << 40, host.ctypes.data, 4)         # not device memory


def test_a_context_is_current_per_thread(driver):
    cuda = gpu.cuda(0)
    seen = {}

    def other():
        try:
            cuda.alloc(8)
        except gpu.CudaError as e:
            seen["before"] = str(e)
        cuda.use()
        seen["after"] = cuda.alloc(8)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["before"] == "cuMemAlloc(8 bytes) failed: CUDA_ERROR_INVALID_CONTEXT"
    cuda.free(seen["after"])


def test_without_a_driver_cuda_says_so(monkeypatch):
    fake_cuda.install(monkeypatch, no_library=True)
    with pytest.raises(gpu.CudaError, match=r"^no NVIDIA driver \(Failed to dlopen libcuda.so.1\)$"):
        gpu.cuda(0)


def test_the_bindings_before_cuda_python_12_6(monkeypatch):
    """``from cuda import cuda`` where there is no ``cuda.bindings``."""
    drv = fake_cuda.FakeDriver(devices=1)
    pkg = types.ModuleType("cuda")
    pkg.__path__, pkg.cuda = [], drv
    monkeypatch.setitem(sys.modules, "cuda", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.cuda", drv)
    monkeypatch.setattr(gpu, "_driver_module", None)
    monkeypatch.setattr(gpu, "_devices", {})
    assert gpu.device_count() == (1, "")
    assert gpu.cuda(0).name() == "Fake GPU 0"


# -- without cuda-python ----------------------------------------------------------------------

class FakeNvml(types.ModuleType):
    def __init__(self, count=None):
        super().__init__("pynvml")
        self.count, self.live = count, 0

    def nvmlInit(self):
        if self.count is None:
            raise RuntimeError("NVML Shared Library Not Found")
        self.live += 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlShutdown(self):
        self.live -= 1


@pytest.fixture
def no_cuda_python(monkeypatch, tmp_path):
    fake_cuda.uninstall(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu, "PROC_GPUS", str(tmp_path / "no-proc"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    return tmp_path


def test_without_cuda_python_or_a_driver(no_cuda_python):
    n, why = gpu.device_count()
    assert n == 0
    assert why.startswith("no NVIDIA driver (no NVML, no ")
    assert "cuda-python is not installed (pip install 'shmserve[gpu]'" in why
    with pytest.raises(gpu.CudaError, match=r"^cuda-python is not installed \(pip install "):
        gpu.cuda(0)


def test_without_cuda_python_nvml_counts_the_gpus(no_cuda_python, monkeypatch):
    nvml = FakeNvml(count=4)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert gpu.device_count() == (4, "") and nvml.live == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert gpu.device_count() == (2, "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    n, why = gpu.device_count()
    assert n == 0 and why.startswith("NVML shows 4 NVIDIA GPUs (CUDA_VISIBLE_DEVICES hides them); "
                                     "cuda-python is not installed")


def test_without_cuda_python_or_nvml_proc_counts_the_gpus(no_cuda_python, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(count=None))       # NVML fails to start
    proc = no_cuda_python / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        os.makedirs(proc / bus)
    monkeypatch.setattr(gpu, "PROC_GPUS", str(proc))
    assert gpu.device_count() == (2, "")


def test_visible_gpus_never_initialises_cuda(monkeypatch, tmp_path):
    """The scheduler forks the fork server and counts GPUs for KIND_AUTO: CUDA stays untouched
    even where cuda-python is installed."""
    driver = fake_cuda.install(monkeypatch, devices=2)
    monkeypatch.setattr(gpu, "PROC_GPUS", str(tmp_path / "no-proc"))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(count=3))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.visible_gpus() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert gpu.visible_gpus() == 1
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu.visible_gpus() == 0                  # no NVML, no /proc entry: no GPU
    assert not driver.initialised


@pytest.mark.parametrize("spec, want", [
    (None, 4), ("0,1,2,3", 4), ("3", 1), ("1,1", 1), ("0,7,1", 1), ("", 0), ("-1", 0),
    ("GPU-8f6c1a2b", 1), ("MIG-1f2e,0", 2), ("2, 3", 2), ("nope,0", 0),
])
def test_cuda_visible_devices_as_cuda_reads_it(spec, want):
    assert gpu._visible(4, spec) == want
