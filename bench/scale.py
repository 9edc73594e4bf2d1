#!/usr/bin/env python3
"""Scale: the cost of a loaded model. Serves N copies of identity_fp32 and measures

- start-up: wall time from launching `shmserve` to the first model READY, to all N READY, and to
  /v2/health/ready answering 200 (the repository index is polled with a deadline);
- memory once ready and idle (CPU of the server's processes settled): RSS, PSS and USS (private
  pages) from /proc/<pid>/smaps_rollup of the launcher, frontend, scheduler and every worker,
  found by walking the launcher's children in /proc;
- the floor of any Python worker: a bare `python3 -c "import numpy, zmq, msgspec"` blocked on
  stdin, measured alone (before the server) and alongside the idle server, where it shares its
  libraries' pages like one more worker would; and the median wall time of 5 such starts;
- unload: wall time to POST /v2/repository/models/<m>/unload for all N (explicit model-control
  mode) and until every worker process has exited (--no-unload: default control mode, no unload).

  python bench/scale.py [--models 100] [--json] [--server-bin shmserve] [--start-timeout 600]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_http  # noqa: E402
import soak  # noqa: E402

SOURCE = os.path.join(run_http.REPO_ROOT, "configs", "models", "identity_fp32")
BARE = "import sys, numpy, zmq, msgspec; print('up', flush=True); sys.stdin.read()"
MIB = 2 ** 20


def build_repository(root: str, n: int, source: str = SOURCE) -> list[str]:
    """``n`` copies of the model in ``source`` (default identity_fp32), named <model>_000 ..."""
    with open(os.path.join(source, "config.pbtxt")) as f:
        config = f.read()
    names = [f"{os.path.basename(source)}_{i:03d}" for i in range(n)]
    for name in names:
        shutil.copytree(os.path.join(source, "1"), os.path.join(root, name, "1"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        with open(os.path.join(root, name, "config.pbtxt"), "w") as f:
            f.write(re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', config, count=1, flags=re.M))
    return names


def smaps(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS (private clean + dirty) of one process, in bytes."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kb = {ln.split(":")[0]: int(ln.split()[-2]) for ln in f if ln.rstrip().endswith(" kB")}
    except (OSError, ValueError):
        return None
    return {"rss": kb["Rss"] * 1024, "pss": kb["Pss"] * 1024,
            "uss": (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024}


def stat(pid: int) -> list[str] | None:  # the fields after the command name: state, ppid, ...
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    fields = stat(pid)
    return int(fields[19]) if fields else None


def cpu_ticks(pids) -> int:
    return sum(int(f[11]) + int(f[12]) for f in map(stat, pids) if f)


def wait_idle(pids, deadline: float, window: float = 0.5, max_cores: float = 0.05) -> float:
    """Wait until the processes use under max_cores of CPU over a window; returns that use."""
    while True:
        before = cpu_ticks(pids)
        time.sleep(window)
        use = (cpu_ticks(pids) - before) / os.sysconf("SC_CLK_TCK") / window
        if use < max_cores or time.monotonic() > deadline:
            return use


def bare_python(timeout: float = 60.0) -> dict:
    """Memory of the bare interpreter, measured while it blocks on stdin; then it exits."""
    p = subprocess.Popen([sys.executable, "-c", BARE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        if not ready or p.stdout.readline() != b"up\n":
            raise RuntimeError("bare python did not start")
        return smaps(p.pid)
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def bare_start_s(runs: int = 5) -> float:
    def once(t0: float) -> float:
        subprocess.run([sys.executable, "-c", "import numpy, zmq, msgspec"], check=True, timeout=60)
        return time.monotonic() - t0
    return statistics.median(once(time.monotonic()) for _ in range(runs))


def wait_ready(proc, port_file: str, http, n: int, deadline: float, t0: float) -> tuple[str, dict]:
    """Poll the port file, then the repository index and /v2/health/ready, until all n are READY."""
    base, out = None, {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before ready")
        try:
            if base is None:
                with open(port_file) as f:
                    base = f"http://127.0.0.1:{int(json.load(f)['http'])}"
            r = http.post(f"{base}/v2/repository/index", json={}, timeout=5)
            ready = len({e["name"] for e in r.json() if e.get("state") == "READY"})
            if ready:
                out.setdefault("first_ready_s", time.monotonic() - t0)
            if ready == n:
                out.setdefault("all_ready_s", time.monotonic() - t0)
                if http.get(f"{base}/v2/health/ready", timeout=5).status_code == 200:
                    out["health_ready_s"] = time.monotonic() - t0
                    return base, out
        except (OSError, ValueError, KeyError, TypeError, requests.RequestException):
            pass    # port file not written (or half-written) yet, frontend not listening yet
        time.sleep(0.05)
    raise TimeoutError(f"not all {n} models ready in time (got {out})")


def stop(proc: subprocess.Popen, known: dict[int, int], timeout: float = 60.0) -> list[int]:
    """SIGTERM the launcher, wait; then SIGKILL any process of the tree still alive. Returns those."""
    for pid in soak.processes(proc.pid):
        known.setdefault(pid, start_time(pid))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10  # the launcher's children run in sessions of their own
    while (left := [p for p, st in known.items() if st and start_time(p) == st]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def memory(tree: dict[int, tuple[str, int]], n: int) -> dict:
    roles: dict[str, list[dict]] = {}
    for pid, (role, _) in tree.items():
        if (m := smaps(pid)) is not None:
            roles.setdefault(role.split()[0], []).append(m)
    workers = roles.get("worker", [])
    if len(workers) != n:
        raise RuntimeError(f"found {len(workers)} workers for {n} models")
    res = {role: roles[role][0] for role in ("launcher", "frontend", "scheduler")}
    res["worker_median"] = {k: statistics.median(w[k] for w in workers) for k in workers[0]}
    res["workers_total"] = {k: sum(w[k] for w in workers) for k in workers[0]}
    res["server_total"] = {k: sum(m[k] for ms in roles.values() for m in ms) for k in workers[0]}
    return res


def measure(args) -> dict:
    res: dict = {"models": args.models, "cpus": os.cpu_count()}
    res["bare_alone"] = bare_python()  # the floor first, on a quiet machine
    res["bare_start_s"] = bare_start_s()
    with tempfile.TemporaryDirectory(prefix="shmserve-scale-") as work:
        repo, port_file = os.path.join(work, "models"), os.path.join(work, "ports.json")
        names = build_repository(repo, args.models)
        cmd = run_http._server_cmd(args.server_bin) + [
            "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", "0", "--port-file", port_file]
        if args.unload:
            cmd += ["--model-control-mode", "explicit", "--load-model", "*"]
        log_path, known = os.path.join(work, "server.log"), {}
        http = requests.Session()
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=run_http.REPO_ROOT,
                                    start_new_session=True)
        try:
            base, times = wait_ready(proc, port_file, http, args.models,
                                     t0 + args.start_timeout, t0)
            res.update(times)
            tree = soak.processes(proc.pid)
            known.update((pid, start_time(pid)) for pid in tree)
            res["idle_cpu_cores"] = wait_idle(tree, time.monotonic() + 60)
            res.update(memory(tree, args.models))
            res["bare_alongside"] = bare_python()
            if args.unload:
                worker_pids = [pid for pid, (role, _) in tree.items() if role.startswith("worker")]
                t1 = time.monotonic()
                for name in names:
                    http.post(f"{base}/v2/repository/models/{name}/unload", timeout=60) \
                        .raise_for_status()
                res["unload_requests_s"] = time.monotonic() - t1
                deadline = t1 + args.start_timeout
                while any(start_time(p) == known[p] for p in worker_pids):
                    if time.monotonic() > deadline:
                        raise TimeoutError("workers still running after unload")
                    time.sleep(0.02)
                res["unload_workers_exited_s"] = time.monotonic() - t1
        except BaseException:
            with open(log_path, "rb") as f:
                sys.stderr.write(f.read()[-4000:].decode("utf-8", "replace"))
            raise
        finally:
            http.close()
            left = stop(proc, known)
            res["server_exit_code"], res["killed_leftovers"] = proc.returncode, len(left)
    return res


def report(r: dict) -> str:
    mem = lambda m, k: f"{m[k] / MIB:.1f}"  # noqa: E731
    s = lambda key: "-" if r.get(key) is None else f"{r[key]:.2f}"  # noqa: E731
    n = r["models"]
    lines = [f"shmserve scale: {n} × identity_fp32, {r['cpus']} CPU(s), "
             f"CPU use of the server when measured: {r['idle_cpu_cores']:.2f} cores\n",
             "| measure | value |", "|---|---:|",
             f"| launch → first model READY, s | {s('first_ready_s')} |",
             f"| launch → all {n} models READY, s | {s('all_ready_s')} |",
             f"| launch → /v2/health/ready 200, s | {s('health_ready_s')} |",
             f"| bare python start with numpy+zmq+msgspec (median of 5), s | {s('bare_start_s')} |",
             f"| unload all {n}: requests answered, s | {s('unload_requests_s')} |",
             f"| unload all {n}: every worker exited, s | {s('unload_workers_exited_s')} |",
             "", "| process | RSS MiB | PSS MiB | USS MiB |", "|---|---:|---:|---:|"]
    rows = [("one idle worker (median)", r["worker_median"]),
            (f"all {n} workers", r["workers_total"]),
            ("frontend", r["frontend"]), ("scheduler", r["scheduler"]), ("launcher", r["launcher"]),
            ("server total", r["server_total"]),
            ("bare python + numpy, zmq, msgspec (alone)", r["bare_alone"]),
            ("bare python + numpy, zmq, msgspec (alongside server)", r["bare_alongside"])]
    lines += [f"| {label} | {mem(m, 'rss')} | {mem(m, 'pss')} | {mem(m, 'uss')} |" for label, m in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=100, help="copies of identity_fp32 to serve")
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds allowed for all models to load (and, again, to unload)")
    ap.add_argument("--no-unload", dest="unload", action="store_false",
                    help="default model-control mode, no unload timing")
    ap.add_argument("--json", action="store_true", help="also print all results as one JSON line")
    args = ap.parse_args(argv)
    if args.models < 1:
        ap.error("--models must be at least 1")
    r = measure(args)
    print(report(r))
    if args.json:
        print(json.dumps(r))
    return 0 if r["killed_leftovers"] == 0 and r["server_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
