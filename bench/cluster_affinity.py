#!/usr/bin/env python3
"""Model affinity across hosts: 3 shmserve hosts behind HAProxy, hundreds of models, each host
on demand under a memory budget; HAProxy hashing on the model name against round robin.

Each host is a network namespace of its own (tests/netlab.py; needs root, iproute2 and haproxy);
every host runs ``--model-control-mode on_demand --model-memory-budget B`` where B holds about
``--fit`` of the (identity backend) models. Clients send requests through HAProxy to models
drawn from a Zipf popularity (a few models hot, a long tail), as a multi-model service sees.
Two runs on fresh hosts: HAProxy as shipped (configs/haproxy/haproxy.cfg: consistent hashing on
/v2/models/<name>), then with ``balance roundrobin``. For each: cold loads per 1,000 requests
(the hosts' shmserve_on_demand_loads_total), evictions, and request latency p50 / p99, after a
warm-up that is not counted.

  sudo python bench/cluster_affinity.py [--models 300] [--fit 50] [--requests 3000]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "e2e"))

import numpy as np  # noqa: E402
import requests  # noqa: E402
from netlab import HTTP_PORT, LAB_ENV, Lab, in_lab, unavailable  # noqa: E402
from repo_builder import write_model  # noqa: E402
from serverproc import wait_for  # noqa: E402

CONFIG = """
    backend: "identity"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


def probe_pss(repo: str, names: list[str]) -> int:
    """One worker's PSS with ``len(names)`` of these models loaded on one server."""
    from test_on_demand import probe_size
    return probe_size(repo, names)


def drive(lab: Lab, names: list[str], weights: list[float], n: int, clients: int,
          seed: int) -> tuple[list[float], list[str]]:
    """``n`` requests from ``clients`` threads through HAProxy; (latencies, errors)."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        body_for = {}
        with requests.Session() as s:
            for _ in range(n // clients):
                model = rng.choices(names, weights)[0]
                body = body_for.setdefault(model, {"inputs": [{
                    "name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
                t = time.monotonic()
                try:
                    r = s.post(f"http://127.0.0.1:{HTTP_PORT}/v2/models/{model}/infer",
                               json=body, timeout=120)
                    ok = r.status_code == 200
                    err = "" if ok else f"{model}: {r.status_code} {r.text[:200]}"
                except requests.RequestException as e:
                    err = f"{model}: {e}"
                took = time.monotonic() - t
                with lock:
                    latencies.append(took)
                    if err:
                        errors.append(err)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    return latencies, errors


def totals(lab: Lab) -> tuple[float, float]:
    loads = sum(h.counter("shmserve_on_demand_loads_total{") for h in lab.hosts)
    evictions = sum(h.counter("shmserve_on_demand_evictions_total{") for h in lab.hosts)
    return loads, evictions


def run(lab: Lab, repo: str, budget: int, balance: str, a, names, weights) -> dict:
    for h in lab.hosts:
        if h.server is not None and h.server.poll() is None:
            h.stop()
    lab.start_all(repo, "--model-control-mode", "on_demand", "--model-memory-budget",
                  str(budget))
    edit = (lambda text: text) if balance == "affinity" else \
        (lambda text: text.replace("balance uri path-only depth 3", "balance roundrobin"))
    hp = lab.balance(edit)
    wait_for(lambda: set(hp.status("shmserve_http").values()) == {"UP"}, 30, "hosts UP")
    drive(lab, names, weights, a.warmup, a.clients, a.seed)      # not counted
    loads0, ev0 = totals(lab)
    t = time.monotonic()
    lat, errors = drive(lab, names, weights, a.requests, a.clients, a.seed + 1)
    took = time.monotonic() - t
    loads1, ev1 = totals(lab)
    loaded = [sum(1 for line in h.metrics().splitlines()
                  if line.startswith("shmserve_on_demand_model_memory_bytes{")) for h in lab.hosts]
    return {"balance": balance, "requests": len(lat), "errors": errors,
            "cold_per_1000": (loads1 - loads0) * 1000 / max(len(lat), 1),
            "evictions_per_1000": (ev1 - ev0) * 1000 / max(len(lat), 1),
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "rate": len(lat) / took, "resident": loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=300)
    ap.add_argument("--fit", type=int, default=50, help="models each host's budget holds")
    ap.add_argument("--requests", type=int, default=3000, help="counted, per run")
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args()
    if not os.environ.get(LAB_ENV):
        why = unavailable()
        if why:
            sys.exit(f"cannot run: {why}")
        r = in_lab([sys.executable, *sys.argv], timeout=7200)
        sys.exit(r.returncode)

    root = tempfile.mkdtemp(prefix="shmserve-affinity-")
    lab = None
    try:
        repo = os.path.join(root, "models")
        names = [f"m{i:03d}" for i in range(a.models)]
        for m in names:
            write_model(repo, m, CONFIG, None)
        size = probe_pss(repo, names[:a.fit])
        budget = int(a.fit * size)
        print(f"{a.models} identity-backend models; one worker {size / 2**20:.2f} MiB PSS; "
              f"budget per host {budget / 2**20:.1f} MiB (about {a.fit} models)")
        weights = zipf_weights(a.models, a.zipf)
        rng = random.Random(a.seed)
        rng.shuffle(names)        # popularity unrelated to the names' hashes
        lab = Lab(3)
        results = [run(lab, repo, budget, b, a, names, weights)
                   for b in ("affinity", "round robin")]
    finally:
        if lab is not None:
            lab.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n3 hosts, {a.models} models (Zipf s={a.zipf}), {a.clients} clients, "
          f"{a.requests} requests counted after {a.warmup} of warm-up\n")
    print("| HAProxy balance | cold loads / 1,000 req | evictions / 1,000 req | p50 ms | p99 ms "
          "| req/s | models resident per host | errors |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        print(f"| {r['balance']} | {r['cold_per_1000']:.1f} | {r['evictions_per_1000']:.1f} | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.1f} | {r['rate']:.0f} | "
              f"{', '.join(map(str, r['resident']))} | {len(r['errors'])} |")
        for e in r["errors"][:3]:
            print("    ", e)


if __name__ == "__main__":
    main()
