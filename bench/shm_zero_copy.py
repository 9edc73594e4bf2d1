#!/usr/bin/env python3
"""Zero-copy check: a 256 MiB identity request whose input and output live in the client's
system shared memory, against one numpy memcpy of 256 MiB measured in the same run.

The request time is measured by the client (so it includes HTTP or gRPC and every hop); the
server-side time can only be smaller. With the worker reading the input in place and writing
the output straight into the client's region, one request costs about one memcpy.

  python bench/shm_zero_copy.py [--mib 256] [--iters 10] [--protocol http|grpc]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_http  # noqa: E402


def memcpy_ms(nbytes: int, iters: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)                      # fault the pages in first
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def shm_request_ms(url: str, protocol: str, nbytes: int, iters: int) -> list[float]:
    import tritonclient.utils.shared_memory as shm
    if protocol == "grpc":
        import tritonclient.grpc as mod
        client = mod.InferenceServerClient(url)
    else:
        import tritonclient.http as mod
        client = mod.InferenceServerClient(url, network_timeout=300)
    tag = f"zc{os.getpid()}"
    inh = shm.create_shared_memory_region(f"{tag}_in", f"/{tag}_in", nbytes)
    outh = shm.create_shared_memory_region(f"{tag}_out", f"/{tag}_out", nbytes)
    try:
        x = np.random.default_rng(1).standard_normal(nbytes // 4).astype(np.float32).reshape(1, -1)
        shm.set_shared_memory_region(inh, [x])
        client.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", nbytes)
        client.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", nbytes)
        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory(f"{tag}_in", nbytes)
        out = mod.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(f"{tag}_out", nbytes)
        times = []
        for i in range(iters + 2):           # the first two map and fault in the regions
            t = time.perf_counter()
            client.infer("identity_fp32", [inp], outputs=[out])
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
        got = shm.get_contents_as_numpy(outh, np.float32, x.shape)
        if not np.array_equal(got, x):
            raise AssertionError("the output region does not hold the input")
        client.unregister_system_shared_memory()
        return times
    finally:
        shm.destroy_shared_memory_region(inh)
        shm.destroy_shared_memory_region(outh)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http")
    ap.add_argument("--model-repository", default=os.path.join(run_http.REPO_ROOT, "configs", "models"))
    ap.add_argument("--server-bin", default="shmserve")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    nbytes = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="shmserve-zc-") as workdir:
        proc, ports = run_http.start_server(args, workdir)
        try:
            times = shm_request_ms(f"127.0.0.1:{ports[args.protocol]}", args.protocol, nbytes,
                                   args.iters)
        finally:
            run_http.stop_server(proc)
    copy = memcpy_ms(nbytes, args.iters)
    req = statistics.median(times)
    print(f"| {args.mib} MiB identity through system shared memory ({args.protocol}) | median ms |")
    print("|---|---:|")
    print(f"| request, client-measured (upper bound of server time) | {req:.2f} |")
    print(f"| numpy memcpy of {args.mib} MiB, same run | {copy:.2f} |")
    print(f"| ratio | {req / copy:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
