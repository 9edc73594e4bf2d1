#!/usr/bin/env bash
# Every check that needs a GPU, in one run on the lent GPU machine as it is: no network, its own
# python3 (Python 3.12 with torch, /opt/torch/.venv). Nothing is fetched: what that Python lacks
# comes as wheels in .whl/ (made beforehand, where PyPI is reached, by bench/gpu_wheelhouse.sh,
# and named in the run's carry), installed with pip --no-index into a folder put first on
# PYTHONPATH; shmserve itself is imported from this checkout through .mypy-path/shmserve (links to
# engine/ frontend/ workers/ ipc/). Then: the GPU, versions, every test marked gpu, and
# bench/gpu_bench.py, within GPU_CHECK_BUDGET seconds (280: under the 5 minutes a run may take,
# so that a rerun fits the machine's 15). The last lines are a summary, one PASS / FAIL / SKIP
# (with the reason) a check; the later checks run after an earlier one failed, so that one run
# tells everything.
# Results also go to $OUT (or /tmp): gpu_check_summary.txt, gpu_versions.txt, gpu_tests.txt,
# gpu_tests.xml, gpu_bench.json. Exit status: 0 no FAIL, 1 a FAIL, 2 no GPU (it stops at once:
# "no GPU: nvidia-smi not found").
#
#   bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --install-only   # no GPU needed: only the offline install from .whl/
#                                            # and the carried packages' imports (the rehearsal,
#                                            # tests/project/test_gpu_rehearsal.py)
# GPU_CHECK_PYTHON (python3), GPU_CHECK_SITE (/tmp/shmserve-gpu-site) and GPU_CHECK_WHEELS (.whl)
# name the Python, the install folder and the wheels.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD

mode=gpu
case "${1:-}" in
    "") ;;
    --install-only) mode=install ;;
    *) echo "usage: bash bench/gpu_check.sh [--install-only]" >&2; exit 2 ;;
esac

if [ "$mode" = gpu ]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "no GPU: nvidia-smi not found" >&2
        exit 2
    fi
    if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        echo "no GPU: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -n 1))" >&2
        exit 2
    fi
fi

py=${GPU_CHECK_PYTHON:-python3}
site=${GPU_CHECK_SITE:-/tmp/shmserve-gpu-site}
wheels=${GPU_CHECK_WHEELS:-.whl}
out_dir=${OUT:-/tmp}
budget=${GPU_CHECK_BUDGET:-280}
export PIP_NO_INDEX=1                   # any pip a test might start stays off the network too
export PYTHONUNBUFFERED=1
export PIP_ROOT_USER_ACTION=ignore      # the GPU machine runs commands as root
mkdir -p "$out_dir"

summary=()
result() {      # result PASS|FAIL|SKIP "what: why"
    summary+=("$(printf '%-4s  %s' "$1" "$2")")
}
step() { echo; echo "== $*"; }
# seconds a step may take: its own cap, or less when the whole budget is running out
left() {
    local rest=$((budget - SECONDS))
    [ "$rest" -lt 10 ] && rest=10
    [ "$rest" -gt "$1" ] && rest=$1
    echo "$rest"
}
# why a package that could not travel is absent, as bench/gpu_wheelhouse.sh measured it
why_not_carried() {
    local why
    why=$(awk -F '\t' -v d="$1" '$1 == d {print $2}' "$wheels/not-carried.txt" 2>/dev/null)
    echo "${why:-not installable offline (.whl/not-carried.txt does not say why)}"
}
finish() {
    echo
    echo "== summary ($mode, ${SECONDS}s)"
    printf '%s\n' "${summary[@]}" | tee "$out_dir/gpu_check_summary.txt"
    if printf '%s\n' "${summary[@]}" | grep -q '^FAIL'; then
        exit 1
    fi
    exit 0
}

if [ "$mode" = gpu ]; then
    step "the GPU"
    nvidia-smi
    result PASS "GPU: $(nvidia-smi -L | head -n 1)"
fi

step "python: $py"
# the wheels are cp312 builds: another Python could not load their extension modules
if ! "$py" -c 'import sys; print(sys.executable, sys.version); sys.exit(sys.version_info[:2] != (3, 12))'; then
    result FAIL "python: $py is not Python 3.12, which the wheels in $wheels are built for"
    finish
fi

step "install: $wheels/*.whl into $site, offline"
shopt -s nullglob
whl=("$wheels"/*.whl)
shopt -u nullglob
if [ ${#whl[@]} -eq 0 ]; then
    result FAIL "install: no wheels in $wheels/ (run bash bench/gpu_wheelhouse.sh where PyPI is reached, and carry .whl)"
    finish
fi
if timeout "$(left 90)" "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$site" "${whl[@]}"; then
    result PASS "install: ${#whl[@]} wheels from $wheels, --no-index"
else
    result FAIL "install: pip install --no-index from $wheels failed"
    finish
fi
# first on the path: the carried versions win over the machine's own (protobuf, grpcio)
export PYTHONPATH="$site:$repo/.mypy-path${PYTHONPATH:+:$PYTHONPATH}"

step "imports: the carried packages from $site"
# Each carried distribution must be the one Python finds (its version, under $site) and its
# modules must import. In --install-only mode (another machine's Python 3.12, without the GPU
# machine's packages) a module whose import stops at a package that the GPU machine has
# (bench/gpu_wheelhouse.sh --present) is only reported; stopping anywhere else is a FAIL.
present=$(bash bench/gpu_wheelhouse.sh --present | tr '\n' ' ')
if timeout "$(left 60)" "$py" - "$site" "$mode" "$present" <<'PY'; then
import importlib
import importlib.metadata as md
import os
import pathlib
import re
import sys
import warnings

# tritonclient's old module names (tritongrpcclient, ...) warn on import whatever the filters
# say (they set "always"): not shown
warnings.showwarning = lambda *args, **kwargs: None
site, mode, present = os.path.realpath(sys.argv[1]), sys.argv[2], set(sys.argv[3].split())
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
# import names that are not their distribution's name, among the GPU machine's packages
DIST_OF = {"cuda": "cuda-bindings", "yaml": "pyyaml", "pynvml": "nvidia-ml-py", "cupy": "cupy-cuda13x",
           "google": "protobuf", "PIL": "pillow", "dateutil": "python-dateutil"}


def modules(dist):
    """The importable names a distribution installs: top-level modules and packages, and the
    packages inside a namespace folder (zope/interface, google/protobuf)."""
    files = {str(f) for f in dist.files or ()}
    names = set()
    for f in files:
        parts = f.split("/")
        if parts[0].endswith((".dist-info", ".data")) or parts[0].startswith("_") or parts[0] == "..":
            continue
        if len(parts) == 1 and f.endswith((".py", ".so")):
            names.add(parts[0].split(".")[0])
        elif len(parts) == 2 and parts[1] == "__init__.py":
            names.add(parts[0])
        elif len(parts) == 3 and parts[2] == "__init__.py" and f"{parts[0]}/__init__.py" not in files:
            names.add(f"{parts[0]}.{parts[1]}")
    return sorted(names)


failed = 0
for info in sorted(pathlib.Path(site).glob("*.dist-info")):
    carried = md.PathDistribution(info)
    name = carried.metadata["Name"]
    found = md.distribution(name)
    where = os.path.realpath(str(found.locate_file("")))
    if found.version != carried.version or where != site:
        print(f"FAIL {name}: Python finds {found.version} in {where}, not the carried {carried.version}")
        failed += 1
        continue
    for mod in modules(carried):
        try:
            m = importlib.import_module(mod)
        except Exception as e:
            # the module that was not found, also where a package turns that into another
            # error (tritonclient.grpc: "does not include grpc support")
            cause = e
            while cause is not None and not isinstance(cause, ModuleNotFoundError):
                cause = cause.__cause__ or cause.__context__
            top = (cause.name or "?").split(".")[0] if cause is not None else None
            dist = DIST_OF.get(top, top) if top else None
            if mode == "install" and dist and norm(dist) in present:
                print(f"     {name} {carried.version}: {mod} needs {dist}, which the GPU machine has")
            else:
                print(f"FAIL {name} {carried.version}: import {mod}: {type(e).__name__}: {e}")
                failed += 1
            continue
        path = os.path.realpath(getattr(m, "__file__", None) or next(iter(m.__path__)))
        if not path.startswith(site + os.sep):
            print(f"FAIL {name}: {mod} comes from {path}, not {site}")
            failed += 1
        else:
            print(f"ok   {name} {carried.version}: {mod}")
sys.exit(1 if failed else 0)
PY
    result PASS "imports: every carried package is the carried version and imports"
else
    result FAIL "imports: a carried package is shadowed or does not import (above)"
fi

if [ "$mode" = install ]; then
    finish
fi

step "imports: every shmserve module, tritonclient's clients and CUDA shared memory"
if timeout "$(left 60)" "$py" - <<'PY'; then
import importlib
import pkgutil

failed = []
count = 0
for pkg in ("shmserve.ipc", "shmserve.engine", "shmserve.frontend", "shmserve.workers"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
for mod in ("tritonclient.http", "tritonclient.grpc", "tritonclient.utils.cuda_shared_memory"):
    try:
        importlib.import_module(mod)
    except Exception as e:
        failed.append(f"{mod}: {type(e).__name__}: {e}")
print(f"{count} shmserve modules imported")
print("\n".join(failed))
raise SystemExit(1 if failed else 0)
PY
    result PASS "imports: every shmserve module, tritonclient.http/grpc/cuda_shared_memory"
else
    result FAIL "imports: shmserve or tritonclient (above)"
fi

step "versions"
timeout "$(left 60)" "$py" - <<'PY' > "$out_dir/gpu_versions.txt" 2>&1
import importlib.metadata as m
for dist in ("torch", "cupy-cuda13x", "cuda-bindings", "cuda-core", "nvidia-ml-py", "numpy", "onnxruntime",
             "onnxruntime-gpu", "tensorrt", "tensorrt-cu13", "protobuf", "grpcio", "tritonclient"):
    try:
        print(f"{dist:16} {m.version(dist)}")
    except m.PackageNotFoundError:
        print(f"{dist:16} -")
for what, probe in (
        ("onnxruntime providers", "__import__('onnxruntime').get_available_providers()"),
        ("torch sees", "__import__('torch').cuda.get_device_name(0)"),
        ("CUDA devices (shmserve, driver API)", "__import__('shmserve.ipc.gpu.device').ipc.gpu.device.device_count()")):
    try:
        print(f"{what}: {eval(probe)}")
    except Exception as e:
        print(f"{what}: none ({type(e).__name__}: {e})")
PY
cat "$out_dir/gpu_versions.txt"
# torch (the python models' device tensors in issue 42's GPU tests) must see the GPU here
if torch_gpu=$(sed -n 's/^torch sees: \(.*\)/\1/p' "$out_dir/gpu_versions.txt") && [ -n "$torch_gpu" ] &&
        [ "${torch_gpu#none}" = "$torch_gpu" ]; then
    result PASS "torch: sees $torch_gpu"
else
    result FAIL "torch: does not see the GPU (${torch_gpu:-gpu_versions.txt})"
fi
if grep -q "CUDAExecutionProvider" "$out_dir/gpu_versions.txt"; then
    ort_gpu=1
    result PASS "onnxruntime-gpu: the CUDA execution provider is there"
else
    ort_gpu=0
    result SKIP "onnxruntime-gpu: $(why_not_carried onnxruntime-gpu)"
fi
if "$py" -c 'import tensorrt' 2>/dev/null; then
    result PASS "tensorrt: $("$py" -c 'import tensorrt; print(tensorrt.__version__)')"
else
    result SKIP "tensorrt: $(why_not_carried tensorrt)"
fi

step "tests marked gpu"
mapfile -t gpu_tests < <(grep -rlE --include='*.py' 'pytest\.mark\.gpu' tests | sort)
echo "${gpu_tests[*]}"
rm -f "$out_dir/gpu_tests.xml" "$out_dir/gpu_bench.json"     # no stale results from an earlier run
# -o addopts= : the project's "-n 2" needs pytest-xdist; it is asked for again only where present
xdist=()
"$py" -c 'import xdist' 2>/dev/null && xdist=(-n 2)
timeout -k 10 "$(left 170)" "$py" -m pytest -o addopts= "${xdist[@]}" -m gpu -q -rA -p no:cacheprovider \
    --timeout 120 --junitxml="$out_dir/gpu_tests.xml" "${gpu_tests[@]}" 2>&1 | tee "$out_dir/gpu_tests.txt"
rc=${PIPESTATUS[0]}
# one summary line a test, from the JUnit XML (pytest writes it unless it was killed)
if [ -s "$out_dir/gpu_tests.xml" ]; then
    while IFS= read -r line; do
        summary+=("$line")
    done < <("$py" - "$out_dir/gpu_tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

def first_line(element):
    text = (element.get("message") or element.text or "").strip()
    return text.splitlines()[0][:200] if text else ""


for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    # find() is compared with None: an Element without children is false
    failure = case.find("failure") if case.find("failure") is not None else case.find("error")
    skipped = case.find("skipped")
    if failure is not None:
        print(f"FAIL  test {name}: {first_line(failure)}")
    elif skipped is not None:
        print(f"SKIP  test {name}: {first_line(skipped)}")
    else:
        print(f"PASS  test {name}")
PY
)
fi
case $rc in
    0) ;;
    124|137) result FAIL "tests marked gpu: stopped at the time limit (gpu_tests.txt)" ;;
    5) result FAIL "tests marked gpu: none collected from ${gpu_tests[*]}" ;;
    # a failed test has its FAIL line above; an exit status without one (a collection error,
    # pytest's own error) gets its own
    *) printf '%s\n' "${summary[@]}" | grep -q '^FAIL  test ' ||
           result FAIL "tests marked gpu: pytest exited $rc (gpu_tests.txt)" ;;
esac

step "bench/gpu_bench.py"
# The bench serves and measures its network with onnxruntime's CUDA provider (KIND_GPU, and
# in-process as the limit): without onnxruntime-gpu it has nothing to measure. When the bench
# moves to a torch model (issue 42, item 3), this gate goes.
if [ "$ort_gpu" = 1 ]; then
    if timeout -k 10 "$(left 90)" "$py" bench/gpu_bench.py --seconds 3 --json "$out_dir/gpu_bench.json"; then
        result PASS "bench/gpu_bench.py: gpu_bench.json"
    else
        result FAIL "bench/gpu_bench.py (above)"
    fi
else
    result SKIP "bench/gpu_bench.py: it runs onnxruntime's CUDA provider; onnxruntime-gpu $(why_not_carried onnxruntime-gpu)"
fi
finish
