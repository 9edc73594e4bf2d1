#!/usr/bin/env python3
"""Streaming and BLS costs (issue 16), measured end to end by real clients (tritonclient, requests).

- Decoupled streams: configs/models/repeat_int32 (--tokens responses per request, default 16;
  DELAY 0, so the numbers are the server's own cost) over the gRPC stream (tritonclient) and
  over Server-Sent Events (/generate_stream, requests), at each concurrency of --concurrency
  (default 1 and 32: c clients, a thread each, one request at a time each). Per request: the
  time to the first response (TTFR), to the last one, and the mean gap ((last - first) /
  (tokens - 1); a server that sends a stream in one burst shows a gap near 0 and a TTFR near
  the last: when a median gap is under 1% of its TTFR, the ratio reads "burst").
  Baseline at the same concurrency: a one-answer gRPC unary infer of identity_fp32.
- BLS: a python model making one BLS request to an adder per request, against the client calling
  the adder directly; the difference of the medians is what one BLS hop costs (c=1).

Each client makes one unmeasured request first (connection, stream set-up), then all start at
once. The requests of a row are spread over --passes passes over all rows (so the machine's
drift falls on every row alike); the table gives medians and p90 over all of them, and the
server's CPU per request (its process tree, from /proc, the median over passes). Never asserts.

--triton: the same repository (python models only; Triton 2.51 loads them unchanged) on the real
Triton 2.51 (../shared/tools/triton-bench; its setup.sh builds /tmp/triton-bench) and on
shmserve, both up at once; each row runs on one server, then on the other, the order
alternating from row to row and pass to pass. Ratio: Triton / shmserve of the medians (above 1:
shmserve is faster), also per pass (median [min-max]), which shows how steady it is.

On 2 cores the Python clients take a large share of the CPU (at c=32 most of a core): compare
ratios, not absolute numbers, and read the load average printed with the table.

  python bench/streaming.py [--quick] [--triton] [--concurrency 1 32] [--tokens 16]
                            [--requests 600] [--passes 6]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import requests
import tritonclient.grpc as grpcclient

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)
from repo_builder import write_model  # noqa: E402
from serverproc import Server, cpu_seconds  # noqa: E402

ADDER = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)])
                for r in requests]
''')
CALLER = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                resp = pb_utils.InferenceRequest(model_name="adder", requested_output_names=["OUT"],
                    inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
                out.append(pb_utils.InferenceResponse(resp.output_tensors()))
            return out
''')
IO = '''
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ -1 ] } ]
'''
MODELS = ("repeat_int32", "identity_fp32", "adder", "caller")


def repository() -> str:
    """All python models; Triton 2.51 (python backend) loads them unchanged."""
    repo = tempfile.mkdtemp(prefix="shmserve-bench-stream-")
    for m in ("repeat_int32", "identity_fp32"):
        shutil.copytree(os.path.join(REPO, "configs", "models", m), os.path.join(repo, m))
    write_model(repo, "adder", 'backend: "python"\nmax_batch_size: 0\n' + IO, ADDER)
    write_model(repo, "caller", 'backend: "python"\nmax_batch_size: 0\n' + IO, CALLER)
    return repo


@dataclass
class Endpoint:
    name: str
    grpc_url: str      # host:port
    base: str          # http://host:port
    pid: int           # the server process (its tree's CPU is counted)


# ---- one client's loop: 1 unmeasured request, wait for the others, n measured ones ---------------
def repeat_inputs(tokens: int):
    inputs = [grpcclient.InferInput("IN", [tokens], "INT32"),
              grpcclient.InferInput("DELAY", [tokens], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.arange(tokens, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.zeros(tokens, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, dtype=np.uint32))
    return inputs


def stream_metrics(times: list[tuple[float, float]], tokens: int) -> dict:
    """(first, last response) after sending, per request -> TTFR, mean gap, last, in ms."""
    return {"TTFR": [a * 1e3 for a, _ in times],
            "gap": [(b - a) * 1e3 / max(1, tokens - 1) for a, b in times],
            "last response": [b * 1e3 for _, b in times]}


def grpc_stream(ep: Endpoint, start: threading.Barrier, tokens: int, n: int) -> dict:
    """One stream, one request at a time."""
    c = grpcclient.InferenceServerClient(ep.grpc_url)
    got: queue.SimpleQueue = queue.SimpleQueue()
    c.start_stream(callback=lambda result, error: got.put((time.perf_counter(), result, error)))
    inputs = repeat_inputs(tokens)
    times = []
    try:
        for i in range(n + 1):
            if i == 1:
                start.wait()
            t0 = time.perf_counter()
            c.async_stream_infer("repeat_int32", inputs, request_id=str(i))
            answers = [got.get(timeout=60) for _ in range(tokens)]
            for _, _, error in answers:
                if error is not None:
                    raise error
            if int(answers[-1][1].as_numpy("OUT")[0]) != tokens - 1:
                raise RuntimeError(f"{ep.name}: the last response is not the last token")
            if i:
                times.append((answers[0][0] - t0, answers[-1][0] - t0))
    finally:
        c.stop_stream()
        c.close()
    return stream_metrics(times, tokens)


def sse_stream(ep: Endpoint, start: threading.Barrier, tokens: int, n: int) -> dict:
    """One keep-alive connection, one request at a time."""
    body = json.dumps({"IN": list(range(tokens)), "DELAY": [0] * tokens, "WAIT": 0})
    url = f"{ep.base}/v2/models/repeat_int32/generate_stream"
    times = []
    with requests.Session() as s:
        for i in range(n + 1):
            if i == 1:
                start.wait()
            t0 = time.perf_counter()
            events = []
            with s.post(url, data=body, stream=True, timeout=60) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data:"):
                        events.append((time.perf_counter(), line))
            if len(events) != tokens or \
                    json.loads(events[-1][1][5:])["OUT"] not in (tokens - 1, [tokens - 1]):
                raise RuntimeError(f"{ep.name}: {len(events)} SSE events, the last {events[-1:]}")
            if i:
                times.append((events[0][0] - t0, events[-1][0] - t0))
    return stream_metrics(times, tokens)


def unary(ep: Endpoint, start: threading.Barrier, model: str, make, n: int) -> dict:
    c = grpcclient.InferenceServerClient(ep.grpc_url)
    inputs = make()
    out = []
    try:
        for i in range(n + 1):
            if i == 1:
                start.wait()
            t0 = time.perf_counter()
            c.infer(model, inputs)
            if i:
                out.append((time.perf_counter() - t0) * 1e3)
    finally:
        c.close()
    return {"latency": out}


def fp32():
    i = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    i.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [i]


def int32():
    i = grpcclient.InferInput("IN", [4], "INT32")
    i.set_data_from_numpy(np.arange(4, dtype=np.int32))
    return [i]


# ---- rows: (label, concurrency, client loop); a row's metrics are its loop's keys --------------
def rows(tokens: int, requests_: int, concurrencies: list[int]) -> list[tuple[str, int, object]]:
    out = []
    for c in concurrencies:
        n = max(2, -(-requests_ // c))           # per client; every row gets >= requests_
        out += [(f"gRPC unary identity_fp32 (baseline), c={c}", c,
                 partial(unary, model="identity_fp32", make=fp32, n=n)),
                (f"gRPC stream repeat_int32 ({tokens} tokens), c={c}", c,
                 partial(grpc_stream, tokens=tokens, n=n)),
                (f"SSE /generate_stream ({tokens} tokens), c={c}", c,
                 partial(sse_stream, tokens=tokens, n=n))]
    out += [("BLS baseline: client -> adder (gRPC unary), c=1", 1,
             partial(unary, model="adder", make=int32, n=requests_)),
            ("client -> caller -> BLS -> adder, c=1", 1,
             partial(unary, model="caller", make=int32, n=requests_))]
    return out


def run_row(ep: Endpoint, c: int, loop) -> dict:
    """c clients of ``loop`` at once: {metric: [ms...]} merged, plus "cpu" (server CPU ms per
    measured request, the clients' warm-up requests included in the time)."""
    start = threading.Barrier(c)
    results: list = [None] * c
    errors: list = []

    def client(i: int) -> None:
        try:
            results[i] = loop(ep, start)
        except BaseException as e:      # noqa: BLE001 - reported below
            errors.append(e)
            start.abort()
    cpu0 = cpu_seconds(ep.pid)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = cpu_seconds(ep.pid) - cpu0
    if errors:
        raise RuntimeError(f"{ep.name}: {errors[0]!r}") from errors[0]
    merged: dict = {}
    for r in results:
        for k, v in r.items():
            merged.setdefault(k, []).extend(v)
    requests_ = len(next(iter(merged.values())))       # one sample per request, each metric
    merged["cpu"] = [cpu * 1e3 / max(1, requests_ + c)]
    return merged


def measure(eps: list[Endpoint], table: list, passes: int, tokens: int) -> list[dict]:
    """Per endpoint, {row label: {metric: [samples of pass 1, of pass 2, ...]}}; each row runs on
    every endpoint in turn, the order alternating from row to row and pass to pass."""
    res: list[dict] = [{} for _ in eps]
    for ep in eps:                               # warm-up: the models' first requests
        run_row(ep, 1, partial(grpc_stream, tokens=tokens, n=5))
        run_row(ep, 1, partial(unary, model="caller", make=int32, n=5))
    for p in range(passes):
        for r, (label, c, loop) in enumerate(table):
            for k in range(len(eps)):
                i = (k + r + p) % len(eps)
                for metric, v in run_row(eps[i], c, loop).items():
                    if metric != "gap" or tokens > 1:
                        res[i].setdefault(label, {}).setdefault(metric, []).append(v)
            print(f"  pass {p + 1}/{passes}: {label} done", file=sys.stderr)
    return res


def median(runs: list[list[float]]) -> float:
    return statistics.median(x for run in runs for x in run)


def p90(runs: list[list[float]]) -> float:
    pooled = [x for run in runs for x in run]
    return statistics.quantiles(pooled, n=10)[-1] if len(pooled) > 1 else pooled[0]


def with_bls_hop(res: dict) -> list[tuple[str, str, list[list[float]]]]:
    """(row label, metric, samples per pass) of every line, the BLS hop (the difference of the
    two BLS rows' medians, one value per pass) last."""
    out = [(label, m, runs) for label, metrics in res.items() for m, runs in metrics.items()]
    via, direct = (res[k]["latency"] for k in ("client -> caller -> BLS -> adder, c=1",
                                               "BLS baseline: client -> adder (gRPC unary), c=1"))
    return out + [("BLS hop (caller - adder, medians)", "hop",
                   [[statistics.median(a) - statistics.median(b)] for a, b in zip(via, direct)])]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 and a > 0 else "-"


def report(res: list[dict]) -> str:
    """shmserve alone: median, p90, samples, server CPU. Triton and shmserve: both medians and
    p90s, the ratio Triton / shmserve of the medians, and that ratio in each pass."""
    if len(res) == 1:
        lines = ["| measurement | median ms | p90 ms | samples | server CPU ms/request |",
                 "|---|---:|---:|---:|---:|"]
    else:
        lines = ["| measurement | Triton median / p90 ms | shmserve median / p90 ms | "
                 "Triton / shmserve | per pass: median [min-max] | server CPU ms/request Triton "
                 "/ shmserve |",
                 "|---|---:|---:|---:|---:|---:|"]
    for cells in zip(*(with_bls_hop(r) for r in res)):
        label, metric, _ = cells[0]
        if metric == "cpu":
            continue
        name = label if metric in ("latency", "hop") else f"{label}: {metric}"
        cpu = " / ".join(f"{median(r[label]['cpu']):.2f}" for r in res) \
            if metric in ("latency", "TTFR") else ""
        runs = [c[2] for c in cells]
        value = [f"{median(r):.3f}" + ("" if metric == "hop" else f" / {p90(r):.3f}")
                 for r in runs]
        if len(res) == 1:
            n = "" if metric == "hop" else sum(map(len, runs[0]))
            lines.append(f"| {name} | {value[0].replace(' / ', ' | ')} | {n} | {cpu} |"
                         if metric != "hop" else f"| {name} | {value[0]} | | | |")
        else:
            per_pass = sorted(statistics.median(a) / statistics.median(b) for a, b in zip(*runs)
                              if statistics.median(a) > 0 and statistics.median(b) > 0)
            per_pass = f"{statistics.median(per_pass):.2f} [{per_pass[0]:.2f}-{per_pass[-1]:.2f}]" \
                if per_pass else "-"
            burst = metric == "gap" and any(median(r) < 0.01 * median(res[i][label]["TTFR"])
                                            for i, r in enumerate(runs))
            lines.append(f"| {name} | {value[0]} | {value[1]} | "
                         f"{'burst' if burst else ratio(median(runs[0]), median(runs[1]))} | "
                         f"{'' if burst else per_pass} | {cpu} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="100 requests per row and server in 4 passes (--triton: about 45 s)")
    ap.add_argument("--tokens", type=int, default=16, help="responses per stream request")
    ap.add_argument("--requests", type=int,
                    help="measured requests per row and server, split over the passes, at least "
                    "2 per client and pass (default 600; 100 --quick)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--passes", type=int, help="the requests of each row are split into this "
                    "many passes over all rows, pooled in the end (default 6; 4 --quick)")
    ap.add_argument("--triton", action="store_true",
                    help="the same repository on Triton 2.51 and shmserve, row by row")
    a = ap.parse_args()
    passes = a.passes or (4 if a.quick else 6)
    n = -(-(a.requests or (100 if a.quick else 600)) // passes)     # per row and pass
    table = rows(a.tokens, n, a.concurrency)
    repo = repository()
    load0, t0 = os.getloadavg(), time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="shmserve-bench-stream-logs-") as work:
            triton = None
            if a.triton:
                from ensemble import start_triton
                triton = start_triton(repo, os.path.join(work, "triton.log"), models=MODELS)
            try:
                srv = Server(repo)
                try:
                    eps = [Endpoint("shmserve", srv.grpc_url, srv.base, srv.proc.pid)]
                    if triton is not None:
                        eps.insert(0, Endpoint("Triton", triton.grpc_url,
                                               f"http://{triton.http_url}", triton.pid))
                    res = measure(eps, table, passes, a.tokens)
                finally:
                    srv.stop()
            finally:
                if triton is not None:
                    triton.stop()
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    load1 = os.getloadavg()
    what = "Triton 2.51 and shmserve on the same repository, each row on both in turn; " \
        "ratio: Triton / shmserve of the medians (above 1: shmserve answers sooner)" \
        if a.triton else "shmserve"
    print(f"{what}; {a.tokens} tokens per stream request, DELAY 0; {n} measured requests per "
          f"row and pass, {passes} pass(es); {os.cpu_count()} CPU(s) shared with the "
          f"clients; load average {load0[0]:.1f} before, {load1[0]:.1f} after; "
          f"{time.monotonic() - t0:.0f} s\n")
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
