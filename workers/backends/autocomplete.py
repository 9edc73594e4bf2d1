"""Auto-complete of a model configuration, run inside the worker (which has the model open
anyway), as Triton's backends do (docs/triton-compat.md §3.4). The scheduler takes the result from the
worker's WorkerReady; user code never runs in the scheduler.
"""
from __future__ import annotations

import json
import os

from shmserve.ipc.errors import BackendLoadError

DEFAULT_MAX_BATCH_SIZE = 4      # Triton's --backend-config=onnxruntime,default-max-batch-size

_ORT_TO_CONFIG = {
    "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64", "tensor(float16)": "TYPE_FP16",
    "tensor(bfloat16)": "TYPE_BF16", "tensor(int8)": "TYPE_INT8", "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64", "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16", "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64", "tensor(bool)": "TYPE_BOOL", "tensor(string)": "TYPE_STRING",
}
CONFIG_DATATYPES = frozenset(_ORT_TO_CONFIG.values())   # those an ONNX tensor can have


def config_datatype(ort_type: str) -> str:
    """The config data_type of an onnxruntime type string ("tensor(float)": TYPE_FP32), or
    TYPE_INVALID for one that a config cannot name (a sequence, a map, float8...)."""
    return _ORT_TO_CONFIG.get(ort_type, "TYPE_INVALID")


def model_dims(shape) -> list[int]:
    """An onnxruntime shape as config dims: a symbolic ("batch") or unknown dimension is -1."""
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape]


def complete_onnx(cfg: dict, path: str, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
                  ) -> dict:
    """Inputs, outputs and batching from the ONNX file, as Triton's onnxruntime backend: a
    model whose tensors all have a variable first dimension batches, up to
    ``default_max_batch_size`` (0: it does not batch) with a dynamic batcher."""
    import onnxruntime as ort
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise BackendLoadError(f"auto-complete could not open {path}: {e}") from None
    ins, outs = sess.get_inputs(), sess.get_outputs()
    variable_first = all(t.shape and not (isinstance(t.shape[0], int) and t.shape[0] > 0)
                         for t in [*ins, *outs])
    mbs = cfg.get("max_batch_size", 0)
    if mbs > 0 and not variable_first:
        raise BackendLoadError(f"max_batch_size is {mbs} but the ONNX model's inputs and "
                               f"outputs do not all have a variable first dimension")
    if mbs == 0 and variable_first and default_max_batch_size > 0:
        mbs = cfg["max_batch_size"] = default_max_batch_size
        if not any(k in cfg for k in ("dynamic_batching", "sequence_batching",
                                      "ensemble_scheduling")):
            cfg["dynamic_batching"] = {}
    for key, tensors in (("input", ins), ("output", outs)):
        have = {t["name"]: t for t in cfg.get(key, [])}
        for t in tensors:
            entry = have.get(t.name)
            if entry is None:
                entry = {"name": t.name}
                cfg.setdefault(key, []).append(entry)
            entry.setdefault("data_type", config_datatype(t.type))
            if not entry.get("dims"):
                entry["dims"] = model_dims(t.shape[1:] if mbs > 0 else t.shape)
    return cfg


def complete_python(cfg: dict, model_cls) -> dict:
    hook = getattr(model_cls, "auto_complete_config", None)
    if hook is None:
        return cfg
    from shmserve.workers.python_backend import pb_utils
    try:
        result = hook(pb_utils.ModelConfig(json.dumps(cfg)))
    except Exception as e:
        raise BackendLoadError(f"auto_complete_config() failed: {type(e).__name__}: {e}") from None
    if result is None:
        raise BackendLoadError("auto_complete_config() must return the model config")
    return result.as_dict()


def complete(config_json: str, backend: str, model_dir: str, version: int,
             default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> str:
    """The completed config as JSON (field names as in config.pbtxt)."""
    cfg = json.loads(config_json)
    if backend == "onnxruntime":
        path = os.path.join(model_dir, str(version), cfg.get("default_model_filename")
                            or "model.onnx")
        if os.path.isdir(path):
            path = os.path.join(path, "model.onnx")
        cfg = complete_onnx(cfg, path, default_max_batch_size)
    return json.dumps(cfg)
