"""The one small interface every backend implements, and the factory that picks one."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from shmserve.ipc.backend_catalog import spec_runs_python
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec


@dataclass(slots=True)
class WorkRequest:
    inputs: dict[str, np.ndarray]      # or gpu.DeviceTensor: an input already on a GPU
    datatypes: dict[str, str]           # wire datatype per input (BF16 is uint16 in numpy)
    requested_outputs: list[str]        # empty: every output
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    correlation_id: int | str = 0
    flags: int = 0
    cancel_key: tuple[int, int] | None = None   # (frontend, req_id): what a CancelRequest names
    # the worker's way out for responses sent through request.get_response_sender():
    # emit(WorkResponse | None, final); None with final: ended without a last response
    emit: Callable[[WorkResponse | None, bool], None] | None = None
    # outputs whose consumer takes device memory (an ensemble's next step): a backend may
    # return these as gpu.DeviceTensor where the model left them, instead of copying them out
    device_outputs: frozenset[str] = frozenset()


@dataclass(slots=True)
class WorkResponse:
    # name, datatype, data (a gpu.DeviceTensor only for a name in device_outputs)
    outputs: list[tuple[str, str, np.ndarray | DeviceTensor]] = field(default_factory=list)
    error: str = ""
    code: ErrorCode | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    # Optional class attributes the worker reads after load: ``device_inputs`` (it binds inputs
    # already in GPU memory) and ``emits`` (it answers through WorkRequest.emit, so the worker
    # keeps each request's stream open until its FINAL flag).
    # None for a request answered through its response sender (now or later)
    def execute(self, requests: list[WorkRequest]) -> Sequence[WorkResponse | None]: ...

    def finalize(self) -> None: ...


# report_response(cancel_key, kind, start_ns, output_start_ns, end_ns): one response of a
# stream, as Triton's backends report response statistics. kind: success, fail, empty (the
# backend chose to send nothing) or cancel; output_start_ns 0 when no output was computed.
ReportResponse = Callable[[tuple[int, int], str, int, int, int], None]


def config_param(cfg: dict, *names: str, default: str | None = None) -> str | None:
    """The ``string_value`` of the first of ``names`` the config's ``parameters`` has."""
    params = cfg.get("parameters") or {}
    for n in names:
        if n in params:
            return params[n].get("string_value", default)
    return default


def load_backend(spec: InstanceSpec,
                 poll_cancelled: Callable[[tuple[int, int]], bool] | None = None,
                 report_response: ReportResponse | None = None) -> Backend:
    """``poll_cancelled(cancel_key)`` tells whether a running request's client has gone (the
    python backend's ``request.is_cancelled()``, the square backend's stop);
    ``report_response`` takes a backend's response statistics (the square backend's)."""
    if spec_runs_python(spec.backend, spec.backend_source):   # python-based ones too
        from shmserve.workers.python_backend.backend import PythonBackend
        return PythonBackend(spec, poll_cancelled)
    if spec.backend == "onnxruntime":
        from shmserve.workers.backends.onnx import OnnxBackend
        return OnnxBackend(spec)
    if spec.backend == "repeat":
        from shmserve.workers.backends.stream import RepeatBackend
        return RepeatBackend(spec)
    if spec.backend == "square":
        from shmserve.workers.backends.stream import SquareBackend
        return SquareBackend(spec, poll_cancelled, report_response)
    if spec.backend == "identity":
        from shmserve.workers.backends.identity import IdentityBackend
        return IdentityBackend(spec)
    if spec.backend == "tensorrt":
        from shmserve.workers.backends.tensorrt import TensorRTBackend
        return TensorRTBackend(spec)
    if spec.backend_source:
        return _plug_in(spec)
    raise BackendLoadError(f"backend '{spec.backend}' is not available in this build")


def _plug_in(spec: InstanceSpec) -> Backend:
    """An installed package's backend (entry point "module:attr"): a class built from the spec."""
    module_name, _, attr = spec.backend_source.partition(":")
    where = f"backend '{spec.backend}' ({spec.backend_source})"
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            target = getattr(target, part)
    except Exception as e:
        raise BackendLoadError(f"failed to import {where}: {type(e).__name__}: {e}") from e
    if not callable(target):
        raise BackendLoadError(f"{where} is not a class")
    try:
        backend = target(spec)
    except BackendLoadError:
        raise
    except Exception as e:
        raise BackendLoadError(f"{where} failed to load model '{spec.model_name}': "
                               f"{type(e).__name__}: {e}") from e
    if not callable(getattr(backend, "execute", None)):
        raise BackendLoadError(f"{where} has no execute method")
    return backend
