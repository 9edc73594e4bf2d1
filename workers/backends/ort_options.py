"""What Triton's onnxruntime backend reads from a model's config, as onnxruntime options.

- ``optimization { graph { level } }``: -1 basic, 1 extended, 2 none, anything else (0, unset) all;
- ``parameters``: ``intra_op_thread_count`` / ``inter_op_thread_count`` (0: onnxruntime's own
  default, the number of cores; unset: 1 here, since every instance is a process of its own),
  ``execution_mode`` (0 sequential, 1 parallel), ``enable_mem_arena``, ``enable_mem_pattern``,
  ``memory.enable_memory_arena_shrinkage`` (a run option), and
  ``session.use_device_allocator_for_initializers``;
- ``optimization { execution_accelerators }``: on the CPU ``openvino``; on a GPU ``tensorrt``
  (the TensorRT execution provider, with its parameters mapped as Triton maps them, CUDA behind
  it for what TensorRT cannot run) and ``cuda`` (the CUDA provider's own options). Any other
  name fails the load with Triton's words, and so does a provider this onnxruntime lacks.
"""
from __future__ import annotations

from typing import Any

from shmserve.ipc.errors import BackendLoadError
from shmserve.workers.backends.base import config_param as param

GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}
_TRUE, _FALSE = ("true", "1", "on", "yes"), ("false", "0", "off", "no")
# the TensorRT provider's options Triton takes under their own names, and how it checks each
_TRT_TYPED = {
    "trt_max_partition_iterations": int, "trt_min_subgraph_size": int, "trt_dla_core": int,
    "trt_builder_optimization_level": int, "trt_auxiliary_streams": int,
    "trt_ep_context_embed_mode": int,
    "trt_dla_enable": bool, "trt_engine_cache_enable": bool, "trt_dump_subgraphs": bool,
    "trt_force_sequential_engine_build": bool, "trt_context_memory_sharing_enable": bool,
    "trt_layer_norm_fp32_fallback": bool, "trt_timing_cache_enable": bool,
    "trt_force_timing_cache": bool, "trt_detailed_build_log": bool,
    "trt_build_heuristics_enable": bool, "trt_sparsity_enable": bool,
    "trt_cuda_graph_enable": bool, "trt_dump_ep_context_model": bool,
    "trt_engine_cache_path": str, "trt_engine_cache_prefix": str, "trt_timing_cache_path": str,
    "trt_tactic_sources": str, "trt_extra_plugin_lib_paths": str, "trt_profile_min_shapes": str,
    "trt_profile_max_shapes": str, "trt_profile_opt_shapes": str, "trt_ep_context_file_path": str,
}
_PRECISION = {"FP16": "trt_fp16_enable", "BF16": "trt_bf16_enable", "INT8": "trt_int8_enable"}
# model-level parameters Triton still passes to the CUDA provider (its deprecated form)
_CUDA_LEGACY = ("cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy",
                "do_copy_in_default_stream")


def _bool(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise BackendLoadError(f"{what}: '{value}' is not a boolean (true or false, 1 or 0)")


def _int(value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise BackendLoadError(f"{what} must be an integer, got '{value}'") from None


def session_options(ort, cfg: dict):
    opts = ort.SessionOptions()
    level = ((cfg.get("optimization") or {}).get("graph") or {}).get("level", 0)
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                            GRAPH_LEVELS.get(int(level), "ORT_ENABLE_ALL"))
    mode = _int(param(cfg, "execution_mode", default="0") or "0", "parameter execution_mode")
    if mode not in (0, 1):
        raise BackendLoadError(f"Invalid configuration value provided. Expected values for "
                               f" execution_mode are 0 or 1 but got {mode} .")
    opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode else \
        ort.ExecutionMode.ORT_SEQUENTIAL
    intra = param(cfg, "intra_op_thread_count", "intra_op_num_threads", default="1") or "1"
    inter = param(cfg, "inter_op_thread_count", "inter_op_num_threads", default="1") or "1"
    opts.intra_op_num_threads = _int(intra, "parameter intra_op_thread_count")
    opts.inter_op_num_threads = _int(inter, "parameter inter_op_thread_count")
    arena = param(cfg, "enable_mem_arena")
    if arena is not None:
        opts.enable_cpu_mem_arena = _bool(arena, "parameter enable_mem_arena")
    pattern = param(cfg, "enable_mem_pattern")
    if pattern is not None:
        opts.enable_mem_pattern = _bool(pattern, "parameter enable_mem_pattern")
    key = "session.use_device_allocator_for_initializers"
    value = param(cfg, key)
    if value is not None:
        opts.add_session_config_entry(key, "1" if _bool(value, f"parameter {key}") else "0")
    return opts


def run_options(ort, cfg: dict):
    """None when the config sets none (session.run then makes no RunOptions per call)."""
    key = "memory.enable_memory_arena_shrinkage"
    value = param(cfg, key)
    if value is None:
        return None
    ro = ort.RunOptions()
    ro.add_run_config_entry(key, value)
    return ro


def _accelerators(cfg: dict, kind: str) -> list[dict]:
    eas = (cfg.get("optimization") or {}).get("execution_accelerators") or {}
    return eas.get(f"{kind}_execution_accelerator") or []


def _unknown(name: str) -> BackendLoadError:
    return BackendLoadError(f"unknown Execution Accelerator '{name}' is requested")


def _missing(provider: str, name: str, available: list[str]) -> BackendLoadError:
    return BackendLoadError(f"Execution Accelerator '{name}' is requested, but this onnxruntime "
                            f"has no {provider} (providers: {available})")


def cpu_providers(cfg: dict, available: list[str]) -> list:
    providers: list = []
    for ea in _accelerators(cfg, "cpu"):
        name = ea.get("name", "")
        if name != "openvino":
            raise _unknown(name)
        if "OpenVINOExecutionProvider" not in available:
            raise _missing("OpenVINOExecutionProvider", name, available)
        providers.append(("OpenVINOExecutionProvider", {"device_type": "CPU"}))
    return providers + ["CPUExecutionProvider"]


def gpu_providers(cfg: dict, device_id: int, available: list[str]) -> list:
    """The providers of a KIND_GPU instance: TensorRT first where asked, then CUDA, then CPU
    (onnxruntime's own fallback for a node no GPU provider takes)."""
    cuda: dict[str, Any] = {"device_id": device_id}
    for key in _CUDA_LEGACY:
        value = param(cfg, key)
        if value is not None:
            cuda[key] = value
    trt = None
    for ea in _accelerators(cfg, "gpu"):
        name, params = ea.get("name", ""), ea.get("parameters") or {}
        if name == "tensorrt":
            if "TensorrtExecutionProvider" not in available:
                raise _missing("TensorrtExecutionProvider", name, available)
            trt = {"device_id": device_id, **_trt_options(params)}
        elif name == "cuda":
            for key, value in params.items():
                if key in ("do_copy_in_default_stream", "use_ep_level_unified_stream"):
                    _bool(value, f"CUDA Execution Accelerator parameter '{key}'")
                cuda[key] = value
        else:
            raise _unknown(name)
    providers: list = [("TensorrtExecutionProvider", trt)] if trt is not None else []
    return providers + [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]


def _trt_options(params: dict) -> dict:
    out: dict = {}
    for key, value in params.items():
        if key == "precision_mode":
            if value in _PRECISION:
                out[_PRECISION[value]] = True
            elif value != "FP32":
                raise BackendLoadError(f"unsupported precision mode '{value}' is requested")
        elif key == "max_workspace_size_bytes":
            n = _int(value, "TensorRT Execution Accelerator parameter 'max_workspace_size_bytes'")
            if n < 0:
                raise BackendLoadError(f"TensorRT Execution Accelerator parameter "
                                       f"'max_workspace_size_bytes' must not be negative, got {n}")
            out["trt_max_workspace_size"] = n
        elif key == "int8_calibration_table_name":
            out["trt_int8_calibration_table_name"] = value
        elif key == "int8_use_native_calibration_table":
            out["trt_int8_use_native_calibration_table"] = _bool(value, key)
        elif key in _TRT_TYPED:
            kind = _TRT_TYPED[key]
            what = f"TensorRT Execution Accelerator parameter '{key}'"
            out[key] = _int(value, what) if kind is int else \
                _bool(value, what) if kind is bool else value
        else:
            raise BackendLoadError(f"unknown parameter '{key}' is provided for TensorRT Execution "
                                   f"Accelerator")
    return out
