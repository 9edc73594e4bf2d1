#!/usr/bin/env bash
# Fills .whl/ (ignored; it travels to the lent GPU machine named in a run's `carry`) with the
# cp312 manylinux x86-64 wheels that bench/gpu_check.sh installs there offline: what shmserve's
# processes and the tests marked gpu import and that machine's Python 3.12 (/opt/torch/.venv, no
# network) lacks. Run it on a machine with PyPI (this one or CI's); it needs no GPU.
#
# It prints each wheel and its size, the working tree's size (what travels besides .whl) and
# fails (exit 1) when the two together pass the 64 MiB a run may carry. It also prints the size
# of onnxruntime-gpu's and TensorRT's wheels (PyPI's metadata, nothing downloaded): the measured
# reason they cannot travel.
#
#   bash bench/gpu_wheelhouse.sh            # download into .whl/ (the old wheels there go)
#   bash bench/gpu_wheelhouse.sh -d DIR     # into DIR instead
#   bash bench/gpu_wheelhouse.sh --list     # the pins only, one NAME==VERSION a line; no network
#   bash bench/gpu_wheelhouse.sh --present  # the GPU machine's own packages, one a line
#   bash bench/gpu_wheelhouse.sh --not-carried   # needed there, too large to travel
#
# tests/project/test_gpu_rehearsal.py checks that --list covers every import the GPU run needs.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=64

# NAME VERSION WHY. Versions are those CI runs with (pip list here), so the GPU run uses a set
# the CPU suite has passed with. "missing": not on the GPU machine (device KINDS.md's package
# list). "pinned": there, but in a version nobody recorded, and one that does not match fails at
# import: tritonclient's and grpc_health's generated modules check protobuf (>=6.33.5, <7) and
# grpcio (>=1.81.1) when imported; --target's folder comes first on PYTHONPATH, so these win.
PINS=$(cat <<'EOF'
pyzmq                  27.3.0    missing: shmserve's processes talk over ZeroMQ
msgspec                0.23.0    missing: shmserve's messages between processes
httptools              0.9.0     missing: the HTTP/1.1 frontend's parser
hpack                  4.2.0     missing: the gRPC frontend's HTTP/2 header compression
grpcio-health-checking 1.81.1    missing: grpc.health.v1 in the gRPC frontend
tritonclient           2.73.0    missing: model_config_pb2 for shmserve; the tests' clients, cuda_shared_memory
python-rapidjson       1.25      missing: tritonclient's JSON
geventhttpclient       2.6.1     missing: tritonclient.http
gevent                 26.9.0    missing: geventhttpclient
greenlet               3.3.2     missing: gevent (tritonclient wants <3.4)
zope.event             6.2       missing: gevent
zope.interface         8.7       missing: gevent
brotli                 1.2.1     missing: geventhttpclient
protobuf               6.33.6    pinned: tritonclient's generated modules need >=6.33.5,<7
grpcio                 1.85.3    pinned: generated gRPC stubs need >=1.81.1
EOF
)

# The GPU machine's own packages (device KINDS.md, "Python packages already there", read on a
# machine of the 'cuda' image on 2026-11-17): what shmserve or the tests import from this list is
# not carried. tests/project/test_gpu_rehearsal.py maps every import to one of the two lists.
PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# Needed on a GPU but not obtainable within a run's limits; bench/gpu_check.sh reports the tests
# and checks that need them as SKIP with the reason this script measures (.whl/not-carried.txt).
NOT_CARRIED="onnxruntime-gpu tensorrt"

case "${1:-}" in
    --list) awk '{print $1 "==" $2}' <<<"$PINS"; exit 0 ;;
    --present) tr ' ' '\n' <<<"$PRESENT" | grep .; exit 0 ;;
    --not-carried) tr ' ' '\n' <<<"$NOT_CARRIED"; exit 0 ;;
esac
dest=.whl
if [ "${1:-}" = "-d" ] && [ -n "${2:-}" ]; then
    dest=$2
elif [ $# -gt 0 ]; then
    echo "usage: bash bench/gpu_wheelhouse.sh [--list | --present | --not-carried | -d DIR]" >&2
    exit 2
fi

# pip matches manylinux tags exactly, so every glibc the GPU machine's Ubuntu 24.04 (glibc 2.39,
# Python 3.12.3) runs is named; the wheel names printed below show which one each package gave.
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do
    platforms+=(--platform "manylinux_2_${n}_x86_64")
done

# A fresh folder first, then swapped in: a wheel of an earlier pin left beside its successor
# would make two versions of one package, and pip install of both stops the whole install.
mkdir -p "$dest"
fresh=$(mktemp -d "${TMPDIR:-/tmp}/gpu-wheelhouse.XXXXXX")
trap 'rm -rf "$fresh"' EXIT
mapfile -t reqs < <(awk '{print $1 "==" $2}' <<<"$PINS")
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    "${platforms[@]}" -d "$fresh" "${reqs[@]}"
count=$(find "$fresh" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$count" -ne "${#reqs[@]}" ]; then
    echo "expected ${#reqs[@]} wheels, pip gave $count" >&2
    exit 1
fi
rm -f "$dest"/*.whl
mv "$fresh"/*.whl "$dest"/

python3 - "$dest" "$LIMIT_MIB" <<'PY'
import json
import os
import subprocess
import sys
import urllib.request

dest, limit = sys.argv[1], float(sys.argv[2])
MIB = 1024 * 1024

def newest_files(project, version_prefix=""):
    """The newest release starting with version_prefix and its files' (name, size), from PyPI's
    JSON API (metadata only)."""
    with urllib.request.urlopen(f"https://pypi.org/pypi/{project}/json", timeout=20) as r:
        data = json.load(r)
    versions = [v for v, files in data["releases"].items()
                if v.startswith(version_prefix) and files and not any(c.isalpha() for c in v)]
    version = max(versions, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))
    return version, [(f["filename"], f["size"]) for f in data["releases"][version]]


def for_gpu_machine(name):
    return name.endswith(".whl") and "x86_64" in name and "manylinux" in name and (
        "cp312" in name or "py3-none" in name or "abi3" in name)


# The reasons travel with the wheels (not-carried.txt, NAME<TAB>reason): bench/gpu_check.sh runs
# offline and prints them where it reports SKIP.
reasons = {}
# tensorrt on PyPI pulls tensorrt-cu13 -> tensorrt-cu13-libs (the libraries) and -bindings;
# shmserve's gpu extra asks for 10.x
for dist, project, prefix in (("onnxruntime-gpu", "onnxruntime-gpu", ""),
                              ("tensorrt", "tensorrt-cu13-libs", "10.")):
    try:
        version, files = newest_files(project, prefix)
    except Exception as e:          # a size we could not read is not a reason to fail the build
        reasons[dist] = f"not carried (> {limit:g} MiB; PyPI's metadata not read here: {e})"
        continue
    wheels = [size for name, size in files if for_gpu_machine(name)]
    if wheels:
        reasons[dist] = (f"not installable offline: the {project}=={version} wheel is "
                         f"{max(wheels) / MIB:.1f} MiB, over the {limit:g} MiB a run carries")
    else:
        # NVIDIA publishes these libraries on its own index; PyPI holds a stub whose install
        # downloads them from there, and that index is not among the registries reached here
        stub = sum(size for _, size in files)
        reasons[dist] = (f"not installable offline: {project}=={version} has no wheel on PyPI, only "
                         f"a {stub / 1024:.0f} KiB sdist that fetches the libraries from NVIDIA's "
                         "own index at install time")
with open(os.path.join(dest, "not-carried.txt"), "w") as f:
    f.writelines(f"{dist}\t{why}\n" for dist, why in reasons.items())

files = sorted(os.listdir(dest))
total = 0
print(f"wheels in {dest}/ for the GPU machine (cp312, manylinux x86_64):")
for w in files:
    size = os.path.getsize(os.path.join(dest, w))
    total += size
    print(f"  {size / MIB:7.2f} MiB  {w}")
print(f"  {total / MIB:7.2f} MiB  in all ({sum(w.endswith('.whl') for w in files)} wheels)")

# What travels besides: tracked and untracked-but-not-ignored files (links as links), as the
# device tool counts them.
names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.lstat(n).st_size for n in set(names) if n and os.path.lexists(n))
print(f"  {tree / MIB:7.2f} MiB  the working tree (git ls-files, tracked and untracked)")
both = (total + tree) / MIB
verdict = "fits" if both <= limit else "does NOT fit"
print(f"  {both:7.2f} MiB  together: {verdict} the {limit:g} MiB a run carries")
print("not carried (PyPI's metadata, nothing downloaded):")
for dist, why in reasons.items():
    print(f"  {dist}: {why}")
sys.exit(0 if both <= limit else 1)
PY
