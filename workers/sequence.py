"""What a sequence model's request gets besides the client's inputs (Triton's sequence batcher,
docs/triton-compat.md §5.3): the control tensors of ``sequence_batching.control_input`` and
the implicit state of ``sequence_batching.state``.

The scheduler sends a sequence's requests to one instance, in order, at most one per sequence
in a batch, each of batch size 1, and never pins more than ``capacity`` live sequences to an
instance; every request a model gets is real (no padding requests, so READY is always true).
A worker therefore needs nothing from the scheduler but each request's correlation id and
START/END flags:

- control tensors: START (flags & 1), END (flags & 2), READY (true) and CORRID (the id), shaped
  [1, 1] per request, [1] when max_batch_size is 0, as Triton shapes them, so they batch like
  any other input (onnxruntime concatenates them; a python model reads them by name);
- implicit state: each request gets its sequence's state as input ``input_name`` (the initial
  state on START), and the model's ``output_name`` output becomes the state of the sequence's
  next request. It reaches the client only if the client asked for it, which, as with Triton,
  needs it in the config's ``output`` list. END drops the state. At most ``capacity`` states
  are kept: past that, the least recently used goes. The scheduler never pins more than that
  many live sequences to an instance, so the one evicted has ended (by its idle timeout: an END
  drops its state at once); this bounds memory without a message from the scheduler.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from shmserve.ipc import dtypes, model_files
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers.backends.base import WorkRequest, WorkResponse
from shmserve.workers.tensors import OutputChecks

log = logging.getLogger("shmserve.worker")

SEQUENCE_START, SEQUENCE_END = 1, 2         # TRITONSERVER_REQUEST_FLAG_SEQUENCE_*
INITIAL_STATE_DIR = "initial_state"         # in the model directory, next to the versions

START, READY, END, CORRID = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY",
                             "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID")
_KINDS = (START, READY, END, CORRID)        # the enum's values are the indexes
_BOOLEANS = (("int32_false_true", "INT32"), ("fp32_false_true", "FP32"),
             ("bool_false_true", "BOOL"))
_CORRID_TYPES = {"TYPE_UINT64": "UINT64", "TYPE_INT64": "INT64", "TYPE_UINT32": "UINT32",
                 "TYPE_INT32": "INT32", "TYPE_STRING": "BYTES"}


class SequenceConfigError(ValueError):
    """sequence_batching asks for something that cannot be given: the model fails to load."""


class SequenceRequestError(ValueError):
    """A request that cannot get its sequence inputs (a string id for an integer CORRID)."""


@dataclass(frozen=True, slots=True)
class _Flag:
    """A START, END or READY control: its two values, made once (read-only, shared)."""
    name: str
    kind: str
    datatype: str
    false: np.ndarray
    true: np.ndarray


@dataclass(frozen=True, slots=True)
class _State:
    input_name: str
    output_name: str
    datatype: str
    dims: list[int]             # the config's, without the batch dimension
    initial: np.ndarray         # with the batch dimension; read-only, shared by every START


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _filled(datatype: str, shape: list[int], value=0) -> np.ndarray:
    if datatype == "BYTES":
        arr = np.empty(shape, dtype=object)
        arr.fill(b"")
        return arr
    return np.full(shape, value, dtype=dtypes.WIRE_TO_NUMPY[datatype])


def _kind(control: dict) -> str:
    kind = control.get("kind", START)           # the enum's default, which JSON may leave out
    if isinstance(kind, int):
        return _KINDS[kind] if 0 <= kind < len(_KINDS) else str(kind)
    return kind


def declared(config: dict) -> tuple[dict[str, str], dict[str, str]]:
    """The tensors sequence_batching adds to the model's own: inputs (controls, states) and
    outputs (states), name -> wire datatype ("" where the config does not say). For a backend's
    load-time check that its model takes and produces them."""
    seq = config.get("sequence_batching") or {}
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for ci in seq.get("control_input", []):
        for c in ci.get("control", []):
            if _kind(c) == CORRID:
                inputs[ci.get("name", "")] = _CORRID_TYPES.get(c.get("data_type", ""), "")
            else:
                inputs[ci.get("name", "")] = next(
                    (wire for key, wire in _BOOLEANS if c.get(key)), "")
    for st in seq.get("state", []):
        wire = dtypes.CONFIG_TO_WIRE.get(st.get("data_type", ""), "")
        inputs.setdefault(st.get("input_name", ""), wire)
        outputs.setdefault(st.get("output_name", ""), wire)
    return inputs, outputs


def from_config(config: dict, model_dir: str) -> Sequences | None:
    """None for a model without sequence_batching. Raises SequenceConfigError."""
    seq = config.get("sequence_batching")
    if seq is None:
        return None
    model = config.get("name", "")
    mbs = int(config.get("max_batch_size", 0))
    # Triton's slots per instance: max_batch_size (at least 1), or the oldest strategy's
    # candidate sequences
    capacity = max(mbs, 1)
    oldest = seq.get("oldest")
    if oldest is not None and int(oldest.get("max_candidate_sequences", 0)) > 0:
        capacity = int(oldest["max_candidate_sequences"])
    lead = [1] if mbs > 0 else []
    flags: list[_Flag] = []
    corrid: tuple[str, str] | None = None
    names: set[str] = set()
    kinds: set[str] = set()
    for ci in seq.get("control_input", []):
        name = ci.get("name", "")
        if not name:
            raise SequenceConfigError(f"sequence batching control tensor must have a name for {model}")
        if name in names:
            raise SequenceConfigError(f"sequence batching control tensor '{name}' is specified for "
                                      f"multiple control kinds for {model}")
        names.add(name)
        controls = ci.get("control", [])
        if len(controls) != 1:
            raise SequenceConfigError(f"sequence batching control tensor '{name}' must have exactly "
                                      f"one control for {model}, it has {len(controls)}")
        c = controls[0]
        kind = _kind(c)
        if kind not in _KINDS:
            raise SequenceConfigError(f"sequence batching control tensor '{name}' has an unknown "
                                      f"kind {kind} for {model}")
        if kind in kinds:
            raise SequenceConfigError(f"sequence batching specifies multiple {kind} tensors for "
                                      f"{model}")
        kinds.add(kind)
        if kind == CORRID:
            wire = _CORRID_TYPES.get(c.get("data_type", ""))
            if wire is None:
                raise SequenceConfigError(f"unexpected control data type, expected TYPE_UINT64, "
                                          f"TYPE_INT64, TYPE_UINT32, TYPE_INT32, or TYPE_STRING "
                                          f"for {CORRID} for {model}")
            corrid = (name, wire)
            continue
        given = [(key, wire) for key, wire in _BOOLEANS if c.get(key)]
        if len(given) != 1:
            raise SequenceConfigError(
                f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                f"'bool_false_true' for {kind} for {model}" if not given else
                f"sequence batching specifies more than one from 'int32_false_true', "
                f"'fp32_false_true' and 'bool_false_true' for {kind} for {model}")
        key, wire = given[0]
        values = c[key]
        if len(values) != 2:
            raise SequenceConfigError(f"sequence batching control '{key}' must have exactly 2 "
                                      f"entries for {kind} for {model}")
        shape = lead + [1]
        flags.append(_Flag(name, kind, wire, _readonly(_filled(wire, shape, values[0])),
                           _readonly(_filled(wire, shape, values[1]))))
    states: list[_State] = []
    state_names: set[str] = set()
    for st in seq.get("state", []):
        inp, out = st.get("input_name", ""), st.get("output_name", "")
        if not inp or not out:
            raise SequenceConfigError(f"a state of model '{model}' needs both an input_name and "
                                      f"an output_name")
        if inp in state_names or out in state_names:
            # Triton warns and ignores the later entry
            log.warning("model '%s': state '%s' -> '%s' repeats a name of an earlier state and is "
                        "ignored", model, inp, out)
            continue
        state_names.update((inp, out))
        wire = dtypes.CONFIG_TO_WIRE.get(st.get("data_type", ""))
        if wire is None:
            raise SequenceConfigError(f"state input '{inp}' of model '{model}' has an invalid "
                                      f"data_type '{st.get('data_type', '')}'")
        dims = [int(d) for d in st.get("dims", [])]
        inits = st.get("initial_state", [])
        if len(inits) > 1:
            raise SequenceConfigError(f"initial_state field for state input '{inp}' must contain "
                                      f"exactly one or zero element. Found '{len(inits)}' elements.")
        if inits:
            initial = _initial_state(inits[0], st, wire, dims, lead, model_dir)
        else:
            # Triton leaves it uninitialized; zeros (empty strings), variable dims as 1
            initial = _filled(wire, lead + [1 if d == -1 else d for d in dims])
        states.append(_State(inp, out, wire, dims, _readonly(initial)))
    outputs = {o.get("name", "") for o in config.get("output", [])}
    return Sequences(model, mbs, capacity, flags, corrid, states, outputs)


def _initial_state(init: dict, st: dict, wire: str, dims: list[int], lead: list[int],
                   model_dir: str) -> np.ndarray:
    """Triton's checks and reading (sequence_batch_scheduler.cc GenerateInitialStateData)."""
    inp = st["input_name"]
    if init.get("data_type") != st.get("data_type"):
        raise SequenceConfigError(f"The data type used for 'initial_state' field of state '{inp}' "
                                  f"does not match the state data type.")
    if not init.get("name"):
        raise SequenceConfigError(f"Field 'name' must be set when using initial_state for state "
                                  f"input '{inp}'.")
    idims = [int(d) for d in init.get("dims", [])]
    if len(idims) != len(dims):
        raise SequenceConfigError(f"Number of dimensions in 'initial_state' doesn't match the size "
                                  f"of 'state' dimensions for state input '{inp}'. "
                                  f"{len(idims)} != {len(dims)}")
    for i, s in zip(idims, dims):
        if i == -1:
            raise SequenceConfigError(f"'initial_state' field for state input name '{inp}' "
                                      f"contains variable dimensions.")
        if s != -1 and i != s:
            raise SequenceConfigError(f"'initial_state' dim for input name '{inp}' doesn't match "
                                      f"'state' dim description. {i} != {s}")
    # Triton shapes the first request's state by the state's dims (variable ones as 1) even where
    # the initial state's differ; the data fills the initial state's dims, so those are used
    shape = lead + idims
    if "zero_data" in init:
        return _filled(wire, shape)
    data_file = init.get("data_file", "")
    if not data_file:
        raise SequenceConfigError(f"initial_state setting expects state '{inp}' to have state_data set")
    if data_file in (".", "..") or "/" in data_file or "\\" in data_file or "\0" in data_file:
        raise SequenceConfigError(f"initial_state data_file '{data_file}' of state input '{inp}' "
                                  f"must be a file name inside {INITIAL_STATE_DIR}/, not a path")
    path = os.path.join(model_dir, INITIAL_STATE_DIR, data_file)
    count = dtypes.element_count(shape)
    try:
        # only what the state takes is read; a string state's file is read whole, bounded
        raw = model_files.read_bytes(path, model_files.DATA_MAX_BYTES) if wire == "BYTES" \
            else model_files.read_prefix(path, count * dtypes.ELEMENT_SIZE[wire])
    except OSError as e:
        raise SequenceConfigError(f"initial_state of state input '{inp}': cannot read {path}: "
                                  f"{e.strerror or e}") from None
    if wire == "BYTES":         # the file holds the serialized strings (Triton's BYTES layout)
        try:
            return dtypes.deserialize_bytes(raw, count).reshape(shape)
        except ValueError as e:
            raise SequenceConfigError(f"initial_state of state input '{inp}': {path}: {e}") from None
    need = count * dtypes.ELEMENT_SIZE[wire]
    if len(raw) < need:
        raise SequenceConfigError(f"initial_state setting expects {need} bytes, but the data provided "
                                  f"from {data_file} only has {len(raw)} bytes.")
    return np.frombuffer(raw, dtype=dtypes.WIRE_TO_NUMPY[wire], count=count).reshape(shape)


class Sequences:
    """One worker's sequence inputs and states. ``prepare`` each request before the execution,
    ``finish`` the batch after it."""

    def __init__(self, model: str, max_batch_size: int, capacity: int, flags: list[_Flag],
                 corrid: tuple[str, str] | None, states: list[_State], outputs: set[str]):
        self.model = model
        self.capacity = capacity
        self.flags = flags
        self.corrid = corrid
        self.states = states
        self.corrid_shape = [1, 1] if max_batch_size > 0 else [1]
        self.initial = {s.input_name: s.initial for s in states}
        # the client's outputs when it names none: the config's (states not among them)
        self.config_outputs = outputs
        self.checks = OutputChecks({"name": model, "max_batch_size": max_batch_size, "output": [
            {"name": s.output_name, "data_type": dtypes.WIRE_TO_CONFIG[s.datatype],
             "dims": s.dims} for s in states]})
        self.batched = max_batch_size > 0
        # correlation id -> {state input name: the array the next request gets}, oldest use first
        self.held: OrderedDict[int | str, dict[str, np.ndarray]] = OrderedDict()
        self.hidden: dict[int | str, list[str]] = {}   # this batch's: state outputs to drop

    def prepare(self, correlation_id: int | str, flags: int, inputs: dict[str, np.ndarray],
                datatypes: dict[str, str], requested: list[str]) -> list[str]:
        """Add the control and state inputs to a request's ``inputs`` and ``datatypes``, and
        say which outputs the backend must produce (``requested`` and the state outputs).
        Raises SequenceRequestError, having changed nothing."""
        if self.corrid is not None:
            name, wire = self.corrid
            inputs[name] = self._corrid(correlation_id, name, wire)
            datatypes[name] = wire
        for f in self.flags:
            on = (f.kind == READY or (f.kind == START and flags & SEQUENCE_START) or
                  (f.kind == END and flags & SEQUENCE_END))
            inputs[f.name] = f.true if on else f.false
            datatypes[f.name] = f.datatype
        if not self.states:
            return requested
        held = None if flags & SEQUENCE_START else self.held.get(correlation_id)
        if held is None:        # a START; or a sequence this worker has not seen (Triton's
            held = self.held[correlation_id] = dict(self.initial)    # empty slot): initial
        self.held.move_to_end(correlation_id)
        for s in self.states:
            inputs[s.input_name] = held[s.input_name]
            datatypes[s.input_name] = s.datatype
        # an empty list asks for every output: the backend then returns the states too
        asked = requested or self.config_outputs
        hidden = [s.output_name for s in self.states if s.output_name not in asked]
        if hidden:
            self.hidden[correlation_id] = hidden
            if requested:
                return requested + hidden
        return requested

    def _corrid(self, cid: int | str, name: str, wire: str) -> np.ndarray:
        if wire == "BYTES":
            arr = np.empty(self.corrid_shape, dtype=object)
            arr.fill(cid.encode("utf-8") if isinstance(cid, str) else str(cid).encode("ascii"))
            return arr
        if isinstance(cid, str):
            raise SequenceRequestError(
                f"sequence '{cid}': model '{self.model}' takes the correlation id as "
                f"{dtypes.WIRE_TO_CONFIG[wire]} in control input '{name}', so the sequence_id must "
                f"be an unsigned integer, not a string")
        # Triton copies the id's low bytes (64-bit little-endian): a 32-bit type truncates, a
        # signed one reads the same bits
        target = dtypes.WIRE_TO_NUMPY[wire]
        bits = np.array(cid & ((1 << (8 * target.itemsize)) - 1), dtype=f"<u{target.itemsize}")
        return np.full(self.corrid_shape, bits.view(target), dtype=target)

    def finish(self, work: list[WorkRequest], responses: Sequence[WorkResponse | None] | None) -> None:
        """After an execution (``responses`` None: it failed as a whole): keep each sequence's
        new state, take the state outputs its client did not ask for out of its response, drop
        the state of sequences that ended, then evict down to ``capacity``."""
        for i, r in enumerate(work):
            cid = r.correlation_id
            hidden = self.hidden.pop(cid, ())
            resp = responses[i] if responses is not None else None
            if resp is not None and not resp.error and self.states:
                problem = "" if r.flags & SEQUENCE_END else self._keep(cid, resp)
                if problem:
                    resp.outputs, resp.error, resp.code = [], problem, ErrorCode.INTERNAL
                elif hidden:
                    resp.outputs = [o for o in resp.outputs if o[0] not in hidden]
            if r.flags & SEQUENCE_END:
                self.held.pop(cid, None)
        self.hidden.clear()
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def _keep(self, cid: int | str, resp: WorkResponse) -> str:
        """The state outputs of a response become its sequence's state; or why they cannot
        (then the state stays as it was)."""
        produced = {name: (datatype, arr) for name, datatype, arr in resp.outputs}
        new = {}
        for s in self.states:
            got = produced.get(s.output_name)
            if got is None:
                return f"model '{self.model}' did not produce state output '{s.output_name}'"
            datatype, arr = self.checks.fit(s.output_name, got[0], np.asarray(got[1]))
            problem = self.checks.problem(s.output_name, datatype, arr.shape)
            if not problem and self.batched and arr.shape[0] != 1:
                problem = (f"state output '{s.output_name}' of model '{self.model}' has batch "
                           f"size {arr.shape[0]}, expecting 1 (shape {list(arr.shape)})")
            if problem:
                return problem
            # A copy: the output may be a slice of the whole batch's array (onnxruntime), which
            # would pin it, or an array a python model goes on writing. One state's bytes per
            # request; read-only, since the next request hands it to the model as an input.
            new[s.input_name] = _readonly(np.array(arr, copy=True, order="C"))
        held = self.held.get(cid)
        if held is not None:
            held.update(new)
        return ""
