"""Which backends exist and where each is found: the one lookup the scheduler (is a config's
``backend`` servable?) and the worker (what to load) share.

Three kinds, looked up in this order:
- built in: the backends under ``workers/backends`` and the python backend;
- python-based, Triton's way: ``<backend directory>/<name>/model.py``, a ``TritonPythonModel``
  that serves every model naming the backend (the user's ``--backend-directory`` first, then the
  directory shipped with shmserve);
- plug-ins: ``[project.entry-points."shmserve.backends"]`` of an installed package, a class that
  implements shmserve's backend interface (docs/backends.md). The scheduler reads only the
  entry points' names and values; the class is imported in the worker, never here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import Sequence

ENTRY_POINT_GROUP = "shmserve.backends"
PYTHON_BASED_FILE = "model.py"          # Triton's name, and the config's ``runtime`` for them
# The python-based backends shipped with shmserve (the default backend directory)
SHIPPED_DIRECTORY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "workers", "backends", "python_based")

# built-in backend -> (platform Triton reports, default model file name)
BUILT_IN = {
    "python": ("", "model.py"),
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "tensorrt": ("tensorrt_plan", "model.plan"),
    # Triton's test backends: a version directory, no model file
    "identity": ("", ""),
    "repeat": ("", ""),
    "square": ("", ""),
}
# the backends that can serve a decoupled model (any number of responses per request); every
# python-based backend can, as a python model can
DECOUPLED_BUILT_IN = ("python", "repeat", "square")
PLATFORM_TO_BACKEND = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt"}
PLATFORMS = ("ensemble", *PLATFORM_TO_BACKEND)


def config_runs_python(cfg) -> bool:
    """A normalized config whose model runs on the python backend: a python model, or a model
    of a python-based backend (its ``runtime`` is ``model.py``, as Triton sets it)."""
    return cfg.backend == "python" or cfg.runtime == PYTHON_BASED_FILE


def spec_runs_python(backend: str, source: str) -> bool:
    """The same for a worker's InstanceSpec: a python-based backend's source is its model.py (a
    plug-in's is "module:attr")."""
    return backend == "python" or source.endswith(".py")


class BackendNotFound(LookupError):
    """A backend name no kind knows; the message lists what exists and where it looked."""


@dataclass(frozen=True, slots=True)
class BackendRef:
    name: str
    kind: str               # "built-in", "python-based" or "plug-in"
    source: str = ""        # python-based: its model.py; plug-in: the entry point's "module:attr"
    platform: str = ""      # what the model's config reports
    default_filename: str = ""
    decoupled: bool = False     # may serve a decoupled model


def _plugins() -> dict[str, str]:
    """name -> "module:attr" of the installed packages' entry points (read once per process:
    a newly installed backend needs a restart, as a new shared library does under Triton)."""
    found: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


class BackendCatalog:
    def __init__(self, directories: Sequence[str] = (), plugins: dict[str, str] | None = None):
        """``directories``: the user's backend directories, searched before the shipped one;
        ``plugins``: name -> "module:attr" (default: the installed entry points)."""
        dirs = [os.path.abspath(d) for d in directories if d]
        self.directories = [*dirs, *([SHIPPED_DIRECTORY] if SHIPPED_DIRECTORY not in dirs else [])]
        self.plugins = _plugins() if plugins is None else dict(plugins)

    def find(self, name: str) -> BackendRef:
        if name in BUILT_IN:
            platform, filename = BUILT_IN[name]
            return BackendRef(name, "built-in", "", platform, filename, name in DECOUPLED_BUILT_IN)
        # a name is one path component: "../x" or "a/b" must not reach outside a directory
        if name and name not in (".", "..") and "/" not in name and "\\" not in name \
                and "\0" not in name:
            for d in self.directories:
                path = os.path.join(d, name, PYTHON_BASED_FILE)
                if os.path.isfile(path):
                    return BackendRef(name, "python-based", path, "", "", True)
        if name in self.plugins:
            return BackendRef(name, "plug-in", self.plugins[name])
        raise BackendNotFound(
            f"unable to find backend library for backend '{name}', try specifying runtime on the "
            f"model configuration. shmserve looked for "
            f"{', '.join(os.path.join(d, name or '<name>', PYTHON_BASED_FILE) for d in self.directories)} "
            f"and the '{ENTRY_POINT_GROUP}' entry points of the installed packages; the backends "
            f"that exist: {', '.join(self.names())}")

    def names(self) -> list[str]:
        """Every backend a config may name now, each once."""
        found = set(BUILT_IN) | set(self.plugins)
        for d in self.directories:
            try:
                entries = os.listdir(d)
            except OSError:
                continue
            found.update(e for e in entries if os.path.isfile(os.path.join(d, e, PYTHON_BASED_FILE)))
        return sorted(found)
