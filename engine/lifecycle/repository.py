"""The model repository on disk: which models and versions exist and what their configs say.

Pure: reads files, never starts processes. The scheduler shell decides what to load from it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from shmserve.ipc import backend_catalog, model_config, model_files
from shmserve.ipc.backend_catalog import BackendCatalog, BackendNotFound
from shmserve.ipc.model_config import ConfigError


@dataclass
class VersionPlan:
    version: int
    path: str
    error: str = ""             # non-empty: this version cannot be loaded, and why


@dataclass
class ModelEntry:
    name: str
    path: str
    config: model_config.ModelConfig | None = None
    error: str = ""             # non-empty: the whole model cannot be loaded, and why
    versions: list[VersionPlan] = field(default_factory=list)
    auto_complete: bool = False  # workers fill in the config from the model when they load it


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether a directory entry is a directory, or a symlink to one; a symlink loop (which
    ``DirEntry.is_dir`` raises ELOOP for) or an entry gone meanwhile is not."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def version_dirs(model_dir: str) -> list[int]:
    """Numeric subdirectories; names with a leading zero are ignored as Triton ignores them."""
    out = []
    for entry in os.scandir(model_dir):
        name = entry.name
        if name.isascii() and name.isdigit() and (name == "0" or name[0] != "0") and \
                _is_dir(entry):
            out.append(int(name))
    return sorted(out)


# the files a model is served from (the built-in backends'): found where they cannot be served
# from (the repository's top, a model directory's top), they get a hint where they belong
MODEL_FILES = tuple(f for _, f in backend_catalog.BUILT_IN.values() if f)


def _misplaced_file(model_dir: str) -> str:
    """A model file directly in a model directory that has no version directory: where it
    should be (its error says so), else ""."""
    for filename in MODEL_FILES:
        if os.path.isfile(os.path.join(model_dir, filename)):
            return (f"{model_dir}/{filename} is not in a version directory: a model's files "
                    f"live in numbered version directories, e.g. {model_dir}/1/{filename}")
    return ""


class ModelRepository:
    def __init__(self, paths: list[str], config_name: str | None = None, gpu_count: int = 0,
                 auto_complete: bool = True, backends: BackendCatalog | None = None):
        self.paths = [os.path.abspath(p) for p in paths]
        self.backends = backends or BackendCatalog()
        self.config_name = config_name
        self.gpu_count = gpu_count
        self.auto_complete = auto_complete

    def check_paths(self) -> None:
        for p in self.paths:
            if not os.path.isdir(p):
                raise ConfigError(f"model repository path '{p}' is not a directory")

    def model_dirs(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for repo in self.paths:
            for entry in sorted(os.scandir(repo), key=lambda e: e.name):
                if not entry.name.startswith(".") and _is_dir(entry):
                    found.setdefault(entry.name, []).append(entry.path)
        return found

    def misplaced_files(self) -> list[str]:
        """Model files at the top of a repository, where no model is looked for: a hint each."""
        hints = []
        for repo in self.paths:
            for entry in sorted(os.scandir(repo), key=lambda e: e.name):
                if entry.is_file() and (entry.name in MODEL_FILES or
                                        entry.name.endswith((".onnx", ".plan"))):
                    stem = os.path.splitext(entry.name)[0]
                    hints.append(f"{entry.path} is a file at the top of the model repository, "
                                 f"where only model directories are served: put it in "
                                 f"{repo}/<model name>/1/ (e.g. {repo}/{stem}/1/"
                                 f"{entry.name if entry.name in MODEL_FILES else 'model.onnx'})")
        return hints

    def scan(self) -> dict[str, ModelEntry]:
        return {name: self.read_model(name, dirs) for name, dirs in self.model_dirs().items()}

    def read_model(self, name: str, dirs: list[str],
                   override: model_config.ModelConfig | None = None) -> ModelEntry:
        """``override``: a config given with a load request, used instead of config.pbtxt."""
        try:
            return self._read_model(name, dirs, override)
        except OSError as e:    # the directory itself cannot be listed or looked at
            return ModelEntry(name=name, path=dirs[0], error=(
                f"cannot read the model directory {dirs[0]}: {e.strerror or e}"))

    def _read_model(self, name: str, dirs: list[str],
                    override: model_config.ModelConfig | None) -> ModelEntry:
        entry = ModelEntry(name=name, path=dirs[0])
        if len(dirs) > 1:
            entry.error = f"model '{name}' appears in more than one repository: {', '.join(dirs)}"
            return entry
        if override is None and not version_dirs(entry.path):
            misplaced = _misplaced_file(entry.path)
            if misplaced:       # before the config: a missing config.pbtxt is not the problem
                entry.error = f"model '{name}' has no version directory: {misplaced}"
                return entry
        try:
            if override is not None:
                cfg = model_config.ModelConfig()
                cfg.CopyFrom(override)
            else:
                cfg = self._config_or_stub(entry.path, name)
            if not cfg.backend and not cfg.platform:
                # Triton fills the backend from the model file's name (an override config with
                # just max_batch_size, as its model-control example sends, included)
                cfg.backend = self._backend_from_files(entry.path) or ""
            entry.config = model_config.normalize(cfg, name, self.gpu_count, self.backends)
        except ConfigError as e:
            entry.error = str(e)
            return entry
        entry.auto_complete = self._wants_completion(entry)
        available = version_dirs(entry.path)
        if not available:
            entry.error = f"model '{name}' has no version directory (e.g. {entry.path}/1)"
            return entry
        chosen, missing = model_config.select_versions(entry.config, available)
        if entry.config.platform != "ensemble":     # an ensemble runs no process of its own
            try:
                model_config.check_process_count(entry.config, len(chosen))
            except ConfigError as e:
                entry.error = str(e)
                return entry
        for v in missing:
            entry.versions.append(VersionPlan(v, "", f"version {v} named by version_policy does "
                                                     f"not exist in {entry.path}"))
        filename = entry.config.default_model_filename
        for v in chosen:
            vpath = os.path.join(entry.path, str(v))
            plan = VersionPlan(v, vpath)
            if filename:
                plan.error = model_file_error(os.path.join(vpath, filename),
                                              entry.config.backend)
            entry.versions.append(plan)
        if not entry.versions:
            entry.error = f"model '{name}': version_policy selects no version"
        return entry


    def _config_or_stub(self, path: str, name: str) -> model_config.ModelConfig:
        """config.pbtxt; or, with auto-complete on and a model.onnx or model.py present, a bare
        config that the workers complete from the model (Triton: docs/triton-compat.md §3.4)."""
        try:
            return model_config.read_config(path, name, self.config_name)
        except model_config.ConfigMissing:
            backend = self._backend_from_files(path) if self.auto_complete else None
            if backend is None:
                raise
        cfg = model_config.ModelConfig()
        cfg.backend = backend
        return cfg

    @staticmethod
    def _backend_from_files(path: str) -> str | None:
        """The backend a config-less model's default file names (ONNX first, as Triton tries it)."""
        for filename, backend in (("model.onnx", "onnxruntime"), ("model.py", "python")):
            if any(os.path.exists(os.path.join(path, str(v), filename)) for v in version_dirs(path)):
                return backend
        return None

    def _wants_completion(self, entry: ModelEntry) -> bool:
        if not self.auto_complete:
            return False
        cfg = entry.config
        if cfg is None:
            return False
        if cfg.backend == "onnxruntime":
            return not cfg.input or not cfg.output
        if backend_catalog.config_runs_python(cfg):
            # Triton calls auto_complete_config() whenever the model (or its python-based
            # backend) defines it
            if cfg.backend == "python":
                paths = [os.path.join(entry.path, str(v), cfg.default_model_filename)
                         for v in version_dirs(entry.path)]
            else:
                try:
                    paths = [self.backends.find(cfg.backend).source]
                except BackendNotFound:     # gone since the config was read: the load says so
                    paths = []
            for path in paths:
                try:
                    source = model_files.read_bytes(path, model_files.SOURCE_MAX_BYTES)
                except model_files.ModelFileError:
                    return True     # too large to scan here: the worker asks the model itself
                except OSError:
                    continue
                if b"def auto_complete_config" in source:
                    return True
        return False


def model_file_error(path: str, backend: str) -> str:
    """Why a version's model file cannot be served, or "". It must be a regular file (a worker
    would block for ever opening a FIFO); an onnxruntime model may also be a directory that
    holds model.onnx (a model with external weights), as Triton allows."""
    if backend == "onnxruntime" and os.path.isdir(path):
        path = os.path.join(path, "model.onnx")
    try:
        model_files.check_regular(path)
    except FileNotFoundError:
        if backend == "python":         # Triton's words
            return f"Failed to preinitialize Python stub: Python model file not found in '{path}'"
        return f"model file '{os.path.basename(path)}' not found in {os.path.dirname(path)}"
    except OSError as e:
        return f"model file {path} cannot be used: {e.strerror or e}"
    return ""
