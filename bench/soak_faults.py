#!/usr/bin/env python3
"""Soak under faults (issue 13): closed-loop load at concurrency C for D seconds, mixed with bad
requests, requests whose client gives up, and a worker SIGKILLed every K seconds. Every
SAMPLE seconds it reads the RSS and open descriptors of each server process (workers summed)
and the /dev/shm entries the server owns, then prints one row per sample: what must stay flat
from minute 2 to the end.

  python bench/soak_faults.py [--duration 600] [--concurrency 32] [--kill-every 10]
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # noqa: E402
import run_http  # noqa: E402
from soak import processes  # noqa: E402

BAD_BODIES = [b'{"inputs": [', b'{"inputs": [{"name": "INPUT0", "shape": [1, 16], '
              b'"datatype": "FP64", "data": [1]}]}', b"[1, 2]", b'{"inputs": 5}']


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def sample(launcher: int) -> dict:
    procs = processes(launcher)
    row = {"rss": {}, "fds": {}}
    for pid, (role, rss) in procs.items():
        key = "workers" if role.startswith("worker") else role
        row["rss"][key] = row["rss"].get(key, 0) + rss
        row["fds"][key] = row["fds"].get(key, 0) + fds(pid)
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve_{launcher}_")]
    row["shm_entries"] = len(names)
    row["shm_bytes"] = sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in names
                           if os.path.exists(f"/dev/shm/{n}"))
    row["workers"] = sum(1 for r, _ in procs.values() if r.startswith("worker"))
    return row


def faults(port: int, model: str, stop: threading.Event, kill_every: float, launcher: int,
           counts: dict) -> None:
    """Bad requests, abandoned requests and worker kills, until ``stop``."""
    next_kill = time.monotonic() + kill_every
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                   "data": [1.0] * 16}]}).encode()
    i = 0
    while not stop.is_set():
        i += 1
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("POST", f"/v2/models/{model}/infer", BAD_BODIES[i % len(BAD_BODIES)])
            status = c.getresponse().status
            counts["bad_4xx" if 400 <= status < 500 else "bad_other"] += 1
            c.close()
            # a client that sends a request and leaves before the answer
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
                      % (model.encode(), len(body)) + body)
            s.close()
            counts["abandoned"] += 1
        except OSError:
            counts["fault_client_errors"] += 1
        if time.monotonic() >= next_kill:
            next_kill += kill_every
            workers = [pid for pid, (role, _) in processes(launcher).items()
                       if role == f"worker {model}"]
            if workers:
                try:
                    os.kill(workers[counts["kills"] % len(workers)], signal.SIGKILL)
                    counts["kills"] += 1
                except ProcessLookupError:
                    pass
        stop.wait(0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kill-every", type=float, default=10.0)
    ap.add_argument("--sample-every", type=float, default=60.0)
    ap.add_argument("--model", default="identity_fp32")
    ap.add_argument("--input", default="INPUT0:FP32:1,16")
    ap.add_argument("--model-repository",
                    default=os.path.join(run_http.REPO_ROOT, "configs", "models"))
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    counts = {"bad_4xx": 0, "bad_other": 0, "abandoned": 0, "kills": 0, "fault_client_errors": 0}
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmserve-soak-") as workdir:
        proc, ports = run_http.start_server(args, workdir)
        stop = threading.Event()
        try:
            url = f"127.0.0.1:{ports['http']}"
            rows.append((0.0, sample(proc.pid)))
            t = threading.Thread(target=faults, args=(ports["http"], args.model, stop,
                                                      args.kill_every, proc.pid, counts))
            t.start()
            t0 = time.monotonic()

            def sampler():
                while not stop.wait(args.sample_every):
                    rows.append((time.monotonic() - t0, sample(proc.pid)))
            st = threading.Thread(target=sampler)
            st.start()
            r = asyncio.run(loadgen.run_load(url, args.model, [args.input], args.concurrency,
                                             args.duration, 0))
            stop.set()
            t.join(60)
            st.join(60)
            rows.append((time.monotonic() - t0, sample(proc.pid)))
            alive = proc.poll() is None
        finally:
            stop.set()
            run_http.stop_server(proc)
    print(f"soak with faults: {args.model}, concurrency {args.concurrency}, {args.duration:g} s: "
          f"{r['count']:,} good-path requests, {r['errors']} errors (requests that ran on a "
          f"killed worker are retried; see below), {r['infer_per_s']:.0f} infer/s, "
          f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; server alive at the end: {alive}")
    print(f"faults: {counts}\n")
    roles = ["launcher", "frontend", "scheduler", "workers"]
    print("| t (s) | " + " | ".join(f"{x} RSS MiB" for x in roles) + " | " +
          " | ".join(f"{x} fds" for x in roles) + " | workers | /dev/shm entries | /dev/shm MiB |")
    print("|" + "---:|" * (2 * len(roles) + 4))
    for t, row in rows:
        print(f"| {t:.0f} | " + " | ".join(f"{row['rss'].get(x, 0) / 2**20:.1f}" for x in roles)
              + " | " + " | ".join(str(row["fds"].get(x, 0)) for x in roles)
              + f" | {row['workers']} | {row['shm_entries']} | {row['shm_bytes'] / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
