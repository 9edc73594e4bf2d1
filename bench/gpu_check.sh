#!/usr/bin/env bash
# Every check that needs a GPU, in one run on a machine with an NVIDIA GPU (meant to finish in
# under 5 minutes, most of it pip's): install shmserve with its GPU extra in a fresh virtual
# environment, show the GPU, run every test marked gpu, then bench/gpu_bench.py. Results also go
# to $OUT (or /tmp) as gpu_tests.txt and gpu_bench.json. Exits non-zero if any step failed; the
# later steps run anyway, so that one run tells everything.
#
# On a machine without a GPU it stops at once: "no GPU: nvidia-smi not found".
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi not found" >&2
    exit 2
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "no GPU: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -n 1))" >&2
    exit 2
fi

out_dir=${OUT:-/tmp}
failed=()
step() { echo; echo "== $*"; }

step "the GPU"
nvidia-smi
# the newest CUDA the driver runs picks the builds: PyPI's onnxruntime-gpu and TensorRT are
# CUDA 13 builds (driver R580 or later); older drivers get the CUDA 12 ones
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1)
extra=gpu
if [ -n "$cuda_major" ] && [ "$cuda_major" -lt 13 ]; then
    extra=gpu-cu12
fi

step "install: .[$extra,test] (the driver runs CUDA ${cuda_major:-?})"
venv=${GPU_CHECK_VENV:-/tmp/shmserve-gpu-venv}
if [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >/dev/null 2>&1; then
    py="$venv/bin/python"
else
    echo "(no venv module: installing into $(command -v python3))"
    py=python3
    export PIP_BREAK_SYSTEM_PACKAGES=1      # a distribution's python refuses pip otherwise
fi
pip=("$py" -m pip install -q --progress-bar off --disable-pip-version-check)
if ! timeout 420 "${pip[@]}" -e ".[$extra,test]"; then
    echo "pip install failed" >&2
    exit 1
fi
# onnxruntime (a dependency of shmserve) and onnxruntime-gpu install the same module: take the
# CPU one out and write the GPU one's files again
ort_version=$("$py" -c 'import importlib.metadata as m; print(m.version("onnxruntime-gpu"))')
"$py" -m pip uninstall -q -y onnxruntime >/dev/null 2>&1
timeout 300 "${pip[@]}" --force-reinstall --no-deps "onnxruntime-gpu==$ort_version" || failed+=("onnxruntime-gpu reinstall")

step "versions"
"$py" - <<'PY' || failed+=("versions")
import importlib.metadata as m
for dist in ("onnxruntime-gpu", "tensorrt", "tensorrt-cu12", "tensorrt-cu13", "cuda-python",
             "nvidia-ml-py", "numpy", "tritonclient"):
    try:
        print(f"{dist:16} {m.version(dist)}")
    except m.PackageNotFoundError:
        pass
import onnxruntime as ort
print("onnxruntime providers:", ort.get_available_providers())
from shmserve.ipc.gpu import device as gpu
print("CUDA devices (driver API):", gpu.device_count())
assert "CUDAExecutionProvider" in ort.get_available_providers(), "no CUDA provider"
PY

step "tests marked gpu"
# among them tests/e2e/test_cuda_shm_gpu.py: CUDA shared memory from tritonclient's
# cuda_shared_memory (a server of its own, a TensorRT engine built, a 64 MiB identity)
timeout 330 "$py" -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 2>&1 | tee "$out_dir/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("gpu tests")

step "bench/gpu_bench.py"
timeout 200 "$py" bench/gpu_bench.py --seconds 3 --json "$out_dir/gpu_bench.json" || failed+=("gpu bench")

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "every GPU check passed"
