#!/usr/bin/env python3
"""Floors that an inference request cannot beat on this machine, measured in one run.

(a) ZeroMQ PAIR round trip over ipc:// between two processes (unpinned, both on one core, on two
    different cores): the cost of one frontend<->worker hop with no serialization at all.
(b) numpy memcpy (np.copyto into a preallocated array): the cost of touching the bytes once.
(c) the same copy into a POSIX shared-memory mapping in /dev/shm (warm, and first-touch, which
    pays the page faults a freshly created segment costs).

Usage: python bench/baseline.py [--sizes 64,64K,4M,64M] [--json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import zmq

DEFAULT_SIZES = (64, 64 << 10, 4 << 20, 64 << 20)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    return int(float(num) * _UNITS[t[len(num):]])


def fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def iterations(size: int, small: int = 2000, budget_bytes: int = 512 << 20) -> int:
    """Fewer iterations for big messages so every size costs roughly the same time."""
    return max(20, min(small, budget_bytes // max(size, 1)))


def _pct(sorted_v, q):
    return sorted_v[min(len(sorted_v) - 1, max(0, int(round(q / 100 * len(sorted_v))) - 1))]


# ---------------------------------------------------------------- (a) zmq round trip
def _echo_peer(endpoint: str, cpu: int) -> None:
    """Child process body: pin, connect, echo every frame back until an empty frame."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(b"ready")
    while True:
        f = s.recv(copy=False)
        if len(f) == 0:
            break
        s.send(f, copy=False)  # zero-copy echo: only the transport's copies are measured
    s.close()
    ctx.term()


def zmq_roundtrip(sizes, placement: str = "unpinned", iters=None) -> dict:
    """placement: 'unpinned' | 'same_core' | 'cross_core'. Returns {size: {median_us, p99_us, iters}}."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "cross_core" and len(cpus) < 2:
        return {}
    parent_cpu, child_cpu = {"unpinned": (-1, -1), "same_core": (cpus[0], cpus[0]),
                             "cross_core": (cpus[0], cpus[1])}[placement]
    endpoint = f"ipc://{tempfile.gettempdir()}/shmserve-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old_aff = os.sched_getaffinity(0)
    # Pin before the Context exists: affinity is per thread and zmq's I/O thread inherits it
    # only at creation, so pinning later would leave that thread free to run anywhere.
    if parent_cpu >= 0:
        os.sched_setaffinity(0, {parent_cpu})
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    # A fresh interpreter (not fork) so the peer shares no state, like a real worker process.
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--echo-peer",
                              endpoint, str(child_cpu)])
    out = {}
    try:
        deadline = time.monotonic() + 30
        while not s.poll(100):  # also watch the child, so a crashed peer fails fast
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"zmq echo peer did not start (exit {child.poll()})")
        s.recv()
        for size in sizes:
            n = iters or iterations(size)
            payload = os.urandom(size)
            for _ in range(min(50, n)):  # warm-up: connection buffers, allocator, caches
                s.send(payload, copy=False)
                s.recv(copy=False)
            samples = []
            clock = time.perf_counter_ns
            for _ in range(n):
                t0 = clock()
                s.send(payload, copy=False)
                f = s.recv(copy=False)
                samples.append(clock() - t0)
            assert len(f) == size
            samples.sort()
            out[size] = {"median_us": statistics.median(samples) / 1e3,
                         "p99_us": _pct(samples, 99) / 1e3, "iters": n}
        s.send(b"")
        child.wait(timeout=30)
    finally:
        os.sched_setaffinity(0, old_aff)
        if child.poll() is None:
            child.kill()
            child.wait()
        s.close()
        ctx.term()
        try:
            os.unlink(endpoint[len("ipc://"):])
        except FileNotFoundError:
            pass
    return out


# ---------------------------------------------------------------- (b)+(c) copies
def _time_copy(dst: np.ndarray, src: np.ndarray, n: int) -> float:
    """Median ns per np.copyto; small copies are batched so timer overhead doesn't dominate."""
    reps = max(1, min(1000, (64 << 10) // max(src.nbytes, 1)))
    clock = time.perf_counter_ns
    samples = []
    for _ in range(max(5, n // reps)):
        t0 = clock()
        for _ in range(reps):
            np.copyto(dst, src)
        samples.append((clock() - t0) / reps)
    return statistics.median(samples)


def memcpy_bench(sizes, iters=None) -> dict:
    out = {}
    for size in sizes:
        src = np.frombuffer(os.urandom(size), dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault in dst before timing
        ns = _time_copy(dst, src, iters or iterations(size))
        out[size] = {"median_us": ns / 1e3, "gib_s": size / ns * 1e9 / (1 << 30)}
    return out


def shm_bench(sizes, iters=None) -> dict:
    out = {}
    for size in sizes:
        src = np.frombuffer(os.urandom(size), dtype=np.uint8)
        path = f"/dev/shm/shmserve-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        mm = dst = None
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            dst = np.frombuffer(mm, dtype=np.uint8)
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)  # first touch: allocates tmpfs pages + page faults
            first_ns = time.perf_counter_ns() - t0
            ns = _time_copy(dst, src, iters or iterations(size))
            out[size] = {"median_us": ns / 1e3, "gib_s": size / ns * 1e9 / (1 << 30),
                         "first_touch_us": first_ns / 1e3}
        finally:
            del dst  # the mmap refuses to close while a numpy view exports its buffer
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(path)
    return out


def measure(sizes=DEFAULT_SIZES, parts=("zmq", "memcpy", "shm"),
            placements=("unpinned", "same_core", "cross_core"), iters=None) -> dict:
    """All baselines; result[part][size] (zmq: result['zmq'][placement][size]) with µs values."""
    sizes = list(sizes)
    res = {"cpus": len(os.sched_getaffinity(0)), "sizes": sizes}
    if "zmq" in parts:
        res["zmq"] = {p: zmq_roundtrip(sizes, p, iters) for p in placements}
    if "memcpy" in parts:
        res["memcpy"] = memcpy_bench(sizes, iters)
    if "shm" in parts:
        res["shm"] = shm_bench(sizes, iters)
    return res


def markdown(res: dict) -> str:
    placements = list(res.get("zmq", {}))
    cols = ["size"] + [f"zmq RTT {p} p50/p99 µs" for p in placements]
    if "memcpy" in res:
        cols.append("memcpy µs (GiB/s)")
    if "shm" in res:
        cols.append("/dev/shm copy µs (GiB/s), first-touch µs")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for size in res["sizes"]:
        row = [fmt_size(size)]
        for p in placements:
            z = res["zmq"][p].get(size)
            row.append(f"{z['median_us']:.1f} / {z['p99_us']:.1f}" if z else "n/a (1 CPU)")
        if "memcpy" in res:
            m = res["memcpy"][size]
            row.append(f"{m['median_us']:.2f} ({m['gib_s']:.1f})")
        if "shm" in res:
            m = res["shm"][size]
            row.append(f"{m['median_us']:.2f} ({m['gib_s']:.1f}), {m['first_touch_us']:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--echo-peer"]:
        _echo_peer(argv[1], int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma list, suffixes K/M/G allowed (e.g. 64,64K,4M,64M)")
    ap.add_argument("--iters", type=int, default=None, help="override iteration count")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = measure([parse_size(s) for s in args.sizes.split(",") if s.strip()], iters=args.iters)
    print(json.dumps(res) if args.json else
          f"baselines on {res['cpus']} CPU(s), {os.uname().machine}\n\n" + markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
