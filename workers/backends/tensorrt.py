"""TensorRT backend: a serialized engine (``model.plan``, platform ``tensorrt_plan``) run on the
instance's GPU with TensorRT's Python API (named I/O tensors: TensorRT 8.6 and later).

The worker deserialises the engine itself, on the GPU its instance is placed on. Bindings are
device buffers this backend owns, grown as batches need, allocated and filled through the CUDA
driver API (ipc/gpu/device.py): host inputs are copied in once, each request's part straight to its
offset in the batch buffer (no gather on the host); an input already on the device
(``gpu.DeviceTensor``) is bound where it is when it makes the whole batch, else copied device to
device. Shapes may vary within an optimisation profile: the batch's shapes pick the profile (the
current one first), and a shape no profile takes is the request's error, naming the bounds. With
``max_batch_size > 0`` the first dimension is the batch. Outputs whose shape depends on the data
(no shape before running) are not supported.

Only TensorRT is needed: ``import tensorrt`` failing makes the load fail with "TensorRT is not
installed" (and the model UNAVAILABLE with that reason).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from shmserve.ipc import dtypes, model_files
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers.backends.base import InstanceSpec, WorkRequest, WorkResponse

# TensorRT's DataType names -> wire datatypes (those TensorRT has and Triton can carry)
_TRT_TYPES = {"FLOAT": "FP32", "HALF": "FP16", "BF16": "BF16", "INT8": "INT8", "INT32": "INT32",
              "INT64": "INT64", "BOOL": "BOOL", "UINT8": "UINT8"}


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise BackendLoadError(f"TensorRT is not installed: the tensorrt backend needs TensorRT's "
                               f"Python package (pip install 'shmserve[gpu]' on a machine with "
                               f"a GPU) ({e})") from None
    return tensorrt


class _RequestError(Exception):
    """A batch the engine cannot take (a shape outside every profile): the requests' error."""


class TensorRTBackend:
    device_inputs = True        # a DeviceTensor input (a client's CUDA region) is bound as it is

    def __init__(self, spec: InstanceSpec, trt=None, cuda=None):
        """``trt`` and ``cuda`` (a ``gpu.Cuda``) are for tests, which give fakes."""
        trt = trt or import_tensorrt()
        self.trt = trt
        who = f"instance '{spec.instance_name}'"
        self.name = spec.model_name
        if spec.kind != "GPU":
            raise BackendLoadError(f"{who} is KIND_CPU, but the tensorrt backend runs only on "
                                   f"GPUs (instance_group kind KIND_GPU)")
        if cuda is None:
            gpu.require_device(spec.device_id, who)
            cuda = gpu.cuda(spec.device_id)
        self.cuda = cuda
        self.cuda.use()         # TensorRT works in the current context: the instance's GPU
        self.cfg = json.loads(spec.config_json)
        path = os.path.join(spec.model_dir, str(spec.version),
                            self.cfg.get("default_model_filename") or "model.plan")
        try:
            model_files.check_regular(path)     # a FIFO would block the load for ever
            with open(path, "rb") as f:
                plan = f.read()
        except OSError as e:
            raise BackendLoadError(f"cannot read the TensorRT engine {path}: {e}") from None
        self.log = _Logger(trt)
        init_plugins = getattr(trt, "init_libnvinfer_plugins", None)
        if init_plugins is not None:
            init_plugins(self.log.logger, "")
        self.runtime = trt.Runtime(self.log.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise BackendLoadError(f"TensorRT could not deserialize {path} (an engine is built "
                                   f"for one TensorRT version and one GPU model): "
                                   f"{self.log.take() or 'no reason given'}")
        if getattr(self.engine, "has_implicit_batch_dimension", False):
            raise BackendLoadError(f"{path} is an implicit-batch engine; build it with an "
                                   f"explicit batch dimension (TensorRT 8.6 or later)")
        self._read_io(path)
        if spec.auto_complete:
            self.cfg = self._complete(self.cfg)
            spec.config_json = json.dumps(self.cfg)
        self.batching = int(self.cfg.get("max_batch_size", 0) or 0) > 0
        self._check_config()
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise BackendLoadError(f"TensorRT could not create an execution context for {path} "
                                   f"(out of GPU memory?): {self.log.take()}")
        self.stream = self.cuda.stream()
        self.profile = 0
        self.context.set_optimization_profile_async(0, self.stream)
        self.buffers: dict[str, tuple[int, int]] = {}       # name -> (device pointer, bytes)

    # -- load --------------------------------------------------------------------------------

    def _read_io(self, path: str) -> None:
        trt, engine = self.trt, self.engine
        self.inputs: dict[str, str] = {}        # name -> wire datatype, in engine order
        self.outputs: dict[str, str] = {}
        self.engine_dims: dict[str, list[int]] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            kind = engine.get_tensor_dtype(name)
            wire = _TRT_TYPES.get(getattr(kind, "name", str(kind)))
            if wire is None:
                raise BackendLoadError(f"tensor '{name}' of {path} has TensorRT type {kind}, "
                                       f"which Triton's datatypes cannot carry")
            self.engine_dims[name] = [int(d) for d in engine.get_tensor_shape(name)]
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                location = getattr(engine, "get_tensor_location", None)
                if location is not None and location(name) == trt.TensorLocation.HOST:
                    raise BackendLoadError(f"input '{name}' of {path} is a shape tensor, which "
                                           f"the tensorrt backend does not support")
                self.inputs[name] = wire
            else:
                self.outputs[name] = wire
        self.profiles = []          # per profile: input -> (min, max)
        for p in range(max(1, engine.num_optimization_profiles)):
            bounds = {}
            for name in self.inputs:
                dims = self.engine_dims[name]
                if -1 in dims:
                    lo, _opt, hi = engine.get_tensor_profile_shape(name, p)
                    bounds[name] = ([int(d) for d in lo], [int(d) for d in hi])
                else:
                    bounds[name] = (dims, dims)
            self.profiles.append(bounds)

    def _complete(self, cfg: dict) -> dict:
        """Triton's auto-complete for a plan: inputs, outputs and max_batch_size from the engine
        where the configuration leaves them out."""
        cfg = dict(cfg)
        io = [*self.inputs, *self.outputs]
        first_dynamic = all(self.engine_dims[n] and self.engine_dims[n][0] == -1 for n in io)
        mbs = int(cfg.get("max_batch_size", 0) or 0)
        if mbs == 0 and first_dynamic and not cfg.get("input"):
            mbs = min(self.profiles[0][n][1][0] for n in self.inputs) if self.inputs else 0
            cfg["max_batch_size"] = mbs
        skip = 1 if mbs > 0 else 0
        for section, tensors in (("input", self.inputs), ("output", self.outputs)):
            if not cfg.get(section):
                cfg[section] = [{"name": n, "data_type": dtypes.WIRE_TO_CONFIG[w],
                                 "dims": self.engine_dims[n][skip:]} for n, w in tensors.items()]
        return cfg

    def _check_config(self) -> None:
        for section, tensors in (("input", self.inputs), ("output", self.outputs)):
            for entry in self.cfg.get(section) or ():
                name = entry.get("name", "")
                if name not in tensors:
                    raise BackendLoadError(f"configuration has {section} '{name}', which the "
                                           f"TensorRT engine does not have (its {section}s: "
                                           f"{list(tensors)})")
                wire = dtypes.CONFIG_TO_WIRE.get(entry.get("data_type", ""), "")
                if wire and wire != tensors[name]:
                    raise BackendLoadError(f"{section} '{name}': the configuration says "
                                           f"{entry.get('data_type')} but the TensorRT engine has "
                                           f"{tensors[name]}")
                dims = entry["reshape"].get("shape") or () if "reshape" in entry else \
                    entry.get("dims") or ()
                rank = len(dims) + (1 if self.batching else 0)
                if rank != len(self.engine_dims[name]):
                    raise BackendLoadError(f"{section} '{name}': the configuration's dims "
                                           f"{entry.get('dims')} (with the batch dimension: "
                                           f"{'yes' if self.batching else 'no'}) do not match "
                                           f"the engine's shape {self.engine_dims[name]}")
        if self.batching:
            mbs = int(self.cfg["max_batch_size"])
            for name, dims in self.engine_dims.items():
                if dims and dims[0] not in (-1, mbs) and name in self.inputs:
                    raise BackendLoadError(f"max_batch_size is {mbs}, but the engine's input "
                                           f"'{name}' has the fixed first dimension {dims[0]}")
            most = max(min(b[n][1][0] for n in self.inputs) for b in self.profiles) \
                if self.inputs else mbs
            if most < mbs:
                raise BackendLoadError(f"configuration specified max_batch_size {mbs}, but the "
                                       f"TensorRT engine's optimisation profiles take at most "
                                       f"{most} (rebuild it, or lower max_batch_size)")

    # -- execute -----------------------------------------------------------------------------

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        if len(requests) > 1 and not self.batching:
            return [self._respond([r])[0] for r in requests]
        groups: dict[tuple, list[WorkRequest]] = {}
        for r in requests:
            key = tuple((n, tuple(a.shape[1:])) for n, a in sorted(r.inputs.items()))
            groups.setdefault(key, []).append(r)
        if len(groups) == 1:
            return self._respond(requests)
        out: dict[int, WorkResponse] = {}
        for members in groups.values():
            for r, resp in zip(members, self._respond(members)):
                out[id(r)] = resp
        return [out[id(r)] for r in requests]

    def _respond(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        try:
            results = self._run(requests)
        except _RequestError as e:
            return [WorkResponse(error=str(e), code=ErrorCode.INVALID_ARG) for _ in requests]
        except Exception as e:      # CUDA or TensorRT failed
            return [WorkResponse(error=f"TensorRT execution failed: {e}", code=ErrorCode.INTERNAL)
                    for _ in requests]
        out, start = [], 0
        for r in requests:
            n = self._rows(r) if self.batching else 1
            wanted = r.requested_outputs or list(self.outputs)
            if self.batching:
                outs = [(name, self.outputs[name], _rows(results[name], start, start + n))
                        for name in wanted]
            else:
                outs = [(name, self.outputs[name], results[name]) for name in wanted]
            out.append(WorkResponse(outputs=outs))
            start += n
        return out

    def _rows(self, r: WorkRequest) -> int:
        return int(next(iter(r.inputs.values())).shape[0]) if r.inputs else 1

    def _run(self, requests: list[WorkRequest]) -> dict[str, np.ndarray | DeviceTensor]:
        """The outputs, copied to the host, except those a request may take on the device
        (``device_outputs``: an ensemble's next step binds them), which are handed over in our
        binding buffers as DeviceTensors; the worker copies them into its device arena before
        the next execution reuses the buffers."""
        trt_ctx, cuda, stream = self.context, self.cuda, self.stream
        device = frozenset().union(*(r.device_outputs for r in requests))
        cuda.use()
        missing = [n for n in self.inputs if n not in requests[0].inputs]
        if missing:
            raise _RequestError(f"the TensorRT engine needs input(s) {missing}")
        shapes = {}
        for name in self.inputs:
            first = requests[0].inputs[name]
            if self.batching:
                rows = sum(int(r.inputs[name].shape[0]) for r in requests)
                shapes[name] = (rows, *(int(d) for d in first.shape[1:]))
            else:
                shapes[name] = tuple(int(d) for d in first.shape)
        self._pick_profile(shapes)
        for name, shape in shapes.items():
            if not trt_ctx.set_input_shape(name, shape):
                raise _RequestError(f"TensorRT refused shape {list(shape)} for input '{name}': "
                                    f"{self.log.take()}")
            parts = [r.inputs[name] for r in requests]
            dtype = dtypes.WIRE_TO_NUMPY[self.inputs[name]]
            if len(parts) == 1 and isinstance(parts[0], DeviceTensor) \
                    and parts[0].device_id == cuda.device_id and not parts[0].ptr % 256:
                # bound where it is (TensorRT takes addresses aligned to 256 bytes; a client's
                # CUDA region at another offset is copied into our buffer below)
                trt_ctx.set_tensor_address(name, parts[0].ptr)
                continue
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            ptr = self._buffer(name, nbytes)
            offset = 0
            for part in parts:
                if isinstance(part, DeviceTensor):
                    cuda.dtod(ptr + offset, part.ptr, part.nbytes, stream)
                    offset += part.nbytes
                else:
                    host = np.ascontiguousarray(part, dtype=dtype)
                    cuda.htod(ptr + offset, host.ctypes.data, host.nbytes, stream)
                    offset += host.nbytes
            trt_ctx.set_tensor_address(name, ptr)
        results: dict[str, np.ndarray | DeviceTensor] = {}
        for name, wire in self.outputs.items():
            shape = tuple(int(d) for d in trt_ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise _RequestError(f"output '{name}' has a data-dependent shape {list(shape)}, "
                                    f"which the tensorrt backend does not support")
            dtype = np.dtype(dtypes.WIRE_TO_NUMPY[wire])
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            ptr = self._buffer(name, nbytes)
            trt_ctx.set_tensor_address(name, ptr)
            results[name] = DeviceTensor(ptr, shape, dtype, cuda.device_id, "cuda", self) \
                if name in device else np.empty(shape, dtype=dtype)
        if not trt_ctx.execute_async_v3(stream):
            raise RuntimeError(f"execute_async_v3 failed: {self.log.take() or 'no reason given'}")
        for name, out in results.items():
            if isinstance(out, np.ndarray):
                cuda.dtoh(out.ctypes.data, self.buffers[name][0], out.nbytes, stream)
        cuda.synchronize(stream)
        return results

    def _pick_profile(self, shapes: dict[str, tuple]) -> None:
        order = [self.profile, *(p for p in range(len(self.profiles)) if p != self.profile)]
        for p in order:
            if all(_within(shape, *self.profiles[p][name]) for name, shape in shapes.items()):
                if p != self.profile:
                    self.context.set_optimization_profile_async(p, self.stream)
                    self.cuda.synchronize(self.stream)
                    self.profile = p
                return
        name, shape = next((n, s) for n, s in shapes.items()
                           if not _within(s, *self.profiles[self.profile][n]))
        bounds = "; ".join(f"profile {p}: min {b[name][0]}, max {b[name][1]}"
                           for p, b in enumerate(self.profiles))
        raise _RequestError(f"input '{name}' has shape {list(shape)}, which no optimisation "
                            f"profile of the TensorRT engine takes ({bounds})")

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, -1))
        if nbytes > size:
            if ptr:
                self.cuda.synchronize(self.stream)
                self.cuda.free(ptr)
            size = max(nbytes, 2 * size, 256)
            ptr = self.cuda.alloc(size)
            self.buffers[name] = (ptr, size)
        return ptr

    def finalize(self) -> None:
        try:
            self.cuda.use()
            self.cuda.synchronize(self.stream)
            for ptr, _ in self.buffers.values():
                self.cuda.free(ptr)
            self.cuda.destroy_stream(self.stream)
        except Exception:
            pass
        self.buffers = {}
        self.context = self.engine = self.runtime = None


def _rows(out: np.ndarray | DeviceTensor, start: int, stop: int) -> np.ndarray | DeviceTensor:
    return out.rows(start, stop) if isinstance(out, DeviceTensor) else out[start:stop]


def _within(shape: tuple, lo: list[int], hi: list[int]) -> bool:
    return len(shape) == len(lo) and all(a <= d <= b for d, a, b in zip(shape, lo, hi))


class _Logger:
    """TensorRT's logger; errors are kept so that a failure can say what TensorRT said."""

    def __init__(self, trt):
        errors: list[str] = []
        severities = (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR)

        base: Any = trt.ILogger     # a class of the tensorrt module, which loads on use

        class Logger(base):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                if severity in severities:
                    errors.append(str(msg))

        self.logger = Logger()
        self.errors = errors

    def take(self) -> str:
        text = "; ".join(self.errors[-3:])
        self.errors.clear()
        return text
