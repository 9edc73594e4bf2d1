#!/usr/bin/env python3
"""A/B of shmserve's gRPC path with the real perf_analyzer, interleaved in one run.

Each variant is one running server; all of them are started first and then measured in turn,
pass after pass (A B C A B C ...), so the noise of a shared 2-core machine lands on every
variant alike. The table gives each variant's median infer/s and p50 over the passes, and the
per-pass numbers.

A variant is ``name`` or ``name:KEY=VALUE,KEY=VALUE`` where the keys are environment variables
of the server (``PYTHONPATH=/some/tree`` runs another copy of shmserve's packages, e.g. a
baseline tree, since the editable install yields to PYTHONPATH) or the special keys
``args`` (extra shmserve flags, space-separated) and ``floor`` (serve
``bench/grpc_floor.py --serve <kind>`` instead: canned answers, no hops).

  python bench/grpc_ab.py --variant base:PYTHONPATH=/tmp/base --variant new \\
      --workload grpc:1 --workload http:1 --passes 3

Workloads are ``protocol:concurrency`` or ``stream:concurrency`` (gRPC ModelStreamInfer).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PA = os.path.expanduser("~/.cache/shmserve-tools/perf_analyzer")


class Variant:
    def __init__(self, spec: str, workdir: str):
        self.name, _, rest = spec.partition(":")
        self.env = dict(os.environ)
        self.args: list[str] = []
        self.floor = ""
        # items are split at a comma that starts the next KEY=, so values may hold commas
        for item in filter(None, re.split(r",(?=[A-Za-z_]+=)", rest)):
            key, _, value = item.partition("=")
            if key == "args":
                self.args += value.split()
            elif key == "floor":
                self.floor = value
            else:
                self.env[key] = value
        self.dir = os.path.join(workdir, self.name)
        os.makedirs(self.dir)
        self.proc: subprocess.Popen | None = None
        self.ports: dict = {}

    def start(self) -> None:
        log = open(os.path.join(self.dir, "server.log"), "wb")
        if self.floor:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, os.path.join(HERE, "grpc_floor.py"), "--serve", self.floor,
                   "--port", str(port)]
            self.ports = {"grpc": port}
        else:
            port_file = os.path.join(self.dir, "ports.json")
            cmd = [sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository",
                   os.path.join(REPO, "configs", "models"), "--host", "127.0.0.1",
                   "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                   "--port-file", port_file, *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.dir,
                                     start_new_session=True)
        if not self.floor:
            deadline = time.monotonic() + 120
            while not os.path.exists(port_file):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: server did not start, see {self.dir}")
                time.sleep(0.1)
            with open(port_file) as f:
                self.ports = json.load(f)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.ports["grpc"]), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def measure(v: Variant, workload: str, interval_ms: int, shape: str) -> tuple[float, float]:
    kind, _, conc = workload.partition(":")
    protocol = "http" if kind == "http" else "grpc"
    if protocol not in v.ports:
        return float("nan"), float("nan")
    report = os.path.join(v.dir, "pa.csv")
    cmd = [PA, "-m", "identity_fp32", "-i", protocol, "-u", f"127.0.0.1:{v.ports[protocol]}",
           "--concurrency-range", conc, "--measurement-interval", str(interval_ms),
           "--stability-percentage", "30", "--max-trials", "6", "--shape", shape, "-f", report]
    if kind == "stream":
        cmd.append("--streaming")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return float("nan"), float("nan")
    if out.returncode != 0:
        return float("nan"), float("nan")
    with open(report) as f:
        row = list(csv.DictReader(f))[-1]
    return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--workload", action="append", default=None)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=2000)
    ap.add_argument("--shape", default="INPUT0:16")
    a = ap.parse_args()
    workloads = a.workload or ["grpc:1", "http:1"]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="grpc-ab-") as workdir:
        variants = [Variant(s, workdir) for s in a.variant]
        try:
            for v in variants:
                v.start()
            time.sleep(2)
            for p in range(a.passes):
                for w in workloads:
                    for v in variants:
                        r = measure(v, w, a.interval_ms, a.shape)
                        results.setdefault((w, v.name), []).append(r)
                        print(f"pass {p + 1} {w:<9} {v.name:<16} {r[0]:8.0f} infer/s "
                              f"p50 {r[1]:.3f} ms", file=sys.stderr, flush=True)
        finally:
            for v in variants:
                v.stop()
    print(f"\nperf_analyzer identity_fp32 {a.shape}, {a.interval_ms} ms windows, {a.passes} "
          f"interleaved passes, {os.cpu_count()} CPUs; medians (per pass in brackets)\n")
    print("| workload | variant | infer/s | p50 ms | passes infer/s |")
    print("|---|---|---:|---:|---|")
    for w in workloads:
        for v in variants:
            rs = [r for r in results[(w, v.name)] if r[0] == r[0]]
            if not rs:
                print(f"| {w} | {v.name} | - | - | failed |")
                continue
            ips = statistics.median(r[0] for r in rs)
            p50 = statistics.median(r[1] for r in rs)
            each = " / ".join(f"{r[0]:.0f}" for r in results[(w, v.name)])
            print(f"| {w} | {v.name} | {ips:.0f} | {p50:.3f} | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
