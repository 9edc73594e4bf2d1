#!/usr/bin/env python3
"""The response cache: what a hit saves and what a miss costs, against the same model without
the cache, in one server and one run (the real perf_analyzer, HTTP, rows interleaved).

Three models with the same python identity code (16 FP32, as side_by_side.sh's identity_fp32):
``plain`` (no cache: the baseline), ``cached`` (response_cache on; perf_analyzer sends the same
input every time, so after the first request every one is a hit) and ``churn`` (response_cache
on, fed 2,000 different inputs in turn from --input-data, more than the cache holds: least
recently used goes first, so every request is a miss that hashes, runs and inserts).

  python bench/response_cache.py [--concurrency 1 --concurrency 8] [--passes 3]

The table gives medians over the passes: infer/s, p50 latency, and the server's own average
cache hit and miss times (lookup, and lookup plus insert) from the statistics API.
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
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
{extra}
"""
CODE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
"""
DISTINCT = 2000
CACHE_BYTES = 64 * 1024         # ~150 entries of this model: fewer than DISTINCT


def write_repo(root: str) -> tuple[str, str]:
    repo = os.path.join(root, "models")
    for name, extra in (("plain", ""), ("cached", "response_cache { enable: true }"),
                        ("churn", "response_cache { enable: true }")):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(CONFIG.format(name=name, extra=extra))
        with open(os.path.join(repo, name, "1", "model.py"), "w") as f:
            f.write(CODE)
    data = os.path.join(root, "distinct.json")
    with open(data, "w") as f:
        json.dump({"data": [{"INPUT0": [float(i)] + [0.0] * 15} for i in range(DISTINCT)]}, f)
    return repo, data


def start(repo: str, tmp: str) -> tuple[subprocess.Popen, str]:
    port_file = os.path.join(tmp, "ports.json")
    server = subprocess.Popen(
        [sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", repo,
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--port-file", port_file, "--cache-config", f"local,size={CACHE_BYTES}"],
        stdout=open(os.path.join(tmp, "server.log"), "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError(f"the server did not start (log in {tmp})")
        try:
            with open(port_file) as f:
                url = f"127.0.0.1:{json.load(f)['http']}"
            if urllib.request.urlopen(f"http://{url}/v2/health/ready").status == 200:
                return server, url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)


def stats(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"http://{url}/v2/models/{model}/stats", timeout=10) as r:
        return json.load(r)["model_stats"][0]["inference_stats"]


def measure(url: str, model: str, concurrency: int, data: str) -> dict[str, float]:
    before = stats(url, model)
    cmd = [PA, "-m", model, "-u", url, "--concurrency-range", str(concurrency),
           "--measurement-interval", "2000", "--stability-percentage", "999", "--max-trials", "3"]
    if model == "churn":
        cmd += ["--input-data", data]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    after = stats(url, model)
    row = {"infer/s": float(re.search(r"Throughput: ([\d.]+)", out.stdout).group(1)),
           "p50 us": float(re.search(r"p50 latency: (\d+)", out.stdout).group(1))}
    for kind in ("cache_hit", "cache_miss"):
        n = after[kind]["count"] - before[kind]["count"]
        ns = after[kind]["ns"] - before[kind]["ns"]
        row[kind + " us"] = ns / n / 1e3 if n else float("nan")
        row[kind + " n"] = n
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-response-cache-")
    repo, data = write_repo(tmp)
    server, url = start(repo, tmp)
    rows: dict[tuple[int, str], list[dict]] = {}
    try:
        for c in a.concurrency or [1, 8]:
            for _ in range(a.passes):
                for model in ("plain", "cached", "churn"):
                    rows.setdefault((c, model), []).append(measure(url, model, c, data))
    finally:
        server.terminate()
        server.wait(60)
    keys = ("infer/s", "p50 us", "cache_hit us", "cache_miss us")
    print(f"response cache, HTTP, identity 16 FP32, medians of {a.passes} interleaved passes")
    print(f"{'c':>3} {'model':<30} " + " ".join(f"{k:>14}" for k in keys) + "  hits/misses")
    what = {"plain": "plain (no cache, baseline)", "cached": "cached (every request a hit)",
            "churn": "churn (every request a miss)"}
    for (c, model), passes in rows.items():
        med = {k: statistics.median(p[k] for p in passes) for k in keys}
        counts = f"{sum(p['cache_hit n'] for p in passes)}/{sum(p['cache_miss n'] for p in passes)}"
        print(f"{c:>3} {what[model]:<30} " + " ".join(f"{med[k]:>14.1f}" for k in keys)
              + f"  {counts}")


if __name__ == "__main__":
    main()
