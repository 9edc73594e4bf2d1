#!/usr/bin/env python3
"""Closed-loop HTTP load generator for the KServe v2 binary tensor protocol.

Each of N keep-alive connections sends its next request as soon as the previous response has
been fully read, so offered load adapts to the server (closed loop, like perf_analyzer's
concurrency mode). Responses are parsed with httptools on a raw asyncio protocol to keep the
client's own per-request cost small: on a 2-core machine the client competes with the server.

Usage:
  python bench/loadgen.py --url 127.0.0.1:8000 --model identity_fp32 \
      --input INPUT0:FP32:1,16 --concurrency 1,32 [--duration 10] [--warmup 2] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import time

import httptools
import numpy as np

NUMPY_DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
    "BF16": np.uint16,  # no numpy bfloat16; raw 2-byte words are all the wire needs
}
# A response that has not arrived this long after the deadline counts as an error, so a stuck
# server can never keep the load generator running.
GRACE_S = 5.0


def parse_url(url: str) -> tuple[str, int]:
    url = url.split("://", 1)[-1].rstrip("/")
    host, _, port = url.rpartition(":")
    if not host:
        host, port = port, "80"
    return host.strip("[]"), int(port)


def parse_input_spec(spec: str) -> tuple[str, str, list[int]]:
    """'INPUT0:FP32:1,16' -> ('INPUT0', 'FP32', [1, 16])."""
    name, dtype, shape = spec.rsplit(":", 2)
    dtype = dtype.upper()
    if dtype not in NUMPY_DTYPES and dtype != "BYTES":
        raise ValueError(f"unsupported datatype {dtype!r} in {spec!r}")
    dims = [int(d) for d in shape.split(",") if d.strip()] if shape.strip() else []
    return name, dtype, dims


def make_tensor_bytes(dtype: str, shape: list[int], seed: int = 0) -> bytes:
    """Random tensor in the binary wire layout (BYTES: uint32 length prefix per element)."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype == "BYTES":
        return b"".join(len(s).to_bytes(4, "little") + s
                        for s in (rng.bytes(8).hex().encode() for _ in range(n)))
    npdt = np.dtype(NUMPY_DTYPES[dtype])
    if dtype == "BOOL":
        arr = rng.integers(0, 2, n).astype(np.bool_)
    elif npdt.kind == "f":
        arr = rng.standard_normal(n).astype(npdt)
    elif dtype == "BF16":
        # Top halves of float32 words are valid bfloat16 values (no NaN garbage).
        arr = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        arr = rng.integers(0, 100, n).astype(npdt)
    return arr.astype(npdt.newbyteorder("<"), copy=False).tobytes()


def build_request(host: str, port: int, model: str, inputs, version: str = "") -> bytes:
    """Complete HTTP/1.1 request bytes; inputs: iterable of (name, dtype, shape, data_bytes)."""
    header = {
        "inputs": [{"name": n, "shape": s, "datatype": d, "parameters": {"binary_data_size": len(b)}}
                   for n, d, s, b in inputs],
        # 'outputs' omitted + binary_data_output: every output comes back as raw bytes.
        "parameters": {"binary_data_output": True},
    }
    js = json.dumps(header, separators=(",", ":")).encode()
    body = js + b"".join(b for _, _, _, b in inputs)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(js)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def percentile(sorted_values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending sequence; nan when empty."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    idx = min(n - 1, max(0, math.ceil(q / 100.0 * n) - 1))
    return float(sorted_values[idx])


def summarize(latencies_ns, errors: int, window_s: float, concurrency: int, model: str,
              first_error: str | None = None) -> dict:
    lat = sorted(latencies_ns)
    # None rather than nan when nothing succeeded: nan is not valid JSON for --json consumers.
    ms = lambda q: percentile(lat, q) / 1e6 if lat else None  # noqa: E731
    return {
        "model": model, "concurrency": concurrency, "duration_s": window_s,
        "count": len(lat), "infer_per_s": len(lat) / window_s if window_s > 0 else 0.0,
        "p50_ms": ms(50), "p90_ms": ms(90), "p99_ms": ms(99),
        "mean_ms": (sum(lat) / len(lat) / 1e6) if lat else None,
        "errors": errors, "first_error": first_error,
    }


class _Conn(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self):
        self.parser = httptools.HttpResponseParser(self)
        self.transport = None
        self.waiter: asyncio.Future | None = None
        self.status = 0
        self.err_body: list[bytes] = []
        self.keep_alive = True
        self.closed = False

    # asyncio callbacks
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(exc=e)

    def connection_lost(self, exc):
        self.closed = True
        self._finish(exc=exc or ConnectionError("connection closed by server"))

    # httptools callbacks
    def on_message_begin(self):
        self.err_body.clear()

    def on_headers_complete(self):
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes):
        # Successful bodies are discarded unread: only an error body is worth the copy.
        if self.status != 200 and sum(map(len, self.err_body)) < 4096:
            self.err_body.append(body)

    def on_message_complete(self):
        self._finish()

    def _finish(self, exc=None):
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            if exc is None:
                w.set_result(self.status)
            else:
                w.set_exception(exc)

    def send(self, data: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def close(self):
        if self.transport is not None and not self.closed:
            self.transport.close()


async def _worker(host, port, request, t_measure, t_end, lat, state):
    loop = asyncio.get_running_loop()
    conn = None
    clock = time.perf_counter_ns
    try:
        while clock() < t_end:
            if conn is None or conn.closed:
                try:
                    _, conn = await asyncio.wait_for(
                        loop.create_connection(_Conn, host, port),
                        timeout=max(0.0, (t_end - clock()) / 1e9) + GRACE_S)
                except (OSError, asyncio.TimeoutError) as e:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or f"connect: {e!r}"
                    conn = None
                    await asyncio.sleep(0.05)  # don't spin on a refused connection
                    continue
            t0 = clock()
            try:
                status = await asyncio.wait_for(conn.send(request),
                                                timeout=max(0.0, (t_end - t0) / 1e9) + GRACE_S)
            except (OSError, ConnectionError, httptools.HttpParserError,
                    asyncio.TimeoutError) as e:
                state["errors"] += 1
                state["first_error"] = state["first_error"] or f"transport: {e!r}"
                conn.close()
                conn = None
                continue
            t1 = clock()
            if status == 200:
                # Only requests that both start after warm-up and finish before the deadline
                # count, so throughput = count / window is not inflated by the edges.
                if t0 >= t_measure and t1 <= t_end:
                    lat.append(t1 - t0)
            else:
                state["errors"] += 1
                if state["first_error"] is None:
                    body = b"".join(conn.err_body)[:2048].decode("utf-8", "replace")
                    state["first_error"] = f"HTTP {status}: {body}"
            if not conn.keep_alive:
                conn.close()
                conn = None
    finally:
        if conn is not None:
            conn.close()


async def run_load(url: str, model: str, inputs, concurrency: int, duration: float = 10.0,
                   warmup: float = 2.0, version: str = "") -> dict:
    """Run one closed-loop measurement; inputs are specs ('INPUT0:FP32:1,16') or
    (name, dtype, shape) tuples. Returns the summarize() dict."""
    host, port = parse_url(url)
    specs = [parse_input_spec(s) if isinstance(s, str) else tuple(s) for s in inputs]
    tensors = [(n, d, list(s), make_tensor_bytes(d, list(s), seed=i))
               for i, (n, d, s) in enumerate(specs)]
    # All connections send identical bytes, so one immutable copy is shared by all of them.
    request = build_request(host, port, model, tensors, version)
    lat: list[int] = []
    state = {"errors": 0, "first_error": None}
    start = time.perf_counter_ns()
    t_measure = start + int(warmup * 1e9)
    t_end = t_measure + int(duration * 1e9)
    await asyncio.gather(*(_worker(host, port, request, t_measure, t_end, lat, state)
                           for _ in range(concurrency)))
    return summarize(lat, state["errors"], duration, concurrency, model, state["first_error"])


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_row(r: dict) -> str:
    return (f"| {r['concurrency']:>5} | {r['infer_per_s']:>10.1f} | {fmt_ms(r['p50_ms']):>8} | "
            f"{fmt_ms(r['p90_ms']):>8} | {fmt_ms(r['p99_ms']):>8} | {r['errors']:>6} |")


TABLE_HEADER = ("| conc. |    infer/s |  p50 ms  |  p90 ms  |  p99 ms  | errors |\n"
                "|------:|-----------:|---------:|---------:|---------:|-------:|")


def _concurrencies(values) -> list[int]:
    out = []
    for v in values:
        out += [int(x) for x in str(v).split(",") if x.strip()]
    if not out or min(out) < 1:
        raise SystemExit("--concurrency values must be >= 1")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-version", default="")
    ap.add_argument("--input", action="append", required=True, metavar="NAME:DTYPE:SHAPE")
    ap.add_argument("--concurrency", action="append", default=None, help="e.g. 1,32; repeatable")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="one JSON result line per concurrency")
    args = ap.parse_args(argv)
    concs = _concurrencies(args.concurrency or ["1"])
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # still usable, only slower
        runner = asyncio.run
    if not args.json:
        print(f"model {args.model} @ {args.url}, inputs {' '.join(args.input)}, "
              f"{args.duration:g}s (+{args.warmup:g}s warm-up)")
        print(TABLE_HEADER)
    errors = 0
    for c in concs:
        r = runner(run_load(args.url, args.model, args.input, c, args.duration, args.warmup,
                            args.model_version))
        errors += r["errors"]
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(format_row(r), flush=True)
            if r["first_error"]:
                print(f"  first error: {r['first_error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
