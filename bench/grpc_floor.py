#!/usr/bin/env python3
"""The floor of Python gRPC servers for Triton's protocol: no inference, no hops, canned answers.

Serves identity_fp32 (ModelInfer echoes raw_input_contents) from a bare gRPC server of each
kind and measures it with the real perf_analyzer at c=1 and c=8, in the same run:

- ``aio+asyncio``: grpc.aio on asyncio's default loop.
- ``aio+uvloop``: grpc.aio on uvloop, the loop shmserve's frontend runs.
- ``aio+uvloop+http``: the same with an idle HTTP server on the loop (shmserve shares its loop).
- ``sync``: grpc's thread-pool server (handlers on Python threads).
- ``loop``: shmserve's own gRPC server on uvloop (frontend/grpc/loop.py: h2, no gRPC threads).

Each is run with gRPC's default experiments and with ``GRPC_EXPERIMENTS=-event_engine_listener``.
The point is to know what a gRPC frontend can reach before anything of shmserve runs in it.

  python bench/grpc_floor.py [--pa PATH] [--interval-ms 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures

MODEL = "identity_fp32"
KINDS = ("aio+asyncio", "aio+uvloop", "aio+uvloop+http", "sync", "loop")


def _servicer_class():
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    meta = pb.ModelMetadataResponse(
        name=MODEL, versions=["1"], platform="python",
        inputs=[pb.ModelMetadataResponse.TensorMetadata(name="INPUT0", datatype="FP32",
                                                        shape=[-1, 16])],
        outputs=[pb.ModelMetadataResponse.TensorMetadata(name="OUTPUT0", datatype="FP32",
                                                         shape=[-1, 16])])
    config = pb.ModelConfigResponse(config=mc.ModelConfig(
        name=MODEL, backend="python", max_batch_size=64,
        input=[mc.ModelInput(name="INPUT0", data_type=mc.TYPE_FP32, dims=[16])],
        output=[mc.ModelOutput(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[16])]))

    def infer(request):
        t = request.inputs[0]
        return pb.ModelInferResponse(
            model_name=MODEL, model_version="1", id=request.id,
            outputs=[pb.ModelInferResponse.InferOutputTensor(name="OUTPUT0", datatype="FP32",
                                                             shape=t.shape)],
            raw_output_contents=[request.raw_input_contents[0]])

    class Sync(pbg.GRPCInferenceServiceServicer):
        def ServerLive(self, r, c):
            return pb.ServerLiveResponse(live=True)

        def ServerReady(self, r, c):
            return pb.ServerReadyResponse(ready=True)

        def ModelReady(self, r, c):
            return pb.ModelReadyResponse(ready=True)

        def ServerMetadata(self, r, c):
            return pb.ServerMetadataResponse(name="floor", version="2.51.0")

        def ModelMetadata(self, r, c):
            return meta

        def ModelConfig(self, r, c):
            return config

        def ModelInfer(self, r, c):
            return infer(r)

    class Aio(pbg.GRPCInferenceServiceServicer):
        async def ServerLive(self, r, c):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, r, c):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, r, c):
            return pb.ModelReadyResponse(ready=True)

        async def ServerMetadata(self, r, c):
            return pb.ServerMetadataResponse(name="floor", version="2.51.0")

        async def ModelMetadata(self, r, c):
            return meta

        async def ModelConfig(self, r, c):
            return config

        async def ModelInfer(self, r, c):
            return infer(r)

    return Sync, Aio, pbg


def serve(kind: str, port: int) -> None:
    import grpc
    Sync, Aio, pbg = _servicer_class()
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pbg.add_GRPCInferenceServiceServicer_to_server(Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return
    if kind.startswith("aio+uvloop") or kind == "loop":
        import uvloop
        uvloop.install()

    async def main():
        if kind == "loop":
            from shmserve.frontend.grpc.loop import GrpcLoopServer
            from shmserve.frontend.grpc.service import _GenericHandlers
            handlers = _GenericHandlers()
            pbg.add_GRPCInferenceServiceServicer_to_server(Aio(), handlers)
            loop_server = GrpcLoopServer(handlers.handlers, 2 ** 31 - 1)
            await loop_server.start("127.0.0.1", port)
            await asyncio.Event().wait()
        server = grpc.aio.server()
        pbg.add_GRPCInferenceServiceServicer_to_server(Aio(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        if kind.endswith("+http"):
            loop = asyncio.get_running_loop()
            await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        await server.wait_for_termination()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(pa: str, kind: str, experiments: str, concurrency: int, interval_ms: int,
            tmp: str) -> tuple[float, float]:
    port = _free_port()
    env = dict(os.environ)
    if experiments:
        env["GRPC_EXPERIMENTS"] = experiments
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)],
                            env=env)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        report = os.path.join(tmp, "pa.csv")
        out = subprocess.run([pa, "-m", MODEL, "-i", "grpc", "-u", f"127.0.0.1:{port}",
                              "--concurrency-range", str(concurrency), "--shape", "INPUT0:16",
                              "--measurement-interval", str(interval_ms),
                              "--stability-percentage", "50", "--max-trials", "6", "-f", report],
                             capture_output=True, timeout=120, text=True)
        if out.returncode != 0:         # did not stabilise on a busy machine
            return float("nan"), float("nan")
        with open(report) as f:
            row = next(csv.DictReader(f))
        return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", choices=KINDS)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--pa", default=os.environ.get("PERF_ANALYZER", "/tmp/triton-bench/perf_analyzer"))
    ap.add_argument("--interval-ms", type=int, default=2000)
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.port)
        return
    print(f"{'server':<18} {'GRPC_EXPERIMENTS':<24} {'c':>3} {'infer/s':>9} {'p50 ms':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.kinds.split(","):
            for exp in (("",) if kind == "loop" else ("", "-event_engine_listener")):
                for c in (1, 8):
                    ips, p50 = measure(a.pa, kind, exp, c, a.interval_ms, tmp)
                    print(f"{kind:<18} {exp or '(default)':<24} {c:>3} {ips:>9.0f} {p50:>8.3f}",
                          flush=True)


if __name__ == "__main__":
    main()
