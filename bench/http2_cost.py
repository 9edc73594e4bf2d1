#!/usr/bin/env python3
"""The Python cost of HTTP/2 per unary gRPC call: the ``h2`` library against shmserve's own
core (frontend/http2/connection.py), in one process, on the same bytes.

The client's bytes for N ModelInfer calls (HEADERS + DATA, as grpc clients send them: the
second call on is all indexed header fields) are made once with h2 as the client. Each server
then reads them call by call and answers each with response HEADERS, one DATA frame and the
status trailers, as a gRPC server must; the client's WINDOW_UPDATEs keep the windows open.
No sockets, no event loop, no handler: only what the HTTP/2 layer costs. Baseline: the same
answer bytes built by ``bytes`` concatenation alone.

  python bench/http2_cost.py [--calls 5000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import h2.config
import h2.connection
import h2.events

from shmserve.frontend.grpc import call as grpc_call
from shmserve.frontend.http2 import connection as http2

HEADERS = [(":method", "POST"), (":scheme", "http"),
           (":path", "/inference.GRPCInferenceService/ModelInfer"),
           (":authority", "localhost:8001"), ("te", "trailers"),
           ("content-type", "application/grpc"), ("user-agent", "grpc-c++/1.66.0"),
           ("grpc-accept-encoding", "identity,deflate,gzip")]
BODY = grpc_call.frame(b"\x0a\x0didentity_fp32" + b"\x00" * 90)        # ~110 bytes, like PA's
ANSWER = grpc_call.frame(b"\x0a\x0didentity_fp32" + b"\x00" * 80)


def client_bytes(calls: int) -> tuple[bytes, list[bytes]]:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    preface = c.data_to_send()
    c.outbound_flow_control_window = 1 << 30          # as if the server had opened it
    out = []
    for _ in range(calls):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, HEADERS)
        c.send_data(sid, BODY, end_stream=True)
        out.append(c.data_to_send())
        c.streams.pop(sid, None)            # keep the client's own bookkeeping flat
    return preface, out


def run_h2(preface: bytes, calls: list[bytes]) -> float:
    cfg = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                    validate_inbound_headers=False,
                                    normalize_inbound_headers=False,
                                    validate_outbound_headers=False,
                                    normalize_outbound_headers=False)
    s = h2.connection.H2Connection(cfg)
    s.initiate_connection()
    s.receive_data(preface)
    s.data_to_send()
    status = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    ok = [(b"grpc-status", b"0")]
    t = time.perf_counter()
    for data in calls:
        for ev in s.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                s.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                sid = ev.stream_id
                s.send_headers(sid, status)
                s.send_data(sid, ANSWER)
                s.send_headers(sid, ok, end_stream=True)
                s.outbound_flow_control_window += len(ANSWER)        # the client's update
        s.data_to_send()
    return (time.perf_counter() - t) / len(calls) * 1e6


class _Owner:
    def __init__(self):
        self.ended: list[int] = []

    def stream_headers(self, sid, headers, end):
        self.path = dict(headers)[b":path"]     # grpc_loop reads the headers once too

    def stream_data(self, sid, data, length, end):
        self.core.ack(sid, length)
        if end:
            self.ended.append(sid)

    def stream_reset(self, sid):
        pass

    def window_opened(self):
        pass

    def peer_going_away(self):
        pass

    def ping_acked(self, payload):
        pass


def run_core(preface: bytes, calls: list[bytes]) -> float:
    from shmserve.frontend.grpc.loop import CONNECTION_WINDOW, LOCAL_SETTINGS, RESPONSE_HEADERS
    owner = _Owner()
    s = owner.core = http2.Http2Server(owner, LOCAL_SETTINGS, CONNECTION_WINDOW)
    s.receive(preface)
    s.take()
    ok = grpc_call.trailers(grpc_call.grpc.StatusCode.OK)
    t = time.perf_counter()
    for data in calls:
        s.receive(data)
        for sid in owner.ended:
            s.send_headers(sid, RESPONSE_HEADERS)
            s.send_data(sid, ANSWER)
            s.send_headers(sid, ok, end_stream=True)
            s.send_window += len(ANSWER)                             # the client's update
        owner.ended.clear()
        s.take()
    return (time.perf_counter() - t) / len(calls) * 1e6


def run_baseline(preface: bytes, calls: list[bytes]) -> float:
    t = time.perf_counter()
    for data in calls:
        out = bytearray()
        out += data[:9]
        out += http2.frame_header(20, 1, 4, 1) + ANSWER + http2.frame_header(9, 1, 5, 1)
        bytes(out)
    return (time.perf_counter() - t) / len(calls) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    preface, calls = client_bytes(a.calls)
    rows = {"bytes only (baseline)": run_baseline, "h2 4.x": run_h2,
            "frontend/http2/connection.py": run_core}
    results = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():           # interleaved, so that noise hits all alike
            results[name].append(fn(preface, calls))
    print(f"{'HTTP/2 server':<24} {'µs per call (median)':>21} {'min':>8} {'max':>8}")
    for name, values in results.items():
        print(f"{name:<24} {statistics.median(values):>21.1f} {min(values):>8.1f} "
              f"{max(values):>8.1f}")


if __name__ == "__main__":
    main()
