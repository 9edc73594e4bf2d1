"""ONNX Runtime backend: CPU provider, or CUDA for KIND_GPU instances (never a silent fallback)."""
from __future__ import annotations

import ctypes
import json
import os

import numpy as np

from shmserve.ipc import dtypes
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers import sequence
from shmserve.workers.backends import autocomplete, onnx_checks, ort_options
from shmserve.workers.backends.base import InstanceSpec, WorkRequest, WorkResponse

# what cudaMalloc gives; a device tensor bound where it is must start on such an address
DEVICE_ALIGNMENT = 256


def _wire_type(ort_type: str) -> str:
    """The wire datatype of an onnxruntime type string ("tensor(float)": FP32), or ""."""
    return dtypes.CONFIG_TO_WIRE.get(autocomplete.config_datatype(ort_type), "")


class OnnxBackend:
    def __init__(self, spec: InstanceSpec, io_binding: bool | None = None):
        """``io_binding`` (default: on for KIND_GPU): run through ``session.io_binding()``, which
        binds inputs already in device memory (``gpu.DeviceTensor``) where they are; tests turn
        it on for a CPU session to exercise that path."""
        import onnxruntime as ort

        self.cfg = json.loads(spec.config_json)
        path = os.path.join(spec.model_dir, str(spec.version), self.cfg["default_model_filename"])
        if os.path.isdir(path):
            path = os.path.join(path, "model.onnx")
        opts = ort_options.session_options(ort, self.cfg)
        self.run_opts = ort_options.run_options(ort, self.cfg)
        self.device = ("cuda", spec.device_id) if spec.kind == "GPU" else ("cpu", 0)
        if spec.kind == "GPU":
            _require_cuda(ort, spec)
            providers = ort_options.gpu_providers(self.cfg, spec.device_id,
                                                  ort.get_available_providers())
        else:
            providers = ort_options.cpu_providers(self.cfg, ort.get_available_providers())
        try:
            self.session = ort.InferenceSession(path, sess_options=opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types
            raise BackendLoadError(f"onnxruntime failed to load {path}: {e}") from None
        if spec.kind == "GPU" and "CUDAExecutionProvider" not in self.session.get_providers():
            # onnxruntime falls back to CPU when the provider cannot start (missing CUDA or
            # cuDNN libraries, a driver too old): never serve a KIND_GPU instance that way
            raise BackendLoadError(f"instance '{spec.instance_name}' is KIND_GPU, but onnxruntime "
                                   f"could not start its CUDA execution provider on GPU "
                                   f"{spec.device_id} (session providers: "
                                   f"{self.session.get_providers()}; missing CUDA 12/13 or cuDNN 9 "
                                   f"libraries? see onnxruntime's log above)")
        self.input_names = [i.name for i in self.session.get_inputs()]
        # BYTES arrive as numpy object arrays of bytes; onnxruntime's string tensors take str
        # (given bytes, it feeds their repr, "b'0'", to the graph)
        self.string_inputs = {i.name for i in self.session.get_inputs()
                              if i.type == "tensor(string)"}
        self.output_types = {o.name: _wire_type(o.type) for o in self.session.get_outputs()}
        self.output_names = list(self.output_types)
        # onnxruntime binds no string tensor: such a model runs through session.run, which
        # keeps strings on the CPU anyway
        strings = self.string_inputs or "BYTES" in self.output_types.values()
        self.io_binding = (spec.kind == "GPU" if io_binding is None else io_binding) and not strings
        # inputs in a client's CUDA region come as DeviceTensors (bound where they are) only on
        # a GPU session; elsewhere the worker copies them to the host first
        self.device_inputs = self.io_binding and self.device[0] == "cuda"
        self._check_sequence_tensors()
        # the config's inputs and outputs against the graph's, as Triton checks them at load
        onnx_checks.check(self.cfg, self.session)
        self.batching = self.cfg.get("max_batch_size", 0) > 0

    def _check_sequence_tensors(self) -> None:
        """The control and state inputs, and the state outputs, sequence_batching feeds and
        takes: the graph must have them, with the same datatypes (Triton's words)."""
        inputs, outputs = sequence.declared(self.cfg)
        types = {i.name: _wire_type(i.type) for i in self.session.get_inputs()}
        for name, wire in inputs.items():
            if name not in types:
                raise BackendLoadError(f"configuration specified sequence control or state input "
                                       f"'{name}', but model does not provide that input")
            if wire and types[name] != wire:
                raise BackendLoadError(f"unable to load model '{self.cfg.get('name', '')}', sequence "
                                       f"input '{name}', the model expects data-type {types[name]} "
                                       f"but the model configuration specifies data-type {wire}")
        for name, wire in outputs.items():
            if name not in self.output_types:
                raise BackendLoadError(f"configuration specified state output '{name}', but model "
                                       f"does not provide that output")
            if wire and self.output_types[name] != wire:
                raise BackendLoadError(f"unable to load model '{self.cfg.get('name', '')}', state "
                                       f"output '{name}', the model produces data-type "
                                       f"{self.output_types[name]} but the model configuration "
                                       f"specifies data-type {wire}")

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        if len(requests) == 1 or not self.batching:
            return [self._run_one(r) for r in requests]
        try:
            feeds = {name: self._concat([r.inputs[name] for r in requests])
                     for name in requests[0].inputs}
        except ValueError:
            # shapes that differ past the batch dimension: a variable-dim implicit state (the
            # scheduler's shape key sees only the client's inputs). Equal shapes run together.
            return self._by_shape(requests)
        try:
            results = self._run(self._text(feeds),
                                frozenset().union(*(r.device_outputs for r in requests)))
        except _NotText as e:
            return [WorkResponse(error=str(e), code=ErrorCode.INVALID_ARG) for _ in requests]
        except Exception as e:
            return [WorkResponse(error=f"onnxruntime execution failed: {e}", code=ErrorCode.INTERNAL)
                    for _ in requests]
        out, start = [], 0
        for r in requests:
            n = next(iter(r.inputs.values())).shape[0]      # (a DeviceTensor's too)
            out.append(self._response(r, [a.rows(start, start + n) if isinstance(a, DeviceTensor)
                                          else a[start:start + n] for a in results]))
            start += n
        return out

    def _by_shape(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            key = tuple((name, tuple(arr.shape[1:])) for name, arr in r.inputs.items())
            groups.setdefault(key, []).append(i)
        if len(groups) == 1:        # not a matter of shapes: one at a time, each its own answer
            return [self._run_one(r) for r in requests]
        out: list[WorkResponse] = [WorkResponse()] * len(requests)
        for members in groups.values():
            for i, resp in zip(members, self.execute([requests[i] for i in members])):
                out[i] = resp
        return out

    def _run_one(self, r: WorkRequest) -> WorkResponse:
        try:
            results = self._run(self._text(r.inputs), r.device_outputs)
        except _NotText as e:
            return WorkResponse(error=str(e), code=ErrorCode.INVALID_ARG)
        except Exception as e:
            return WorkResponse(error=f"onnxruntime execution failed: {e}", code=ErrorCode.INTERNAL)
        return self._response(r, results)

    def _run(self, feeds: dict, device: frozenset = frozenset()) -> list:
        """The outputs in ``output_names`` order; those named in ``device`` (an ensemble's next
        step reads them on the GPU) as DeviceTensors where onnxruntime put them, when I/O
        binding is on."""
        if not self.io_binding:
            return self.session.run(self.output_names, feeds, self.run_opts)
        # I/O binding: host arrays are bound where they are (onnxruntime copies them to the
        # device once), device tensors where they are (no trip through the host); outputs come
        # back to host memory, where the worker sends them from, except those ``device`` names
        binding = self.session.io_binding()
        held = []
        for name, value in feeds.items():
            if isinstance(value, DeviceTensor):
                if value.device_type == "cuda" and (value.device_id != self.device[1]
                                                    or value.ptr % DEVICE_ALIGNMENT):
                    # on another GPU, or at an offset kernels may not take (a client's CUDA
                    # region at any offset): copied, device to device, to a buffer of our own
                    value = _gather([value], self.device)
                    held.append(value)      # alive until the run
                binding.bind_input(name, value.device_type, value.device_id, value.dtype,
                                   list(value.shape), value.ptr)
            else:
                binding.bind_cpu_input(name, value)
        device = frozenset(n for n in device if self.output_types.get(n) in dtypes.WIRE_TO_NUMPY)
        for name in self.output_names:
            if name in device:
                binding.bind_output(name, self.device[0], self.device[1])
            else:
                binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding, self.run_opts)
        if not device:
            return binding.copy_outputs_to_cpu()
        return [self._on_device(name, value) if name in device else value.numpy()
                for name, value in zip(self.output_names, binding.get_outputs())]

    def _on_device(self, name: str, value) -> DeviceTensor:
        """An output onnxruntime allocated on our device; the OrtValue owns the memory."""
        dtype = np.dtype(dtypes.WIRE_TO_NUMPY[self.output_types[name]])
        return DeviceTensor(int(value.data_ptr()), tuple(int(d) for d in value.shape()), dtype,
                            self.device[1], self.device[0], value)

    def _concat(self, parts: list):
        """One batch input from the requests' parts: host arrays are concatenated on the host;
        where any part is already on the device, the batch is gathered on the device."""
        if not any(isinstance(p, DeviceTensor) for p in parts):
            return np.concatenate(parts, axis=0)
        return _gather(parts, self.device)

    def _text(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """String inputs as onnxruntime wants them: str elements (UTF-8 decoded)."""
        if not self.string_inputs:
            return feeds
        out = dict(feeds)
        for name in self.string_inputs.intersection(feeds):
            arr = feeds[name]
            try:
                text = [x.decode("utf-8") if type(x) is bytes else str(x)
                        for x in arr.ravel().tolist()]
            except UnicodeDecodeError:
                raise _NotText(f"input '{name}' holds an element that is not UTF-8 text, which "
                               f"onnxruntime's string tensors need") from None
            out[name] = np.array(text, dtype=object).reshape(arr.shape)
        return out

    def _response(self, r: WorkRequest, results) -> WorkResponse:
        wanted = r.requested_outputs or self.output_names
        by_name = dict(zip(self.output_names, results))
        return WorkResponse(outputs=[(n, self.output_types[n], by_name[n]) for n in wanted])

    def finalize(self) -> None:
        self.session = None


def _require_cuda(ort, spec: InstanceSpec) -> None:
    """The CUDA execution provider can run on the instance's GPU, or the load error that says
    why not: no GPU, or an onnxruntime without CUDA. Never a silent CPU fallback."""
    who = f"instance '{spec.instance_name}'"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        count, why = gpu.device_count()
        machine = f"this machine has no GPU that CUDA can use ({why}), and " if count == 0 else ""
        raise BackendLoadError(f"{who} is KIND_GPU (GPU {spec.device_id}), but {machine}this "
                               f"onnxruntime has no CUDA "
                               f"execution provider (providers: {ort.get_available_providers()}; "
                               f"install shmserve[gpu], which brings onnxruntime-gpu, on a "
                               f"machine with a GPU)")
    gpu.require_device(spec.device_id, who)
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:     # onnxruntime-gpu >= 1.21: CUDA and cuDNN from nvidia-* wheels
        try:
            preload()
        except Exception:       # the session's own error says more
            pass


def _gather(parts: list, device: tuple[str, int]) -> DeviceTensor:
    """Concatenate batch parts (host arrays and device tensors of one dtype) along the first
    dimension into one new tensor on ``device``."""
    first = parts[0]
    dtype = np.dtype(first.dtype)
    rows = sum(p.shape[0] for p in parts)
    inner = tuple(first.shape[1:])
    for p in parts:
        if tuple(p.shape[1:]) != inner or np.dtype(p.dtype) != dtype:
            raise ValueError("batch parts differ past the batch dimension")
    shape = (rows, *inner)
    if device[0] == "cpu":
        out = np.empty(shape, dtype)
        start = 0
        for p in parts:
            n = p.shape[0]
            if isinstance(p, DeviceTensor):
                ctypes.memmove(out[start:start + n].ctypes.data, p.ptr, p.nbytes)
            else:
                out[start:start + n] = p
            start += n
        return DeviceTensor(out.ctypes.data, shape, dtype, 0, "cpu", out)
    cuda = gpu.cuda(device[1])
    total = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = _DeviceBuffer(cuda, total)
    offset = 0
    for p in parts:
        if isinstance(p, DeviceTensor):
            cuda.dtod(buf.ptr + offset, p.ptr, p.nbytes)
            offset += p.nbytes
        else:
            host = np.ascontiguousarray(p)
            cuda.htod(buf.ptr + offset, host.ctypes.data, host.nbytes)
            offset += host.nbytes
    cuda.synchronize(0)
    return DeviceTensor(buf.ptr, shape, dtype, device[1], "cuda", buf)


class _DeviceBuffer:
    """Device memory freed with its last reference."""

    def __init__(self, cuda: gpu.Cuda, nbytes: int):
        self.cuda, self.ptr = cuda, cuda.alloc(nbytes)

    def __del__(self):
        try:
            self.cuda.free(self.ptr)
        except Exception:
            pass


class _NotText(ValueError):
    """A BYTES input that onnxruntime cannot take as a string tensor."""
