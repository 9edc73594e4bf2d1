#!/usr/bin/env python3
"""CPU per request of each shmserve process under perf_analyzer load, for several server
settings measured interleaved in one run (the first is the baseline the others are read
against).

Each pass starts the server with one setting, loads a model at a fixed concurrency with the
real perf_analyzer, and reads utime+stime of the frontend, the scheduler, the model's workers
and perf_analyzer from /proc over a window, against the model's inference count from the
statistics API. The table gives medians over the passes.

  python bench/cpu_per_request.py --repo /tmp/triton-bench/models/triton --model identity_fp32 \\
      --concurrency 32 --setting "" --setting "--instance-leases false"

A setting may start with ``python=PATH`` to run the server of another build (a virtual
environment with that build installed), e.g. ``--setting "python=/tmp/main-venv/bin/python"``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PA = os.path.expanduser("~/.cache/shmserve-tools/perf_analyzer")
ROLES = ("frontend", "scheduler", "worker", "perf_analyzer")


def _children() -> dict[int, list[tuple[int, str]]]:
    kids: dict[int, list[tuple[int, str]]] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append((int(p), cmd))
    return kids


def _roles(server_pid: int, pa_pid: int, model: str) -> dict[int, str]:
    kids, out, todo = _children(), {pa_pid: "perf_analyzer"}, [server_pid]
    while todo:
        for pid, cmd in kids.get(todo.pop(), []):
            todo.append(pid)
            if "shmserve.frontend" in cmd:
                out[pid] = "frontend"
            elif "shmserve.engine.scheduler" in cmd:
                out[pid] = "scheduler"
            elif f'"model_name":"{model}"' in cmd:
                out[pid] = "worker"
    return out


def _cpu(roles: dict[int, str]) -> dict[str, int]:
    ticks: dict[str, int] = {}
    for pid, role in roles.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[role] = ticks.get(role, 0) + int(fields[11]) + int(fields[12])
    return ticks


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _interpreter(setting: str) -> tuple[str, list[str]]:
    """A setting's Python (``python=PATH`` first: another build, e.g. main's in its own
    virtual environment, measured interleaved with this one) and its server flags."""
    words = shlex.split(setting)
    if words and words[0].startswith("python="):
        return words[0][len("python="):], words[1:]
    return sys.executable, words


def one_pass(a, setting: str) -> dict[str, float]:
    tmp = tempfile.mkdtemp(prefix="cpu-per-request-")
    port_file = os.path.join(tmp, "ports.json")
    python, flags = _interpreter(setting)
    server = subprocess.Popen(
        [python, "-m", "shmserve.engine.launch.cli", "--model-repository", a.repo,
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--port-file", port_file, *flags],
        stdout=open(os.path.join(tmp, "server.log"), "wb"), stderr=subprocess.STDOUT)
    pa = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the server did not start (log in {tmp})")
            time.sleep(0.1)
        time.sleep(0.1)
        with open(port_file) as f:
            ports = json.load(f)
        base = f"http://127.0.0.1:{ports['http']}"
        while True:
            try:
                if urllib.request.urlopen(f"{base}/v2/models/{a.model}/ready").status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{a.model} did not become ready (log in {tmp})")
            time.sleep(0.1)
        pa = subprocess.Popen(
            [PA, "-m", a.model, "-u", f"127.0.0.1:{ports[a.protocol]}", "-i", a.protocol,
             "--concurrency-range", str(a.concurrency), "-p", "3000", "-s", "20",
             *(["-a", "--max-threads", str(a.async_threads)] if a.async_threads else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(a.warmup)
        roles = _roles(server.pid, pa.pid, a.model)

        def count() -> int:
            s = _get(f"{base}/v2/models/{a.model}/stats")
            return int(s["model_stats"][0]["inference_count"])
        c0, t0, cpu0 = count(), time.monotonic(), _cpu(roles)
        time.sleep(a.window)
        c1, t1, cpu1 = count(), time.monotonic(), _cpu(roles)
        n = c1 - c0
        tick = os.sysconf("SC_CLK_TCK")
        out = {"infer/s": n / (t1 - t0)}
        for role in ROLES:
            out[role] = (cpu1.get(role, 0) - cpu0.get(role, 0)) / tick / n * 1e6
        out["server"] = sum(out[r] for r in ROLES[:3])
        return out
    finally:
        if pa is not None:
            pa.terminate()
            pa.wait()
        server.terminate()
        server.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default="configs/models")
    ap.add_argument("--model", default="identity_fp32")
    ap.add_argument("--protocol", default="http", choices=("http", "grpc"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--setting", action="append", default=None,
                    help="server flags for one configuration (repeatable; the first is the "
                         "baseline); default: the defaults, and --instance-leases false")
    ap.add_argument("--async-threads", type=int, default=0,
                    help="perf_analyzer in async mode with this many threads, as "
                         "side_by_side.sh runs it at c=32 (0: sync, one thread per request)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--window", type=float, default=8.0)
    a = ap.parse_args()
    settings = a.setting or ["", "--instance-leases false"]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for p in range(a.passes):
        for s in settings:
            r = one_pass(a, s)
            runs[s].append(r)
            print(f"pass {p + 1} [{s or 'defaults'}] {r['infer/s']:,.0f} infer/s, server "
                  f"{r['server']:.0f} us/request", flush=True)
    print(f"\n{a.model}, {a.protocol}, concurrency {a.concurrency}: medians of {a.passes} "
          f"passes; CPU in us per request")
    cols = ["infer/s", "server", *ROLES]
    print("| setting | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for s in settings:
        med = {c: statistics.median(r[c] for r in runs[s]) for c in cols}
        print(f"| {s or 'defaults'} | " + " | ".join(
            f"{med[c]:,.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
