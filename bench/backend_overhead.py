#!/usr/bin/env python3
"""What serving a model through a python-based backend costs against the same code as a plain
python model, in one server and one run (the real perf_analyzer, HTTP, rows interleaved).

Two models with the same python identity code (16 FP32, as side_by_side.sh's identity_fp32):
``plain`` (``backend: "python"``, its own ``1/model.py``: the baseline) and ``based``
(``backend: "identity_code"``, the same code as ``<backend directory>/identity_code/model.py``).

  python bench/backend_overhead.py [--concurrency 1 --concurrency 8] [--passes 3]

The table gives medians over the passes: infer/s and p50 latency (client side), and the
model's load time (from the start of the load until READY, the server's log).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PA = os.path.expanduser("~/.cache/shmserve-tools/perf_analyzer")
CONFIG = """
backend: "{backend}"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
"""
# the python identity model of the response-cache bench (side_by_side.sh's identity_fp32)
from response_cache import CODE  # noqa: E402  (bench/ is the script's own folder on sys.path)


def write_repo(root: str) -> tuple[str, str]:
    repo, backends = os.path.join(root, "models"), os.path.join(root, "backends")
    os.makedirs(os.path.join(backends, "identity_code"))
    with open(os.path.join(backends, "identity_code", "model.py"), "w") as f:
        f.write(CODE)
    for name, backend in (("plain", "python"), ("based", "identity_code")):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(CONFIG.format(backend=backend))
        if backend == "python":
            with open(os.path.join(repo, name, "1", "model.py"), "w") as f:
                f.write(CODE)
    return repo, backends


def load_ms(url: str, model: str) -> float:
    """Unload and load the model again: the load's wall time as the client sees it."""
    for action in ("unload", "load"):
        req = urllib.request.Request(f"http://{url}/v2/repository/models/{model}/{action}",
                                     data=b"{}", method="POST")
        t0 = time.perf_counter()
        urllib.request.urlopen(req, timeout=120).read()
    return (time.perf_counter() - t0) * 1e3


def measure(url: str, model: str, concurrency: int) -> dict[str, float]:
    cmd = [PA, "-m", model, "-u", url, "--concurrency-range", str(concurrency),
           "--measurement-interval", "2000", "--stability-percentage", "999", "--max-trials", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    return {"infer/s": float(re.search(r"Throughput: ([\d.]+)", out.stdout).group(1)),
            "p50 us": float(re.search(r"p50 latency: (\d+)", out.stdout).group(1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-backend-overhead-")
    repo, backends = write_repo(tmp)
    # explicit mode, every model loaded at start, so that the bench may reload them
    url = ""
    port_file = os.path.join(tmp, "ports.json")
    server = subprocess.Popen(
        [sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", repo,
         "--backend-directory", backends, "--model-control-mode", "explicit", "--load-model", "*",
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--port-file", port_file],
        stdout=open(os.path.join(tmp, "server.log"), "wb"), stderr=subprocess.STDOUT)
    rows: dict[tuple[int, str], list[dict]] = {}
    loads: dict[str, list[float]] = {"plain": [], "based": []}
    try:
        deadline = time.monotonic() + 60
        while not url:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the server did not start (log in {tmp})")
            try:
                with open(port_file) as f:
                    candidate = f"127.0.0.1:{json.load(f)['http']}"
                if urllib.request.urlopen(f"http://{candidate}/v2/health/ready").status == 200:
                    url = candidate
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        for _ in range(a.passes):
            for model in ("plain", "based"):
                loads[model].append(load_ms(url, model))
        for c in a.concurrency or [1, 8]:
            for _ in range(a.passes):
                for model in ("plain", "based"):
                    rows.setdefault((c, model), []).append(measure(url, model, c))
    finally:
        server.terminate()
        server.wait(60)
    print(f"python-based backend against a python model, HTTP, identity 16 FP32, medians of "
          f"{a.passes} interleaved passes")
    print(f"{'c':>3} {'model':<34} {'infer/s':>10} {'p50 us':>10}")
    what = {"plain": "plain (python model, baseline)", "based": "based (python-based backend)"}
    for (c, model), passes in rows.items():
        print(f"{c:>3} {what[model]:<34} {statistics.median(p['infer/s'] for p in passes):>10.1f} "
              f"{statistics.median(p['p50 us'] for p in passes):>10.1f}")
    for model, times in loads.items():
        print(f"load (unload + load, client side) {what[model]}: median {statistics.median(times):.0f} ms")


if __name__ == "__main__":
    main()
