#!/usr/bin/env python3
"""HTTP benchmark suite: fixed loadgen scenarios plus the machine's baselines, one Markdown table.

Ratios put each result next to the floor it cannot beat: a small request's p50 against one raw
ZeroMQ round trip (one frontend<->worker hop), a 4 MiB request's p50 against a 4 MiB round trip
and a 4 MiB memcpy.

Usage:
  python bench/run_http.py --url 127.0.0.1:8000 [--duration 10] [--warmup 2] [--json]
  python bench/run_http.py --start [--model-repository configs/models] [--server-bin shmserve]
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline  # noqa: E402
import loadgen  # noqa: E402

SMALL, LARGE = 64, 4 << 20
# (label, model, input spec, concurrency, baseline size the ratio is taken against)
SCENARIOS = [
    ("identity_fp32 16×FP32", "identity_fp32", "INPUT0:FP32:1,16", 1, SMALL),
    ("identity_fp32 16×FP32", "identity_fp32", "INPUT0:FP32:1,16", 32, SMALL),
    ("mlp_onnx 256×FP32", "mlp_onnx", "INPUT0:FP32:1,256", 32, SMALL),
    ("identity_fp32 4 MiB", "identity_fp32", "INPUT0:FP32:1,1048576", 1, LARGE),
]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- optional server lifecycle
def _server_cmd(binary: str) -> list[str]:
    if os.sep in binary or shutil.which(binary):
        return [binary]
    # Not installed as a console script (e.g. plain checkout): call the entry point directly.
    return [sys.executable, "-c", "import sys; from shmserve.engine.launch.cli import main; sys.exit(main())"]


def _wait_port_file(path: str, proc: subprocess.Popen, deadline: float) -> dict:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening")
        try:
            with open(path) as f:
                ports = json.load(f)
                int(ports["http"])
                return ports
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError, TypeError):
            time.sleep(0.1)  # not written yet, or caught half-written
    raise TimeoutError(f"server did not write {path} in time")


def _wait_ready(host: str, port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before ready")
        try:
            c = http.client.HTTPConnection(host, port, timeout=2)
            c.request("GET", "/v2/health/ready")
            status = c.getresponse().status
            c.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become ready in time")


def start_server(args, workdir: str) -> tuple[subprocess.Popen, dict]:
    """Start shmserve on OS-picked ports; returns the process and {"http": port, "grpc": ...}."""
    port_file = os.path.join(workdir, "ports.json")
    log_path = os.path.join(workdir, "server.log")
    cmd = _server_cmd(args.server_bin) + ["--model-repository", args.model_repository,
                                          "--http-port", "0", "--grpc-port", "0",
                                          "--metrics-port", "0", "--port-file", port_file]
    log = open(log_path, "wb")
    # Own session so a SIGKILL fallback can take the server's worker processes down with it.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + args.start_timeout
        ports = _wait_port_file(port_file, proc, deadline)
        _wait_ready("127.0.0.1", ports["http"], proc, deadline)
    except BaseException:
        stop_server(proc)
        with open(log_path, "rb") as f:
            sys.stderr.write(f.read()[-4000:].decode("utf-8", "replace"))
        raise
    return proc, ports


def stop_server(proc: subprocess.Popen, timeout: float = 20.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # our own session: only what we started
            except ProcessLookupError:
                pass
            proc.wait()
    # Workers that outlived a clean exit of the main process would skew the baselines.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


# ---------------------------------------------------------------- measurement + report
def run_scenarios(url: str, duration: float, warmup: float) -> list[dict]:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    results = []
    for label, model, spec, conc, base in SCENARIOS:
        r = runner(loadgen.run_load(url, model, [spec], conc, duration, warmup))
        r.update(label=label, input=spec, baseline_size=base)
        results.append(r)
        print(f"  {label} c={conc}: {r['infer_per_s']:.1f} infer/s, "
              f"p50 {loadgen.fmt_ms(r['p50_ms'])} ms, errors {r['errors']}", file=sys.stderr)
        if r["first_error"]:
            print(f"    first error: {r['first_error']}", file=sys.stderr)
    return results


def _ratio(ms, us) -> str:
    return "-" if ms is None or not us else f"{ms * 1e3 / us:.1f}×"


def report(results: list[dict], base: dict) -> str:
    zmq = base["zmq"]
    rtt = lambda size: zmq["unpinned"][size]["median_us"]  # noqa: E731
    memcpy_large = base["memcpy"][LARGE]["median_us"]
    lines = [
        "| scenario | conc. | infer/s | p50 ms | p99 ms | errors | p50 / zmq RTT | p50 / memcpy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['infer_per_s']:.1f} | "
            f"{loadgen.fmt_ms(r['p50_ms'])} | {loadgen.fmt_ms(r['p99_ms'])} | {r['errors']} | "
            f"{_ratio(r['p50_ms'], rtt(r['baseline_size']))} | "
            f"{_ratio(r['p50_ms'], memcpy_large) if r['baseline_size'] == LARGE else '-'} |")
    for size in (SMALL, LARGE):
        for placement, z in zmq.items():
            if size in z:
                lines.append(f"| baseline: zmq ipc RTT {baseline.fmt_size(size)} ({placement}) | "
                             f"1 | {1e6 / z[size]['median_us']:.1f} | "
                             f"{z[size]['median_us'] / 1e3:.3f} | {z[size]['p99_us'] / 1e3:.3f} "
                             f"| - | {'ref' if placement == 'unpinned' else '-'} | - |")
    m = base["memcpy"][LARGE]
    lines.append(f"| baseline: memcpy {baseline.fmt_size(LARGE)} ({m['gib_s']:.1f} GiB/s) | 1 | "
                 f"{1e6 / m['median_us']:.1f} | {m['median_us'] / 1e3:.3f} | - | - | - | ref |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000", help="running server (ignored with --start)")
    ap.add_argument("--start", action="store_true", help="start shmserve for the run, stop it after")
    ap.add_argument("--model-repository", default=os.path.join(REPO_ROOT, "configs", "models"))
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="also print all results as one JSON line")
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    with tempfile.TemporaryDirectory(prefix="shmserve-bench-") as workdir:
        try:
            if args.start:
                try:
                    proc, ports = start_server(args, workdir)
                    url = f"127.0.0.1:{ports['http']}"
                except (RuntimeError, TimeoutError, OSError) as e:
                    print(f"could not start the server: {e}", file=sys.stderr)
                    return 2
                print(f"started server at {url}", file=sys.stderr)
            results = run_scenarios(url, args.duration, args.warmup)
        finally:
            if proc is not None:
                rc = stop_server(proc)
                print(f"server stopped (exit {rc})", file=sys.stderr)
    # Baselines after the load (and after stopping our server) so neither disturbs the other.
    base = baseline.measure([SMALL, LARGE], parts=("zmq", "memcpy"))
    print(f"HTTP benchmark, {url}, {args.duration:g}s per scenario (+{args.warmup:g}s warm-up), "
          f"{base['cpus']} CPU(s); zmq ratios use the unpinned round trip\n")
    print(report(results, base))
    if args.json:
        print(json.dumps({"url": url, "results": results, "baseline": base}))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
