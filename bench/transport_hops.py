#!/usr/bin/env python3
"""What one hop costs on each transport: a ping-pong between two processes, as shmserve sends.

Rows, measured in the same run:
- ``raw seqpacket``: bare ``socket.send``/``recv`` on a SOCK_SEQPACKET pair, no framing: the floor.
- ``packets``: ``ipc.packets`` PacketOutbox/PacketInbox (framing, encode/decode, epoll).
- ``zmq``: ``ipc.channel`` Outbox/Inbox over ipc:// (one I/O thread each side).

Each round trip is two hops (there and back); the table gives the median and p99 of the round
trip in microseconds for a header-only message and for one with a 64 KiB inline payload.

  python bench/transport_hops.py [--rounds 20000]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time

from shmserve.ipc import channel, packets
from shmserve.ipc.messages.to_worker import Ping


def _echo_raw(sock: socket.socket, rounds: int) -> None:
    for _ in range(rounds):
        sock.send(sock.recv(1 << 20))


def _echo(kind: str, in_addr: str, out_addr: str, rounds: int) -> None:
    inbox = packets.PacketInbox(in_addr) if kind == "packets" else channel.Inbox(in_addr)
    outbox = (packets.PacketOutbox(out_addr, wait_connected_s=10) if kind == "packets"
              else channel.Outbox(out_addr, wait_connected_s=10))
    for _ in range(rounds):
        msg, frames = inbox.recv()
        outbox.send(msg, frames)


def _time_raw(payload: bytes, rounds: int) -> list[float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    head = b"\x92\x18\x01"
    proc = mp.get_context("fork").Process(target=_echo_raw, args=(b, rounds))
    proc.start()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        a.send(head + payload)
        a.recv(1 << 20)
        out.append((time.perf_counter_ns() - t0) / 1000)
    proc.join()
    return out


def _time(kind: str, payload: bytes, rounds: int, tmp: str) -> list[float]:
    if kind == "packets":
        there, back = f"unix://{tmp}/{kind}-a", f"unix://{tmp}/{kind}-b"
    else:
        there, back = f"ipc://{tmp}/{kind}-a", f"ipc://{tmp}/{kind}-b"
    inbox = packets.PacketInbox(back) if kind == "packets" else channel.Inbox(back)
    proc = mp.get_context("spawn").Process(target=_echo, args=(kind, there, back, rounds))
    proc.start()
    outbox = (packets.PacketOutbox(there, wait_connected_s=30) if kind == "packets"
              else channel.Outbox(there, wait_connected_s=30))
    frames = (payload,) if payload else ()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        outbox.send(Ping(1), frames)
        inbox.recv()
        out.append((time.perf_counter_ns() - t0) / 1000)
    proc.join()
    inbox.close()
    outbox.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20000)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, payload in (("header only", b""), ("64 KiB inline", os.urandom(64 << 10))):
            for kind in ("raw seqpacket", "packets", "zmq"):
                t = (_time_raw(payload, a.rounds) if kind == "raw seqpacket"
                     else _time(kind, payload, a.rounds, tmp))
                t = t[len(t) // 10:]            # warm-up
                t.sort()
                rows.append((label, kind, statistics.median(t), t[int(len(t) * 0.99)]))
    base = {label: med for label, kind, med, _ in rows if kind == "raw seqpacket"}
    print(f"{'message':<15} {'transport':<15} {'RTT p50 us':>11} {'RTT p99 us':>11} "
          f"{'per hop p50':>12} {'x raw':>6}")
    for label, kind, med, p99 in rows:
        print(f"{label:<15} {kind:<15} {med:>11.1f} {p99:>11.1f} {med / 2:>12.1f} "
              f"{med / base[label]:>6.2f}")


if __name__ == "__main__":
    main()
