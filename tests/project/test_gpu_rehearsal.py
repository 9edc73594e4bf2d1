"""The GPU check rehearsed without a GPU (issue 42), so that bench/gpu_check.sh and
bench/gpu_wheelhouse.sh cannot rot between the rare runs on the lent GPU machine (offline, its
own Python 3.12, only what .whl/ carries):

- both scripts parse, and gpu_check.sh stops with "no GPU" (exit 2) where nvidia-smi is absent;
- every package that shmserve's processes, the tests marked gpu (with the helpers they import)
  and bench/gpu_bench.py import is either on the GPU machine (gpu_wheelhouse.sh --present),
  carried (--list), or named as too large to carry (--not-carried); the pins satisfy
  pyproject.toml's ranges;
- the wheelhouse is built for real (PyPI; a few seconds with pip's cache), every carried wheel's
  own requirements are carried or on the GPU machine, pip resolves the install offline for
  Python 3.12, and, where a Python 3.12 is on this machine, gpu_check.sh --install-only installs
  the wheels with it and imports what they hold.
"""
from __future__ import annotations

import ast
import glob
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from serverproc import REPO_ROOT

CHECK = os.path.join(REPO_ROOT, "bench", "gpu_check.sh")
WHEELHOUSE = os.path.join(REPO_ROOT, "bench", "gpu_wheelhouse.sh")
PRODUCT = ("engine", "frontend", "workers", "ipc")
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")     # the same pattern gpu_check.sh greps for

# Import names that this machine's packages_distributions() cannot map, since their packages
# exist only on a GPU machine; None: provided by shmserve itself.
GPU_ONLY = {"cuda": "cuda-bindings", "pynvml": "nvidia-ml-py", "tensorrt": "tensorrt", "torch": "torch",
            "cupy": "cupy-cuda13x", "triton_python_backend_utils": None}
# Needed by the run without an import of their own: gpu_check.sh passes pytest --timeout
PLUGINS = ("pytest-timeout",)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lines_of(*args: str) -> list[str]:
    out = subprocess.run(["bash", WHEELHOUSE, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.split() if line]


def pins() -> dict[str, str]:
    return {norm(p.split("==")[0]): p.split("==")[1] for p in lines_of("--list")}


def gpu_test_files() -> list[str]:
    found = []
    for path in glob.glob(os.path.join(REPO_ROOT, "tests", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            if GPU_MARK.search(f.read()) and os.path.abspath(path) != os.path.abspath(__file__):
                found.append(path)
    return sorted(found)


def top_imports(path: str) -> set[str]:
    """Absolute imports anywhere in the file (inside functions too: the GPU paths import late)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Import name -> the files importing it, over the product's packages and, following local
    helper modules (tests/, the test file's folder, bench/: the folders on sys.path there), the
    tests marked gpu, tests/conftest.py and bench/gpu_bench.py."""
    files = [os.path.join(d, f) for top in PRODUCT
             for d, _, fs in os.walk(os.path.join(REPO_ROOT, top)) for f in fs if f.endswith(".py")]
    todo = gpu_test_files() + [os.path.join(REPO_ROOT, "tests", "conftest.py"),
                               os.path.join(REPO_ROOT, "bench", "gpu_bench.py")]
    seen: set[str] = set()
    found: dict[str, set[str]] = {}
    for path in files:
        for name in top_imports(path):
            found.setdefault(name, set()).add(os.path.relpath(path, REPO_ROOT))
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        local_dirs = {os.path.join(REPO_ROOT, "tests"), os.path.join(REPO_ROOT, "bench"), os.path.dirname(path)}
        for name in top_imports(path):
            local = [os.path.join(d, name + ".py") for d in local_dirs if os.path.exists(os.path.join(d, name + ".py"))]
            if local:
                todo.extend(local)
            else:
                found.setdefault(name, set()).add(os.path.relpath(path, REPO_ROOT))
    return {name: where for name, where in found.items()
            if name not in sys.stdlib_module_names and name not in ("shmserve", "__future__")}


def test_both_scripts_parse():
    for script in (CHECK, WHEELHOUSE):
        out = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{script}: {out.stderr}"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi is present here")
def test_check_stops_with_no_gpu_where_nvidia_smi_is_absent(tmp_path):
    out = subprocess.run(["bash", CHECK], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, OUT=str(tmp_path)), stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == "no GPU: nvidia-smi not found"
    assert out.stdout == "" and os.listdir(tmp_path) == []      # stopped before any step


def test_the_gpu_tests_are_found():
    # the scan below and gpu_check.sh's list of test files rest on this pattern
    names = [os.path.basename(p) for p in gpu_test_files()]
    assert "test_cuda_shm_gpu.py" in names and "test_gpu_backends.py" in names


def test_every_import_is_on_the_gpu_machine_carried_or_named_too_large():
    carried, present = set(pins()), {norm(n) for n in lines_of("--present")}
    too_large = {norm(n) for n in lines_of("--not-carried")}
    dists_of = md.packages_distributions()
    uncovered, unmapped = [], []
    for name, where in sorted(third_party_imports().items()):
        if name in GPU_ONLY:
            dists = [GPU_ONLY[name]] if GPU_ONLY[name] else []
        elif name in dists_of:
            dists = dists_of[name]
        else:
            unmapped.append(f"{name} (in {', '.join(sorted(where)[:3])})")
            continue
        if dists and not any(norm(d) in carried | present | too_large for d in dists):
            uncovered.append(f"{name} -> {'/'.join(dists)} (in {', '.join(sorted(where)[:3])})")
    for plugin in PLUGINS:
        if norm(plugin) not in carried | present:
            uncovered.append(f"{plugin} (gpu_check.sh's pytest --timeout)")
    assert not unmapped, ("imports of no distribution known here: add them to GPU_ONLY or install them: "
                          + "; ".join(unmapped))
    assert not uncovered, ("neither on the GPU machine nor carried: add a pin to bench/gpu_wheelhouse.sh: "
                           + "; ".join(uncovered))


def test_the_pins_satisfy_pyproject():
    tomllib = pytest.importorskip("tomllib")     # Python 3.11
    from packaging.requirements import Requirement
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    carried, present = pins(), {norm(n) for n in lines_of("--present")}
    wrong = []
    for dep in deps:
        problem = unmet(Requirement(dep), carried, present)
        if problem:
            wrong.append(f"{dep}: {problem}")
    assert not wrong, "; ".join(wrong)


def unmet(req, carried: dict[str, str], present: set[str]) -> str:
    """Why the GPU run would not satisfy ``req`` ("" when it would): carried in a version
    outside it, or neither carried nor on the GPU machine."""
    name = norm(req.name)
    if name in carried:
        if not req.specifier.contains(carried[name], prereleases=True):
            return f"carried {name}=={carried[name]}"
        return ""
    return "" if name in present else "neither carried nor on the GPU machine"


def python312() -> str | None:
    """A Python 3.12 on this machine (pyenv keeps one here), to install the wheels with for real."""
    candidates = [shutil.which("python3.12"), "/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python3.12")))
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                 capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if out.stdout.strip() == "True":
            return exe
    return None


def wheel_requirements(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """The real script, into a folder of its own (pip's cache makes a second build quick):
    (its folder, what it printed)."""
    house = tmp_path_factory.mktemp("gpu") / "whl"
    out = subprocess.run(["bash", WHEELHOUSE, "-d", str(house)], capture_output=True, text=True,
                         timeout=240, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return house, out.stdout


def test_wheelhouse_builds_fits_and_installs_offline_for_python_312(wheelhouse, tmp_path):
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename
    house, printed = wheelhouse
    assert re.search(r"MiB  together: fits the 64 MiB a run carries", printed), printed

    # exactly one wheel a pin, at the pinned version, each one the GPU machine's CPython 3.12 on
    # x86-64 Linux (glibc 2.39) installs
    platforms = ["manylinux2014_x86_64", *(f"manylinux_2_{i}_x86_64" for i in range(5, 40)), "manylinux1_x86_64"]
    supported = set(cpython_tags((3, 12), platforms=platforms)) | set(
        compatible_tags((3, 12), "cp312", platforms=platforms))
    wheels = sorted(glob.glob(str(house / "*.whl")))
    got = {}
    for w in wheels:
        name, version, _, tags = parse_wheel_filename(os.path.basename(w))
        got[norm(name)] = str(version)
        assert set(tags) & supported, f"{w}: not for CPython 3.12 on manylinux x86-64"
    assert got == pins()
    with open(house / "not-carried.txt") as f:
        reasons = dict(line.rstrip("\n").split("\t", 1) for line in f)
    assert set(reasons) == set(lines_of("--not-carried"))

    # every carried wheel's own requirements (for CPython 3.12 on x86-64 Linux; tritonclient with
    # the grpc and http extras shmserve asks for) are carried or on the GPU machine
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix"}
    extras = {"tritonclient": ("grpc", "http")}
    present = {norm(n) for n in lines_of("--present")}
    missing = []
    for w in wheels:
        name = norm(parse_wheel_filename(os.path.basename(w))[0])
        for line in wheel_requirements(w):
            req = Requirement(line)
            wanted = req.marker is None or any(req.marker.evaluate(dict(env, extra=e))
                                               for e in ("",) + extras.get(name, ()))
            if not wanted:
                continue
            problem = unmet(req, got, present)
            if problem:
                missing.append(f"{name} needs {line}: {problem}")
    assert not missing, "; ".join(missing)

    # pip resolves the offline install for Python 3.12 (what gpu_check.sh runs there)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                          "--find-links", str(house), "--only-binary=:all:", "--python-version", "3.12",
                          "--implementation", "cp", *(a for p in platforms for a in ("--platform", p)),
                          "--target", str(tmp_path / "dry"), *(f"{n}=={v}" for n, v in got.items())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Would install" in out.stdout


def test_check_installs_the_wheelhouse_with_python_312_and_imports_it(wheelhouse, tmp_path):
    exe = python312()
    if exe is None:
        pytest.skip("no Python 3.12 on this machine to install the cp312 wheels with")
    env = dict(os.environ, GPU_CHECK_PYTHON=exe, GPU_CHECK_WHEELS=str(wheelhouse[0]),
               GPU_CHECK_SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"))
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", CHECK, "--install-only"], capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = (tmp_path / "out" / "gpu_check_summary.txt").read_text().splitlines()
    assert summary[0].startswith("PASS  install: ") and summary[1].startswith("PASS  imports: "), summary
    # every carried package was imported, or, in this bare Python, stopped only at a package the
    # GPU machine has: none went unreported
    reported = {norm(m.group(1)) for m in re.finditer(r"^(?:ok  |    ) (\S+) \S+: ", out.stdout, re.M)}
    assert reported == set(pins()), out.stdout
