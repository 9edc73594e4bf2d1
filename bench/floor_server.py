#!/usr/bin/env python3
"""The floors under shmserve's shape, servable to perf_analyzer: a bare HTTP server, and the same
server with N message hops behind it, with no inference code at all.

``--hops 0`` is a bare uvloop + httptools server. It answers perf_analyzer's metadata and config
requests for one model with canned JSON. For an infer request in binary form it echoes the input
tensor back as OUTPUT0.

``--hops N`` sends each request's bytes through N - 1 relays and back to the frontend; each
relay is a bare loop that passes the record on. ``--transport unix`` makes each hop an AF_UNIX
SOCK_SEQPACKET socket read and written by the process's own thread, as shmserve's leased hops
are (ipc/packets.py); ``--transport zmq`` makes it a ZeroMQ PUSH/PULL pair, which moves every
message through an I/O thread on each side (one hop wakes three threads instead of one).

What each floor stands for on shmserve's one path (docs/architecture.md has the hop counts):

- ``--hops 2 --transport unix``: a plain model's request under a lease (frontend -> worker ->
  frontend), and a sequence's request under its lease.
- ``--hops 3 --transport unix``: a two-step pipeline (ensemble) under leases, handed worker to
  worker (frontend -> step 1 -> step 2 -> frontend); a BLS call adds the same one hop out and
  one back (caller -> callee -> caller) to its caller's two.
- ``--hops 4 --transport unix``: a three-step pipeline (row h's ``ensemble3``).
- ``--hops 3 --transport zmq``: a request that queues in the scheduler (frontend -> scheduler ->
  worker -> frontend; the first hop is ZeroMQ, the rest are not, so this is its upper bound).

The difference between a floor and shmserve on the same request kind is shmserve's own Python
(codecs, routing, statistics, the model's backend).

  python bench/floor_server.py --port 0 --hops 2 --transport unix --port-file /tmp/floor.json
  python bench/floor_server.py --port 0 --hops 3 --transport unix
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile

import httptools
import uvloop
import zmq

MODEL = "identity_fp32"
METADATA = json.dumps({"name": MODEL, "versions": ["1"], "platform": "python",
                       "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}],
                       "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, -1]}]}).encode()
SERVER = json.dumps({"name": "floor", "version": "2.51.0", "extensions": []}).encode()
CONFIG = json.dumps({"name": MODEL, "backend": "python", "max_batch_size": 64,
                     "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                     "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}).encode()


def _relay(pull_addr: str, push_addr: str) -> None:
    """One bare hop: receive a message, send it on; what a process costs with no work in it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_addr)
    while True:
        frames = pull.recv_multipart()
        push.send_multipart(frames)


def _unix_relay(inbound: socket.socket, outbound: socket.socket) -> None:
    """The same bare hop over AF_UNIX SOCK_SEQPACKET: one blocking read, one write."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        record = inbound.recv(1 << 17)
        if not record:
            return
        outbound.send(record)


def _infer_response(header_len: int, body: bytes) -> bytes:
    tensor = body[header_len:]
    req = json.loads(body[:header_len]) if header_len else json.loads(body)
    shape = req["inputs"][0]["shape"]
    answer = {"id": req["id"]} if "id" in req else {}     # perf_analyzer's async mode checks it
    head = json.dumps({**answer, "model_name": MODEL, "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": shape,
         "parameters": {"binary_data_size": len(tensor)}}]}).encode()
    return head, tensor


class Conn(asyncio.Protocol):
    def __init__(self, server):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.headers = {}
        self.body = []

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_message_begin(self):
        self.headers = {}
        self.body = []
        self.url = b""

    def on_url(self, url):
        self.url += url

    def on_header(self, name, value):
        self.headers[name.lower()] = value

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        url = self.url.decode()
        if self.parser.get_method() == b"POST" and url.endswith("/infer"):
            body = b"".join(self.body)
            hlen = int(self.headers.get(b"inference-header-content-length", b"0"))
            self.server.infer(self, hlen, body)
        elif url.endswith("/config"):
            self.send(CONFIG)
        elif url.startswith(f"/v2/models/{MODEL}"):
            self.send(METADATA)
        elif url.rstrip("/") == "/v2":
            self.send(SERVER)
        else:
            self.send(b"")

    def send(self, body: bytes, extra: bytes = b"", header_len: int | None = None) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % (len(body) + len(extra))
        if header_len is not None:
            head += b"Inference-Header-Content-Length: %d\r\n" % header_len
            head += b"Content-Type: application/octet-stream\r\n"
        self.transport.write(head + b"\r\n" + body + extra)


class FloorServer:
    def __init__(self, hops: int, run_dir: str, transport: str = "zmq"):
        self.hops = hops
        self.transport = transport
        self.waiting: dict[int, Conn] = {}
        self.next_id = 0
        if hops and transport == "unix":
            # hop i goes from pairs[i][0] to pairs[i][1]; the frontend writes hop 0 and reads
            # the last one, relay i reads hop i and writes hop i + 1
            pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                     for _ in range(hops)]
            self.relays = [mp.Process(target=_unix_relay, args=(pairs[i][1], pairs[i + 1][0]),
                                      daemon=True) for i in range(hops - 1)]
            for p in self.relays:
                p.start()
            self.out, self.back = pairs[0][0], pairs[-1][1]
            self.back.setblocking(False)
        elif hops:
            ctx = zmq.Context(io_threads=1)
            back = f"ipc://{run_dir}/front"
            self.pull = ctx.socket(zmq.PULL)
            self.pull.bind(back)
            self.push = ctx.socket(zmq.PUSH)
            addrs = [f"ipc://{run_dir}/relay{i}" for i in range(hops - 1)] + [back]
            self.relays = [mp.Process(target=_relay, args=(addrs[i], addrs[i + 1]), daemon=True)
                           for i in range(hops - 1)]
            for p in self.relays:
                p.start()
            self.push.connect(addrs[0])

    def attach(self, loop) -> None:
        if self.hops and self.transport == "unix":
            loop.add_reader(self.back.fileno(), self._drain_unix)
        elif self.hops:
            loop.add_reader(self.pull.getsockopt(zmq.FD), self._drain)

    def infer(self, conn: Conn, hlen: int, body: bytes) -> None:
        if not self.hops:
            head, tensor = _infer_response(hlen, body)
            conn.send(head, tensor, len(head))
            return
        self.next_id += 1
        self.waiting[self.next_id] = conn
        if self.transport == "unix":
            self.out.send(self.next_id.to_bytes(8, "little") + hlen.to_bytes(8, "little") + body)
            return
        self.push.send_multipart([self.next_id.to_bytes(8, "little"),
                                  hlen.to_bytes(8, "little"), body])
        self._drain()

    def _answer(self, rid: bytes, hlen: bytes, body: bytes) -> None:
        conn = self.waiting.pop(int.from_bytes(rid, "little"))
        head, tensor = _infer_response(int.from_bytes(hlen, "little"), body)
        conn.send(head, tensor, len(head))

    def _drain(self) -> None:
        while self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._answer(*self.pull.recv_multipart())

    def _drain_unix(self) -> None:
        while True:
            try:
                record = self.back.recv(1 << 17)
            except BlockingIOError:
                return
            if not record:                  # the relays are gone: the server is stopping
                asyncio.get_running_loop().remove_reader(self.back.fileno())
                return
            self._answer(record[:8], record[8:16], record[16:])


def _grpc_servicer():
    """The same floor on grpc.aio: canned metadata and config, ModelInfer echoes INPUT0."""
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    class Floor(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="floor", version="2.51.0")

        async def ModelMetadata(self, request, context):
            resp = pb.ModelMetadataResponse(name=MODEL, versions=["1"], platform="python")
            resp.inputs.add(name="INPUT0", datatype="FP32", shape=[-1, -1])
            resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=[-1, -1])
            return resp

        async def ModelConfig(self, request, context):
            cfg = mc.ModelConfig(name=MODEL, backend="python", max_batch_size=64)
            cfg.input.add(name="INPUT0", data_type=mc.TYPE_FP32, dims=[-1])
            cfg.output.add(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[-1])
            return pb.ModelConfigResponse(config=cfg)

        async def ModelInfer(self, request, context):
            resp = pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
            resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=request.inputs[0].shape)
            resp.raw_output_contents.append(request.raw_input_contents[0])
            return resp

    return Floor(), pb_grpc.add_GRPCInferenceServiceServicer_to_server


async def serve_grpc(args) -> None:
    import grpc
    servicer, add = _grpc_servicer()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 ** 31 - 1),
                                      ("grpc.max_send_message_length", 2 ** 31 - 1)])
    add(servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            json.dump({"grpc": port}, f)
        os.replace(args.port_file + ".tmp", args.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


async def serve(args) -> None:
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory(prefix="shmserve-floor-") as run_dir:
        floor = FloorServer(args.hops, run_dir, args.transport)
        floor.attach(loop)
        server = await loop.create_server(lambda: Conn(floor), args.host, args.port)
        port = server.sockets[0].getsockname()[1]
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as f:
                json.dump({"http": port}, f)
            os.replace(args.port_file + ".tmp", args.port_file)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        for p in getattr(floor, "relays", []):
            p.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--hops", type=int, choices=(0, 2, 3, 4), default=0,
                    help="message hops behind the HTTP server (see above); 0: none")
    ap.add_argument("--transport", choices=("zmq", "unix"), default="zmq",
                    help="what carries each hop (unix: SOCK_SEQPACKET, no I/O threads)")
    ap.add_argument("--protocol", choices=("http", "grpc"), default="http",
                    help="grpc: a bare grpc.aio server (no hops)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the event loop (grpc.aio behaves very differently on the two)")
    ap.add_argument("--port-file", default="")
    args = ap.parse_args(argv)
    main_coro = serve_grpc(args) if args.protocol == "grpc" else serve(args)
    if args.loop == "asyncio":
        asyncio.run(main_coro)
    else:
        uvloop.run(main_coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
