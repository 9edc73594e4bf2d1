#!/usr/bin/env python3
"""How a process should wait for ZeroMQ messages: the choice behind the receive loops in
workers/main.py and engine/scheduler.py.

Two processes echo a two-frame message shaped like a request (a 120-byte header and a 200-byte
payload) over ipc://. Each way of receiving is measured one at a time (round trip) and with 32
messages in flight (pipelined, which gives messages per second):

  poll+noblock  zmq.Poller.poll, then recv_multipart(NOBLOCK, copy=False) until zmq.Again
                (the loops before this change)
  blocking      one blocking recv_multipart() with copied frames (the loops before the next one)

The same message through one inproc PUSH/PULL pair inside this process, which leaves only the
cost of the calls: pyzmq's send_multipart/recv_multipart (which combine flags as enum.IntFlag
values) against shmserve's Outbox.send/Inbox.recv (pyzmq's Cython core with int flags).

  python bench/zmq_options.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time

import zmq

MESSAGE = [b"h" * 120, b"p" * 200]


def _echo(mode: str, inbound: str, outbound: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(inbound)
    push = ctx.socket(zmq.PUSH)
    push.connect(outbound)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        if mode == "poll+noblock":
            poller.poll(1000)
            while True:
                try:
                    frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                push.send_multipart(frames, copy=False)
                if len(frames[0]) == 0:
                    return
        else:
            frames = pull.recv_multipart()
            push.send_multipart(frames)
            if len(frames[0]) == 0:
                return


def measure(mode: str, run_dir: str) -> tuple[float, float]:
    """Returns (round trip in us, pipelined messages per second)."""
    inbound, outbound = f"ipc://{run_dir}/{mode}-in", f"ipc://{run_dir}/{mode}-out"
    peer = mp.Process(target=_echo, args=(mode, inbound, outbound))
    peer.start()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(outbound)
    push = ctx.socket(zmq.PUSH)
    push.connect(inbound)
    for _ in range(500):                        # warm up: connections, caches
        push.send_multipart(MESSAGE)
        pull.recv_multipart()
    n = 5000
    t = time.perf_counter()
    for _ in range(n):
        push.send_multipart(MESSAGE)
        pull.recv_multipart()
    rtt_us = (time.perf_counter() - t) / n * 1e6
    n, sent, got, inflight = 40000, 0, 0, 0
    t = time.perf_counter()
    while got < n:
        while inflight < 32 and sent < n:
            push.send_multipart(MESSAGE)
            sent += 1
            inflight += 1
        pull.recv_multipart()
        got += 1
        inflight -= 1
    rate = n / (time.perf_counter() - t)
    push.send_multipart([b"", b""])
    pull.recv_multipart()
    peer.join(10)
    ctx.destroy(0)
    return rtt_us, rate


def call_layer(n: int = 100_000) -> dict[str, float]:
    """us per two-frame message (send + receive), inproc, one process."""
    from shmserve.ipc import channel, messages
    from shmserve.ipc.messages.to_scheduler import Wake
    inbox = channel.Inbox("inproc://zmq-options-calls")
    outbox = channel.Outbox("inproc://zmq-options-calls")
    head = Wake()                      # the smallest message; decode is in both columns
    payload = (MESSAGE[1],)

    def pyzmq_multipart():
        enc, dec = messages.encode, messages.decode
        for _ in range(n):
            outbox.socket.send_multipart([enc(head), *payload])
            dec(inbox.socket.recv_multipart()[0])

    def channel_calls():
        for _ in range(n):
            outbox.send(head, payload)
            inbox.recv()

    out = {}
    for name, loop in (("pyzmq send_multipart/recv_multipart", pyzmq_multipart),
                       ("Outbox.send/Inbox.recv", channel_calls)):
        t = time.perf_counter()
        loop()
        out[name] = (time.perf_counter() - t) / n * 1e6
    inbox.close()
    outbox.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    modes = ("poll+noblock", "blocking")
    results = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="shmserve-zmq-") as run_dir:
        for _ in range(args.rounds):            # interleaved, so drift hits both alike
            for m in modes:
                results[m].append(measure(m, run_dir))
    print(f"ZeroMQ receive loops, ipc://, medians of {args.rounds} rounds\n")
    print("| receive loop | round trip µs | pipelined msg/s |")
    print("|---|---:|---:|")
    for m in modes:
        rtt = statistics.median(r[0] for r in results[m])
        rate = statistics.median(r[1] for r in results[m])
        print(f"| {m} | {rtt:.1f} | {rate:,.0f} |")
    calls = [call_layer() for _ in range(args.rounds)]
    print(f"\nCalls only (inproc, one process, send + receive of one two-frame message), "
          f"medians of {args.rounds} rounds\n")
    print("| calls | µs per message |")
    print("|---|---:|")
    for name in calls[0]:
        print(f"| {name} | {statistics.median(c[name] for c in calls):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
