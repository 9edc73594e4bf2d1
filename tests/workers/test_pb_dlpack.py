"""pb_utils.Tensor and DLPack: CPU tensors both ways through numpy, capsules made by
ipc/gpu/dlpack.py (read back, consumed by numpy, none leaked), and GPU tensors: a clear error
on a machine without a GPU; with a (faked) GPU they stay in device memory, refuse as_numpy()
with Triton's words, and are copied to the host when they leave the model as outputs. The real
GPU: tests/workers/test_gpu_backends.py (gpu)."""
from __future__ import annotations

import gc
import json
import os

import fake_cuda
import numpy as np
import pytest

from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu import dlpack
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest
from shmserve.workers.python_backend import pb_utils as pb


class Producer:
    """Any framework's tensor: __dlpack__ and __dlpack_device__ over a DeviceTensor."""

    def __init__(self, t: DeviceTensor):
        self.t = t

    def __dlpack__(self, stream=None, **_):
        return dlpack.capsule(self.t)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def _on(array: np.ndarray, device_type: str) -> DeviceTensor:
    return DeviceTensor(array.ctypes.data, array.shape, array.dtype, 0, device_type, array)


@pytest.fixture
def fake_gpu(monkeypatch):
    """One GPU, through ipc/gpu/device.py on cuda-python's (fake) driver bindings."""
    return fake_cuda.install(monkeypatch)


def test_cpu_round_trips():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb.Tensor.from_dlpack("x", Producer(_on(a, "cpu")))
    assert t.is_cpu() and t.shape() == [2, 3] and t.datatype() == "FP32"
    np.testing.assert_array_equal(t.as_numpy(), a)
    assert t.as_numpy().ctypes.data == a.ctypes.data            # no copy
    back = np.from_dlpack(pb.Tensor("y", a))
    np.testing.assert_array_equal(back, a)
    via_capsule = pb.Tensor.from_dlpack("z", pb.Tensor("y", a).to_dlpack())
    np.testing.assert_array_equal(via_capsule.as_numpy(), a)
    bits = np.array([0x3F80, 0x4000, 0xC040], np.uint16)       # 1.0, 2.0, -3.0
    bf = pb.Tensor.from_dlpack("b", Producer(_on(bits.view(pb.WIRE_TO_NUMPY["BF16"]), "cpu")))
    assert bf.datatype() == "BF16"      # numpy's importer refuses bfloat16; read directly
    assert bf.as_numpy().astype(np.float32).tolist() == [1.0, 2.0, -3.0]


def test_read_only_inputs_export_through_dlpack():
    """The worker's inputs are read-only views of shared memory; legacy DLPack (to_dlpack(), as
    torch.utils.dlpack.from_dlpack takes it) cannot say read-only, so it gets a copy; a
    consumer that speaks DLPack 1.0 (numpy 2) gets the memory itself, read-only."""
    a = np.arange(5, dtype=np.float32)
    a.flags.writeable = False
    t = pb.Tensor._from_worker("in", a, "FP32")
    copy = pb.Tensor.from_dlpack("c", t.to_dlpack()).as_numpy()
    np.testing.assert_array_equal(copy, a)
    assert copy.ctypes.data != a.ctypes.data
    same = np.from_dlpack(t)
    np.testing.assert_array_equal(same, a)
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":     # asks for DLPack 1.0
        assert same.ctypes.data == a.ctypes.data and not same.flags.writeable


def test_capsules_are_read_consumed_and_released():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    cap = dlpack.capsule(_on(a, "cpu"))
    seen = dlpack.read(cap)
    assert (seen.ptr, seen.shape, seen.dtype, seen.device_type) == (a.ctypes.data, (3, 4), np.int64, "cpu")
    del seen, cap
    gc.collect()
    assert dlpack.exported_count() == 0         # never consumed: the capsule freed it
    arr = np.from_dlpack(Producer(_on(a, "cpu")))
    np.testing.assert_array_equal(arr, a)
    assert dlpack.exported_count() == 1         # numpy holds it
    del arr
    gc.collect()
    assert dlpack.exported_count() == 0         # and released it through the deleter
    with pytest.raises(ValueError, match="not dense"):
        dlpack.read(a[:, ::2].__dlpack__())
    # a consumer that refuses a capsule raises its own error (the capsule has no Python
    # destructor that could swallow it), and the capsule is collected afterwards
    for refused in (_on(a, "cuda"), _on(np.ones(2, np.uint16).view(pb.WIRE_TO_NUMPY["BF16"]), "cpu")):
        with pytest.raises((BufferError, RuntimeError)):
            np.from_dlpack(Producer(refused))
    gc.collect()
    assert dlpack.exported_count() == 0


def test_a_gpu_tensor_on_a_machine_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(gpu, "device_count", lambda: (0, "no NVIDIA driver (test)"))
    fake = Producer(_on(np.zeros(4, np.float32), "cuda"))
    with pytest.raises(pb.TritonModelException, match=r"tensor 'x' is in GPU memory \(DLPack device "
                                                      r"CUDA:0\), but this machine has no GPU that "
                                                      r"CUDA can use: no NVIDIA driver \(test\)"):
        pb.Tensor.from_dlpack("x", fake)
    with pytest.raises(pb.TritonModelException, match="is in GPU memory"):
        pb.Tensor.from_dlpack("x", dlpack.capsule(_on(np.zeros(4, np.float32), "cuda")))


def test_a_gpu_tensor_stays_on_the_gpu(fake_gpu):
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    fake_gpu.adopt(a.ctypes.data, a.nbytes)                 # stands for device memory
    t = pb.Tensor.from_dlpack("g", Producer(_on(a, "cuda")))
    assert not t.is_cpu() and t.memory_type() == pb.TRITONSERVER_MEMORY_GPU
    assert t.shape() == [2, 4] and t.datatype() == "INT32" and t.__dlpack_device__() == (2, 0)
    with pytest.raises(pb.TritonModelException, match="Tensor is stored in GPU and cannot be converted to NumPy."):
        t.as_numpy()
    again = pb.Tensor.from_dlpack("h", t.to_dlpack())       # a capsule of the same device memory
    assert not again.is_cpu() and again._device.ptr == a.ctypes.data
    np.testing.assert_array_equal(t._host(), a)
    assert fake_gpu.copies == ["dtoh"]


MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils
from shmserve.ipc.gpu.device import DeviceTensor

class Producer:
    def __init__(self, arr):
        self.arr = arr
        self.t = DeviceTensor(arr.ctypes.data, arr.shape, arr.dtype, 0, "cuda", arr)
    def __dlpack__(self, stream=None, **_):
        return self.t.__dlpack__()
    def __dlpack_device__(self):
        return (2, 0)

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            on_gpu = pb_utils.Tensor.from_dlpack("OUT", Producer(np.ascontiguousarray(x * 2)))
            assert not on_gpu.is_cpu()
            out.append(pb_utils.InferenceResponse([on_gpu]))
        return out
'''


def test_gpu_outputs_leave_the_model_through_the_host(tmp_path, fake_gpu):
    from shmserve.workers.python_backend.backend import PythonBackend
    fake_gpu.strict = False         # the model's "device" tensors are its own host arrays
    os.makedirs(tmp_path / "gpu_out" / "1")
    (tmp_path / "gpu_out" / "1" / "model.py").write_text(MODEL)
    cfg = {"name": "gpu_out", "backend": "python", "max_batch_size": 0,
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}]}
    spec = InstanceSpec("gpu_out", 1, str(tmp_path / "gpu_out"), json.dumps(cfg), "gpu_out_0",
                        "GPU", 0, "python")
    backend = PythonBackend(spec)
    x = np.array([1, 2, 3], np.float32)
    (resp,) = backend.execute([WorkRequest({"IN": x}, {"IN": "FP32"}, [])])
    assert not resp.error, resp.error
    (name, datatype, arr), = resp.outputs
    assert (name, datatype) == ("OUT", "FP32") and isinstance(arr, np.ndarray)
    np.testing.assert_array_equal(arr, x * 2)
    assert fake_gpu.copies == ["dtoh"]


def _python_backend(tmp_path, name: str, model: str, parameters: dict | None = None):
    from shmserve.workers.python_backend.backend import PythonBackend
    os.makedirs(tmp_path / name / "1")
    (tmp_path / name / "1" / "model.py").write_text(model)
    cfg = {"name": name, "backend": "python", "max_batch_size": 0,
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}],
           "parameters": {k: {"string_value": v} for k, v in (parameters or {}).items()}}
    return PythonBackend(InstanceSpec(name, 1, str(tmp_path / name), json.dumps(cfg),
                                      f"{name}_0", "GPU", 0, "python"))


def test_a_gpu_output_the_next_step_reads_on_the_gpu_stays_there(tmp_path, fake_gpu):
    """An ensemble's intermediate tensor (device_outputs): the worker gets the DeviceTensor
    and hands it on as a CUDA IPC handle, nothing is copied here."""
    fake_gpu.strict = False
    backend = _python_backend(tmp_path, "gpu_out", MODEL)
    x = np.array([1, 2, 3], np.float32)
    (resp,) = backend.execute([WorkRequest({"IN": x}, {"IN": "FP32"}, [],
                                           device_outputs=frozenset({"OUT"}))])
    (name, datatype, t), = resp.outputs
    assert (name, datatype) == ("OUT", "FP32") and isinstance(t, DeviceTensor)
    assert t.device_type == "cuda" and t.shape == (3,) and fake_gpu.copies == []
    np.testing.assert_array_equal(gpu.cuda(0).to_host(t), x * 2)


GPU_INPUT_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu import dlpack

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "IN")
            try:
                t.as_numpy()
                refused = ""
            except pb_utils.TritonModelException as e:
                refused = str(e)
            dev = dlpack.read(t.to_dlpack())            # what torch.from_dlpack would see
            x = gpu.cuda(dev.device_id).to_host(dev)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)],
                       parameters={"is_cpu": t.is_cpu(), "refused": refused,
                                   "ptr": dev.ptr}))
        return out
'''


def test_force_cpu_only_input_tensors_no_gives_the_model_gpu_tensors(tmp_path, fake_gpu):
    from shmserve.workers.python_backend.backend import PythonBackend
    backend = _python_backend(tmp_path, "gpu_in", GPU_INPUT_MODEL,
                              {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})
    assert backend.device_inputs is True and PythonBackend.device_inputs is False
    a = np.array([1, 2, 3], np.float32)
    fake_gpu.adopt(a.ctypes.data, a.nbytes)
    (resp,) = backend.execute([WorkRequest({"IN": DeviceTensor(a.ctypes.data, (3,), a.dtype)},
                                           {"IN": "FP32"}, [])])
    assert not resp.error, resp.error
    assert resp.parameters == {"is_cpu": False, "ptr": a.ctypes.data,
                               "refused": "Tensor is stored in GPU and cannot be converted to NumPy."}
    np.testing.assert_array_equal(resp.outputs[0][2], a + 1)


@pytest.mark.parametrize("value, device", [("yes", False), ("No", True), ("maybe", None)])
def test_force_cpu_only_input_tensors_values(tmp_path, value, device):
    from shmserve.ipc.errors import BackendLoadError
    if device is None:
        with pytest.raises(BackendLoadError, match="FORCE_CPU_ONLY_INPUT_TENSORS must be 'yes' or "
                                                   "'no', got 'maybe'"):
            _python_backend(tmp_path, "m", MODEL, {"FORCE_CPU_ONLY_INPUT_TENSORS": value})
        return
    backend = _python_backend(tmp_path, "m", MODEL, {"FORCE_CPU_ONLY_INPUT_TENSORS": value})
    assert backend.device_inputs is device
