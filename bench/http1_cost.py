#!/usr/bin/env python3
"""The Python cost of an HTTP/1.1 infer request in the frontend, by stage, on the bytes
perf_analyzer sends for identity_fp32 (binary data), in one process.

- The connection layer (frontend/http/server.py: httptools' callbacks, the limits, keep-alive,
  the answer's head), against the same layer of another checkout (``--against``). The app
  answers each request at once with an identity model's JSON header and one binary part.
- The infer codec (frontend/http/codec.py): the request parsed and checked against the model's
  config (parse_infer), and the answer's JSON header made (render_response), against their
  floor: msgspec decoding the same JSON header and encoding the answer's.

No sockets, no event loop, no model. Rounds alternate; the tables give medians.

  python bench/http1_cost.py [--against /path/to/other/checkout] [--requests 20000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType

import msgspec
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.frontend.http import codec
from shmserve.frontend.http import server as ours
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import shm
from shmserve.ipc.messages.common import Tensor
from shmserve.ipc.messages.to_frontend import InferResult, ModelInfo, ModelTable, VersionInfo
from shmserve.ipc.model_config import normalize

CONFIG = """backend: "python"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]"""

HEADER = (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32",'
          b'"parameters":{"binary_data_size":64}}],"outputs":[{"name":"OUTPUT0",'
          b'"parameters":{"binary_data":true}}]}')
BODY = HEADER + bytes(64)
REQUEST = (b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: localhost:8000\r\n"
           b"Accept: */*\r\nInference-Header-Content-Length: %d\r\n"
           b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
           % (len(HEADER), len(BODY))) + BODY
ANSWER = (b'{"model_name":"identity_fp32","model_version":"1","outputs":[{"name":"OUTPUT0",'
          b'"datatype":"FP32","shape":[1,16],"parameters":{"binary_data_size":64}}]}')


class Transport:
    """What HttpConnection asks of an asyncio transport; keeps only a count of bytes."""

    def __init__(self) -> None:
        self.written = 0
        self.first = b""

    def write(self, data) -> None:
        if not self.first:
            self.first = bytes(data)
        self.written += len(data)

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class Answering:
    """The app: what HttpConnection asks of one (frontend/http/server.py's HttpApp), answering
    each request at once as an identity model's answer."""
    raw_headers = False

    def check_body_size(self, req, n: int) -> str:
        return ""

    def body_buffer(self, req, n: int):
        return None

    def release_body(self, req) -> None:
        pass

    def connection_lost(self, conn) -> None:
        pass

    def handle(self, conn, req) -> None:
        conn.respond(req, 200, ANSWER, "application/octet-stream",
                     (("Inference-Header-Content-Length", len(ANSWER)),), (bytes(64),))


def load_other(checkout: str) -> ModuleType:
    path = os.path.join(checkout, "frontend", "http", "server.py")
    spec = importlib.util.spec_from_file_location("other_http_server", path)
    if spec is None or spec.loader is None:
        sys.exit(f"no {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def one_round(module: ModuleType, requests: int) -> float:
    """µs per request, one connection, the requests one after another (as at concurrency 1)."""
    conn = module.HttpConnection(Answering())
    transport = Transport()
    conn.connection_made(transport)
    t = time.perf_counter()
    for _ in range(requests):
        conn.data_received(REQUEST)
    spent = time.perf_counter() - t
    if not transport.first.startswith(b"HTTP/1.1 200 ") or \
            transport.written < requests * (len(ANSWER) + 64):
        sys.exit(f"{module.__name__}: answered {transport.written} bytes "
                 f"({transport.first[:40]!r}...), not {requests} answers")
    conn.connection_lost(None)
    return spent / requests * 1e6


def codec_rounds(requests: int, rounds: int) -> dict[str, list[float]]:
    """µs per request of parse_infer and render_response, and of their msgspec floor."""
    cfg = normalize(text_format.Parse(CONFIG, mc.ModelConfig()), "identity_fp32")
    catalog = ModelCatalog()
    catalog.update(ModelTable([ModelInfo("identity_fp32", cfg.SerializeToString(),
                                         [VersionInfo(1, "READY")])], startup_done=True))
    view = catalog.get("identity_fp32")
    assert view is not None
    prefix = shm.new_server_prefix()
    arena = shm.ShmArena(prefix, chunk_size=2 << 20)
    registry = ShmRegistry()
    result = InferResult(1, "identity_fp32", 1, [Tensor("OUTPUT0", "FP32", [1, 16], bytes(64))])
    decode, encode = msgspec.json.decode, msgspec.json.encode
    answer = decode(ANSWER)
    out: dict[str, list[float]] = {"parse_infer": [], "render_response": [],
                                   "floor: JSON decode + encode": []}
    try:
        for r in range(rounds + 1):         # the first round warms up
            t0 = time.perf_counter()
            for _ in range(requests):
                parsed = codec.parse_infer(view, BODY, len(HEADER), None, arena, registry)
            t1 = time.perf_counter()
            for _ in range(requests):
                codec.render_response(result, parsed, [bytes(64)])
            t2 = time.perf_counter()
            for _ in range(requests):
                decode(HEADER)
                encode(answer)
            t3 = time.perf_counter()
            tensor = parsed.payload.inputs[0]
            if tensor.data != bytes(64) or tensor.shape != [1, 16]:
                sys.exit(f"parse_infer read {tensor}, not the request's input")
            if r:
                for key, spent in zip(out, (t1 - t0, t2 - t1, t3 - t2)):
                    out[key].append(spent / requests * 1e6)
    finally:
        arena.close()
        shm.unlink_prefixed(prefix)
    return out


def table(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    print("| stage | µs per request | rounds |")
    print("|---|---:|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {', '.join(f'{t:.2f}' for t in ts)} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="another checkout whose frontend/http/server.py is the "
                                      "baseline")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    layers = [("this checkout", ours)]
    if a.against:
        layers.insert(0, (a.against, load_other(a.against)))
    times: dict[str, list[float]] = {name: [] for name, _ in layers}
    for _, module in layers:
        one_round(module, 1000)         # warm: the interpreter's caches, allocations
    for _ in range(a.rounds):
        for name, module in layers:
            times[name].append(one_round(module, a.requests))
    table(f"Connection layer (frontend/http/server.py), {a.requests} requests x {a.rounds} "
          f"rounds", {f"layer of {name}": times[name] for name, _ in layers})
    table(f"Infer codec (frontend/http/codec.py), {a.requests} requests x {a.rounds} rounds",
          codec_rounds(a.requests, a.rounds))


if __name__ == "__main__":
    main()
