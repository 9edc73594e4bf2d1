"""Models for the tests of ensemble tensors that stay on the GPU (test_ensemble_gpu_handoff.py on
the fake cuda-python, test_ensemble_gpu_handoff_gpu.py on a GPU): gpu_make leaves its output on
the GPU (from_dlpack of device memory it allocates through ipc/gpu/device.py, as torch or cupy
would), gpu_take asks for GPU inputs (FORCE_CPU_ONLY_INPUT_TENSORS "no") and says whether its
input was on the GPU (ON_GPU), and the ensemble gpu_pipe chains them."""
from repo_builder import write_model

MAKE = '''
import numpy as np
import triton_python_backend_utils as pb_utils
from shmserve.ipc.gpu import device as gpu


class DeviceMemory:
    """What torch or cupy would hold: device memory, freed with the last reference."""
    def __init__(self, arr):
        self.cuda = gpu.cuda(0)
        self.cuda.use()
        self.ptr = self.cuda.alloc(arr.nbytes)
        self.cuda.htod(self.ptr, arr.ctypes.data, arr.nbytes)

    def __del__(self):
        self.cuda.use()
        self.cuda.free(self.ptr)


class OnGpu:
    def __init__(self, arr):
        memory = DeviceMemory(arr)
        self.t = gpu.DeviceTensor(memory.ptr, arr.shape, arr.dtype, 0, "cuda", memory)
    def __dlpack__(self, stream=None, **_):
        return self.t.__dlpack__()
    def __dlpack_device__(self):
        return (2, 0)


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            mid = pb_utils.Tensor.from_dlpack("MID", OnGpu(np.ascontiguousarray(x * 2)))
            assert not mid.is_cpu()
            out.append(pb_utils.InferenceResponse([mid]))
        return out
'''

TAKE = '''
import numpy as np
import triton_python_backend_utils as pb_utils
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu import dlpack


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "MID")
            if t.is_cpu():
                x = t.as_numpy()
            else:
                dev = dlpack.read(t.to_dlpack())       # as torch.from_dlpack would take it
                x = gpu.cuda(dev.device_id).to_host(dev)
            if (x < 0).any():
                raise ValueError("negative values are refused")
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", (x + 1).astype(np.float32)),
                pb_utils.Tensor("ON_GPU", np.array([not t.is_cpu()]))]))
        return out
'''


def write_handoff_models(repo: str, dims: str = "[ -1 ]") -> None:
    """gpu_make, gpu_take and gpu_pipe (IN -> gpu_make -> mid -> gpu_take -> OUT, ON_GPU), FP32
    tensors of ``dims``, no batching."""
    write_model(repo, "gpu_make", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_FP32, dims: DIMS } ]
        output [ { name: "MID", data_type: TYPE_FP32, dims: DIMS } ]
    '''.replace("DIMS", dims), MAKE)
    write_model(repo, "gpu_take", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "MID", data_type: TYPE_FP32, dims: DIMS } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: DIMS },
                 { name: "ON_GPU", data_type: TYPE_BOOL, dims: [ 1 ] } ]
        parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value { string_value: "no" } }
    '''.replace("DIMS", dims), TAKE)
    write_model(repo, "gpu_pipe", '''
        platform: "ensemble"
        max_batch_size: 0
        input [ { name: "IN", data_type: TYPE_FP32, dims: DIMS } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: DIMS },
                 { name: "ON_GPU", data_type: TYPE_BOOL, dims: [ 1 ] } ]
        ensemble_scheduling { step [
          { model_name: "gpu_make" model_version: -1
            input_map { key: "IN" value: "IN" } output_map { key: "MID" value: "mid" } },
          { model_name: "gpu_take" model_version: -1
            input_map { key: "MID" value: "mid" }
            output_map [ { key: "OUT" value: "OUT" }, { key: "ON_GPU" value: "ON_GPU" } ] }
        ] }
    '''.replace("DIMS", dims), None)
