"""Triton's identity backend (``backend: "identity"``): each output is its input.

Triton's QA model repositories and several of its examples (``custom_identity_int32``) use it
as the model with no work of its own; this one keeps its rules, so those repositories load and
answer here as they do there:

- the config pairs ``INPUT<i>`` with ``OUTPUT<i>``: as many outputs as inputs, the same index,
  datatype and shape (the reshape where there is one); a load breaking that fails with the
  identity backend's own words;
- a requested output is its input as sent (datatype and shape of the request); an output whose
  input is ``optional`` and absent is zeros of the config's shape (-1 read as 1, the request's
  batch dimension in front);
- ``parameters``: ``execute_delay_ms`` sleeps before each execution (times the instance's
  index with ``instance_wise_delay_multiplier``), ``creation_delay_sec`` sleeps at load;
- each answer carries the four example response parameters the identity backend sets, and the
  model counts the bytes of the inputs it copied in the ``input_byte_size_counter`` family.
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from shmserve.ipc import dtypes
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers.backends.base import InstanceSpec, WorkRequest, WorkResponse, config_param
from shmserve.workers.python_backend import metrics as pb_metrics

# the response parameters every answer of Triton's identity backend carries
RESPONSE_PARAMETERS = {"param0": "an example string parameter", "param1": 42, "param2": False,
                       "param3": 123.123}


def _int_param(cfg: dict, name: str) -> int:
    value = config_param(cfg, name)
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise BackendLoadError(f"parameter '{name}' must be an integer, got '{value}'") from None


def _shape(tensor: dict) -> list[int]:
    reshape = tensor.get("reshape")
    dims = reshape.get("shape", []) if reshape is not None else tensor.get("dims", [])
    return [int(d) for d in dims]


def _pairs(cfg: dict) -> dict[str, tuple[str, list[int], bool]]:
    """Index -> (wire datatype, config shape, optional) of each INPUT<i>/OUTPUT<i> pair; raises
    BackendLoadError where the config breaks the identity backend's rules."""
    inputs, outputs = cfg.get("input") or [], cfg.get("output") or []
    if len(inputs) != len(outputs):
        raise BackendLoadError("model configuration must have equal input/output pairs")
    ins: dict[str, tuple[str, list[int], bool]] = {}
    outs: dict[str, tuple[str, list[int]]] = {}
    for i, o in zip(inputs, outputs):
        if not i["name"].startswith("INPUT"):
            raise BackendLoadError(f"expected input name to follow INPUT<index> pattern, got "
                                   f"'{i['name']}'")
        if not o["name"].startswith("OUTPUT"):
            raise BackendLoadError(f"expected output name to follow OUTPUT<index> pattern, got "
                                   f"'{o['name']}'")
        ins[i["name"][5:]] = (i.get("data_type", ""), _shape(i), bool(i.get("optional")))
        outs[o["name"][6:]] = (o.get("data_type", ""), _shape(o))
    for index, (otype, oshape) in outs.items():
        if index not in ins:
            raise BackendLoadError("expected input and output indices to match")
        itype, ishape, _ = ins[index]
        if itype != otype:
            raise BackendLoadError(f"expected input and output datatype to match, got {itype} "
                                   f"and {otype}")
        if ishape != oshape:
            raise BackendLoadError(f"expected input and output shape to match, got "
                                   f"{dtypes.shape_text(ishape)} and {dtypes.shape_text(oshape)}")
    return {index: (dtypes.CONFIG_TO_WIRE.get(t, t[5:]), shape, optional)
            for index, (t, shape, optional) in ins.items()}


class IdentityBackend:
    def __init__(self, spec: InstanceSpec):
        cfg = json.loads(spec.config_json)
        self.pairs = _pairs(cfg)
        self.output_names = [o["name"] for o in cfg.get("output") or []]
        self.batching = int(cfg.get("max_batch_size") or 0) > 0
        delay_ms = _int_param(cfg, "execute_delay_ms")
        multiplier = _int_param(cfg, "instance_wise_delay_multiplier") if delay_ms else 0
        if multiplier > 0:
            multiplier *= spec.instance_index
        self.delay_s = delay_ms * max(multiplier, 1) / 1000
        creation_s = _int_param(cfg, "creation_delay_sec")
        if creation_s > 0:
            time.sleep(creation_s)
        family = pb_metrics.MetricFamily(
            "input_byte_size_counter",
            "Cumulative input byte size of all requests received by the model",
            pb_metrics.MetricFamily.COUNTER)
        self.input_bytes = family.Metric({"model": spec.model_name, "version": str(spec.version)})

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return [self._answer(r) for r in requests]

    def _answer(self, r: WorkRequest) -> WorkResponse:
        # the batch dimension of the request's first input, for zeros in place of an absent one
        first = next(iter(r.inputs.values()), None)
        batch = first.shape[0] if self.batching and first is not None and first.ndim else 0
        outputs: list[tuple[str, str, Any]] = []
        copied = 0
        # requested outputs are config outputs (the frontend checked), so OUTPUT<i> with a pair
        for name in r.requested_outputs or self.output_names:
            index = name[6:]
            pair = self.pairs[index]
            arr = r.inputs.get(f"INPUT{index}")
            if arr is not None:
                outputs.append((name, r.datatypes[f"INPUT{index}"], arr))
                copied += _byte_size(arr)
            elif pair[2]:
                outputs.append((name, pair[0], _zeros(pair[0], pair[1], batch)))
            else:
                return _missing(index)
        if copied:
            self.input_bytes.increment(copied)
        return WorkResponse(outputs=outputs, parameters=dict(RESPONSE_PARAMETERS))

    def finalize(self) -> None:
        pass


def _missing(index: str) -> WorkResponse:
    return WorkResponse(error=f"failed to get input 'INPUT{index}'", code=ErrorCode.UNSUPPORTED)


def _byte_size(arr: np.ndarray) -> int:
    if arr.dtype == object:     # BYTES: each element as the wire carries it, length prefixed
        return sum(4 + len(x if isinstance(x, bytes) else str(x).encode()) for x in arr.flat)
    return int(arr.nbytes)


def _zeros(wire: str, shape: list[int], batch: int) -> np.ndarray:
    dims = ([batch] if batch else []) + [1 if d == -1 else d for d in shape]
    if wire == "BYTES":
        return np.full(dims, b"", dtype=object)
    return np.zeros(dims, dtype=dtypes.WIRE_TO_NUMPY[wire])
