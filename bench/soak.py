#!/usr/bin/env python3
"""Soak: closed-loop load for a fixed time, with the memory of every server process and the use
of /dev/shm read before and after, to show nothing grows without bound.

  python bench/soak.py [--duration 300] [--concurrency 32] [--model identity_fp32 --input INPUT0:FP32:1,16]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # noqa: E402
import run_http  # noqa: E402


def processes(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (role, RSS bytes) for the server's process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
        role = ("worker " + cmd.split('"model_name":"')[1].split('"')[0] if "workers.main" in cmd
                else "scheduler" if "engine.scheduler" in cmd
                else "zygote" if "workers.zygote" in cmd      # the fork server
                else "frontend" if "frontend.main" in cmd else "launcher")
        out[pid] = (role, rss)
        todo.extend(children.get(pid, []))
    return out


def shm_bytes(launcher: int) -> int:
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"shmserve_{launcher}_"):
            st = os.stat(os.path.join("/dev/shm", name))
            total += st.st_blocks * 512
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default="identity_fp32")
    ap.add_argument("--input", default="INPUT0:FP32:1,16")
    ap.add_argument("--model-repository", default=os.path.join(run_http.REPO_ROOT, "configs", "models"))
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shmserve-soak-") as workdir:
        proc, ports = run_http.start_server(args, workdir)
        try:
            url = f"127.0.0.1:{ports['http']}"
            asyncio.run(loadgen.run_load(url, args.model, [args.input], args.concurrency, 5, 1))
            before, shm_before = processes(proc.pid), shm_bytes(proc.pid)
            r = asyncio.run(loadgen.run_load(url, args.model, [args.input], args.concurrency,
                                             args.duration, 0))
            after, shm_after = processes(proc.pid), shm_bytes(proc.pid)
        finally:
            run_http.stop_server(proc)
    print(f"soak: {args.model} {args.input}, concurrency {args.concurrency}, {args.duration:g} s: "
          f"{r['count']} requests, {r['errors']} errors, {r['infer_per_s']:.0f} infer/s, "
          f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms\n")
    print("| process | RSS before MiB | RSS after MiB |")
    print("|---|---:|---:|")
    for pid, (role, rss) in sorted(before.items(), key=lambda kv: kv[1][0]):
        a = after.get(pid, (role, 0))[1]
        print(f"| {role} ({pid}) | {rss / 2**20:.1f} | {a / 2**20:.1f} |")
    print(f"| /dev/shm used by the server | {shm_before / 2**20:.1f} | {shm_after / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
