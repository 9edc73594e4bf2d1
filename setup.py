"""Builds shmserve; the request path's modules are compiled with mypyc where the machine allows.

Everything else about the package is in pyproject.toml. The modules compiled are listed in
ipc/compiled.py: the ones where a profile of a small request shows the interpreter's time
(docs/performance.md). mypyc makes each a C extension from the same typed Python, so there is one
source, and the ``.py`` file is the fallback. ``SHMSERVE_PURE_PYTHON=1`` builds none (and removes
those an earlier editable build left next to their sources); a machine without a C compiler, or
without mypy where pip's build isolation is off, gets the pure-Python package and a warning. A build
is all or nothing: the compiled modules share one runtime library, so a partial build is removed.
"""
from __future__ import annotations

import glob
import json
import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
_COMPILED = runpy.run_path(os.path.join(HERE, "ipc", "compiled.py"))
SOURCES = _COMPILED["SOURCES"]
# the runtime library the compiled modules share, kept in the lowest layer's folder
GROUP = "shmserve.ipc.compiled"


def _warn(text: str) -> None:
    print(f"shmserve: {text}; installing the pure-Python modules", file=sys.stderr)


def _built_in_place() -> list[str]:
    stems = [p[:-len(".py")] for p in SOURCES] + ["ipc/compiled__mypyc"]
    found = [f for stem in stems for f in glob.glob(os.path.join(HERE, stem + ".*.so"))]
    return found + glob.glob(os.path.join(HERE, "ipc", "compiled_sources.json"))


class _AllOrNothing(build_ext):
    """Compiles every module or none: a failure removes what was built and warns."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:     # a compiler's failure takes many forms
            for path in self.get_outputs():
                if os.path.exists(path):
                    os.remove(path)
            _warn(f"compiling with mypyc failed ({e})")
            return
        if self.extensions:
            self._record_sources()

    def _record_sources(self) -> None:
        """Each source's digest, beside the shared library, for ``compiled.stale``."""
        records = {_COMPILED["module_name"](p): _COMPILED["digest"](os.path.join(HERE, p))
                   for p in SOURCES}
        where = os.path.dirname(self.get_ext_fullpath(GROUP + "__mypyc"))
        with open(os.path.join(where, "compiled_sources.json"), "w") as f:
            json.dump(records, f, indent=1, sort_keys=True)


def _extensions() -> list:
    # an extension an earlier editable build left for a module no longer listed would still be
    # imported before its source
    for path in _COMPILED["leftover_extensions"](HERE):
        os.remove(path)
    if os.environ.get("SHMSERVE_PURE_PYTHON") == "1":
        for path in _built_in_place():
            os.remove(path)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    old = os.getcwd()
    os.chdir(HERE)      # mypy reads pyproject.toml's [tool.mypy] from the working directory
    try:
        # named through .mypy-path/shmserve (links to the four folders), as they are imported
        return mypycify([os.path.join(".mypy-path", "shmserve", p) for p in SOURCES],
                        group_name=GROUP)
    except (Exception, SystemExit) as e:
        # mypy's checks failed (it exits): a mypy newer than the code, say. The install goes on
        # in pure Python; tests/project/test_compiled.py fails where the build must compile.
        _warn(f"mypyc refused the modules ({e})")
        return []
    finally:
        os.chdir(old)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _AllOrNothing})
