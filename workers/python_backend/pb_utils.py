"""shmserve's own ``triton_python_backend_utils``.

Worker processes install this module as ``sys.modules["triton_python_backend_utils"]`` before importing
a repository ``model.py``, so unmodified Triton python models run against it.  Tensors wrap numpy
arrays, and the worker moves them through shared memory itself; a GPU tensor a model makes with
``Tensor.from_dlpack`` stays in GPU memory (ipc/gpu/dlpack.py) until it leaves the model.
"""

import enum
import json
import logging
import struct
import threading
import typing as _typing

import numpy as np
from ml_dtypes import bfloat16

from shmserve.ipc import dtypes as _dtypes
from shmserve.workers.python_backend.errors import TritonError, TritonModelException  # noqa: F401  (part of the API)
from shmserve.workers.python_backend.metrics import MetricFamily  # noqa: F401  (part of the API)

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_GPU = 1
TRITONSERVER_MEMORY_CPU_PINNED = 2

# (wire name, TRITONSERVER_DataType number, numpy type). numpy has no bfloat16 of its own; BF16 uses
# ml_dtypes.bfloat16, the type tritonclient (>= 2.67) uses for BF16 too.
_TYPES = [
    ("BOOL", 1, np.bool_), ("UINT8", 2, np.uint8), ("UINT16", 3, np.uint16),
    ("UINT32", 4, np.uint32), ("UINT64", 5, np.uint64), ("INT8", 6, np.int8),
    ("INT16", 7, np.int16), ("INT32", 8, np.int32), ("INT64", 9, np.int64),
    ("FP16", 10, np.float16), ("FP32", 11, np.float32), ("FP64", 12, np.float64),
    ("BYTES", 13, np.object_), ("BF16", 14, bfloat16),
]
WIRE_TO_ENUM = {w: e for w, e, _ in _TYPES}
ENUM_TO_WIRE = {e: w for w, e, _ in _TYPES}
WIRE_TO_NUMPY = {w: t for w, _, t in _TYPES}
_ENUM_TO_NUMPY = {e: t for _, e, t in _TYPES}
# Keyed on (kind, itemsize) rather than dtype equality so that byte-swapped and platform-alias dtypes
# (np.intc, '>f4') still map; BF16 is absent on purpose: a uint16 array is UINT16 unless told otherwise.
_KIND_TO_WIRE = {("b", 1): "BOOL", ("u", 1): "UINT8", ("u", 2): "UINT16", ("u", 4): "UINT32",
                 ("u", 8): "UINT64", ("i", 1): "INT8", ("i", 2): "INT16", ("i", 4): "INT32",
                 ("i", 8): "INT64", ("f", 2): "FP16", ("f", 4): "FP32", ("f", 8): "FP64"}
_BYTES_KINDS = "OSUT"  # object, bytes_, str_, and numpy 2's StringDType
_U32 = struct.Struct("<I")
_BF16 = np.dtype(bfloat16)
_WIRE_OF_NATIVE = {np.dtype(f"={kind}{size}"): wire for (kind, size), wire in _KIND_TO_WIRE.items()}
_WIRE_OF_NATIVE[_BF16] = "BF16"


def _wire_of_dtype(dtype):
    wire = _WIRE_OF_NATIVE.get(dtype)     # the common case: a numpy dtype of native order
    if wire is not None:
        return wire
    dtype = np.dtype(dtype)
    if dtype == _BF16:
        return "BF16"
    if dtype.kind in _BYTES_KINDS:
        return "BYTES"
    return _KIND_TO_WIRE.get((dtype.kind, dtype.itemsize))


def triton_string_to_numpy(triton_type_string):
    """Config-style "TYPE_FP32" (wire-style "FP32" also accepted) -> numpy type; KeyError if unknown."""
    s = triton_type_string[5:] if triton_type_string.startswith("TYPE_") else triton_type_string
    s = "BYTES" if s == "STRING" else s
    if s not in WIRE_TO_NUMPY:
        raise KeyError(f"unknown Triton data type {triton_type_string!r}")
    return WIRE_TO_NUMPY[s]


def triton_to_numpy_type(data_type):  # None for unknown numbers, as Triton's helper does
    return _ENUM_TO_NUMPY.get(int(data_type))


def numpy_to_triton_type(data_type):
    try:
        return WIRE_TO_ENUM.get(_wire_of_dtype(data_type))
    except TypeError:
        return None


def serialize_byte_tensor(input_tensor):
    """Row-major elements -> uint8 array of (uint32 LE length, bytes) records."""
    arr = np.asarray(input_tensor)
    if arr.dtype.kind not in _BYTES_KINDS:
        raise ValueError(f"cannot serialize a {arr.dtype} array as BYTES (need object, bytes or str)")
    return _dtypes.serialize_bytes(arr)


def deserialize_bytes_tensor(encoded_tensor):
    """(uint32 LE length, bytes) records -> 1-D object array of bytes; ValueError if truncated."""
    buf = encoded_tensor
    if isinstance(buf, np.ndarray) and buf.dtype == np.object_:
        buf = buf.item()  # tritonclient's serializer returns a 0-d object array holding the bytes
    return _dtypes.deserialize_bytes(buf)


def _to_bytes_object_array(arr):
    if arr.dtype.kind == "S":
        return arr.astype(np.object_)  # yields bytes elements (trailing NULs stripped, as numpy does)
    flat = arr.ravel(order="C").tolist()
    return np.fromiter((s.encode("utf-8") for s in flat), dtype=np.object_, count=len(flat)).reshape(arr.shape)


class Tensor:
    __slots__ = ("_name", "_array", "_wire", "_device")

    def __init__(self, name, numpy_array, datatype=None):
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a str, got {type(name).__name__}")
        if numpy_array is None:         # Triton's binding refuses it as an argument type
            raise TypeError(f"tensor '{name}': expected a numpy array, got None")
        arr = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        natural = _wire_of_dtype(arr.dtype)
        if natural is None:
            raise ValueError(f"tensor '{name}': numpy dtype {arr.dtype} has no Triton data type")
        if arr.dtype.kind in "SUT":
            arr = _to_bytes_object_array(arr)
        elif natural != "BYTES" and not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if datatype is not None and datatype != natural:
            if datatype not in WIRE_TO_ENUM:
                raise ValueError(f"tensor '{name}': unknown datatype {datatype!r}")
            if datatype == "BF16" and natural in ("UINT16", "INT16"):
                arr = arr.view(_BF16)  # raw bfloat16 bit patterns
            else:
                raise ValueError(f"tensor '{name}': datatype {datatype} does not match numpy dtype {arr.dtype}"
                                 + (" (BF16 needs the raw bits in a uint16 array)" if datatype == "BF16" else ""))
        self._name, self._array, self._wire, self._device = name, arr, datatype or natural, None

    @classmethod
    def _from_worker(cls, name, array, datatype):
        """Trusted path: `array` already has the numpy type that `datatype` (a wire name) implies."""
        t = cls.__new__(cls)
        t._name, t._array, t._wire, t._device = name, array, datatype, None
        return t

    @classmethod
    def _from_device(cls, name, device_tensor, datatype):
        """Trusted path: an input in GPU memory (a gpu.DeviceTensor), for a model that asked for
        GPU inputs (FORCE_CPU_ONLY_INPUT_TENSORS "no"); read through to_dlpack()."""
        t = cls.__new__(cls)
        t._name, t._array, t._wire, t._device = name, None, datatype, device_tensor  # type: ignore[assignment]
        return t

    def name(self): return self._name
    def datatype(self): return self._wire
    def triton_dtype(self): return WIRE_TO_ENUM[self._wire]
    def is_cpu(self): return self._device is None
    def memory_type(self): return TRITONSERVER_MEMORY_CPU if self._device is None else TRITONSERVER_MEMORY_GPU
    def to_dlpack(self): return self.__dlpack__()

    def as_numpy(self):
        if self._device is not None:        # Triton's words
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def shape(self):
        return list(self._array.shape if self._device is None else self._device.shape)

    def _host(self):
        """The tensor in host memory: the array itself, or a GPU tensor copied out (the worker
        sends outputs from host memory)."""
        if self._device is None:
            return self._array
        from shmserve.ipc.gpu import device as gpu
        return gpu.cuda(self._device.device_id).to_host(self._device)

    def __dlpack__(self, stream=None, **kwargs):
        if self._wire == "BYTES":
            raise TritonModelException(f"tensor '{self._name}': DLPack cannot carry BYTES tensors")
        if self._device is not None:
            from shmserve.ipc.gpu import dlpack
            return dlpack.capsule(self._device)
        if stream is not None:
            kwargs["stream"] = stream
        try:
            return self._array.__dlpack__(**kwargs)
        except BufferError:
            # an input is a read-only view of memory the model does not own (a client's
            # region, perhaps); the legacy protocol (to_dlpack(), a consumer that asks for no
            # max_version) cannot say read-only, so it gets a copy the model may write
            if self._array.flags.writeable:
                raise
            return np.array(self._array).__dlpack__(**kwargs)

    def __dlpack_device__(self):
        if self._device is not None:
            return (2, self._device.device_id)      # kDLCUDA
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name, dlpack_tensor):
        """CPU tensors become numpy arrays (no copy); GPU tensors stay in GPU memory (``is_cpu()``
        is False), held through their capsule, and are copied to the host only when they leave
        the model as outputs."""
        if not name or dlpack_tensor is None:
            raise TritonModelException(f"Tensor.from_dlpack needs a tensor name and a DLPack "
                                       f"tensor, got name {name!r} and "
                                       f"{type(dlpack_tensor).__name__}")
        obj = dlpack_tensor
        is_capsule = type(obj).__name__ == "PyCapsule"
        device = _dlpack_device(name, obj, is_capsule)
        if device[0] in (2, 13):        # kDLCUDA, kDLCUDAManaged
            return Tensor._from_gpu(name, obj, is_capsule, device)
        if is_capsule:  # Triton models pass torch.utils.dlpack.to_dlpack(t) capsules
            obj = _CapsuleHolder(obj)
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as e:
            arr = _cpu_fallback(dlpack_tensor, is_capsule)      # what numpy cannot take: BF16
            if arr is None:
                raise TritonModelException(f"tensor '{name}': cannot import DLPack tensor on CPU: {e}") from e
        return Tensor(name, arr)

    @staticmethod
    def _from_gpu(name, obj, is_capsule, device):
        from shmserve.ipc.gpu import device as gpu
        from shmserve.ipc.gpu import dlpack
        count, why = gpu.device_count()
        if count == 0:
            raise TritonModelException(f"tensor '{name}' is in GPU memory (DLPack device CUDA:{device[1]}), "
                                       f"but this machine has no GPU that CUDA can use: {why}")
        try:
            dev = dlpack.read(obj if is_capsule else obj.__dlpack__())
        except (ValueError, BufferError, TypeError) as e:
            raise TritonModelException(f"tensor '{name}': cannot import DLPack tensor: {e}") from e
        wire = _wire_of_dtype(dev.dtype)
        if wire is None:
            raise TritonModelException(f"tensor '{name}': dtype {dev.dtype} has no Triton data type")
        t = Tensor.__new__(Tensor)
        t._name, t._array, t._wire, t._device = name, None, wire, dev  # type: ignore[assignment]
        return t

    def __repr__(self): return f"Tensor({self._name!r}, {self._wire}, shape={self.shape()})"


def _cpu_fallback(obj, is_capsule):
    """A CPU DLPack tensor read without numpy's importer (which refuses bfloat16); None if it
    is not one."""
    from shmserve.ipc.gpu import dlpack
    try:
        t = dlpack.read(obj if is_capsule else obj.__dlpack__())
    except Exception:
        return None
    return dlpack.host_array(t) if t.device_type == "cpu" else None


def _dlpack_device(name, obj, is_capsule):
    """(DLPack device type, device id) of what from_dlpack was given."""
    if is_capsule:
        from shmserve.ipc.gpu import dlpack
        try:
            dev = dlpack.read(obj)
        except ValueError as e:
            raise TritonModelException(f"tensor '{name}': cannot import DLPack tensor: {e}") from e
        return (2, dev.device_id) if dev.device_type == "cuda" else (1, 0)
    get = getattr(obj, "__dlpack_device__", None)
    if get is None:
        return (1, 0)
    try:
        kind, index = get()
        return int(kind), int(index)
    except (TypeError, ValueError) as e:
        raise TritonModelException(f"tensor '{name}': bad __dlpack_device__(): {e}") from e


class _CapsuleHolder:
    """Gives a bare legacy capsule the __dlpack__ protocol numpy requires; numpy rejects non-CPU ones."""
    __slots__ = ("_capsule",)

    def __init__(self, capsule): self._capsule = capsule
    def __dlpack__(self, **_): return self._capsule
    def __dlpack_device__(self): return (1, 0)


def _params_json(parameters):
    """Triton's rules for a request's or response's parameters: a dict (or None), str keys,
    bool/int/str values (no float), with its error texts."""
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for k, v in parameters.items():
        if not isinstance(k, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(k)}")
        if not isinstance(v, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(v)}")
    return json.dumps(parameters)


class PreferredMemory:
    def __init__(self, preferred_memory_type=TRITONSERVER_MEMORY_CPU, preferred_device_id=0):
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


def _tensor_list(values, owner: str, what: str) -> list:
    """A list of tensors, checked as Triton's binding checks it: None where the list goes is
    a TypeError, anything but a Tensor in it a TritonModelException."""
    if values is None:
        raise TypeError(f"{owner}(): {what} must be a list, not None")
    values = list(values)
    for t in values:
        if not isinstance(t, Tensor):
            raise TritonModelException(f"{what} must be pb_utils.Tensor objects, got "
                                       f"{type(t).__name__}")
    return values


class InferenceRequest:
    __slots__ = ("_inputs", "_requested_output_names", "_request_id", "_correlation_id", "_flags",
                 "_parameters", "_model_name", "_model_version", "_timeout", "_preferred_memory",
                 "_trace", "_release_flags", "_cancel_key", "_poll_cancelled", "_sender")

    def __init__(self, model_name, requested_output_names, inputs, request_id="", correlation_id=0,
                 model_version=-1, flags=0, timeout=0, preferred_memory=None, trace=None, parameters=None):
        # the argument types Triton's binding takes (TypeError), then its own checks
        if isinstance(model_name, bytes):      # e.g. an element of a BYTES input, as Triton takes
            model_name = model_name.decode()
        for what, value, kinds in (("model_name", model_name, str),
                                   ("request_id", request_id, str),
                                   ("correlation_id", correlation_id, (int, str)),
                                   ("model_version", model_version, int),
                                   ("flags", flags, int), ("timeout", timeout, int)):
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(f"InferenceRequest(): incompatible argument {what}: "
                                f"{type(value).__name__}")
        if requested_output_names is None:
            raise TypeError("InferenceRequest(): requested_output_names must be a list, not "
                            "None")
        if any(not isinstance(n, str) for n in requested_output_names):
            raise TypeError("InferenceRequest(): requested_output_names must be strings")
        self._inputs = _tensor_list(inputs, "InferenceRequest", "inputs")
        self._requested_output_names = [str(n) for n in requested_output_names]
        self._request_id, self._correlation_id = str(request_id), correlation_id
        self._flags, self._parameters = int(flags), _params_json(parameters)
        self._model_name, self._model_version = str(model_name), int(model_version)
        self._timeout, self._preferred_memory, self._trace = int(timeout), preferred_memory, trace
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._cancel_key = self._poll_cancelled = None  # a request the model builds has no client
        self._sender = None

    @classmethod
    def _from_worker(cls, inputs, requested_output_names, request_id, correlation_id, flags,
                     parameters_json, model_name, model_version, cancel_key=None, poll_cancelled=None):
        """Trusted path for the worker: no validation, no copies; parameters_json must be a JSON string.
        ``poll_cancelled(cancel_key)`` asks the worker whether this request's client has gone."""
        r = cls.__new__(cls)
        r._inputs, r._requested_output_names = inputs, requested_output_names
        r._request_id, r._correlation_id, r._flags = request_id, correlation_id, flags
        r._parameters, r._model_name, r._model_version = parameters_json or "{}", model_name, model_version
        r._timeout, r._preferred_memory, r._trace = 0, None, None
        r._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        r._cancel_key, r._poll_cancelled = cancel_key, poll_cancelled
        r._sender = None
        return r

    def inputs(self): return self._inputs
    def requested_output_names(self): return self._requested_output_names
    def request_id(self): return self._request_id
    def correlation_id(self): return self._correlation_id
    def flags(self): return self._flags
    def set_flags(self, flags): self._flags = int(flags)
    def timeout(self): return self._timeout
    def parameters(self): return self._parameters
    def model_name(self): return self._model_name
    def model_version(self): return self._model_version
    def trace(self): return self._trace

    def is_cancelled(self):
        # The worker is single-threaded and busy in execute(); asking reads its inbox (without
        # blocking) for the CancelRequest the scheduler forwards when the client goes away.
        poll = self._poll_cancelled
        return poll is not None and poll(self._cancel_key)

    def set_release_flags(self, flags): self._release_flags = int(flags)

    def _sender_closed(self):
        """Whether its response sender (if the model made one) has sent FINAL or was closed
        by a failed execution: the request is done."""
        return isinstance(self._sender, InferenceResponseSender) and self._sender._closed

    def get_response_sender(self):
        sender = self._sender
        if sender is None:
            raise TritonModelException("a request the model built has no response sender")
        if not isinstance(sender, InferenceResponseSender):
            sender = self._sender = sender()    # the worker's factory: made on first use
        return sender
    def exec(self, decoupled=False):
        """BLS: run this request on its model (workers/python_backend/bls.py). One response; with
        ``decoupled``, an iterator of the model's responses (the last may be empty)."""
        if _bls_refused_in is not None:
            raise TritonModelException("BLS is only supported during the 'execute' function.")
        if _bls is None:
            raise TritonModelException("BLS requests can only be made by a model that the "
                                       "server runs")
        answers, cancel = _bls().answers(self, bool(decoupled))
        if decoupled:
            return ResponseIterator(answers, cancel)
        responses = list(answers)
        return responses[-1] if responses else InferenceResponse(
            error=TritonError("BLS: the model sent no response"))

    async def async_exec(self, decoupled=False):
        """``await request.async_exec()``: the wait runs in a thread, so other awaits of an
        async execute() go on meanwhile. With ``decoupled``, the await ends at the model's
        first response (as in Triton), and the iterator it gives holds that response."""
        import asyncio
        loop = asyncio.get_running_loop()
        if decoupled:
            return await loop.run_in_executor(None, lambda: self.exec(decoupled=True)._first())
        return await loop.run_in_executor(None, self.exec)


# the worker's BLS client, made on first use (workers/python_backend/bls.py); None outside a worker
_bls: _typing.Callable[..., _typing.Any] | None = None
# "initialize" or "finalize" while the model runs one: Triton refuses BLS there
_bls_refused_in: str | None = None


class ResponseIterator:
    """What ``exec(decoupled=True)`` returns: the responses as they come, and ``cancel()``,
    which asks the model answering to stop (its ``is_cancelled()`` turns true)."""
    __slots__ = ("_answers", "_cancel")

    def __init__(self, answers, cancel):
        self._answers, self._cancel = answers, cancel

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._answers)

    def cancel(self):
        if self._cancel is not None:
            self._cancel()

    def _first(self) -> "ResponseIterator":
        """Waits for the first response (async_exec runs this in a thread), kept for __next__."""
        import itertools
        try:
            first = next(self._answers)
        except StopIteration:
            return self
        self._answers = itertools.chain((first,), self._answers)
        return self


class InferenceResponseSender:
    """What ``request.get_response_sender()`` returns: sends the request's responses as the
    model makes them, from execute() or from threads it started, with Triton's rules: a
    decoupled model sends any number and ends with TRITONSERVER_RESPONSE_COMPLETE_FINAL (with or
    without a last response); any other model sends one. ``emit(response, final)`` is the
    worker's: it turns the response into an answer on its way to the client."""
    __slots__ = ("_emit", "_decoupled", "_is_cancelled", "_closed", "_sent", "_answered",
                 "_lock")

    def __init__(self, emit, decoupled, is_cancelled):
        self._emit, self._decoupled, self._is_cancelled = emit, decoupled, is_cancelled
        self._closed, self._sent, self._answered = False, 0, False
        self._lock = threading.Lock()

    def send(self, response=None, flags=0):
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the "
                                       "response flags is set to zero.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"Expected an 'InferenceResponse' object, found type "
                                       f"'{type(response)}'.")
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent > 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model "
                                               "cannot send more than one response.")
                if response is None and final and self._sent == 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model "
                                               "cannot send complete final before sending a "
                                               "response.")
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been "
                                           "closed.")
            self._closed = final
            self._sent += 1
            if not self._decoupled:
                # its one answer leaves at once, as Triton sends it: an error the model raises
                # afterwards (a second send) does not replace it. The FINAL flag alone then
                # has nothing to add.
                if response is not None:
                    self._answered = True
                    self._emit(response, True)
                return
            self._emit(response, final)

    def is_cancelled(self):
        return self._is_cancelled()

    def _close(self):
        """The worker answered the request (an error): later sends are refused. True when the
        request had its answer already (its sender finished, or a non-decoupled model's one
        response has left)."""
        with self._lock:
            was, self._closed = self._closed or self._answered, True
        return was


class InferenceResponse:
    __slots__ = ("_output_tensors", "_error", "_parameters")

    def __init__(self, output_tensors=(), error=None, parameters=None):
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))  # tolerate a str or an exception where Triton wants TritonError
        self._output_tensors = _tensor_list(output_tensors, "InferenceResponse",
                                            "output_tensors")
        self._error = error
        self._parameters = _params_json(parameters)

    def output_tensors(self): return self._output_tensors
    def has_error(self): return self._error is not None
    def error(self): return self._error
    def parameters(self): return self._parameters


# (loops, not next() over a generator: a model calls these for every request)
def get_input_tensor_by_name(inference_request, name):
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response, name):
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def _config_entry(model_config, section, name):
    return next((e for e in model_config.get(section) or () if e.get("name") == name), None)


def get_input_config_by_name(model_config, name): return _config_entry(model_config, "input", name)
def get_output_config_by_name(model_config, name): return _config_entry(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config):
    return bool((model_config.get("model_transaction_policy") or {}).get("decoupled", False))


class LogLevel(enum.IntEnum):
    INFO, WARNING, ERROR, VERBOSE = range(4)


_LOG = logging.getLogger("shmserve.model")
_PY_LEVEL = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
             LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}


class Logger:
    # Triton's stub nests the levels in Logger as well (Logger.INFO, ...)
    LogLevel = LogLevel
    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, \
        LogLevel.VERBOSE

    # stacklevel points the record at the model's own file:line, as Triton's log lines do.
    @staticmethod
    def log(message, level=LogLevel.INFO, _depth=2):
        # the argument types Triton's binding takes, or its TypeError
        if not isinstance(message, str) or not isinstance(level, LogLevel):
            raise TypeError(f"log(): incompatible function arguments: expected (message: str, "
                            f"level: LogLevel), got ({type(message).__name__}, "
                            f"{type(level).__name__})")
        _LOG.log(_PY_LEVEL[level], "%s", message, stacklevel=_depth)

    log_info = staticmethod(lambda message: Logger.log(message, LogLevel.INFO, 3))
    log_warn = staticmethod(lambda message: Logger.log(message, LogLevel.WARNING, 3))
    log_error = staticmethod(lambda message: Logger.log(message, LogLevel.ERROR, 3))
    log_verbose = staticmethod(lambda message: Logger.log(message, LogLevel.VERBOSE, 3))


class ModelConfig:
    """What auto_complete_config receives and returns; mirrors Triton's checks on conflicting values."""
    _INPUT_KEYS = {"name", "data_type", "dims", "optional"}
    _OUTPUT_KEYS = {"name", "data_type", "dims"}

    def __init__(self, model_config):
        self._model_config = json.loads(model_config) if isinstance(model_config, str) else model_config

    def as_dict(self): return self._model_config
    def _model(self): return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size):
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 0:
            raise ValueError(f"model '{self._model()}': max_batch_size must be a non-negative int")
        current = int(self._model_config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:  # Triton lets auto-complete raise the configured value, never lower it
            raise ValueError(f"model '{self._model()}': configuration specified max_batch_size {current}, "
                             f"but auto_complete_config tries to set {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self):
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"model '{self._model()}': configuration uses {other}; "
                                 "auto_complete_config cannot switch it to dynamic_batching")
        self._model_config.setdefault("dynamic_batching", {})

    def _add(self, section, keys, entry):
        model = self._model()
        if not isinstance(entry, dict):
            raise ValueError(f"model '{model}': {section} must be a dict, got {type(entry).__name__}")
        for required in ("name", "data_type", "dims"):
            if required not in entry:
                raise ValueError(f"model '{model}': {section} {entry!r} is missing '{required}'")
        if set(entry) - keys:
            raise ValueError(f"model '{model}': {section} '{entry['name']}' has properties other than "
                             f"{sorted(keys)}: {sorted(set(entry) - keys)}")
        entries = self._model_config.setdefault(section, [])
        for cur in entries:
            if cur.get("name") != entry["name"]:
                continue
            cur_type = cur.get("data_type", "TYPE_INVALID")
            if cur_type not in ("TYPE_INVALID", "", entry["data_type"]):
                raise ValueError(f"model '{model}': {section} '{entry['name']}' has data_type {cur_type} in "
                                 f"the configuration but auto_complete_config specifies {entry['data_type']}")
            cur_dims = [int(d) for d in cur.get("dims") or ()]
            if cur_dims and cur_dims != [int(d) for d in entry["dims"]]:
                raise ValueError(f"model '{model}': {section} '{entry['name']}' has dims {cur_dims} in the "
                                 f"configuration but auto_complete_config specifies {list(entry['dims'])}")
            if "optional" in cur and "optional" in entry and cur["optional"] != entry["optional"]:
                raise ValueError(f"model '{model}': {section} '{entry['name']}' has optional {cur['optional']} "
                                 f"in the configuration but auto_complete_config specifies {entry['optional']}")
            cur.update(entry)
            return
        entries.append(dict(entry))

    def add_input(self, input): self._add("input", self._INPUT_KEYS, input)
    def add_output(self, output): self._add("output", self._OUTPUT_KEYS, output)

    def set_model_transaction_policy(self, transaction_policy_dict):
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model '{self._model()}': unknown model_transaction_policy keys {sorted(unknown)}")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        new = transaction_policy_dict.get("decoupled")
        # the server writes decoupled: false into every config it normalizes, so only a
        # configured true is the user's word (a model may make itself decoupled, as vLLM's does)
        if new is not None and policy.get("decoupled") and not new:
            raise ValueError(f"model '{self._model()}': auto_complete_config cannot change decoupled, "
                             f"which the configuration sets to {policy['decoupled']}")
        policy.update(transaction_policy_dict)


# the model loading API (workers/python_backend/model_control.py), made by the worker; None outside a worker
_control: _typing.Any = None


def _model_control():
    if _control is None:
        raise TritonModelException("the model loading API can only be used by a model that "
                                   "the server runs")
    return _control()


def load_model(model_name, config="", files=None):
    """Load (or reload) a model, with an optional JSON config and override files
    ({"file:<path>": bytes}); returns once it is loaded, raises TritonModelException if not
    (the server must run in explicit model control mode)."""
    _model_control().load(model_name, config, files)


def unload_model(model_name, unload_dependents=False):
    _model_control().unload(model_name, unload_dependents)


def is_model_ready(model_name, model_version=""):
    return _model_control().is_ready(model_name, model_version)
