#!/usr/bin/env python3
"""Footprint: memory and start-up time per model with workers forked from the fork server
(`--worker-start fork`, the default) against workers spawned as fresh interpreters
(`--worker-start spawn`), both in the same run (issue 18).

Cases: N copies of identity_fp32 (python backend; 50 and 200 by default) and of mlp_onnx (the
native onnxruntime MLP, 2 instances each; 20 by default). For each case and each start mode:
- wall time from launching `shmserve` to all N models READY, and the CPU seconds the server's
  live processes had used by then;
- PSS of the whole server process tree (launcher, frontend, scheduler, fork server, workers;
  /proc/<pid>/smaps_rollup) divided by N, once ready and idle;
- the same after --traffic-secs of requests sent round-robin to every model by a Python
  client loop, so that what copy-on-write un-shares while models run is counted; and the
  median worker's USS (its private pages) then.

Helpers (repository, smaps, readiness, idle wait, stop) come from bench/scale.py.

  python bench/footprint.py [--quick] [--traffic-secs 60] [--cases identity:50,identity:200,mlp:20]
                            [--json] [--png PATH]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_http  # noqa: E402
import scale  # noqa: E402
import soak  # noqa: E402

MIB = scale.MIB
MODELS = {  # case name -> (model directory, input shape of one request)
    "identity": (scale.SOURCE, (1, 64)),
    "mlp": (os.path.join(run_http.REPO_ROOT, "configs", "models", "mlp_onnx"), (1, 256)),
}
MODES = ("fork", "spawn")


def tree_memory(root: int) -> dict:
    """PSS of every process of the server's tree, the workers' USS, and how many there are."""
    tree = soak.processes(root)
    total, workers = 0, []
    for pid, (role, _) in tree.items():
        m = scale.smaps(pid)
        if m is None:
            continue
        total += m["pss"]
        if role.startswith("worker"):
            workers.append(m)
    return {"pss_total": total, "workers": len(workers), "processes": len(tree),
            "worker_uss_median": statistics.median(w["uss"] for w in workers) if workers else 0,
            "worker_pss_median": statistics.median(w["pss"] for w in workers) if workers else 0}


def traffic(base: str, names: list[str], shape: tuple[int, ...], seconds: float,
            clients: int) -> dict:
    """``clients`` threads, each sending one request at a time, round-robin over every model
    (each thread starting at a different one), for ``seconds``."""
    import tritonclient.http as httpclient
    url = base.removeprefix("http://")
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    counts, errors = [0] * clients, [0] * clients
    end = time.monotonic() + seconds

    def loop(k: int) -> None:
        c = httpclient.InferenceServerClient(url, network_timeout=60)
        inp = httpclient.InferInput("INPUT0", list(shape), "FP32")
        inp.set_data_from_numpy(x)
        order = itertools.islice(itertools.cycle(names), k * len(names) // clients, None)
        try:
            for name in order:
                if time.monotonic() >= end:
                    break
                try:
                    c.infer(name, [inp])
                    counts[k] += 1
                except Exception:
                    errors[k] += 1
        finally:
            c.close()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return {"requests": sum(counts), "errors": sum(errors), "seconds": seconds}


def run_one(case: str, n: int, mode: str, repo: str, names: list[str], args) -> dict:
    res: dict = {"case": case, "models": n, "mode": mode}
    with tempfile.TemporaryDirectory(prefix="shmserve-footprint-") as work:
        port_file = os.path.join(work, "ports.json")
        cmd = run_http._server_cmd(args.server_bin) + [
            "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", "0", "--port-file", port_file, "--worker-start", mode]
        log_path, known = os.path.join(work, "server.log"), {}
        http = requests.Session()
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=run_http.REPO_ROOT, start_new_session=True)
        try:
            base, times = scale.wait_ready(proc, port_file, http, n, t0 + args.start_timeout, t0)
            res["ready_s"] = times["all_ready_s"]
            tree = soak.processes(proc.pid)
            known.update((pid, scale.start_time(pid)) for pid in tree)
            res["start_cpu_s"] = scale.cpu_ticks(tree) / os.sysconf("SC_CLK_TCK")
            scale.wait_idle(tree, time.monotonic() + 60)
            res["idle"] = tree_memory(proc.pid)
            shape = MODELS[case][1]
            res["traffic"] = traffic(base, names, shape, args.traffic_secs, args.clients)
            tree = soak.processes(proc.pid)
            known.update((pid, scale.start_time(pid)) for pid in tree)
            scale.wait_idle(tree, time.monotonic() + 60)
            res["after"] = tree_memory(proc.pid)
        except BaseException:
            with open(log_path, "rb") as f:
                sys.stderr.write(f.read()[-4000:].decode("utf-8", "replace"))
            raise
        finally:
            http.close()
            left = scale.stop(proc, known)
            res["server_exit_code"], res["killed_leftovers"] = proc.returncode, len(left)
    return res


def measure(args) -> list[dict]:
    results = []
    for case, n in args.cases:
        with tempfile.TemporaryDirectory(prefix="shmserve-footprint-repo-") as root:
            names = scale.build_repository(root, n, MODELS[case][0])
            for mode in MODES:
                print(f"... {case} x {n}, --worker-start {mode}", file=sys.stderr, flush=True)
                results.append(run_one(case, n, mode, root, names, args))
    return results


def report(results: list[dict], traffic_secs: float) -> str:
    mib = lambda b: f"{b / MIB:.1f}"  # noqa: E731
    lines = [f"shmserve footprint: {os.cpu_count()} CPU(s); PSS of the whole server tree / "
             f"models; 'after' = after {traffic_secs:g} s of round-robin requests\n",
             "| models | start | workers | all READY, s | CPU to ready, s | PSS/model idle, MiB "
             "| PSS/model after, MiB | worker USS after (median), MiB | server PSS after, MiB "
             "| requests (errors) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n = r["models"]
        lines.append(
            f"| {r['case']} x {n} | {r['mode']} | {r['after']['workers']} | {r['ready_s']:.1f} "
            f"| {r['start_cpu_s']:.1f} | {mib(r['idle']['pss_total'] / n)} "
            f"| {mib(r['after']['pss_total'] / n)} | {mib(r['after']['worker_uss_median'])} "
            f"| {mib(r['after']['pss_total'])} | {r['traffic']['requests']} "
            f"({r['traffic']['errors']}) |")
    return "\n".join(lines)


def bars(results: list[dict], width: int = 50) -> str:
    """ASCII bar chart of PSS per model after traffic, fork against spawn for each case."""
    vals = [(f"{r['case']} x {r['models']} {r['mode']}", r["after"]["pss_total"] / r["models"] / MIB)
            for r in results]
    top = max(v for _, v in vals) or 1.0
    label_w = max(len(k) for k, _ in vals)
    out = ["PSS per model after traffic (MiB)"]
    for k, v in vals:
        out.append(f"{k:<{label_w}} |{'#' * max(1, round(v / top * width)):<{width}} {v:6.1f}")
    out.append("")
    out.append("launch to all models READY (s)")
    vals = [(f"{r['case']} x {r['models']} {r['mode']}", r["ready_s"]) for r in results]
    top = max(v for _, v in vals) or 1.0
    for k, v in vals:
        out.append(f"{k:<{label_w}} |{'#' * max(1, round(v / top * width)):<{width}} {v:6.1f}")
    return "\n".join(out)


def png(results: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = sorted({(r["case"], r["models"]) for r in results}, key=lambda c: (c[0], c[1]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "pss", "PSS per model after traffic, MiB"),
                           (axes[1], "ready", "launch to all READY, s")):
        for i, mode in enumerate(MODES):
            ys = []
            for case, n in cases:
                r = next(x for x in results if (x["case"], x["models"], x["mode"]) == (case, n, mode))
                ys.append(r["after"]["pss_total"] / n / MIB if key == "pss" else r["ready_s"])
            ax.bar([j + i * 0.4 for j in range(len(cases))], ys, width=0.4, label=mode)
        ax.set_xticks([j + 0.2 for j in range(len(cases))], [f"{c} x {n}" for c, n in cases])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def parse_cases(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        case, _, n = item.partition(":")
        if case not in MODELS or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"expected <{'|'.join(MODELS)}>:<copies>, got {item!r}")
        out.append((case, int(n)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=parse_cases, default=None,
                    help="comma-separated <identity|mlp>:<copies> (default identity:50,"
                         "identity:200,mlp:20; --quick: identity:8,mlp:2)")
    ap.add_argument("--traffic-secs", type=float, default=None,
                    help="seconds of round-robin requests before the second measurement "
                         "(default 60; --quick: 5)")
    ap.add_argument("--clients", type=int, default=1, help="client threads sending requests")
    ap.add_argument("--quick", action="store_true", help="a short run: few models, 5 s of traffic")
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true", help="also print all results as one JSON line")
    ap.add_argument("--png", metavar="PATH", help="also draw the chart to PATH (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.cases is None:
        args.cases = parse_cases("identity:8,mlp:2" if args.quick
                                 else "identity:50,identity:200,mlp:20")
    if args.traffic_secs is None:
        args.traffic_secs = 5.0 if args.quick else 60.0
    results = measure(args)
    print(report(results, args.traffic_secs))
    print()
    print(bars(results))
    if args.png:
        print(f"\nchart written to {args.png}" if png(results, args.png)
              else "\nmatplotlib is not installed: no PNG")
    if args.json:
        print(json.dumps(results))
    ok = all(r["killed_leftovers"] == 0 and r["server_exit_code"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
