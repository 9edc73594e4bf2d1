"""Triton's two decoupled example backends, ``repeat`` and ``square``: any number of responses
per request, sent from a thread of their own after ``execute`` has returned or while it waits.

Triton's QA repositories and decoupled tests use them (``repeat_int32``, ``square_int32``); the
config rules and the answers are theirs:

- ``repeat``: inputs IN (INT32, one dimension), DELAY (UINT32, IN's shape), WAIT (UINT32 [1]);
  outputs OUT (INT32 [1]) and IDX (UINT32 [1]); no batching. Response i carries IN[i] and i,
  DELAY[i] ms after the one before; then the FINAL flag alone. The instance is held WAIT ms.
- ``square``: input IN (INT32 [1]), output OUT (INT32 [1]). IN[0] responses, each OUT = IN[0],
  then the FINAL flag alone. ``parameters`` CUSTOM_INFER_DELAY_NS, CUSTOM_OUTPUT_DELAY_NS and
  CUSTOM_CANCEL_DELAY_NS sleep before, after each output and once cancelled;
  CUSTOM_FAIL_COUNT / CUSTOM_EMPTY_COUNT turn the last responses into failures ("simulated
  failure") and, after them, into no response at all. A cancelled request stops at once.
  Each response (sent, failed, left empty or cancelled) is reported for the model's
  response statistics (``response_stats``), timed as Triton's square backend times it.

Either may also serve a model that is not decoupled, as in Triton (its gRPC state-cleanup test
streams to such a repeat model): the request's first response is its answer and the later ones
are dropped (workers/worker.py, ``Worker.emit``).
"""
from __future__ import annotations

import json
import threading
import time
from functools import partial
from typing import Callable

import numpy as np

from shmserve.ipc.dtypes import shape_text
from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers.backends.base import InstanceSpec, ReportResponse, WorkRequest, WorkResponse, config_param

JOIN_S = 30.0       # how long finalize() waits for the threads still answering


class _Checks:
    """The config's tensors by position, and the load errors in the example backends' words."""

    def __init__(self, cfg: dict, backend: str, inputs: list[str], outputs: list[str]):
        self.ins, self.outs = cfg.get("input") or [], cfg.get("output") or []
        self.cfg, self.backend = cfg, backend
        for got, want, what in ((self.ins, inputs, "input"), (self.outs, outputs, "output")):
            if len(got) != len(want):
                n = len(want)
                raise BackendLoadError(f"expected {n} {what}{'s' if n > 1 else ''}, got "
                                       f"{len(got)}")
        ordinals = ("first", "second", "third")
        for tensors, names, what in ((self.ins, inputs, "input"), (self.outs, outputs, "output")):
            for i, (t, name) in enumerate(zip(tensors, names)):
                if t["name"] != name:
                    raise BackendLoadError(f"expected {ordinals[i]} {what} tensor name to be "
                                           f"{name}, got {t['name']}")

    @staticmethod
    def dims(t: dict) -> list[int]:
        return [int(d) for d in t.get("dims", [])]

    def shape_is_one(self, t: dict) -> None:
        if self.dims(t) != [1]:
            raise BackendLoadError(f"expected {t['name']} shape to be [1], got "
                                   f"{shape_text(self.dims(t))}")

    @staticmethod
    def datatype(t: dict, wire: str) -> None:
        if t.get("data_type") != f"TYPE_{wire}":
            raise BackendLoadError(f"expected {t['name']} datatype to be {wire}, got "
                                   f"{t.get('data_type')}")


class _Threads:
    """The answering threads of one instance; finalize() waits for them, as Triton's do."""

    def __init__(self):
        self.live: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def start(self, target: Callable[[], None]) -> None:
        def run():
            try:
                target()
            finally:
                with self.lock:
                    self.live.discard(threading.current_thread())
        t = threading.Thread(target=run, daemon=True)
        with self.lock:
            self.live.add(t)
        t.start()

    def join(self) -> None:
        deadline = time.monotonic() + JOIN_S
        with self.lock:
            live = list(self.live)
        for t in live:
            t.join(max(0.0, deadline - time.monotonic()))


class RepeatBackend:
    emits = True        # answers through WorkRequest.emit, from a thread of its own

    def __init__(self, spec: InstanceSpec):
        cfg = json.loads(spec.config_json)
        if int(cfg.get("max_batch_size") or 0) != 0:
            raise BackendLoadError("repeat backend only supports models with max_batch_size == 0")
        c = _Checks(cfg, "repeat", ["IN", "DELAY", "WAIT"], ["OUT", "IDX"])
        (i, d, w), (o, x) = c.ins, c.outs
        if len(c.dims(i)) != 1:
            raise BackendLoadError(f"expected IN shape to have one dimension, got "
                                   f"{shape_text(c.dims(i))}")
        if c.dims(i) != c.dims(d):
            raise BackendLoadError(f"expected IN and DELAY shape to match, got "
                                   f"{shape_text(c.dims(i))} and {shape_text(c.dims(d))}")
        for t in (w, o, x):
            c.shape_is_one(t)
        for t, wire in ((i, "INT32"), (d, "UINT32"), (w, "UINT32"), (o, "INT32"), (x, "UINT32")):
            c.datatype(t, wire)
        self.threads = _Threads()

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse | None]:
        out: list[WorkResponse | None] = []
        wait_ms = 0
        for r in requests:
            values, delays = r.inputs["IN"], r.inputs["DELAY"]
            if values.shape != delays.shape:
                out.append(WorkResponse(error=f"expected IN and DELAY shape to match, got "
                                              f"{shape_text(values.shape)} and "
                                              f"{shape_text(delays.shape)}",
                                        code=ErrorCode.INVALID_ARG))
                continue
            wait_ms = int(r.inputs["WAIT"].reshape(-1)[0])
            # copies: the request's memory is given back once execute() returns
            values, delays = values.reshape(-1).copy(), delays.reshape(-1).copy()
            self.threads.start(partial(self._respond, r, values, delays))
            out.append(None)
        time.sleep(wait_ms / 1000)      # the instance stays busy that long (Triton's release)
        return out

    @staticmethod
    def _respond(r: WorkRequest, values: np.ndarray, delays: np.ndarray) -> None:
        emit = r.emit
        assert emit is not None
        for i, (v, delay) in enumerate(zip(values.tolist(), delays.tolist())):
            time.sleep(delay / 1000)
            emit(WorkResponse(outputs=[("OUT", "INT32", np.array([v], np.int32)),
                                       ("IDX", "UINT32", np.array([i], np.uint32))]), False)
        emit(None, True)

    def finalize(self) -> None:
        self.threads.join()


class SquareBackend:
    emits = True

    def __init__(self, spec: InstanceSpec,
                 poll_cancelled: Callable[[tuple[int, int]], bool] | None = None,
                 report: ReportResponse | None = None):
        cfg = json.loads(spec.config_json)
        c = _Checks(cfg, "square", ["IN"], ["OUT"])
        (i,), (o,) = c.ins, c.outs
        for t in (i, o):
            c.shape_is_one(t)
        for t in (i, o):
            c.datatype(t, "INT32")
        def number(key: str) -> int:
            value = config_param(cfg, key, default="") or ""
            return int(value) if value.isdigit() else 0     # Triton ignores what is not a number
        self.infer_s = number("CUSTOM_INFER_DELAY_NS") / 1e9
        self.output_s = number("CUSTOM_OUTPUT_DELAY_NS") / 1e9
        self.cancel_s = number("CUSTOM_CANCEL_DELAY_NS") / 1e9
        self.fail, self.empty = number("CUSTOM_FAIL_COUNT"), number("CUSTOM_EMPTY_COUNT")
        self.poll = poll_cancelled
        self.report = report
        self.threads = _Threads()

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse | None]:
        out: list[WorkResponse | None] = []
        for r in requests:
            x = r.inputs["IN"]
            if x.ndim == 2 and x.shape[0] != 1:
                out.append(WorkResponse(error="unexpected shape for IN input",
                                        code=ErrorCode.INVALID_ARG))
                continue
            count, ndim = int(x.reshape(-1)[0]), x.ndim
            self.threads.start(partial(self._respond, r, count, ndim))
            out.append(None)
        return out

    def _respond(self, r: WorkRequest, count: int, ndim: int) -> None:
        emit, poll, key = r.emit, self.poll, r.cancel_key
        assert emit is not None
        clock = time.monotonic_ns

        def report(kind: str, start: int, output_start: int, end: int) -> None:
            if self.report is not None and key is not None:
                self.report(key, kind, start, output_start, end)
        for e in range(max(count, 0)):
            start = clock()
            if poll is not None and key is not None and poll(key):
                time.sleep(self.cancel_s)
                report("cancel", start, 0, clock())
                break
            time.sleep(self.infer_s)
            if e + self.empty >= count:             # the last EMPTY elements: no response
                report("empty", start, 0, clock())
                continue
            output_start = clock()
            time.sleep(self.output_s)
            end = clock()
            if e + self.fail + self.empty >= count:     # the FAIL ones before them
                emit(WorkResponse(error="simulated failure", code=ErrorCode.UNKNOWN), False)
                report("fail", start, output_start, end)
            else:
                emit(WorkResponse(outputs=[("OUT", "INT32",
                                            np.full([1] * ndim, count, np.int32))]), False)
                report("success", start, output_start, end)
        emit(None, True)

    def finalize(self) -> None:
        self.threads.join()
