"""The modules that run compiled, and whether a compiled one is older than its source.

setup.py compiles the modules in ``SOURCES`` with mypyc (the request path, where a profile shows
the interpreter's time); the ``.py`` file stays the source and the fallback. In an editable
install the extension sits next to its source and Python imports the extension first, so an edit
made after the build would not run: ``stale`` finds such modules (by the digests the build
records), the launcher warns about them, and the test suite refuses to run on them.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
from typing import Any

try:
    from mypy_extensions import mypyc_attr, trait
except ImportError:     # (mypy is a build tool: the decorators only tell mypyc what to allow)
    def mypyc_attr(*attrs: str, **kwattrs: object) -> Any:  # type: ignore[misc]
        return lambda cls: cls

    def trait(cls: Any) -> Any:     # type: ignore[misc]
        return cls

# the package's folders (each is the package shmserve.<folder>)
FOLDERS = ("engine", "frontend", "ipc", "workers")
# paths under the repository
SOURCES = (
    # HTTP/1.1, HTTP/2 and gRPC's codec, the request's preparation and checks, the model
    # catalog, the frontend's service, its link to the workers and its lease table, the packet
    # transport, and the worker's loop with its tensor and answer handling; gRPC's connection
    # (its calls' answers and its limits are traits of it). Not: the answer streams (async
    # generators), the python backend (compiled, a BLS call measured no faster).
    "engine/requests/catalog.py",
    "engine/requests/prepare.py",
    "engine/requests/validation.py",
    "frontend/colocation.py",
    "frontend/deadlines.py",
    "frontend/engine_client.py",
    "frontend/grpc/answer.py",
    "frontend/grpc/call.py",
    "frontend/grpc/codec.py",
    "frontend/grpc/guard.py",
    "frontend/grpc/loop.py",
    "frontend/http/app.py",
    "frontend/http/codec.py",
    "frontend/http/routes.py",
    "frontend/http/server.py",
    "frontend/http2/connection.py",
    "frontend/http2/frames.py",
    "frontend/http2/headers.py",
    "frontend/http2/send.py",
    "frontend/priority.py",
    "frontend/service.py",
    "ipc/lease_table.py",
    "ipc/packets.py",
    "workers/answers.py",
    "workers/tensors.py",
    "workers/worker.py",
)


# written by the build next to this module: each compiled module's source digest
RECORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled_sources.json")


def module_name(path: str) -> str:
    return "shmserve." + path[:-len(".py")].replace("/", ".")


def _origin(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None else None


def compiled() -> list[str]:
    """The modules of SOURCES that import as extensions here."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    out = []
    for path in SOURCES:
        origin = _origin(module_name(path))
        if origin is not None and origin.endswith(suffixes):
            out.append(module_name(path))
    return out


def leftover_extensions(root: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                        ) -> list[str]:
    """Extension files under ``root`` (the package's folder, or a source tree) of modules an
    earlier build compiled and ``SOURCES`` no longer lists: Python would still import them
    before their source. The build removes them; ``stale`` reports them."""
    listed = {p[:-len(".py")] for p in SOURCES} | {"ipc/compiled__mypyc"}
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return [os.path.join(where, f)
            for folder in FOLDERS for where, _, files in os.walk(os.path.join(root, folder))
            for f in files if f.endswith(suffixes) and
            os.path.relpath(os.path.join(where, f.split(".", 1)[0]), root) not in listed]


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stale(records: str = RECORDS) -> list[str]:
    """Compiled modules whose source is not what they were built from (``pip install -e .``
    again, or ``SHMSERVE_PURE_PYTHON=1 pip install -e .`` to drop them). The build records each
    source's digest in ``records``; contents are compared, not times, which an install from a
    wheel sets in whatever order it writes the files."""
    try:
        with open(records) as f:
            built = json.load(f)
    except (OSError, ValueError):
        built = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = [module_name(os.path.relpath(path, root).split(".", 1)[0] + ".py")
           for path in leftover_extensions(root)]
    for name in compiled():
        origin = _origin(name)
        assert origin is not None
        source = os.path.join(os.path.dirname(origin), name.rsplit(".", 1)[1] + ".py")
        try:
            if digest(source) != built.get(name):
                out.append(name)
        except FileNotFoundError:
            continue    # installed without its sources: nothing to compare
    return out
