#!/usr/bin/env python3
"""On-demand loading under a memory budget (--model-control-mode=on_demand), at scale.

N small python models (identity, FP32 [4]) in one repository; a budget that holds about F of
them: a probe server loads F models and the budget is F times their mean PSS. Then (the same as
tests/e2e/test_on_demand.py test_many_models_under_a_budget, longer, with the figures):

1. random traffic: C clients each send R requests to models picked at random; every answer is
   checked, and the PSS of all the server's workers is summed every 50 ms;
2. cold requests: one client sends K requests, each to a model the index shows not loaded at
   that moment (so each waits for a load, and for an eviction with its worker's exit first);
3. the server stops; no process and no /dev/shm segment of it may be left.

Prints the first-request latency of cold models (p50 / p99), the latency of all requests in
phase 1, loads and evictions, and the peak memory against the budget.

  python bench/on_demand.py [--models 500] [--fit 50] [--clients 4] [--requests 250] [--cold 100]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "e2e"))

import numpy as np  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from serverproc import descendants  # noqa: E402
from test_on_demand import (  # noqa: E402
    MIB,
    identity_repo,
    index,
    infer_http,
    metrics,
    on_demand,
    probe_size,
    run_many,
    stop_clean,
    worker_pss,
    x_for,
)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server's processes, by role."""
    out: dict[str, float] = {}
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = next((r for key, r in ((b"engine.scheduler", "scheduler"),
                                      (b"frontend.main", "frontend"),
                                      (b"workers.zygote", "fork server"),
                                      (b"workers.main", "workers (alive)"))
                     if key in cmd), "launcher")
        # a process's own time plus that of its reaped children (the workers that exited)
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        dead = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
        out[role] = out.get(role, 0.0) + own
        if dead:
            out["workers (exited)" if role == "scheduler" else role] = \
                out.get("workers (exited)" if role == "scheduler" else role, 0.0) + dead
    return out


def sums(page: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=500)
    ap.add_argument("--fit", type=int, default=50, help="models the budget holds, about")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=250, help="per client, phase 1")
    ap.add_argument("--cold", type=int, default=100, help="cold requests, phase 2")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()

    root = tempfile.mkdtemp(prefix="shmserve-on-demand-")
    try:
        names = [f"m{i:03d}" for i in range(a.models)]
        t = time.monotonic()
        repo = identity_repo(root, a.models)
        print(f"repository: {a.models} identity models ({time.monotonic() - t:.1f} s to write)")
        size = probe_size(repo, names[:a.fit])
        budget = int(a.fit * size)
        print(f"probe: one worker {size / MIB:.2f} MiB (PSS, {a.fit} alive); "
              f"budget {budget / MIB:.1f} MiB")

        t = time.monotonic()
        srv = on_demand(repo, "--model-memory-budget", str(budget))
        print(f"server ready in {time.monotonic() - t:.1f} s (every model listed, none loaded)")
        try:
            t = time.monotonic()
            peak, errors, latencies = run_many(srv, names, a.clients, a.requests, budget, a.seed)
            took = time.monotonic() - t
            cpu = cpu_by_role(srv.proc.pid)
            page = metrics(srv)
            loads1 = sums(page, "shmserve_on_demand_loads_total{")

            rng = random.Random(a.seed)
            c = httpclient.InferenceServerClient(srv.url, network_timeout=300)
            cold: list[float] = []
            cold_errors: list[str] = []
            for i in range(a.cold):
                idx = index(srv)
                out = [m for m in names if idx[m].get("state") != "READY"]
                model = rng.choice(out)
                t0 = time.monotonic()
                try:
                    y = infer_http(c, model, float(i))
                    if not np.array_equal(y, x_for(float(i))):
                        cold_errors.append(f"{model}: wrong answer")
                except Exception as e:      # noqa: BLE001 - counted below
                    cold_errors.append(f"{model}: {e}")
                cold.append(time.monotonic() - t0)
            warm = []
            for i in range(a.cold):
                t0 = time.monotonic()
                infer_http(c, model, float(i))       # the last cold model, loaded now
                warm.append(time.monotonic() - t0)
            peak_cold = max(sum(worker_pss(srv).values()), 0)
            page = metrics(srv)
        finally:
            stop_clean(srv)         # asserts: no process and no segment left

        evict_budget = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                           if line.startswith("shmserve_on_demand_evictions_total{") and
                           'reason="budget"' in line)
        loads = sums(page, "shmserve_on_demand_loads_total{")
        wait_n = sums(page, "shmserve_on_demand_load_wait_us_count")
        wait_sum = sums(page, "shmserve_on_demand_load_wait_us_sum")
        resident = sums(page, "shmserve_on_demand_resident_bytes ")
        print()
        print(f"phase 1: {len(latencies)} requests from {a.clients} clients to random models in "
              f"{took:.1f} s ({len(latencies) / took:.0f}/s), {len(errors)} failed or wrong")
        for e in errors[:5]:
            print("   ", e)
        print(f"   latency of every request: p50 {pct(latencies, 50) * 1e3:.1f} ms, "
              f"p99 {pct(latencies, 99) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms")
        print(f"   loads {loads1:.0f} ({loads1 / len(latencies):.0%} of requests)")
        print("   CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items())))
        print(f"   peak worker PSS {peak[0] / MIB:.1f} MiB in {peak[1]} workers = "
              f"{peak[0] / budget:.1%} of the budget ({budget / MIB:.1f} MiB): "
              f"{'UNDER' if peak[0] <= budget else 'OVER'}")
        print(f"phase 2: {len(cold)} cold first requests, {len(cold_errors)} failed: "
              f"p50 {pct(cold, 50) * 1e3:.1f} ms, p99 {pct(cold, 99) * 1e3:.1f} ms, "
              f"max {max(cold) * 1e3:.1f} ms (warm: p50 {pct(warm, 50) * 1e3:.2f} ms, "
              f"p99 {pct(warm, 99) * 1e3:.2f} ms)")
        for e in cold_errors[:5]:
            print("   ", e)
        print(f"server totals: loads {loads:.0f}, evictions for the budget {evict_budget:.0f}, "
              f"requests that waited for a load {wait_n:.0f} (mean wait "
              f"{wait_sum / max(wait_n, 1) / 1e3:.1f} ms), resident at the end "
              f"{resident / MIB:.1f} MiB (workers' PSS {peak_cold / MIB:.1f} MiB)")
        print("after stop: no process and no /dev/shm segment left")
        if errors or cold_errors or peak[0] > budget:
            sys.exit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
