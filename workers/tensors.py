"""Turning message tensors into numpy arrays and numpy arrays back into message tensors."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from shmserve.ipc import dtypes
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ShmRef, Tensor
from shmserve.ipc.shm import ShmArena, ShmMapCache


def to_numpy(t: Tensor, maps: ShmMapCache) -> np.ndarray:
    buf: Any = t.data if t.shm is None else maps.view(t.shm)
    if buf is None:
        raise ValueError(f"input '{t.name}' has neither data nor a shared-memory reference")
    if t.datatype == "BYTES":
        return dtypes.deserialize_bytes(buf, dtypes.element_count(t.shape)).reshape(t.shape)
    # one call (frombuffer, then reshape, cost three times as much); the buffer must hold the
    # tensor exactly, as frombuffer + reshape demanded
    try:
        arr = np.ndarray(t.shape, dtypes.WIRE_TO_NUMPY[t.datatype], buf)
    except TypeError as e:      # the buffer is too small
        raise ValueError(str(e)) from None
    if arr.nbytes != len(buf):
        raise ValueError(f"{len(buf)} bytes hold no tensor of shape {t.shape}")
    if t.shm is not None:
        # inputs in memory the model does not own (a client's region): never let it write (an
        # array on the message's bytes is read-only already)
        arr.flags.writeable = False
    return arr


def from_numpy(name: str, datatype: str, arr: np.ndarray, arena: ShmArena) -> Tensor:
    """One copy at most: small outputs into the message, large ones into our output arena."""
    shape = list(arr.shape)
    if datatype == "BYTES":
        data = dtypes.serialize_bytes(arr)
        if len(data) <= INLINE_LIMIT:
            return Tensor(name, datatype, shape, data.tobytes())
        slot = arena.alloc(len(data))
        slot.view[:] = data  # type: ignore[call-overload]  # numpy arrays are buffers
        return Tensor(name, datatype, shape, None, slot.ref)
    nbytes = arr.nbytes
    if nbytes <= INLINE_LIMIT:
        return Tensor(name, datatype, shape, arr.tobytes())
    slot = arena.alloc(nbytes)
    np.copyto(np.frombuffer(slot.view, dtype=arr.dtype).reshape(arr.shape), arr, casting="no")
    return Tensor(name, datatype, shape, None, slot.ref)


class OutputTooLarge(Exception):
    pass


def into_region(name: str, datatype: str, arr: np.ndarray, target: ShmRef,
                maps: ShmMapCache) -> Tensor:
    """Write an output straight into the client's region; the Tensor then says how many bytes."""
    data = dtypes.serialize_bytes(arr) if datatype == "BYTES" else arr
    nbytes = data.nbytes
    if nbytes > target.nbytes:
        raise OutputTooLarge(f"shared memory size specified with the request for output '{name}' "
                             f"({target.nbytes} bytes) should be at least {nbytes} bytes to hold "
                             f"the results")
    view = maps.view(ShmRef(target.segment, target.offset, nbytes))
    dst = np.frombuffer(view, dtype=data.dtype).reshape(data.shape)
    same = data.flags.c_contiguous and \
        dst.__array_interface__["data"][0] == data.__array_interface__["data"][0]
    if not same:        # an identity model may hand back the very memory it is asked to fill
        np.copyto(dst, data, casting="no")
    return Tensor(name, datatype, list(arr.shape), None, ShmRef(target.segment, target.offset, nbytes))


class Reshapes:
    """``reshape`` from the model config: the model sees ``reshape.shape``, clients see ``dims``."""

    def __init__(self, config: dict):
        self.batching = config.get("max_batch_size", 0) > 0
        self.inputs = {t["name"]: [int(d) for d in t["reshape"]["shape"]]
                       for t in config.get("input", []) if "reshape" in t}
        self.outputs = {t["name"]: [int(d) for d in t["dims"]]
                        for t in config.get("output", []) if "reshape" in t}

    def _apply(self, arr, shape: list[int]):
        lead = [arr.shape[0]] if self.batching and len(arr.shape) else []
        if isinstance(arr, DeviceTensor):       # dense: the same memory, another shape
            return dataclasses.replace(arr, shape=tuple(lead + shape))
        return arr.reshape(lead + shape)

    def model_input(self, name: str, arr: Any) -> Any:
        shape = self.inputs.get(name)
        return arr if shape is None else self._apply(arr, shape)

    def client_output(self, name: str, arr: np.ndarray) -> np.ndarray:
        shape = self.outputs.get(name)
        return arr if shape is None else self._apply(arr, shape)


_INTEGERS = frozenset(("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"))


class OutputChecks:
    """What the config promises about each output (datatype, dims), checked on every answer.

    A datatype that is not the config's is an error: a client that reads an FP32 output as FP32
    must not get FP64 bytes. A shape that is not the config's passes, as Triton passes it: python
    models often declare ``[-1, -1]`` or a fixed shape and return another (the shape travels
    with the tensor, so a client reads what it got), and the worker logs it once per output."""

    def __init__(self, config: dict):
        self.model = config.get("name", "")
        self.batching = config.get("max_batch_size", 0) > 0
        self.outputs = {t["name"]: (dtypes.CONFIG_TO_WIRE.get(t.get("data_type", ""), ""),
                                    tuple(int(d) for d in t.get("dims", ())))
                        for t in config.get("output", [])}

    def fit(self, name: str, datatype: str, arr):
        """Outputs Triton's python backend passes on although their numpy type is not the
        config's, which its examples rely on, get the config's type: an empty array (numpy
        makes ``np.array([])`` float64), and integers whose values all fit (numpy makes int64
        by default). Anything else is left for ``problem``."""
        spec = self.outputs.get(name)
        if spec is None or not spec[0] or spec[0] == datatype:
            return datatype, arr
        if arr.size == 0:
            return spec[0], np.empty(arr.shape, dtype=dtypes.WIRE_TO_NUMPY[spec[0]])
        if datatype not in _INTEGERS or spec[0] not in _INTEGERS:
            return datatype, arr
        target = np.dtype(dtypes.WIRE_TO_NUMPY[spec[0]])
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            return datatype, arr
        return spec[0], arr.astype(target)

    def problem(self, name: str, datatype: str, shape: tuple) -> str:
        """Why this output breaks the config, its datatype or its shape, or "" when it does not."""
        return self.datatype_problem(name, datatype) or self.shape_problem(name, shape)

    def datatype_problem(self, name: str, datatype: str) -> str:
        spec = self.outputs.get(name)
        if spec is None or not spec[0] or datatype == spec[0]:
            return ""
        return (f"unexpected datatype {datatype} for inference output '{name}' of model "
                f"'{self.model}', expecting {spec[0]}")

    def shape_problem(self, name: str, shape: tuple) -> str:
        spec = self.outputs.get(name)
        if spec is None:
            return ""
        dims = spec[1]
        got = shape[1:] if self.batching else shape
        if (self.batching and not shape) or len(got) != len(dims) or \
                any(d != -1 and d != g for d, g in zip(dims, got)):
            want = ([-1] if self.batching else []) + list(dims)
            return (f"unexpected shape {list(shape)} for inference output '{name}' of model "
                    f"'{self.model}', expecting {want}")
        return ""
