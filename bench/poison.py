#!/usr/bin/env python3
"""A poison request among good ones (issue 13): how long do the good ones wait?

A 2-instance python model with dynamic batching exits its worker on the value -1 and echoes
anything else (tests/repo_builder.py POISON). C clients send good requests for D seconds; in the
second phase one more client sends the poison value every P seconds. The first phase, without
poison, is the baseline measured in the same run. Prints, per phase: good requests, good ones
that failed, p50 / p99 / max latency, poison requests and how they ended, and whether the model
was still READY at the end.

  python bench/poison.py [--clients 8] [--duration 20] [--poison-every 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np
import tritonclient.http as httpclient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
import run_http  # noqa: E402
from repo_builder import POISON, POISON_CONFIG, write_model  # noqa: E402


def _infer(client, value: int):
    inp = httpclient.InferInput("INPUT0", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return client.infer("poisonable", [inp])


def phase(url: str, clients: int, duration: float, poison_every: float) -> dict:
    latencies: list[float] = []
    failed: list[str] = []
    poison: list[str] = []
    stop = time.monotonic() + duration

    def good_loop(k: int) -> None:
        c = httpclient.InferenceServerClient(url, network_timeout=120)
        i = 0
        while time.monotonic() < stop:
            i += 1
            t = time.perf_counter()
            try:
                _infer(c, k * 1_000_000 + i)
                latencies.append(time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - counted in the table
                failed.append(repr(e)[:200])
        c.close()

    def poison_loop() -> None:
        c = httpclient.InferenceServerClient(url, network_timeout=120)
        while time.monotonic() < stop:
            try:
                _infer(c, -1)
                poison.append("answered")
            except Exception as e:  # noqa: BLE001
                poison.append("failed alone" if "retried alone" in str(e) else repr(e)[:200])
            time.sleep(poison_every)        # the scenario's pacing
        c.close()

    threads = [threading.Thread(target=good_loop, args=(k,)) for k in range(clients)]
    if poison_every > 0:
        threads.append(threading.Thread(target=poison_loop))
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 300)
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    c = httpclient.InferenceServerClient(url)
    ready = c.is_model_ready("poisonable")
    c.close()
    return {"good": len(latencies), "failed": len(failed), "p50": float(np.median(lat)),
            "p99": float(np.percentile(lat, 99)), "max": float(lat.max()),
            "poison": len(poison), "poison_outcomes": sorted(set(poison)), "ready": ready,
            "failures": failed[:3]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--poison-every", type=float, default=2.0)
    p.add_argument("--server-bin", default="shmserve")
    p.add_argument("--start-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shmserve-poison-") as work:
        repo = os.path.join(work, "models")
        write_model(repo, "poisonable", POISON_CONFIG, POISON)
        args.model_repository = repo
        proc, ports = run_http.start_server(args, work)
        try:
            url = f"127.0.0.1:{ports['http']}"
            rows = [("baseline: no poison", phase(url, args.clients, args.duration, 0)),
                    (f"poison every {args.poison_every:g} s",
                     phase(url, args.clients, args.duration, args.poison_every))]
        finally:
            run_http.stop_server(proc)
    print(f"\n{args.clients} clients, {args.duration:g} s per phase, 2 instances, dynamic batching\n")
    print("| phase | good requests | good failed | p50 ms | p99 ms | max ms | poison sent | poison "
          "outcome | model READY after |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['good']:,} | {r['failed']} | {r['p50']:.2f} | {r['p99']:.2f} | "
              f"{r['max']:.1f} | {r['poison']} | {', '.join(r['poison_outcomes']) or '-'} | "
              f"{'yes' if r['ready'] else 'NO'} |")
    for name, r in rows:
        for f in r["failures"]:
            print(f"  {name}: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
