"""The trace extension (docs/triton-compat.md §1.13): ``GET|POST /v2/trace/setting``,
``GET|POST /v2/models/{m}/trace/setting``, the gRPC ``TraceSetting`` RPC, and the trace file.

``TraceCore`` is the socket-free part: the global settings and each model's own, sampling (one
request in ``trace_rate`` is traced, ``trace_count`` traces at most), and the file. A traced
request carries a ``Trace``; the frontend stamps what it sees (HTTP_RECV_*, REQUEST_START,
QUEUE_START, INFER_RESPONSE_COMPLETE, REQUEST_END, HTTP_SEND_* / GRPC_*), the worker the four
COMPUTE_* times (``InferResult.compute_ns``). A finished trace is written as Triton writes it:
a JSON array of ``{"id", "model_name", "model_version"[, "request_id"]}`` and one
``{"id", "timestamps": [{"name", "ns"}]}`` per time, in ns of CLOCK_MONOTONIC. With
``log_frequency`` N > 0 every N traces go to ``<trace_file>.<k>`` (k = 0, 1, ...); with 0 they
are kept until the server stops and go to ``<trace_file>``. A failed request's trace is dropped
(its id is used up), as Triton does.

What clients see, in Triton's words where Triton has them:
- ``trace_file`` in an update: UNSUPPORTED (HTTP 501, gRPC UNIMPLEMENTED) "trace file location
  can not be updated through network protocol";
- ``Unable to parse 'trace_rate', got: abc``; ``... sample rate must be non-zero``;
  ``Unable to parse 'trace_count'. Expecting value >= -1, got:-2``;
- an unknown model: ``Request for unknown model : <m>`` (400 / INVALID_ARGUMENT).
Beyond Triton, which ignores or wraps them, these are refused (400): an unknown key, an unknown
level, a negative rate or log frequency, a mode other than ``triton`` (the only one written), a
body that is not a JSON object, and tracing turned on with no trace file given at start.
JSON ``null`` sets a global setting back to its value at start, and drops a model's own.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from shmserve.ipc import dtypes
from shmserve.ipc.errors import InferError, invalid
from shmserve.ipc.messages.common import ErrorCode, Tensor, TraceChanges, TraceConfig
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmError, ShmMapCache

log = logging.getLogger("shmserve.trace")

KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
_FIELD = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count",
          "log_frequency": "log_frequency", "trace_mode": "mode"}


def render(cfg: TraceConfig, count: int | None = None) -> dict[str, Any]:
    """The settings as ``GET .../trace/setting`` answers (values are strings, as Triton's)."""
    return {"trace_level": list(cfg.level), "trace_rate": str(cfg.rate),
            "trace_count": str(cfg.count if count is None else count),
            "log_frequency": str(cfg.log_frequency), "trace_file": cfg.file,
            "trace_mode": cfg.mode}


def _int(key: str, value: Any, least: int) -> int:
    if not isinstance(value, str):
        raise invalid(f"attempt to access JSON non-string as string (the value of '{key}' "
                      f"is a string, e.g. \"1000\")")
    try:
        n = int(value)
    except ValueError:
        raise invalid(f"Unable to parse '{key}', got: {value}") from None
    if key == "trace_rate" and n == 0:
        raise invalid("Attempting to set invalid trace setting :sample rate must be non-zero")
    if n < least:
        raise invalid(f"Unable to parse '{key}'. Expecting value >= {least}, got:{value}")
    return n


def _levels(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise invalid("attempt to access JSON non-array as array (the value of 'trace_level' "
                      "is a list, e.g. [\"TIMESTAMPS\"])")
    out = []
    for v in value:
        if not isinstance(v, str):
            raise invalid("attempt to access JSON non-string as string (each trace level is "
                          "a string)")
        if v.upper() not in LEVELS:
            raise invalid(f"invalid trace level '{v}' (the levels are {', '.join(LEVELS)})")
        if v.upper() != "OFF" and v.upper() not in out:
            out.append(v.upper())
    return out or ["OFF"]


def parse_changes(doc: Any) -> TraceChanges:
    """The checked changes an update asks for (a value of None sets a setting back)."""
    if not isinstance(doc, dict):
        raise invalid("the trace settings request must be a JSON object")
    if "trace_file" in doc:
        raise InferError(ErrorCode.UNSUPPORTED,
                         "trace file location can not be updated through network protocol")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in KEYS:
            raise invalid(f"unknown trace setting '{key}' (the settings are {', '.join(KEYS)})")
        name = _FIELD[key]
        if value is None:
            out[name] = None
        elif key == "trace_level":
            out[name] = _levels(value)
        elif key == "trace_mode":
            if value != "triton":
                raise invalid(f"trace mode '{value}' is not supported: traces are written in "
                              f"Triton's own format only (trace_mode 'triton')")
            out[name] = value
        else:
            out[name] = _int(key, value, {"trace_rate": 1, "trace_count": -1,
                                          "log_frequency": 0}[key])
    return TraceChanges(**out)


def from_grpc(settings) -> dict[str, Any]:
    """A TraceSettingRequest's ``settings`` map as the JSON an HTTP update would carry: a key
    with no values is null (tritonclient sends None that way)."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        values = list(value.value)
        if not values:
            out[key] = None
        elif key == "trace_level":
            out[key] = values
        else:
            out[key] = values[0]
    return out


def _values(datatype: str, raw) -> str:
    """A tensor's elements as Triton's TENSORS level writes them: comma-separated."""
    if raw is None:
        return ""       # on a GPU (CUDA shared memory): not read back for a trace
    if datatype == "BYTES":
        items = dtypes.deserialize_bytes(raw).ravel().tolist()
        return ",".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                        for v in items)
    arr = np.frombuffer(raw, dtypes.WIRE_TO_NUMPY[datatype]).ravel().tolist()
    if datatype == "BOOL":
        return ",".join("1" if v else "0" for v in arr)
    if datatype.startswith(("FP", "BF")):
        return ",".join(format(v, "g") for v in arr)
    return ",".join(map(str, arr))


@dataclass
class Trace:
    """One traced request: its id in the file, and the times (TIMESTAMPS) and tensors
    (TENSORS) recorded on its way."""
    id: int
    model: str
    version: int
    request_id: str = ""
    stamps: list[tuple[str, int]] = field(default_factory=list)
    created_ns: int = field(default_factory=time.monotonic_ns)     # when it was sampled
    timestamps: bool = True
    tensors: list[dict] | None = None       # TENSORS level: the tensor records so far

    def tensor(self, activity: str, t: Tensor, maps: ShmMapCache) -> None:
        """Record an input (TENSOR_QUEUE_INPUT) or output (TENSOR_BACKEND_OUTPUT)."""
        if self.tensors is None:
            return
        try:
            data = _values(t.datatype, t.data if t.shm is None else maps.view(t.shm))
        except (ShmError, ValueError) as e:     # a trace must not fail its request
            data = ""
            log.warning("trace %d: could not read tensor '%s': %s", self.id, t.name, e)
        self.tensors.append({"id": self.id, "activity": activity, "tensor": {
            "name": t.name, "data": data,
            "shape": ",".join(map(str, t.shape)), "dtype": t.datatype}})

    # ---- the steps both protocols stamp, in order ----
    def started(self, read: str, first_ns: int) -> None:
        """The request was read (``read``: HTTP_RECV or GRPC_WAITREAD, from ``first_ns`` to the
        sampling) and its parse begins."""
        self.stamps += [(f"{read}_START", first_ns), (f"{read}_END", self.created_ns)]
        self.stamp("REQUEST_START")

    def queued(self, prepared, maps: ShmMapCache) -> None:
        """``prepared`` (a PreparedRequest) is about to be submitted: it carries the trace."""
        self.request_id = prepared.request_id
        self.stamp("QUEUE_START")
        for t in prepared.payload.inputs:
            self.tensor("TENSOR_QUEUE_INPUT", t, maps)
        prepared.trace = self

    def answered(self, result: InferResult, maps: ShmMapCache) -> None:
        """Its answer came (before its outputs are given back to the worker)."""
        self.stamp("INFER_RESPONSE_COMPLETE")
        self.compute(result.compute_ns)
        self.stamp("REQUEST_END")
        if not result.error:
            for t in result.outputs:
                self.tensor("TENSOR_BACKEND_OUTPUT", t, maps)

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))

    def compute(self, times: list[int]) -> None:
        """The worker's [start, inputs read, outputs start, end] of the execution."""
        if len(times) == 4:
            for name, ns in zip(("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
                                 "COMPUTE_END"), times):
                self.stamps.append((name, ns))

    def records(self) -> list[dict]:
        """Its records for the file (a TENSORS-only trace has only its tensors, as Triton's)."""
        out: list[dict] = []
        if self.timestamps:
            head: dict[str, Any] = {"id": self.id, "model_name": self.model,
                                    "model_version": self.version}
            if self.request_id:
                head["request_id"] = self.request_id
            out = [head] + [{"id": self.id, "timestamps": [{"name": n, "ns": ns}]}
                            for n, ns in self.stamps]
        return out + (self.tensors or [])


class _Owner:
    """What sampling counts against: the global settings, or a model's own."""
    __slots__ = ("seen", "left")

    def __init__(self, count: int):
        self.seen = 0
        self.left = count           # -1: no limit


def write_json(path: str, records: list[dict]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(records, f)
    os.replace(tmp, path)


class TraceCore:
    """Trace settings, sampling and the file; no sockets. ``write(path, records)`` is injected
    so tests can see what would be written."""

    def __init__(self, start: TraceConfig, suffix: str = "",
                 write: Callable[[str, list[dict]], None] = write_json):
        self.start = start
        self.glob = start
        self.overrides: dict[str, dict[str, Any]] = {}     # model -> its own fields
        self.owners: dict[str, _Owner] = {}                 # model -> counters of its own
        self.glob_owner = _Owner(start.count)
        self.suffix = suffix        # ".frontend<k>" when several frontends write traces
        self.write = write
        self.next_id = 1
        self.pending: list[dict] = []
        self.in_pending = 0
        self.file_index = 0
        self.active = False
        self._refresh()

    # ---- settings --------------------------------------------------------------------------------
    def settings(self, model: str = "") -> dict[str, Any]:
        cfg = self.effective(model)
        owner = self.owners.get(model) if model else None
        return render(cfg, (owner or self.glob_owner).left)

    def effective(self, model: str = "") -> TraceConfig:
        own = self.overrides.get(model) if model else None
        return msgspec.structs.replace(self.glob, **own) if own else self.glob

    def update(self, changes: TraceChanges, model: str = "") -> None:
        """Apply checked changes (``parse_changes``) to the global settings or a model's."""
        given = changes.given()
        if model:
            own = dict(self.overrides.get(model, {}))
            for name, value in given.items():
                if value is None:
                    own.pop(name, None)
                else:
                    own[name] = value
            cfg = msgspec.structs.replace(self.glob, **own)
            self._check_file(cfg)
            if own:
                self.overrides[model] = own
                if model not in self.owners or "count" in given:
                    self.owners[model] = _Owner(cfg.count)
            else:
                self.overrides.pop(model, None)
                self.owners.pop(model, None)
        else:
            fields = {name: getattr(self.start, name) if value is None else value
                      for name, value in given.items()}
            cfg = msgspec.structs.replace(self.glob, **fields)
            self._check_file(cfg)
            if self.glob.log_frequency and cfg.log_frequency != self.glob.log_frequency:
                self.flush()        # the traces counted so far, to the file they were for
            self.glob = cfg
            if "count" in fields:
                self.glob_owner = _Owner(cfg.count)
        self._refresh()

    def _check_file(self, cfg: TraceConfig) -> None:
        if cfg.level != ["OFF"] and not self.glob.file:
            # Triton's text (clients match it), then how to give the file
            raise invalid("Attempting to set invalid trace setting :trace file name is not "
                          "given (start the server with --trace-config triton,file=<path>; "
                          "the file cannot be set over the network)")

    def _refresh(self) -> None:
        self.active = self.glob.level != ["OFF"] or any(
            self.effective(m).level != ["OFF"] for m in self.overrides)

    # ---- sampling and writing --------------------------------------------------------------------
    def sample(self, model: str, version: int, request_id: str = "") -> Trace | None:
        """The trace of this request if it is one to trace (call only while ``active``)."""
        cfg = self.effective(model)
        if cfg.level == ["OFF"]:
            return None
        owner = self.owners[model] if model in self.overrides else self.glob_owner
        owner.seen += 1
        if owner.seen % cfg.rate or owner.left == 0:
            return None
        if owner.left > 0:
            owner.left -= 1
        trace = Trace(self.next_id, model, version, request_id,
                      timestamps="TIMESTAMPS" in cfg.level,
                      tensors=[] if "TENSORS" in cfg.level else None)
        self.next_id += 1
        return trace

    def finish(self, trace: Trace) -> None:
        """A traced request answered without error: its records join the file."""
        self.pending.extend(trace.records())
        self.in_pending += 1
        every = self.effective(trace.model).log_frequency
        if every and self.in_pending >= every:
            self.flush()

    def flush(self) -> None:
        """Write what is pending: to ``<file>.<k>`` under a log frequency, else ``<file>``."""
        if not self.pending or not self.glob.file:
            return
        if self.glob.log_frequency:
            path = f"{self.glob.file}{self.suffix}.{self.file_index}"
            self.file_index += 1
        else:
            path = self.glob.file + self.suffix
        records, self.pending, self.in_pending = self.pending, [], 0
        try:
            self.write(path, records)
        except OSError as e:    # a request must not fail for it: say so, and go on
            log.error("could not write %d trace records to %s: %s", len(records), path, e)


class TraceControl:
    """This frontend's side of the extension: its TraceCore, and the way to the others (a
    change made here travels through the scheduler to every other frontend)."""

    def __init__(self, core: TraceCore, client, known: Callable[[str], bool]):
        self.core = core
        self.client = client            # EngineClient
        self.known = known              # whether a model name is in the repository

    def _check_model(self, model: str) -> None:
        if model and not self.known(model):
            raise invalid(f"Request for unknown model : {model}")

    def get(self, model: str = "") -> dict[str, Any]:
        self._check_model(model)
        return self.core.settings(model)

    async def update(self, doc: Any, model: str = "") -> dict[str, Any]:
        """Apply the settings ``doc`` (as ``parse_changes`` takes it) here and in every other
        frontend; the settings now. An unknown model is the error before any in ``doc``."""
        self._check_model(model)
        changes = parse_changes(doc)
        self.core.update(changes, model)
        try:
            await self.client.trace_settings(changes, model)
        except TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE, "the scheduler did not confirm the new trace "
                             "settings in time; they apply in this frontend, and in the others "
                             "once they read them") from None
        return self.core.settings(model)

    def apply(self, changes: TraceChanges, model: str) -> None:
        """Another frontend's client changed them (checked there already)."""
        self.core.update(changes, model)
