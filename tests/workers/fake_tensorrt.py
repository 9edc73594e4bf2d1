"""A stand-in for TensorRT's Python API, so that workers/backends/tensorrt.py runs on a machine
without a GPU, with fake_cuda.py for the CUDA driver. "Device" memory is host memory there (a
pointer is a host address), so the backend's copies, offsets and bindings are checked byte for
byte; the engine computes with numpy what its spec says. Only the calls the backend makes are
modelled, with TensorRT 10's names and return conventions (set_input_shape -> bool,
execute_async_v3 -> bool, deserialize_cuda_engine -> None on failure).

A plan file is JSON naming an engine registered in ENGINES.
"""
from __future__ import annotations

import ctypes
import enum
import json
import types

import numpy as np


class _Named:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"DataType.{self.name}"


DataType = types.SimpleNamespace(**{n: _Named(n) for n in
                                    ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL",
                                     "UINT8", "FP8")})
_NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32,
          "INT64": np.int64, "BOOL": np.bool_, "UINT8": np.uint8}


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class TensorLocation(enum.Enum):
    DEVICE = 0
    HOST = 1


class ILogger:
    class Severity(enum.Enum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def __init__(self):
        pass


class EngineSpec:
    """inputs/outputs: name -> (DataType name, dims with -1 for dynamic); profiles: list of
    {input: (min, opt, max)}; compute(inputs: dict of arrays) -> dict of arrays."""

    def __init__(self, inputs, outputs, profiles, compute, shape_tensors=()):
        self.inputs, self.outputs, self.profiles = inputs, outputs, profiles
        self.compute, self.shape_tensors = compute, set(shape_tensors)


ENGINES: dict[str, EngineSpec] = {}


def plan_bytes(engine: str) -> bytes:
    return json.dumps({"engine": engine}).encode()


class Runtime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes):
        try:
            spec = ENGINES[json.loads(data)["engine"]]
        except (ValueError, KeyError):
            self.logger.log(ILogger.Severity.ERROR, "Serialization assertion failed: magic tag "
                                                   "mismatch (fake)")
            return None
        return Engine(spec)


class Engine:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.names = [*spec.inputs, *spec.outputs]
        self.contexts: list[Context] = []

    @property
    def num_io_tensors(self):
        return len(self.names)

    @property
    def num_optimization_profiles(self):
        return max(1, len(self.spec.profiles))

    def get_tensor_name(self, i):
        return self.names[i]

    def _entry(self, name):
        return self.spec.inputs.get(name) or self.spec.outputs[name]

    def get_tensor_dtype(self, name):
        return getattr(DataType, self._entry(name)[0])

    def get_tensor_shape(self, name):
        return tuple(self._entry(name)[1])

    def get_tensor_mode(self, name):
        return TensorIOMode.INPUT if name in self.spec.inputs else TensorIOMode.OUTPUT

    def get_tensor_location(self, name):
        return TensorLocation.HOST if name in self.spec.shape_tensors else TensorLocation.DEVICE

    def get_tensor_profile_shape(self, name, profile):
        return [tuple(s) for s in self.spec.profiles[profile][name]]

    def create_execution_context(self):
        ctx = Context(self)
        self.contexts.append(ctx)
        return ctx


class Context:
    def __init__(self, engine: Engine):
        self.engine, self.spec = engine, engine.spec
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0
        self.profile_switches = 0

    def set_optimization_profile_async(self, profile, stream):
        self.profile = profile
        self.profile_switches += 1
        return True

    def set_input_shape(self, name, shape):
        if self.spec.profiles:
            lo, _opt, hi = self.spec.profiles[self.profile][name]
        else:       # a static engine (TensorRT reports one profile; its shapes are the dims)
            lo = hi = self.spec.inputs[name][1]
        if len(shape) != len(lo) or not all(a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = int(ptr)
        return True

    def _inputs(self):
        out = {}
        for name, (kind, _dims) in self.spec.inputs.items():
            shape = self.shapes[name]
            dtype = np.dtype(_NUMPY[kind])
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            raw = (ctypes.c_char * n).from_address(self.addresses[name]) if n else b""
            out[name] = np.frombuffer(bytes(raw), dtype=dtype).reshape(shape)
        return out

    def get_tensor_shape(self, name):
        if name in self.spec.inputs:
            return self.shapes[name]
        zeros = {n: np.zeros(s, _NUMPY[self.spec.inputs[n][0]]) for n, s in self.shapes.items()}
        return self.spec.compute(zeros)[name].shape

    def execute_async_v3(self, stream):
        results = self.spec.compute(self._inputs())
        for name, arr in results.items():
            arr = np.ascontiguousarray(arr, dtype=_NUMPY[self.spec.outputs[name][0]])
            if arr.nbytes:
                ctypes.memmove(self.addresses[name], arr.ctypes.data, arr.nbytes)
        self.runs += 1
        return True


def install(monkeypatch) -> types.ModuleType:
    """A fake ``tensorrt`` module (what the backend imports)."""
    mod = types.ModuleType("tensorrt")
    mod.__version__ = "10.0.0-fake"
    for name in ("DataType", "TensorIOMode", "TensorLocation", "ILogger", "Runtime"):
        setattr(mod, name, globals()[name])
    mod.init_libnvinfer_plugins = lambda logger, namespace: True
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", mod)
    return mod
