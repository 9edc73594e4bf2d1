"""The project's structure, checked: every package installs, the layering contract holds (and
catches a breach), and mypy resolves imports between the packages (and catches a wrong type
passed across them)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from serverproc import REPO_ROOT

tomllib = pytest.importorskip("tomllib")     # Python 3.11

TOPS = ("engine", "frontend", "workers", "ipc")


def _pyproject() -> dict:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _package_dirs() -> list[str]:
    found = []
    for top in TOPS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO_ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                found.append("shmserve." + os.path.relpath(dirpath, REPO_ROOT).replace(os.sep, "."))
    return sorted(found)


def test_every_package_is_listed_for_installation():
    # a wheel (not the editable install) holds only the listed packages
    listed = sorted(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == _package_dirs()


# python-based backends shipped with shmserve: a model.py per folder, loaded by path (as
# Triton loads them), not imported as packages; the wheel carries them as package data
SHIPPED_BACKENDS = os.path.join(REPO_ROOT, "workers", "backends", "python_based")


def test_every_module_folder_is_a_package():
    for top in TOPS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO_ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"
                           and os.path.join(dirpath, d) != SHIPPED_BACKENDS]
            if any(f.endswith(".py") for f in filenames):
                assert "__init__.py" in filenames, dirpath


def test_the_shipped_backends_are_package_data():
    import fnmatch
    patterns = _pyproject()["tool"]["setuptools"]["package-data"]["shmserve.workers.backends"]
    base = os.path.join(REPO_ROOT, "workers", "backends")
    shipped = [os.path.relpath(os.path.join(d, f), base)
               for d, _, files in os.walk(SHIPPED_BACKENDS) for f in files if f.endswith(".py")]
    assert shipped
    for path in shipped:
        assert any(fnmatch.fnmatch(path, p) for p in patterns), path


def test_mypy_links_name_the_four_folders():
    links = os.path.join(REPO_ROOT, ".mypy-path", "shmserve")
    assert sorted(os.listdir(links)) == sorted(TOPS)
    for top in TOPS:
        assert os.path.realpath(os.path.join(links, top)) == os.path.realpath(os.path.join(REPO_ROOT, top))


LINT = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"


def _lint_imports(cwd, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath:      # ahead of the installed package: the copy there is what is analysed
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_layering_contract_holds():
    done = _lint_imports(REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _copy_tree(dst: str) -> None:
    """The four folders as the package shmserve in ``dst``, with pyproject.toml beside it."""
    for top in TOPS:
        shutil.copytree(os.path.join(REPO_ROOT, top), os.path.join(dst, "shmserve", top),
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO_ROOT, "pyproject.toml"), dst)


@pytest.mark.parametrize("module, line, broken", [
    # a worker reaching into the frontend
    ("workers/leases/batch.py", "from shmserve.frontend import connections", "shmserve.workers is not allowed to import shmserve.frontend"),
    # the bottom layer reaching up
    ("ipc/shm.py", "from shmserve.engine.batching import rule", "shmserve.ipc is not allowed to import shmserve.engine"),
    # the frontend using the scheduler process's core
    ("frontend/deadlines.py", "from shmserve.engine import core", "shmserve.frontend is not allowed to import shmserve.engine.core"),
])
def test_the_layering_contract_catches_a_breach(tmp_path, module, line, broken):
    _copy_tree(str(tmp_path))
    path = tmp_path / "shmserve" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    done = _lint_imports(tmp_path, str(tmp_path))
    assert done.returncode != 0, done.stdout + done.stderr
    assert broken in done.stdout


PROBE = """
from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.ipc.messages.common import OutputSpec

spec = OutputSpec("OUT", classification="3")
catalog: ModelCatalog = ModelCatalog()
catalog.no_such_method()
"""


def test_mypy_reports_a_wrong_type_passed_across_packages(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(REPO_ROOT, "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache"), str(probe)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    # an int field given a str, in a message defined in ipc and used from outside it
    assert 'Argument "classification" to "OutputSpec" has incompatible type "str"; expected "int"' in out
    # a method the frontend's catalog (in engine) does not have
    assert '"ModelCatalog" has no attribute "no_such_method"' in out
