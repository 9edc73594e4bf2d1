"""Models for the GPU tests, made at run time: a TensorRT engine built from the committed
mlp_onnx model with TensorRT's builder, and the repository entries that serve it."""
from __future__ import annotations

import os
import shutil

from serverproc import REPO_ROOT

MLP_ONNX = os.path.join(REPO_ROOT, "configs", "models", "mlp_onnx", "1", "model.onnx")
MLP_IO = '''
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
'''


def ort_cuda_missing() -> str:
    """Why onnxruntime cannot run a model on the GPU here ("" when it can): the GPU machine
    lent to the project has onnxruntime's CPU build only (onnxruntime-gpu's wheel is too large
    to carry there, bench/gpu_wheelhouse.sh)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                f"(install onnxruntime-gpu: shmserve[gpu])")
    return ""


def build_engine(onnx_path: str, plan_path: str, input_name: str, min_shape, opt_shape,
                 max_shape) -> None:
    """An FP32 engine (TF32 off, so results match onnxruntime's closely) with one optimisation
    profile for ``input_name``."""
    import tensorrt as trt
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    if explicit is not None and int(trt.__version__.split(".")[0]) < 10:
        flags = 1 << int(explicit)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        if not parser.parse(f.read()):
            raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    profile.set_shape(input_name, min_shape, opt_shape, max_shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT could not build the engine")
    with open(plan_path, "wb") as f:
        f.write(bytes(plan))


def add_mlp_models(repo: str, gpus: str = "[ 0 ]") -> None:
    """mlp_gpu (onnxruntime, KIND_GPU) and mlp_trt (tensorrt, max_batch_size 64) in ``repo``."""
    d = os.path.join(repo, "mlp_gpu", "1")
    os.makedirs(d, exist_ok=True)
    shutil.copy(MLP_ONNX, d)
    with open(os.path.join(repo, "mlp_gpu", "config.pbtxt"), "w") as f:
        f.write(f'backend: "onnxruntime"\nmax_batch_size: 64\n{MLP_IO}'
                f'instance_group [ {{ kind: KIND_GPU, gpus: {gpus} }} ]\n'
                'dynamic_batching { max_queue_delay_microseconds: 200 }\n')
    d = os.path.join(repo, "mlp_trt", "1")
    os.makedirs(d, exist_ok=True)
    build_engine(MLP_ONNX, os.path.join(d, "model.plan"), "INPUT0", (1, 256), (16, 256), (64, 256))
    with open(os.path.join(repo, "mlp_trt", "config.pbtxt"), "w") as f:
        f.write(f'platform: "tensorrt_plan"\nmax_batch_size: 64\n{MLP_IO}'
                'dynamic_batching { max_queue_delay_microseconds: 200 }\n')
