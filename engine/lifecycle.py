"""Loading, reloading and unloading models while traffic flows (a mixin of the scheduler shell).

A load builds new ModelVersions next to the ones serving. Only when every new version is READY
does traffic switch to them; the replaced versions then drain (their queued and running requests
finish) and their workers stop. A load that fails releases what it started and leaves the old
versions serving.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from shmserve.ipc.messages import (ControlReply, ControlRequest, ErrorCode, ModelInfo, ModelTable,
                                   Shutdown, VersionInfo)

from . import model_config
from .model_config import ConfigError
from .models import Instance, ModelVersion
from .repository import ModelEntry
from .states import InstanceState, ModelState

log = logging.getLogger("shmserve.scheduler")

LOAD_UNLOAD_REFUSED = "explicit model load / unload is not allowed if polling is enabled"


@dataclass
class Load:
    name: str
    entry: ModelEntry
    versions: list[ModelVersion]
    waiters: list[tuple[int, int]] = field(default_factory=list)   # (frontend, query id)


class Lifecycle:
    # ---- start-up ---------------------------------------------------------------------------------
    def load_initial(self) -> None:
        self.repo_dirs = self.repository.model_dirs()
        mode = self.settings.model_control_mode
        if mode == "explicit":
            wanted = self.settings.load_models
            names = list(self.repo_dirs) if wanted == ["*"] else wanted
        else:
            names = list(self.repo_dirs)
        for name in self.repo_dirs:
            self.entries.setdefault(name, ModelEntry(name=name, path=self.repo_dirs[name][0]))
        for name in names:
            if name not in self.repo_dirs:
                self.entries[name] = ModelEntry(name=name, path="", error=(
                    f"failed to load '{name}', no such model in the model repository"))
                continue
            self.start_load(name)
        self.check_startup()
        self.publish()

    # ---- load ---------------------------------------------------------------------------------------
    def start_load(self, name: str, config_json: str = "", waiter=None) -> None:
        if name in self.loads:
            if waiter:
                self.loads[name].waiters.append(waiter)   # the same load answers both
            return
        dirs = self.repository.model_dirs().get(name)
        if not dirs:
            return self.reply_control(waiter, ErrorCode.INTERNAL,
                                      f"failed to load '{name}', failed to poll from model "
                                      f"repository: no model directory named '{name}'")
        self.repo_dirs[name] = dirs
        self.fingerprints[name] = fingerprint(dirs)
        override = None
        if config_json:
            try:
                override = model_config.config_from_json(config_json)
            except ConfigError as e:
                return self.reply_control(waiter, ErrorCode.INVALID_ARG, str(e))
        entry = self.repository.read_model(name, dirs, override)
        if entry.error:
            if not self.serving_versions(name):
                self.entries[name] = entry
                self.publish()
            return self.reply_control(waiter, ErrorCode.INVALID_ARG, entry.error)
        cfg_json = model_config.config_to_json(entry.config)
        versions = []
        for plan in entry.versions:
            ver = ModelVersion(name, plan.version, entry.path, entry.config, cfg_json,
                               summaries=self.settings.summary_latencies,
                               auto_complete=entry.auto_complete)
            try:
                ver.configure_timeout(self.settings.execution_timeout_secs)
            except ValueError:
                plan.error = (f"parameter execution_timeout_ms of model '{name}' must be a "
                              f"number of milliseconds")
            versions.append(ver)
            if plan.error:
                ver.state, ver.reason = ModelState.UNAVAILABLE, plan.error
        load = Load(name, entry, versions, [waiter] if waiter else [])
        self.loads[name] = load
        failed = [v for v in versions if v.state == ModelState.UNAVAILABLE]
        if failed:
            return self.finish_load(load, failed[0].reason)
        log.info("loading model '%s' version(s) %s", name, [v.version for v in versions])
        for ver in versions:
            for group in entry.config.instance_group:
                kind = "GPU" if group.kind == group.KIND_GPU else "CPU"
                # a GPU group on a machine without GPUs still gets its workers: the backend
                # then refuses to load with the reason, instead of having no instances
                devices = (list(group.gpus) or [0]) if kind == "GPU" else [0]
                for device in devices:
                    for i in range(group.count):
                        ver.instances.append(Instance(f"{group.name}_{i}", kind, device))
            for inst in ver.instances:
                self.spawn(ver, inst)
        self.publish()

    def apply_completed_config(self, ver: ModelVersion, config_json: str) -> bool:
        """The first worker of an auto-completing version reports the completed config."""
        ver.auto_complete = False
        try:
            cfg = model_config.normalize(model_config.config_from_json(config_json), ver.name)
        except ConfigError as e:
            self.version_failed(ver, f"auto-completed configuration is invalid: {e}")
            return False
        ver.config = cfg
        ver.config_json = model_config.config_to_json(cfg)
        ver.build_scheduler()
        ver.configure_timeout(self.settings.execution_timeout_secs)
        load = self.loads.get(ver.name)
        if load is not None:
            load.entry.config = cfg
        return True

    def version_started(self, ver: ModelVersion) -> None:
        """Every instance of ``ver`` is up; the load commits once all its versions are."""
        ver.stats.record.load_seconds = time.monotonic() - ver.load_started
        load = self.loads.get(ver.name)
        if load is None or ver not in load.versions:
            return
        ver.state = ModelState.READY
        if all(v.state == ModelState.READY for v in load.versions):
            self.finish_load(load, "")

    def version_failed(self, ver: ModelVersion, reason: str) -> None:
        load = self.loads.get(ver.name)
        ver.state, ver.reason = ModelState.UNAVAILABLE, reason
        if load is not None and ver in load.versions:
            self.finish_load(load, reason)

    def finish_load(self, load: Load, error: str) -> None:
        del self.loads[load.name]
        name = load.name
        old = self.serving_versions(name)
        if error:
            for ver in load.versions:
                self.stop_instances(ver, kill=True)
                ver.state = ModelState.UNAVAILABLE
                if not ver.reason:
                    ver.reason = error
            if not any(v.state == ModelState.READY for v in old):
                # nothing else serves: show the failed versions and why
                for v in old:
                    del self.versions[(name, v.version)]
                for ver in load.versions:
                    self.versions[(name, ver.version)] = ver
                self.entries[name] = load.entry
            log.error("loading model '%s' failed: %s", name, error)
        else:
            self.entries[name] = load.entry
            for v in old:
                del self.versions[(name, v.version)]
                self.begin_drain(v)
            for ver in load.versions:
                self.versions[(name, ver.version)] = ver
                self.retired.pop((name, ver.version), None)
                if ver.config.HasField("dynamic_batching"):
                    self.batching.append(ver)
                log.info("model '%s' version %d is READY", name, ver.version)
        # the table goes first: a client that hears "loaded" must find the model ready
        self.check_startup()
        self.publish()
        for waiter in load.waiters:
            self.reply_control(waiter, ErrorCode.INVALID_ARG if error else "",
                               f"load failed for model '{name}': {error}" if error else "")
        for ver in load.versions:
            if ver.state == ModelState.READY:
                self.dispatch(ver)

    # ---- unload and drain --------------------------------------------------------------------------
    def unload(self, name: str, waiter) -> None:
        if name in self.loads:
            load = self.loads[name]
            self.finish_load(load, "unloaded while loading")
        for v in self.serving_versions(name):
            del self.versions[(name, v.version)]
            self.begin_drain(v)
        self.publish()
        self.reply_control(waiter, "", "")

    def begin_drain(self, ver: ModelVersion) -> None:
        """No new requests reach ``ver``; those it holds finish, then its workers stop."""
        if ver.state == ModelState.READY:
            ver.state = ModelState.UNLOADING
        if ver in self.batching:
            self.batching.remove(ver)
        self.draining.append(ver)
        self.drain_progress(ver)

    def drain_progress(self, ver: ModelVersion) -> None:
        if ver not in self.draining:
            return
        busy = any(i.state == InstanceState.BUSY for i in ver.instances)
        if len(ver.scheduler) or busy:
            return
        self.draining.remove(ver)
        self.stop_instances(ver, kill=False)
        ver.state, ver.reason = ModelState.UNAVAILABLE, "unloaded"
        if (ver.name, ver.version) not in self.versions:
            self.retired[(ver.name, ver.version)] = "unloaded"
        log.info("model '%s' version %d unloaded", ver.name, ver.version)
        self.publish()

    def stop_instances(self, ver: ModelVersion, kill: bool) -> None:
        for inst in ver.instances:
            if inst.state == InstanceState.STOPPED:
                continue
            if inst.outbox is not None and not kill:
                inst.outbox.send(Shutdown())
            elif inst.process is not None:
                inst.process.kill()
            inst.state = InstanceState.STOPPED
            self.backoff.discard((ver, inst))

    # ---- poll mode ---------------------------------------------------------------------------------
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

    # ---- control requests from frontends -------------------------------------------------------------
    def control(self, req: ControlRequest) -> None:
        waiter = (req.frontend, req.query_id)
        if self.settings.model_control_mode != "explicit":
            return self.reply_control(waiter, ErrorCode.UNAVAILABLE, LOAD_UNLOAD_REFUSED)
        if req.action == "load":
            self.start_load(req.name, req.config, waiter)
        else:
            self.unload(req.name, waiter)

    def reply_control(self, waiter, code: str, error: str) -> None:
        if waiter is None:
            if error:
                log.error("%s", error)
            return
        box = self.frontends.get(waiter[0])
        if box is not None:
            box.send(ControlReply(waiter[1], error, code))

    # ---- views ----------------------------------------------------------------------------------------
    def serving_versions(self, name: str) -> list[ModelVersion]:
        return [v for (n, _), v in self.versions.items() if n == name]

    def model_table(self) -> ModelTable:
        models = []
        for name, entry in sorted(self.entries.items()):
            cfg = entry.config.SerializeToString() if entry.config is not None else b""
            states: dict[int, VersionInfo] = {}
            for (n, v), reason in self.retired.items():
                if n == name:
                    states[v] = VersionInfo(v, ModelState.UNAVAILABLE.value, reason)
            for ver in self.draining:
                if ver.name == name:
                    states[ver.version] = VersionInfo(ver.version, ver.state.value, ver.reason)
            load = self.loads.get(name)
            if load is not None:
                for ver in load.versions:
                    states[ver.version] = VersionInfo(ver.version, ModelState.LOADING.value)
            for ver in self.serving_versions(name):
                states[ver.version] = VersionInfo(ver.version, ver.state.value, ver.reason)
            vers = [states[k] for k in sorted(states)]
            if entry.error and not vers:
                vers = [VersionInfo(-1, ModelState.UNAVAILABLE.value, entry.error)]  # model-wide
            models.append(ModelInfo(name, cfg, vers))
        return ModelTable(models, self.startup_done)


def fingerprint(dirs: list[str]) -> tuple:
    """What a poll compares: names, sizes and mtimes of everything under the model directory."""
    out = []
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs.sort()
            for f in sorted(files):
                try:
                    st = os.stat(os.path.join(root, f))
                except FileNotFoundError:
                    continue
                out.append((os.path.relpath(os.path.join(root, f), d), st.st_size, st.st_mtime_ns))
    return tuple(out)
