#!/usr/bin/env python3
"""Streaming and BLS costs (issue 16), measured end to end by real clients in one run.

- Decoupled streams: time to first response (TTFR) and the gap between responses of
  configs/models/repeat_int32 (DELAY 0, so the numbers are the server's own cost), over the gRPC
  stream (tritonclient) and over Server-Sent Events (/generate_stream), at c=1 and c=C.
  Baseline in the same run: a one-answer gRPC unary infer of identity_fp32 at the same
  concurrency (the cheapest round trip the server does).
- BLS: a python model that makes one BLS request to an adder per request, against the client
  calling the adder directly (the difference is what one BLS hop costs), at c=1.

Prints a table of medians (and p90) over all measured requests; never asserts anything.

  python bench/streaming.py [--tokens 16] [--requests 200] [--concurrency 8]
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
from functools import partial

import numpy as np
import requests
import tritonclient.grpc as grpcclient

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
from repo_builder import write_model  # noqa: E402
from serverproc import Server  # noqa: E402

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


def repository() -> str:
    repo = tempfile.mkdtemp(prefix="shmserve-bench-stream-")
    for m in ("repeat_int32", "identity_fp32"):
        shutil.copytree(os.path.join(REPO, "configs", "models", m), os.path.join(repo, m))
    write_model(repo, "adder", 'backend: "python"\nmax_batch_size: 0\n' + IO, ADDER)
    write_model(repo, "caller", 'backend: "python"\nmax_batch_size: 0\n' + IO, CALLER)
    return repo


def repeat_inputs(tokens: int):
    inputs = [grpcclient.InferInput("IN", [tokens], "INT32"),
              grpcclient.InferInput("DELAY", [tokens], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.arange(tokens, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.zeros(tokens, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, dtype=np.uint32))
    return inputs


def grpc_stream(srv, tokens: int, n: int) -> tuple[list[float], list[float]]:
    """One client, one stream, one request at a time: TTFR and gaps in ms."""
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    got: queue.SimpleQueue = queue.SimpleQueue()
    c.start_stream(callback=lambda result, error: got.put((time.perf_counter(), error)))
    inputs = repeat_inputs(tokens)
    ttfr, gaps = [], []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            c.async_stream_infer("repeat_int32", inputs, request_id=str(i))
            last = t0
            for k in range(tokens):
                t, error = got.get(timeout=60)
                if error is not None:
                    raise error
                (ttfr if k == 0 else gaps).append((t - last) * 1e3)
                last = t
    finally:
        c.stop_stream()
        c.close()
    return ttfr, gaps


def sse_stream(srv, tokens: int, n: int) -> tuple[list[float], list[float]]:
    body = json.dumps({"IN": list(range(tokens)), "DELAY": [0] * tokens, "WAIT": 0})
    url = f"{srv.base}/v2/models/repeat_int32/generate_stream"
    ttfr, gaps = [], []
    with requests.Session() as s:
        for _ in range(n):
            t0 = last = time.perf_counter()
            with s.post(url, data=body, stream=True, timeout=60) as r:
                r.raise_for_status()
                k = 0
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    t = time.perf_counter()
                    (ttfr if k == 0 else gaps).append((t - last) * 1e3)
                    last, k = t, k + 1
            assert k == tokens, k
            del t0
    return ttfr, gaps


def unary(srv, model: str, n: int, make) -> list[float]:
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    inputs = make()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.infer(model, inputs)
        out.append((time.perf_counter() - t0) * 1e3)
    c.close()
    return out


def concurrent(fn, workers: int) -> tuple[list[float], list[float]]:
    results: list = [None] * workers
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fn())) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a = [x for r in results for x in (r[0] if isinstance(r, tuple) else r)]
    b = [x for r in results if isinstance(r, tuple) for x in r[1]]
    return a, b


def fp32():
    i = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    i.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [i]


def int32():
    i = grpcclient.InferInput("IN", [4], "INT32")
    i.set_data_from_numpy(np.arange(4, dtype=np.int32))
    return [i]


def row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name} | - | - | 0 |"
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values
    return f"| {name} | {statistics.median(values):.3f} | {q[-1]:.3f} | {len(values)} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    repo = repository()
    srv = Server(repo)
    lines = ["| measurement | median ms | p90 ms | samples |", "|---|---:|---:|---:|"]
    try:
        n, c, k = a.requests, a.concurrency, a.tokens
        grpc_stream(srv, k, 10)                                    # warm-up
        lines.append(row("baseline: gRPC unary identity_fp32, c=1", unary(srv, "identity_fp32", n, fp32)))
        ttfr, gaps = grpc_stream(srv, k, n)
        lines += [row(f"gRPC stream repeat_int32 TTFR, c=1 ({k} tokens)", ttfr),
                  row("gRPC stream gap between responses, c=1", gaps)]
        ttfr, gaps = sse_stream(srv, k, n)
        lines += [row("SSE /generate_stream TTFR, c=1", ttfr),
                  row("SSE gap between responses, c=1", gaps)]
        base, _ = concurrent(partial(unary, srv, "identity_fp32", n // c or 1, fp32), c)
        lines.append(row(f"baseline: gRPC unary identity_fp32, c={c}", base))
        ttfr, gaps = concurrent(partial(grpc_stream, srv, k, n // c or 1), c)
        lines += [row(f"gRPC stream TTFR, c={c}", ttfr), row(f"gRPC stream gap, c={c}", gaps)]
        ttfr, gaps = concurrent(partial(sse_stream, srv, k, n // c or 1), c)
        lines += [row(f"SSE TTFR, c={c}", ttfr), row(f"SSE gap, c={c}", gaps)]
        direct = unary(srv, "adder", n, int32)
        via = unary(srv, "caller", n, int32)
        lines += [row("baseline: client -> adder (gRPC unary), c=1", direct),
                  row("client -> caller -> BLS -> adder, c=1", via),
                  f"| BLS hop (median difference) | {statistics.median(via) - statistics.median(direct):.3f} | | |"]
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
