"""bench/gpu_check.sh and bench/gpu_bench.py on a machine without a GPU: the check stops at once
with the reason, and the bench's GPU-independent parts (model building, the in-process loop,
the server run at c=1 and c=16, the table) run with --cpu-dry-run."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from serverproc import REPO_ROOT

BENCH = os.path.join(REPO_ROOT, "bench")


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(BENCH, "gpu_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = mod          # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi is present")
def test_gpu_check_fails_fast_without_a_gpu():
    r = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh")], capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip() == "no GPU: nvidia-smi not found"
    assert r.stdout == ""       # nothing installed, nothing run


def test_convnet_builder_and_table(tmp_path):
    pytest.importorskip("onnx")
    bench = _bench()
    import numpy as np
    import onnxruntime as ort
    path = str(tmp_path / "convnet.onnx")
    params = bench.build_convnet(path, **bench.TINY)
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (y,) = s.run(None, {"INPUT0": np.zeros((2, 3, 32, 32), np.float32)})
    assert y.shape == (2, 10) and params > 0
    text = bench.table("t", [bench.Row("a", "1", 10.0, 1.0, 2.0, 0.5), bench.Row("b", "1", note="skipped: x")])
    lines = text.splitlines()
    assert lines[5].index("skipped: x") == lines[2].index("note")      # columns line up


def test_gpu_bench_cpu_dry_run(tmp_path):
    pytest.importorskip("onnx")
    out = tmp_path / "bench.json"
    r = subprocess.run(["python3", os.path.join(BENCH, "gpu_bench.py"), "--cpu-dry-run",
                        "--seconds", "0.5", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "onnxruntime in process, batch 1" in r.stdout and "shmserve HTTP binary" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    served = [row for row in rows if row["what"] == "shmserve HTTP binary"]
    assert [row["concurrency"] for row in served] == ["1", "16"]
    assert all(row["per_s"] > 0 and row["vs_limit"] > 0 for row in served)
    skipped = [row["note"] for row in rows if "CUDA" in row["what"] or "cudaMemcpy" in row["what"]]
    assert skipped == ["skipped: no GPU", "skipped: no GPU"]
