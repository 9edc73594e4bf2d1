"""``model_warmup``: requests each instance runs after loading and before it reports ready."""
from __future__ import annotations

import json
import os
import threading

import numpy as np

from shmserve.ipc import dtypes, model_files
from shmserve.ipc.errors import BackendLoadError
from shmserve.workers.backends.base import WorkRequest

# how long a warm-up request answered through its response sender (a decoupled model's) may
# take to send its FINAL flag
STREAM_WAIT_S = 120.0


def _tensor(spec: dict, shape: list[int], model_dir: str, name: str, rng) -> tuple[np.ndarray, str]:
    wire = dtypes.CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
    if not wire:
        raise BackendLoadError(f"warmup input '{name}' has an invalid data_type")
    dtype = dtypes.WIRE_TO_NUMPY[wire]
    count = dtypes.element_count(shape)
    if "input_data_file" in spec:
        path = os.path.join(model_dir, "warmup", spec["input_data_file"])
        need = count * dtype.itemsize
        try:
            # only what the tensor takes is read; a string tensor's file is read whole, bounded
            raw = model_files.read_bytes(path, model_files.DATA_MAX_BYTES) if wire == "BYTES" \
                else model_files.read_prefix(path, need)
        except OSError as e:
            raise BackendLoadError(f"warmup input '{name}': cannot read {path}: "
                                   f"{e.strerror or e}") from None
        if wire == "BYTES":
            return dtypes.deserialize_bytes(raw, count).reshape(shape), wire
        if len(raw) < need:
            raise BackendLoadError(f"warmup input '{name}': {path} holds {len(raw)} bytes, "
                                   f"{need} needed")
        return np.frombuffer(raw[:need], dtype=dtype).reshape(shape).copy(), wire
    if wire == "BYTES":
        fill = [bytes(rng.integers(0, 256, 8, dtype=np.uint8)) if spec.get("random_data")
                else b"" for _ in range(count)]
        arr = np.empty(count, dtype=object)
        arr[:] = fill
        return arr.reshape(shape), wire
    if spec.get("random_data"):
        if dtype.kind == "f" or wire == "BF16":
            return rng.standard_normal(shape).astype(dtype), wire
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(bool), wire
        return rng.integers(0, 100, shape).astype(dtype), wire
    return np.zeros(shape, dtype=dtype), wire


def run_warmup(backend, config_json: str, model_dir: str) -> None:
    """Run every model_warmup entry; raises BackendLoadError naming the one that failed."""
    cfg = json.loads(config_json)
    batching = cfg.get("max_batch_size", 0) > 0
    rng = np.random.default_rng(0)
    for w in cfg.get("model_warmup", []):
        name = w.get("name", "")
        batch = max(1, int(w.get("batch_size", 1)))
        inputs, types = {}, {}
        for input_name, spec in (w.get("inputs") or {}).items():
            shape = [int(d) for d in spec.get("dims", [])]
            if batching:
                shape = [batch] + shape
            inputs[input_name], types[input_name] = _tensor(spec, shape, model_dir, input_name, rng)
        for _ in range(max(1, int(w.get("count", 1)))):
            _warm_once(backend, name, inputs, types)


def _warm_once(backend, name: str, inputs: dict, types: dict) -> None:
    """One warm-up request; its answers are dropped, an error fails the load. A model that
    answers through the response sender (decoupled) is waited for until its FINAL flag."""
    ended, errors = threading.Event(), []

    def emit(resp, final: bool) -> None:
        if resp is not None and resp.error:
            errors.append(resp.error)
        if final:
            ended.set()
    try:
        responses = backend.execute([WorkRequest(inputs, types, [], emit=emit)])
    except Exception as e:
        raise BackendLoadError(f"warmup '{name}' failed: {type(e).__name__}: {e}") from None
    first = responses[0] if responses else None
    if first is None:
        if not ended.wait(STREAM_WAIT_S):
            raise BackendLoadError(f"warmup '{name}' failed: the model sent no FINAL flag within "
                                   f"{STREAM_WAIT_S:g} s")
        if errors:
            raise BackendLoadError(f"warmup '{name}' failed: {errors[0]}")
    elif first.error:
        raise BackendLoadError(f"warmup '{name}' failed: {first.error}")
