#!/usr/bin/env python3
"""Dynamic batching with perf_analyzer: mlp_onnx and identity_fp32 with and without it.

Builds a temporary repository from configs/models with a twin of each model that differs only
in dynamic batching ("_nobatch" or "_batched"), starts shmserve on it, runs perf_analyzer per model and
concurrency, and reads /v2/models/<m>/stats before and after each run to report which batch
sizes executed.

  python bench/run_batching.py [--concurrency 1,8,32] [--measurement-interval 3000]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_http  # noqa: E402
import run_perf_analyzer  # noqa: E402

MODELS = {"mlp_onnx": ["--shape", "INPUT0:256"], "identity_fp32": ["--shape", "INPUT0:16"]}


BATCHING = ("dynamic_batching {\n  preferred_batch_size: [ 16, 32 ]\n"
            "  max_queue_delay_microseconds: 500\n}\n")


def make_repository(root: str, models) -> tuple[str, list[str]]:
    """Each model as configs/ has it, plus a twin that differs only in dynamic batching: without
    it ("_nobatch") if the model batches, with it ("_batched") if not."""
    repo = os.path.join(root, "models")
    src = os.path.join(run_http.REPO_ROOT, "configs", "models")
    names = []
    for name in models:
        shutil.copytree(os.path.join(src, name), os.path.join(repo, name))
        with open(os.path.join(src, name, "config.pbtxt")) as f:
            text = f.read()
        if re.search(r"dynamic_batching\s*\{", text):
            twin = f"{name}_nobatch"
            text = re.sub(r"dynamic_batching\s*\{[^}]*\}", "", text)
        else:
            twin = f"{name}_batched"
            text += "\n" + BATCHING
        text = re.sub(r'^name:\s*"[^"]*"', f'name: "{twin}"', text, count=1, flags=re.M)
        shutil.copytree(os.path.join(src, name), os.path.join(repo, twin))
        with open(os.path.join(repo, twin, "config.pbtxt"), "w") as f:
            f.write(text)
        names += [name, twin]
    return repo, names


def batch_sizes(http_port: int, model: str) -> dict[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/stats",
                                timeout=10) as r:
        stats = json.load(r)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def describe(before: dict[int, int], after: dict[int, int]) -> str:
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(diff.values())
    if not total:
        return "-"
    mean = sum(k * v for k, v in diff.items()) / total
    top = sorted(diff.items(), key=lambda kv: -kv[1])[:3]
    return f"mean {mean:.1f}; " + ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--measurement-interval", type=int, default=3000)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    models = args.models.split(",")
    pa = run_perf_analyzer.install()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmserve-batch-") as workdir:
        args.model_repository, names = make_repository(workdir, models)
        proc, ports = run_http.start_server(args, workdir)
        try:
            for name in names:
                base = name if name in MODELS else name.rsplit("_", 1)[0]
                for c in (int(x) for x in args.concurrency.split(",")):
                    before = batch_sizes(ports["http"], name)
                    r = run_perf_analyzer.run_one(pa, f"127.0.0.1:{ports['http']}", "http", c,
                                                  MODELS[base], args.measurement_interval,
                                                  workdir, model=name)
                    after = batch_sizes(ports["http"], name)
                    rows.append((name, c, r, describe(before, after)))
                    print(f"  {name} c={c}: {r['infer_per_s']:.0f} infer/s", file=sys.stderr)
        finally:
            run_http.stop_server(proc)
    print(f"perf_analyzer over HTTP, {args.measurement_interval} ms windows, {os.cpu_count()} CPU(s)\n")
    print("| model | conc. | infer/s | p50 ms | p99 ms | batch sizes executed |")
    print("|---|---:|---:|---:|---:|---|")
    for name, c, r, sizes in rows:
        print(f"| {run_perf_analyzer.labelled(name, r)} | {c} | {r['infer_per_s']:.0f} | {r['p50_ms']:.3f} | "
              f"{r['p99_ms']:.3f} | {sizes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
