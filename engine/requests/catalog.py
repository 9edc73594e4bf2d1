"""The frontend's cached view of the scheduler's model table: configs, metadata, readiness.

Rebuilt whenever the scheduler publishes a new table; requests are validated against it without
asking the scheduler.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from tritonclient.grpc.model_config_pb2 import DataType

from shmserve.ipc.dtypes import CONFIG_TO_WIRE
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_frontend import ModelTable
from shmserve.ipc.model_config import ModelConfig, config_to_json


@dataclass(slots=True)
class TensorSpec:
    name: str
    datatype: str               # wire name
    dims: list[int]
    optional: bool = False


@dataclass
class ModelView:
    name: str
    config: ModelConfig | None
    config_json: bytes
    states: dict[int, tuple[ModelState, str, StateCause]]   # version -> state, reason, cause
    max_batch_size: int = 0
    inputs: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, TensorSpec] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)
    required_inputs: list[str] = field(default_factory=list)
    platform: str = ""
    variable_inputs: frozenset = frozenset()     # inputs whose dims have -1 (and not ragged)
    has_optional: bool = False
    preserve_ordering: bool = False
    decoupled: bool = False             # any number of answers per request (streams only)
    sequence: bool = False              # a sequence batcher: requests carry a correlation id
    # ... unless it is iterative (iterative_sequence: true): each request is a sequence of its
    # own, which the model steps through by rescheduling it (workers/python_backend/backend.py)
    iterative: bool = False
    integer_corrid: str = ""            # its CORRID control's integer data type, if it has one
    # --model-control-mode=on_demand: a request for a version that is not loaded is sent all
    # the same, and the scheduler holds it while the model loads
    on_demand: bool = False
    # response_cache { enable: true }: answers may come from the frontend's response cache
    # (when the server has one; not for a sequence model, whose answers depend on its state)
    response_cache: bool = False
    raw_config: bytes = b""             # as the table carried it (unchanged: the view is reused)
    raw_versions: list = field(default_factory=list)    # the table's VersionInfos, likewise
    labels: dict[str, list[bytes]] = field(default_factory=dict)   # an ensemble's, per output
    _ready: list = field(default_factory=list, repr=False, compare=False)
    _ready_of: Any = field(default=None, repr=False, compare=False)

    @property
    def batch_sensitive(self) -> bool:
        return bool(self.variable_inputs) or self.has_optional

    def ready_versions(self) -> list[int]:
        """The READY versions, lowest first (do not change the list: it is kept). Every request
        that names no version asks; ``states`` is replaced, never changed, when a table comes."""
        states = self.states
        if self._ready_of is not states:
            self._ready = sorted(v for v, (s, _, _) in states.items() if s == ModelState.READY)
            self._ready_of = states
        return self._ready

    def unhealthy(self, version: int) -> str:
        """The version's instance that is not running now (its worker ended and restarts), or
        "" when all run."""
        return next((v.unhealthy for v in self.raw_versions
                     if v.version == version and v.unhealthy), "")

    def asks_model(self, version: int) -> bool:
        """Whether the version's model decides its own readiness (is_ready()): a readiness
        check asks it rather than reading the state alone."""
        return any(v.version == version and v.asks_model for v in self.raw_versions)

    def servable(self, state: tuple[ModelState, str, StateCause]) -> bool:
        """Whether a request for a version in ``state`` is served: READY, or (on demand) not
        loaded, loading or unloading, as long as its last load did not fail."""
        return state[0] == ModelState.READY or (
            self.on_demand and state[2] not in (StateCause.LOAD_FAILED, StateCause.CRASH_LOOP))

    def metadata(self, version: int | None) -> dict:
        lead = [-1] if self.max_batch_size > 0 else []
        versions = [version] if version is not None else (
            self.ready_versions() or (sorted(self.states) if self.on_demand else []))
        return {
            "name": self.name,
            "versions": [str(v) for v in versions],
            "platform": self.platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": lead + t.dims}
                       for t in self.inputs.values()],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": lead + t.dims}
                        for t in self.outputs.values()],
        }


def _view(info, old: ModelView | None = None) -> ModelView:
    if old is not None and old.raw_config == info.config and old.on_demand == info.on_demand \
            and old.labels == info.labels:
        # the same config (on demand, a table comes with every load and unload of any model,
        # and parsing hundreds of configs each time would cost): the same view, or a copy
        # with the new states
        if old.raw_versions == info.versions:
            return old
        view = copy.copy(old)
        view.states = {v.version: (v.state, v.reason, v.cause) for v in info.versions}
        view.raw_versions = list(info.versions)
        return view
    states = {v.version: (v.state, v.reason, v.cause) for v in info.versions}
    if not info.config:
        return ModelView(info.name, None, b"", states, on_demand=info.on_demand,
                         raw_versions=list(info.versions))
    cfg = ModelConfig()
    cfg.ParseFromString(info.config)
    view = ModelView(info.name, cfg, config_to_json(cfg).encode(), states,
                     max_batch_size=cfg.max_batch_size, platform=cfg.platform or cfg.backend,
                     on_demand=info.on_demand, raw_config=info.config,
                     raw_versions=list(info.versions), labels=info.labels)
    view.variable_inputs = frozenset(t.name for t in cfg.input
                                     if -1 in t.dims and not t.allow_ragged_batch)
    view.has_optional = any(t.optional for t in cfg.input)
    view.decoupled = cfg.model_transaction_policy.decoupled
    view.sequence = cfg.HasField("sequence_batching")
    view.iterative = view.sequence and cfg.sequence_batching.iterative_sequence
    view.response_cache = cfg.response_cache.enable and not view.sequence and not view.decoupled
    for ci in cfg.sequence_batching.control_input:
        for ctl in ci.control:
            if ctl.kind == ctl.CONTROL_SEQUENCE_CORRID and ctl.data_type != DataType.TYPE_STRING:
                view.integer_corrid = DataType.Name(ctl.data_type)
    view.preserve_ordering = cfg.HasField("dynamic_batching") and \
        cfg.dynamic_batching.preserve_ordering and not view.decoupled
    for t in cfg.input:
        spec = TensorSpec(t.name, CONFIG_TO_WIRE[DataType.Name(t.data_type)], list(t.dims),
                          t.optional)
        view.inputs[t.name] = spec
        if not t.optional:
            view.required_inputs.append(t.name)
    for t in cfg.output:
        spec = TensorSpec(t.name, CONFIG_TO_WIRE[DataType.Name(t.data_type)], list(t.dims))
        view.outputs[t.name] = spec
        view.output_names.append(t.name)
    return view


def version_number(name: str, version: str) -> int:
    """A version as a request spells it; every protocol and endpoint refuses a bad one alike."""
    if not (version.isascii() and version.isdigit()) or int(version) >= 1 << 63:
        raise InferError(ErrorCode.INVALID_ARG,
                         # Triton's words ("stol": what its parse failed in), which its clients
                         # and tests look for
                         f"failed to get model version from specified version string "
                         f"'{version}' (details: stol), version should be an integral value > 0")
    return int(version)


class ModelCatalog:
    def __init__(self):
        self.models: dict[str, ModelView] = {}
        self.startup_done = False

    def update(self, table: ModelTable) -> None:
        old = self.models
        self.models = {m.name: _view(m, old.get(m.name)) for m in table.models}
        self.startup_done = table.startup_done

    def server_ready(self, strict: bool = True) -> bool:
        if not self.startup_done:
            return False
        if not strict:
            return True
        return all(s == ModelState.READY or cause == StateCause.UNLOADED or
                   (m.on_demand and m.servable((s, _r, cause)))
                   for m in self.models.values() for s, _r, cause in m.states.values())

    def index(self, ready_only: bool) -> list[dict]:
        """Entries of the repository index: one per model version (version -1: the whole model)."""
        out = []
        for name in sorted(self.models):
            if not self.models[name].states and not ready_only:
                out.append({"name": name})          # in the repository, never loaded
            for v, (state, reason, _) in sorted(self.models[name].states.items()):
                if ready_only and state != ModelState.READY:
                    continue
                entry = {"name": name}
                if v >= 0:
                    entry["version"] = str(v)
                entry["state"] = ModelState(state).value     # tables built in tests hold str
                if reason:          # as Triton: no "reason" key where there is none
                    entry["reason"] = reason
                out.append(entry)
        return out

    def get(self, name: str) -> ModelView:
        view = self.models.get(name)
        if view is None:
            raise InferError(ErrorCode.NOT_FOUND, f"Request for unknown model: '{name}' is not found")
        return view

    def resolve(self, name: str, version: str) -> tuple[ModelView, int]:
        """The model and the version a request addresses ("" = highest READY version)."""
        view = self.get(name)
        if not version:
            ready = view.ready_versions()
            if not ready and view.on_demand:
                return view, self._on_demand(view, max(view.states))
            if not view.states:     # in the repository, never loaded: unknown, as Triton says
                raise InferError(ErrorCode.NOT_FOUND,
                                 f"Request for unknown model: '{name}' is not found")
            if not ready:
                loading = [v for v, (s, _, _) in view.states.items() if s == ModelState.LOADING]
                if loading:         # it will be there: a 503 says try again, a 404 would not
                    raise InferError(ErrorCode.UNAVAILABLE,
                                     f"Request for unknown model: '{name}' version "
                                     f"{max(loading)} is not at ready state: the model is "
                                     f"loading")
                reasons = "; ".join(r for _, r, _ in view.states.values() if r)
                raise InferError(ErrorCode.NOT_FOUND,
                                 f"Request for unknown model: '{name}' has no available versions"
                                 + (f" ({reasons})" if reasons else ""))
            return view, ready[-1]
        v = version_number(name, version)
        state = view.states.get(v)
        if state is None or v < 0:
            raise InferError(ErrorCode.NOT_FOUND,
                             f"Request for unknown model: '{name}' version {v} is not found")
        if state[0] != ModelState.READY:
            if view.on_demand:
                return view, self._on_demand(view, v)
            raise InferError(ErrorCode.UNAVAILABLE,
                             f"Request for unknown model: '{name}' version {v} is not at ready state"
                             + (": the model is loading" if state[0] == ModelState.LOADING else ""))
        return view, v

    @staticmethod
    def _on_demand(view: ModelView, version: int) -> int:
        """A version of an on-demand model that is not loaded: the scheduler loads it."""
        if view.config is None:
            raise InferError(ErrorCode.UNAVAILABLE,
                             f"model '{view.name}' is not loaded, and its inputs and outputs "
                             f"come from the model itself (auto-complete) when it loads: load "
                             f"it once first (POST /v2/repository/models/{view.name}/load), or "
                             f"list them in its config.pbtxt")
        return version
