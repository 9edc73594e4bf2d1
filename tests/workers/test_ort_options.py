"""Triton's onnxruntime config options as onnxruntime's own: session and run options, and the
execution providers a config's accelerators ask for (GPU ones as lists, checked without a GPU)."""
import onnxruntime as ort
import pytest

from shmserve.ipc.errors import BackendLoadError
from shmserve.workers.backends.ort_options import cpu_providers, gpu_providers, run_options, session_options


def _params(**kw):
    return {"parameters": {k.replace("__", "."): {"string_value": v} for k, v in kw.items()}}


@pytest.mark.parametrize("level,expected", [
    (None, "ORT_ENABLE_ALL"), (0, "ORT_ENABLE_ALL"), (-1, "ORT_ENABLE_BASIC"),
    (1, "ORT_ENABLE_EXTENDED"), (2, "ORT_DISABLE_ALL")])
def test_graph_level_maps_as_triton_maps_it(level, expected):
    cfg = {} if level is None else {"optimization": {"graph": {"level": level}}}
    assert session_options(ort, cfg).graph_optimization_level == \
        getattr(ort.GraphOptimizationLevel, expected)


def test_parameters_set_the_session():
    opts = session_options(ort, _params(execution_mode="1", intra_op_thread_count="0",
                                        inter_op_thread_count="3", enable_mem_arena="0",
                                        enable_mem_pattern="false",
                                        session__use_device_allocator_for_initializers="1"))
    assert opts.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert opts.intra_op_num_threads == 0 and opts.inter_op_num_threads == 3
    assert opts.enable_cpu_mem_arena is False and opts.enable_mem_pattern is False
    assert opts.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    plain = session_options(ort, {})
    assert plain.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert plain.intra_op_num_threads == 1 and plain.inter_op_num_threads == 1
    assert run_options(ort, {}) is None


def test_arena_shrinkage_is_a_run_option():
    ro = run_options(ort, _params(memory__enable_memory_arena_shrinkage="cpu:0"))
    assert ro.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"


@pytest.mark.parametrize("params,message", [
    ({"execution_mode": "3"}, "Invalid configuration value provided. Expected values for  "
                              "execution_mode are 0 or 1 but got 3 ."),
    ({"intra_op_thread_count": "many"}, "parameter intra_op_thread_count must be an integer, "
                                        "got 'many'"),
    ({"enable_mem_arena": "maybe"}, "parameter enable_mem_arena: 'maybe' is not a boolean"),
])
def test_bad_parameters_fail_the_load(params, message):
    with pytest.raises(BackendLoadError) as e:
        session_options(ort, _params(**params))
    assert str(e.value).startswith(message)


def _accel(kind, *eas):
    return {"optimization": {"execution_accelerators": {f"{kind}_execution_accelerator":
                                                        list(eas)}}}


def test_cpu_accelerators():
    assert cpu_providers({}, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(BackendLoadError, match="unknown Execution Accelerator 'fast' is requested"):
        cpu_providers(_accel("cpu", {"name": "fast"}), ["CPUExecutionProvider"])
    with pytest.raises(BackendLoadError, match="this onnxruntime has no OpenVINOExecutionProvider"):
        cpu_providers(_accel("cpu", {"name": "openvino"}), ["CPUExecutionProvider"])
    assert cpu_providers(_accel("cpu", {"name": "openvino"}),
                         ["OpenVINOExecutionProvider", "CPUExecutionProvider"]) == \
        [("OpenVINOExecutionProvider", {"device_type": "CPU"}), "CPUExecutionProvider"]


GPU = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_tensorrt_accelerator_goes_first_with_its_parameters_mapped():
    cfg = {**_accel("gpu", {"name": "tensorrt", "parameters": {
        "precision_mode": "FP16", "max_workspace_size_bytes": "1073741824",
        "trt_engine_cache_enable": "1", "trt_engine_cache_path": "/tmp/cache",
        "trt_builder_optimization_level": "3"}}),
           **_params(gpu_mem_limit="4294967200")}
    assert gpu_providers(cfg, 1, GPU) == [
        ("TensorrtExecutionProvider", {"device_id": 1, "trt_fp16_enable": True,
                                       "trt_max_workspace_size": 1073741824,
                                       "trt_engine_cache_enable": True,
                                       "trt_engine_cache_path": "/tmp/cache",
                                       "trt_builder_optimization_level": 3}),
        ("CUDAExecutionProvider", {"device_id": 1, "gpu_mem_limit": "4294967200"}),
        "CPUExecutionProvider"]


def test_cuda_accelerator_parameters_reach_the_cuda_provider():
    cfg = _accel("gpu", {"name": "cuda", "parameters": {"cudnn_conv_use_max_workspace": "0",
                                                        "use_ep_level_unified_stream": "1"}})
    assert gpu_providers(cfg, 0, GPU)[0] == (
        "CUDAExecutionProvider", {"device_id": 0, "cudnn_conv_use_max_workspace": "0",
                                  "use_ep_level_unified_stream": "1"})


@pytest.mark.parametrize("ea,available,message", [
    ({"name": "tensorrt", "parameters": {"precision_mode": "FP8"}}, GPU,
     "unsupported precision mode 'FP8' is requested"),
    ({"name": "tensorrt", "parameters": {"trt_go_faster": "1"}}, GPU,
     "unknown parameter 'trt_go_faster' is provided for TensorRT Execution Accelerator"),
    ({"name": "tensorrt"}, GPU[1:], "this onnxruntime has no TensorrtExecutionProvider"),
    ({"name": "openvino"}, GPU, "unknown Execution Accelerator 'openvino' is requested"),
])
def test_bad_gpu_accelerators_fail_the_load(ea, available, message):
    with pytest.raises(BackendLoadError, match=message):
        gpu_providers(_accel("gpu", ea), 0, available)
