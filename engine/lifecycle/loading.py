"""Model lifecycle: loading, reloading and unloading models while traffic flows.

A load builds new ModelVersions next to the ones serving. Only when every new version is READY
does traffic switch to them; the replaced versions then drain (their queued and running requests
finish) and their workers stop. A load that fails releases what it started and leaves the old
versions serving.

``ModelLifecycle`` owns the serving map, the loads in progress, the draining and retired
versions and the poll-mode fingerprints. It starts and stops instances through the supervisor
and tells the core what happened through three callbacks (publish the table, answer a control
request, dispatch a version that turned READY). No sockets, no processes, no wall clock.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Protocol

from shmserve.engine.batching.rate_limiter import RateLimiter, RateLimitError
from shmserve.engine.ensemble import plan as ensemble_plan
from shmserve.engine.lifecycle.repository import ModelEntry, ModelRepository
from shmserve.engine.lifecycle.startup_report import SlowLoads, status_table
from shmserve.engine.lifecycle.uploads import UploadDirs
from shmserve.engine.models import Instance, ModelVersion
from shmserve.engine.processes.instances import InstanceSupervisor, SpawnFailed
from shmserve.engine.states import InstanceState, ModelState
from shmserve.ipc import model_config, model_files
from shmserve.ipc.messages.common import ChainHop, ControlAction, ErrorCode, StateCause
from shmserve.ipc.messages.to_frontend import ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.messages.to_scheduler import ControlRequest
from shmserve.ipc.model_config import ConfigError
from shmserve.ipc.spawn_args import ServerSettings

log = logging.getLogger("shmserve.scheduler")

LOAD_UNLOAD_REFUSED = "explicit model load / unload is not allowed if polling is enabled"

Waiter = tuple[int, int]        # (frontend, query id) of a control request to answer


class OnDemandHooks(Protocol):
    """What the lifecycle asks of on-demand loading (engine/lifecycle/on_demand.py)."""

    def need(self, name: str) -> None:
        """An ensemble that is loading needs ``name``: load it when there is room."""

    def pending(self, name: str) -> bool:
        """Whether a load of ``name`` waits for room (an ensemble waits for it)."""

    def load_ended(self, name: str, error: str) -> None:
        """A load ended (``error`` says why it failed); the table is already published."""


@dataclass
class Load:
    name: str
    entry: ModelEntry
    versions: list[ModelVersion]
    waiters: list[Waiter] = field(default_factory=list)
    upload: str = ""            # the uploaded model directory it loads from, if any


class ModelLifecycle:
    def __init__(self, settings: ServerSettings, repository: ModelRepository,
                 supervisor: InstanceSupervisor, clock: Callable[[], int],
                 publish: Callable[[], None],
                 reply: Callable[[Waiter | None, ErrorCode | None, str], None],
                 dispatch: Callable[[ModelVersion], None]):
        self.settings = settings
        self.repository = repository
        self.supervisor = supervisor
        self.clock = clock
        self.publish = publish
        self.reply = reply
        self.dispatch = dispatch
        self.entries: dict[str, ModelEntry] = {}
        self.versions: dict[tuple[str, int], ModelVersion] = {}    # the serving map
        self.loads: dict[str, Load] = {}            # model name -> its load in progress
        self.draining: list[ModelVersion] = []      # replaced or unloaded, finishing their work
        self.retired: dict[tuple[str, int], str] = {}   # unloaded versions and why
        self.fingerprints: dict[str, tuple] = {}    # model name -> files when last loaded
        self.batching: list[ModelVersion] = []      # serving versions whose queue has deadlines
        self.uploads = UploadDirs(settings.model_upload_dir)
        self.startup_done = False
        self.slow_loads = SlowLoads()
        self.rate_limiter: RateLimiter | None = None     # set by the core (--rate-limit)
        self.starting = True                        # load_initial is starting the first loads
        self.exit_requested = False                 # --exit-on-error and a model failed
        # --model-control-mode=on_demand: engine/lifecycle/on_demand.py, which admits every load
        self.on_demand: OnDemandHooks | None = None
        self._serialized: dict[str, tuple[object, bytes]] = {}     # model_table's configs

    # ---- start-up -------------------------------------------------------------------------------
    def load_initial(self) -> None:
        for hint in self.repository.misplaced_files():
            log.warning("%s", hint)
        found = self.repository.model_dirs()
        if self.settings.model_control_mode == "explicit":
            wanted = self.settings.load_models
            names = list(found) if wanted == ["*"] else wanted
        elif self.on_demand is not None:
            names = []      # each loads at its first request; its config is read now
        else:
            names = list(found)
        for name in found:
            self.entries.setdefault(name, self.repository.read_model(name, found[name])
                                    if self.on_demand is not None else
                                    ModelEntry(name=name, path=found[name][0]))
        for name in names:
            if name not in found:
                self.entries[name] = ModelEntry(name=name, path="", error=(
                    f"failed to load '{name}', no such model in the model repository"))
                continue
            try:
                self.start_load(name)
            except Exception as e:      # one bad model never stops the start of the others
                log.exception("error loading model '%s'", name)
                load = self.loads.pop(name, None)
                for ver in load.versions if load is not None else ():
                    self.supervisor.stop(ver, kill=True)
                self.entries[name] = ModelEntry(name=name, path=found[name][0], error=(
                    failed_to_load(name, f"{type(e).__name__}: {e}")))
        self.starting = False
        self.check_ensembles()
        self.check_startup()
        self.publish()

    def check_startup(self) -> None:
        if self.startup_done or self.loads:
            return
        self.startup_done = True
        failed = [n for n, e in self.entries.items() if e.error] + \
                 [f"{v.name}:{v.version}" for v in self.versions.values()
                  if v.state == ModelState.UNAVAILABLE]
        if failed and self.settings.exit_on_error:
            log.error("failed to load %s; exiting because --exit-on-error is true",
                      ", ".join(failed))
            self.exit_requested = True
        else:
            log.info("startup finished: %d model version(s) ready",
                     sum(v.state == ModelState.READY for v in self.versions.values()))
        if self.entries:        # a line a record: the log escapes newlines inside one
            log.info("model status:")
            for line in status_table(self.model_table().models).splitlines():
                log.info("%s", line)

    def slow_loads_due(self) -> float:
        """A line for each load that is taking long; seconds until one may be due."""
        now = self.clock() / 1e9
        started = {name: min((v.load_started for v in load.versions), default=now)
                   for name, load in self.loads.items()}
        wait, lines = self.slow_loads.due(started, now)
        for line in lines:
            log.info("%s", line)
        return wait

    # ---- control requests ---------------------------------------------------------------------
    def control(self, req: ControlRequest) -> None:
        waiter = (req.frontend, req.query_id)
        if req.upload_dir and not self.uploads.adopt(req.upload_dir):
            return self.reply(waiter, ErrorCode.INVALID_ARG, failed_to_load(
                req.name, "the uploaded model directory is not one of this server's"))
        try:
            if self.settings.model_control_mode not in ("explicit", "on_demand"):
                # Triton's words first (clients match them), then what is really the case
                return self.reply(waiter, ErrorCode.UNAVAILABLE, (
                    f"{LOAD_UNLOAD_REFUSED}: the model control mode is "
                    f"'{self.settings.model_control_mode}'; loading and unloading models "
                    f"needs --model-control-mode=explicit"))
            if req.action == ControlAction.LOAD:
                self.start_load(req.name, req.config, waiter, req.upload_dir)
            else:
                self.unload(req.name, waiter, req.unload_dependents)
        except Exception as e:
            # a bug must cost this request, never leave its client waiting for an answer
            log.exception("error handling a %s of model '%s'", req.action.name, req.name)
            if not any(waiter in load.waiters for load in self.loads.values()):
                error = f"{type(e).__name__}: {e}"
                self.reply(waiter, ErrorCode.INTERNAL, failed_to_load(req.name, error)
                           if req.action == ControlAction.LOAD else
                           f"failed to unload '{req.name}': {error}")
        finally:
            if req.upload_dir and self.sweep_uploads():    # refused, or joined another load
                self.publish()

    # ---- load -----------------------------------------------------------------------------------
    def start_load(self, name: str, config_json: str = "", waiter: Waiter | None = None,
                   upload: str = "") -> None:
        """``upload``: load from this uploaded model directory instead of the repository's."""
        if name in self.loads:
            if waiter:
                self.loads[name].waiters.append(waiter)   # the same load answers both
            return
        if upload:
            if not config_json:         # the frontend refuses this first (Triton's rule)
                return self.reply(waiter, ErrorCode.INVALID_ARG, failed_to_load(
                    name, "uploaded model files need the 'config' load parameter"))
            dirs = [upload]
        else:
            dirs = self.repository.model_dirs().get(name, [])
            if not dirs:
                return self.reply(waiter, ErrorCode.INTERNAL,
                                  f"failed to load '{name}', failed to poll from model "
                                  f"repository: no model directory named '{name}'")
            self.fingerprints[name] = fingerprint(dirs)
        override = None
        if config_json:
            try:
                override = model_config.config_from_json(config_json)
            except ConfigError as e:
                return self.reply(waiter, ErrorCode.INVALID_ARG, failed_to_load(name, str(e)))
        entry = self.repository.read_model(name, dirs, override)
        if entry.error:
            # an upload of a model the index does not list stays out of it, as in Triton
            if not self.serving_versions(name) and (not upload or name in self.entries):
                self.entries[name] = entry
                self.publish()
            return self.reply(waiter, ErrorCode.INVALID_ARG, failed_to_load(name, entry.error))
        cfg_json = model_config.config_to_json(entry.config)
        versions = []
        now = self.clock() / 1e9
        for plan in entry.versions:
            ver = ModelVersion(name, plan.version, entry.path, entry.config, cfg_json,
                               summaries=self.settings.summary_latencies,
                               auto_complete=entry.auto_complete, clock=self.clock,
                               load_started=now)
            try:
                ver.configure_timeout(self.settings.execution_timeout_secs)
            except ValueError:
                plan.error = (f"parameter execution_timeout_ms of model '{name}' must be a "
                              f"finite, non-negative number of milliseconds")
            versions.append(ver)
            if plan.error:
                ver.set_state(ModelState.UNAVAILABLE, plan.error, StateCause.LOAD_FAILED)
        load = Load(name, entry, versions, [waiter] if waiter else [], upload)
        self.loads[name] = load
        failed = [v for v in versions if v.state == ModelState.UNAVAILABLE]
        if failed:
            return self.finish_load(load, failed[0].reason)
        if entry.config is not None and entry.config.platform == "ensemble":
            return self.start_ensemble(load)
        log.info("loading model '%s' version(s) %s", name, [v.version for v in versions])
        try:
            for ver in versions:
                ver.instances = list(instances_of(entry.config))
                if self.rate_limiter is not None:
                    self.rate_limiter.check(ver)
                for inst in ver.instances:
                    self.supervisor.spawn(ver, inst)
        except (SpawnFailed, RateLimitError) as e:
            return self.finish_load(load, str(e))
        self.publish()

    # ---- ensembles --------------------------------------------------------------------------------
    def start_ensemble(self, load: Load) -> None:
        """An ensemble has no instances: it is READY once its composing models are. In explicit
        mode, loading it loads those of them that are not loaded (as Triton does)."""
        try:
            plan = ensemble_plan.plan(load.entry.config)
            # its own label files: a classification of its outputs names these labels
            labels = model_files.read_labels(model_config.config_to_dict(load.entry.config),
                                             load.versions[0].path) if load.versions else {}
        except (ConfigError, model_files.LabelFileError) as e:
            return self.finish_load(load, str(e))
        for ver in load.versions:
            ver.ensemble = plan
            ver.labels = labels
        log.info("loading ensemble '%s' (composing models %s)", load.name,
                 ", ".join(plan.composing()))
        if self.settings.model_control_mode in ("explicit", "on_demand"):
            found = self.repository.model_dirs()
            for model in plan.composing():
                if model in self.loads or model not in found:
                    continue
                if self.on_demand is not None:
                    if self.ready_version(model, -1) is None:
                        self.on_demand.need(model)      # loads when there is room for it
                elif not self.serving_versions(model):
                    self.start_load(model)
        self.publish()
        self.check_ensembles()

    def check_ensembles(self) -> None:
        """Ensemble loads whose composing models are no longer loading end: READY when each
        has a ready version and the steps agree with their configs, failed otherwise."""
        if self.starting:       # at start-up, the models after it in the list load too
            return
        for load in [ld for ld in self.loads.values() if ld.versions and
                     ld.versions[0].ensemble is not None]:
            plan = load.versions[0].ensemble
            assert plan is not None
            cycle = self.ensemble_cycle(load.name) if load.name in self.loads else None
            if cycle:       # nested ensembles that wait for each other would wait for ever
                self.finish_load(load, f"ensemble '{load.name}' has a cycle of nested "
                                       f"ensembles: {' -> '.join(cycle)}")
                continue
            if load.name not in self.loads or any(
                    m in self.loads or (self.on_demand is not None and self.on_demand.pending(m))
                    for m in plan.composing()):
                continue
            try:
                ensemble_plan.bind(plan, load.entry.config, self.ready_config)
            except ConfigError as e:
                self.finish_load(load, str(e))
                continue
            if plan.decoupled and load.entry.config is not None:
                # it streams what its decoupled steps stream
                load.entry.config.model_transaction_policy.decoupled = True
            now = self.clock() / 1e9
            for ver in load.versions:
                ver.stats.record.load_seconds = now - ver.load_started
                ver.set_state(ModelState.READY)
            self.finish_load(load, "")

    def ready_config(self, model: str, version: int):
        v = self.ready_version(model, version)
        return None if v is None else self.versions[(model, v)].config

    def ready_version(self, model: str, version: int) -> int | None:
        """The version a request for ``model`` (-1: its latest ready one) goes to, if READY."""
        if version >= 0:
            ver = self.versions.get((model, version))
            return version if ver is not None and ver.state == ModelState.READY else None
        ready = [v.version for v in self.serving_versions(model) if v.state == ModelState.READY]
        return max(ready) if ready else None

    def apply_completed_config(self, ver: ModelVersion, config_json: str) -> bool:
        """The first worker of an auto-completing version reports the completed config."""
        ver.auto_complete = False
        try:
            cfg = model_config.normalize(model_config.config_from_json(config_json), ver.name,
                                         backends=self.repository.backends)
        except ConfigError as e:
            self.version_failed(ver, f"auto-completed configuration is invalid: {e}")
            return False
        ver.config = cfg
        ver.config_json = model_config.config_to_json(cfg)
        ver.build_queue()
        ver.configure_timeout(self.settings.execution_timeout_secs)
        load = self.loads.get(ver.name)
        if load is not None:
            load.entry.config = cfg
        return True

    def version_started(self, ver: ModelVersion) -> None:
        """Every instance of ``ver`` is up; the load commits once all its versions are."""
        ver.stats.record.load_seconds = self.clock() / 1e9 - ver.load_started
        load = self.loads.get(ver.name)
        if load is None or ver not in load.versions:
            return
        ver.set_state(ModelState.READY)
        if all(v.state == ModelState.READY for v in load.versions):
            self.finish_load(load, "")

    def version_failed(self, ver: ModelVersion, reason: str) -> None:
        load = self.loads.get(ver.name)
        ver.set_state(ModelState.UNAVAILABLE, reason, StateCause.LOAD_FAILED)
        if load is not None and ver in load.versions:
            self.finish_load(load, reason)

    def finish_load(self, load: Load, error: str) -> None:
        del self.loads[load.name]
        name = load.name
        old = self.serving_versions(name)
        if error:
            for ver in load.versions:
                self.supervisor.stop(ver, kill=True)
                if self.rate_limiter is not None:
                    self.rate_limiter.forget(ver)
                ver.set_state(ModelState.UNAVAILABLE, ver.reason or error,
                              ver.cause if ver.reason else StateCause.LOAD_FAILED)
            if not any(v.state == ModelState.READY for v in old) and \
                    (not load.upload or name in self.entries):
                # nothing else serves: show the failed versions and why
                for v in old:
                    del self.versions[(name, v.version)]
                for ver in load.versions:
                    self.versions[(name, ver.version)] = ver
                self.entries[name] = load.entry
            log.error("failed to load '%s': %s", name, error)      # Triton's words
        else:
            self.entries[name] = load.entry
            for v in old:
                del self.versions[(name, v.version)]
            for ver in load.versions:
                self.versions[(name, ver.version)] = ver
                self.retired.pop((name, ver.version), None)
                if ver.batching:
                    self.batching.append(ver)
                log.info("model '%s' version %d is READY", name, ver.version)
            for v in old:       # after the swap: a drain that ends at once sees the new ones
                self.begin_drain(v)
        self.sweep_uploads()
        # the table goes first: a client that hears "loaded" must find the model ready
        self.check_startup()
        self.publish()
        for waiter in load.waiters:
            self.reply(waiter, ErrorCode.INVALID_ARG if error else None,
                       f"load failed for model '{name}': {error}" if error else "")
        for ver in load.versions:
            if ver.state == ModelState.READY:
                self.dispatch(ver)
        if self.on_demand is not None:
            self.on_demand.load_ended(name, error)
        self.check_ensembles()      # one may have waited for this model

    # ---- unload and drain ---------------------------------------------------------------------
    def unload(self, name: str, waiter: Waiter | None, dependents: bool = False) -> None:
        """``dependents``: an ensemble's composing models are unloaded with it, except those
        another serving ensemble still uses."""
        composing: set[str] = set()
        if dependents:
            plans = [v.ensemble for v in self.serving_versions(name) if v.ensemble is not None]
            if plans:
                # only loaded ensembles keep their models (not one whose load failed)
                others = {m for v in self.versions.values() if v.ensemble is not None
                          and v.name != name and v.state == ModelState.READY
                          for m in v.ensemble.composing()}
                composing = {m for p in plans for m in p.composing()} - others
        if name in self.loads:
            self.finish_load(self.loads[name], "unloaded while loading")
        for v in self.serving_versions(name):
            del self.versions[(name, v.version)]
            self.begin_drain(v)
        for model in sorted(composing):     # after the ensemble itself: it was unloaded
            self.unload(model, None)
        self.unload_ensembles_of(name)
        self.publish()
        self.reply(waiter, None, "")

    def ensemble_cycle(self, name: str) -> list[str] | None:
        """The path by which the ensemble load ``name`` waits for itself through loading
        nested ensembles, if it does."""
        def visit(path: list[str]) -> list[str] | None:
            load = self.loads.get(path[-1])
            plan = load.versions[0].ensemble if load is not None and load.versions else None
            for m in plan.composing() if plan is not None else ():
                if m == name:
                    return path + [m]
                if m not in path:
                    found = visit(path + [m])
                    if found:
                        return found
            return None
        return visit([name])

    def unload_ensembles_of(self, name: str) -> None:
        """As Triton does, an ensemble whose composing model is unloaded is unloaded too (its
        requests could only fail); the index says why. Loading the model again does not bring
        it back: load the ensemble."""
        for (n, v), ver in list(self.versions.items()):
            if ver.ensemble is not None and name in ver.ensemble.composing() and \
                    (n, v) in self.versions:
                del self.versions[(n, v)]
                self.begin_drain(ver)
                self.retired[(n, v)] = (f"ensemble '{n}' contains models that are not "
                                        f"available: {name}")
                self.unload_ensembles_of(n)     # and an ensemble whose step it is (nested)

    def begin_drain(self, ver: ModelVersion) -> None:
        """No new requests reach ``ver``; those it holds finish, then its workers stop."""
        if ver.state == ModelState.READY:
            ver.set_state(ModelState.UNLOADING)
        if ver in self.batching:
            self.batching.remove(ver)
        self.draining.append(ver)
        self.dispatch(ver)          # what it holds runs; a lease on it is revoked
        self.drain_progress(ver)

    def drain_progress(self, ver: ModelVersion) -> None:
        if ver not in self.draining or len(ver.queue) or ver.busy():
            return
        self.draining.remove(ver)
        self.supervisor.stop(ver, kill=False)
        ver.set_state(ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)
        if self.rate_limiter is not None:
            self.rate_limiter.forget(ver)       # its resources no longer count
        if (ver.name, ver.version) not in self.versions:
            self.retired[(ver.name, ver.version)] = "unloaded"
        log.info("model '%s' version %d unloaded", ver.name, ver.version)
        self.sweep_uploads()
        self.publish()

    def fail_version(self, ver: ModelVersion, reason: str, cause: StateCause) -> None:
        """A serving version stops serving (crash loop) until it is loaded again."""
        log.error("model '%s' version %d is UNAVAILABLE: %s", ver.name, ver.version, reason)
        ver.set_state(ModelState.UNAVAILABLE, reason, cause)
        if ver in self.batching:
            self.batching.remove(ver)
        self.supervisor.stop(ver, kill=False)
        self.sweep_uploads()
        self.publish()

    # ---- uploaded models --------------------------------------------------------------------------
    def sweep_uploads(self) -> bool:
        """Remove the uploaded model directories nothing loads, serves or drains from. A model
        whose upload is gone and serves no version is the repository's again, or is forgotten
        if it only came from uploads (Triton's index lists the repository's models). Returns
        whether the model table changed."""
        if not self.uploads.root:
            return False
        in_use = {v.path for load in self.loads.values() for v in load.versions}
        in_use.update(v.path for v in self.draining)
        in_use.update(v.path for v in self.versions.values() if v.state != ModelState.UNAVAILABLE)
        self.uploads.sweep(in_use)
        stale = [name for name, entry in self.entries.items()
                 if self.uploads.removed(entry.path) and not self.serving_versions(name)
                 and name not in self.loads]
        found = self.repository.model_dirs() if stale else {}
        for name in stale:
            if name in found:       # the repository's model again, as before the upload
                self.entries[name] = ModelEntry(name=name, path=found[name][0])
                continue
            del self.entries[name]
            for key in [k for k in self.retired if k[0] == name]:
                del self.retired[key]
        return bool(stale)

    # ---- poll mode --------------------------------------------------------------------------------
    def poll_repository(self) -> None:
        """Apply what changed on disk: new models load, removed ones unload, changed ones reload
        (the old version serves until the new one is READY)."""
        found = self.repository.model_dirs()
        for name, dirs in found.items():
            if name not in self.fingerprints or fingerprint(dirs) != self.fingerprints[name]:
                log.info("repository poll: loading %s model '%s'",
                         "changed" if name in self.fingerprints else "new", name)
                self.entries.setdefault(name, ModelEntry(name=name, path=dirs[0]))
                self.start_load(name)
        for name in list(self.fingerprints):
            if name not in found:
                log.info("repository poll: model '%s' was removed; unloading it", name)
                del self.fingerprints[name]
                self.unload(name, None)
                self.entries.pop(name, None)
                self.publish()

    # ---- views ------------------------------------------------------------------------------------
    def serving_versions(self, name: str) -> list[ModelVersion]:
        return [v for (n, _), v in self.versions.items() if n == name]

    def live_versions(self) -> list[ModelVersion]:
        """Every version that may hold requests or busy instances."""
        return [*self.versions.values(), *self.draining]

    def model_table(self) -> ModelTable:
        # each source indexed by name once: a repository of hundreds of models (on demand) is
        # published at every load and unload of any of them
        states_of: dict[str, dict[int, VersionInfo]] = {}
        for (n, v), reason in self.retired.items():
            states_of.setdefault(n, {})[v] = VersionInfo(v, ModelState.UNAVAILABLE, reason,
                                                         StateCause.UNLOADED)
        for ver in self.draining:
            states_of.setdefault(ver.name, {})[ver.version] = VersionInfo(
                ver.version, ver.state, ver.reason, ver.cause)
        for name, load in self.loads.items():
            for ver in load.versions:
                states_of.setdefault(name, {})[ver.version] = VersionInfo(ver.version,
                                                                          ModelState.LOADING)
        for (n, _), ver in self.versions.items():
            states_of.setdefault(n, {})[ver.version] = VersionInfo(
                ver.version, ver.state, ver.reason, ver.cause, round(ver.load_started * 1e9),
                self.route(ver), ver.asks_model, _unhealthy(ver))
        labels = {n: ver.labels for (n, _), ver in self.versions.items() if ver.labels}
        models = []
        for name, entry in sorted(self.entries.items()):
            cfg = self._config_bytes(name, entry.config)
            states = states_of.get(name, {})
            vers = [states[k] for k in sorted(states)]
            if entry.error and not vers:       # model-wide failure
                vers = [VersionInfo(-1, ModelState.UNAVAILABLE, entry.error,
                                    StateCause.LOAD_FAILED)]
            on_demand = self.on_demand is not None and not entry.error
            if on_demand:
                if not vers:        # never loaded: each version loads at its first request
                    vers = [VersionInfo(p.version, ModelState.UNAVAILABLE, p.error or "unloaded",
                                        StateCause.LOAD_FAILED if p.error else StateCause.UNLOADED)
                            for p in entry.versions]
                if entry.auto_complete and entry.config is not None and \
                        (not entry.config.input or not entry.config.output):
                    cfg = b""       # the model completes it when it first loads
            models.append(ModelInfo(name, cfg, vers, on_demand, labels.get(name, {})))
        return ModelTable(models, self.startup_done)

    def route(self, ver: ModelVersion) -> list[ChainHop]:
        """A serving ensemble whose steps run one after the other: its steps, on the versions
        that serve them now ([] for any other model, or while a step has no ready version)."""
        plan = ver.ensemble
        steps = plan.chained() if plan is not None else []
        if not steps or ver.state != ModelState.READY:
            return []
        hops = []
        for s in steps:
            version = self.ready_version(s.model, s.version)
            if version is None:
                return []
            hops.append(ChainHop(s.index, s.model, version, s.inputs, s.outputs,
                                 s.max_batch_size, s.input_dims))
        return hops

    def _config_bytes(self, name: str, config) -> bytes:
        """``config`` serialized, once per config object (an entry's config is replaced, not
        changed, once it is in ``entries``; the cache holds the object, so its id stays)."""
        if config is None:
            return b""
        cached = self._serialized.get(name)
        if cached is None or cached[0] is not config:
            cached = self._serialized[name] = (config, config.SerializeToString())
        return cached[1]


def failed_to_load(name: str, error: str) -> str:
    """Triton's clients look for this prefix in a refused load's message."""
    return error if error.startswith("failed to load") else f"failed to load '{name}': {error}"


def instances_of(config):
    """One Instance per worker process the config's instance groups ask for."""
    for index, group in enumerate(config.instance_group):
        kind = "GPU" if group.kind == group.KIND_GPU else "CPU"
        # a GPU group on a machine without GPUs still gets its workers: the backend then
        # refuses to load with the reason, instead of having no instances
        devices = (list(group.gpus) or [0]) if kind == "GPU" else [0]
        # as Triton (since 2.37) names them: the group's name and the instance's index, also
        # for a group's only one (a python model sees it as args["model_instance_name"];
        # Triton's init_args test expects "init_args_0_0")
        # the index runs over the group's devices too (gpus [0, 1], count 1: _0 on GPU 0, _1
        # on GPU 1): every instance of a model has a name of its own
        i = 0
        for device in devices:
            for _ in range(group.count):
                yield Instance(f"{group.name}_{i}", kind, device, group=index)
                i += 1


def fingerprint(dirs: list[str]) -> tuple:
    """What a poll compares: names, sizes and mtimes of everything under the model directory.
    The walk does not enter symlinked directories (so a symlink loop cannot trap it); a file
    that cannot be looked at (a symlink loop, no permission) counts by its name alone."""
    out = []
    for d in dirs:
        for root, subdirs, files in os.walk(d, followlinks=False):
            subdirs.sort()
            for f in sorted(files):
                path = os.path.join(root, f)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                except OSError:
                    out.append((os.path.relpath(path, d), -1, -1))
                    continue
                out.append((os.path.relpath(path, d), st.st_size, st.st_mtime_ns))
    return tuple(out)


def _unhealthy(ver: ModelVersion) -> str:
    """The first instance of a READY version that is not running now (died, restarting)."""
    if ver.state != ModelState.READY:
        return ""
    return next((i.name for i in ver.instances
                 if i.state in (InstanceState.BACKOFF, InstanceState.STARTING)), "")
