#!/usr/bin/env python3
"""Send the same bad (and a few good) requests to the real Triton and to shmserve, and print
where their answers differ: HTTP status and error text, gRPC status code and details.

Not part of the test suite (CI has no Triton); what it finds becomes e2e tests in our own
words. Needs a tritonserver install as ../shared/tools/triton-bench sets one up.

Usage: python tests/compat/diff_triton.py [--tools DIR] [--all]
  --tools  the triton-bench tools folder (sbs_server.py), default ../shared/tools/triton-bench
  --all    print the cases that agree too (same, or Triton's words first: see verdict())
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from multiprocessing import shared_memory

import grpc
from tritonclient.grpc import service_pb2_grpc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import triton_steps  # noqa: E402
from serverproc import Server  # noqa: E402
from triton_cases import GOOD_GRPC, GOOD_HTTP, GRPC_CASES, HTTP_CASES, build_repo  # noqa: E402


def http_call(url: str, method: str, path: str, body, headers) -> tuple:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        text = json.loads(data).get("error", "") if data else ""
    except (ValueError, AttributeError):
        text = data[:120].decode("latin-1")
    return r.status, text


# ---- answers to good requests: their shape ---------------------------------------------------
# Values that differ between any two servers (names, versions, counters, times) are compared by
# type only; everything else must be equal.
VOLATILE = {"name", "version", "count", "ns", "last_inference", "inference_count",
            "execution_count", "extensions"}

def http_good(url: str, method: str, path: str, body) -> tuple:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        data = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()
                   if k.lower() in ("content-type", "inference-header-content-length")}
    finally:
        conn.close()
    hlen = headers.get("inference-header-content-length")
    head = data[:int(hlen)] if hlen else data
    try:
        doc = json.loads(head) if head else None
    except ValueError:
        doc = head.decode("latin-1")
    return r.status, headers, doc, data[int(hlen):] if hlen else b""


def shape_diff(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ: keys one has and the other lacks, types, and values of
    keys not in VOLATILE."""
    key = path.rsplit(".", 1)[-1].split("[")[0]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only Triton has it" for k in a if k not in b]
        out += [f"{path}.{k}: only shmserve has it" for k in b if k not in a]
        for k in a:
            if k in b:
                out += shape_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) and key not in VOLATILE:
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in shape_diff(x, y, f"{path}[{i}]")]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} {a!r} against {type(b).__name__} {b!r}"]
    if a != b and key not in VOLATILE and not key.endswith("_ns"):
        return [f"{path}: {a!r} against {b!r}"]
    return []


def run_good(http_url: str, grpc_url: str) -> dict:
    from google.protobuf.json_format import MessageToDict
    out = {("HTTP", name): http_good(http_url, m, p, b) for name, m, p, b in GOOD_HTTP}
    with grpc.insecure_channel(grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for name, (rpc, req) in GOOD_GRPC:
            try:
                resp = getattr(stub, rpc)(req, timeout=30)
                out[("gRPC", name)] = ("OK", {}, MessageToDict(
                    resp, preserving_proto_field_name=True), b"")
            except grpc.RpcError as e:
                out[("gRPC", name)] = (e.code().name, {}, e.details(), b"")
    return out


def run_steps(http_url: str, grpc_url: str) -> dict:
    """Each step's answer: (status, the JSON / message as a dict) when it succeeded, else
    (status, error text)."""
    from google.protobuf.json_format import MessageToDict
    out = {}
    with grpc.insecure_channel(grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for proto, name, step in triton_steps.STEPS:
            if proto == "HTTP":
                status, _, doc, _ = http_good(http_url, *step[:3])
                if status != 200:
                    doc = doc.get("error", "") if isinstance(doc, dict) else doc
                out[(proto, name)] = (status, doc)
            elif proto == "stream":     # ModelStreamInfer: every response the stream gives
                try:
                    out[(proto, name)] = ("OK", [
                        MessageToDict(r, preserving_proto_field_name=True)
                        for r in stub.ModelStreamInfer(iter(step), timeout=60)])
                except grpc.RpcError as e:
                    out[(proto, name)] = (e.code().name, e.details())
            else:
                try:
                    resp = getattr(stub, step[0])(step[1], timeout=60)
                    out[(proto, name)] = ("OK", MessageToDict(resp,
                                                              preserving_proto_field_name=True))
                except grpc.RpcError as e:
                    out[(proto, name)] = (e.code().name, e.details())
    return out


def grpc_call(stub, rpc: str, req) -> tuple:
    try:
        getattr(stub, rpc)(req, timeout=30)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details()


def wait_ready(url: str, path: str, deadline_s: float = 120.0) -> None:
    u = urllib.parse.urlparse(url)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def run_cases(http_url: str, grpc_url: str) -> dict:
    out = {}
    for name, method, path, body, headers in HTTP_CASES:
        out[("HTTP", name)] = http_call(http_url, method, path, body, headers)
    with grpc.insecure_channel(grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for name, (rpc, req) in GRPC_CASES:
            out[("gRPC", name)] = grpc_call(stub, rpc, req)
    return out


def verdict(theirs: tuple, ours: tuple) -> str:
    """same; words: shmserve's text starts with Triton's and the status is Triton's, or 400
    where Triton answers a client's mistake with 500 (INVALID_ARGUMENT for gRPC's INTERNAL);
    DIFF otherwise."""
    if theirs == ours:
        return "same"
    status_ok = theirs[0] == ours[0] or (theirs[0], ours[0]) in (
        (500, 400), ("INTERNAL", "INVALID_ARGUMENT"))
    if status_ok and theirs[1] and ours[1].startswith(theirs[1]):
        return "words"
    return "DIFF"


def run_both(tools: str, build, flags: list[str], ready_path: str, run) -> tuple:
    """``run(http_url, grpc_url)`` against Triton, then against shmserve, each serving a fresh
    copy of the repository ``build(root)`` writes, started with ``flags``."""
    sys.path.insert(0, os.path.abspath(tools))
    import sbs_server
    answers = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        build(repo)
        http, grpc_port, metrics = (sbs_server.free_port() for _ in range(3))
        cmd, env = sbs_server.command_for("triton", repo, http, grpc_port, metrics)
        with open(os.path.join(tmp, "triton.log"), "wb") as log:
            tri = subprocess.Popen(cmd + flags, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{http}", ready_path)
            answers.append(run(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}"))
        finally:
            os.killpg(tri.pid, signal.SIGTERM)
            tri.wait(timeout=60)
        ours = Server(repo, *flags, wait_ready=False)
        try:
            wait_ready(ours.base, ready_path)
            answers.append(run(ours.base, ours.grpc_url))
        finally:
            ours.stop()
    return answers[0], answers[1]


def _requests(http_url: str, grpc_url: str) -> tuple:
    return run_cases(http_url, grpc_url), run_good(http_url, grpc_url)


def compare_answers(theirs: dict, ours: dict, show_all: bool) -> int:
    """Print each answer that differs (all with ``show_all``); return how many are alike."""
    alike = 0
    for name, (ts, th, tdoc, traw) in theirs.items():
        os_, oh, odoc, oraw = ours[name]
        if ts in (200, "OK") and ts == os_:
            diffs = ([f"headers {th} against {oh}"] if th != oh else []) + \
                shape_diff(tdoc, odoc) + \
                ([f"binary part {len(traw)} bytes against {len(oraw)}"] if traw != oraw else [])
        elif ts not in (200, "OK") and os_ not in (200, "OK") and \
                verdict((ts, tdoc), (os_, odoc)) != "DIFF":
            diffs = []
        else:
            diffs = [f"{ts} {tdoc!r} against {os_} {odoc!r}"]
        alike += not diffs
        if diffs or show_all:
            print(f"{'same' if not diffs else 'DIFF'} {name[0]} answer: {name[1]}")
            for d in diffs:
                print(f"   {d}")
    return alike


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", default=os.path.join(ROOT, "..", "shared", "tools", "triton-bench"))
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    (theirs, theirs_good), (ours, ours_good) = run_both(
        a.tools, build_repo, ["--exit-on-error=false"], "/v2/models/identity_fp32/ready",
        _requests)
    counts = {"same": 0, "words": 0, "DIFF": 0}
    for key, t in theirs.items():
        o = ours[key]
        kind = verdict(t, o)
        counts[kind] += 1
        if a.all or kind == "DIFF":
            print(f"{kind} {key[0]} {key[1]}\n   triton:   {t[0]} {t[1]!r}\n"
                  f"   shmserve: {o[0]} {o[1]!r}")
    good_alike = compare_answers(theirs_good, ours_good, a.all)
    segments = [shared_memory.SharedMemory(name, create=True, size=64)
                 for name in (triton_steps.SHM_IN, triton_steps.SHM_OUT)]
    try:
        segments[0].buf[:64] = bytes(range(64))
        steps_theirs, steps_ours = run_both(
            a.tools, triton_steps.build_repo, ["--model-control-mode=explicit"],
            "/v2/health/ready", run_steps)
    finally:
        for seg in segments:
            seg.close()
            seg.unlink()
    as_answers = {k: (v[0], {}, v[1], b"") for k, v in steps_theirs.items()}
    steps_alike = compare_answers(as_answers,
                                  {k: (v[0], {}, v[1], b"") for k, v in steps_ours.items()}, a.all)
    print(f"{len(theirs)} bad requests: {counts['same']} answered the same, {counts['words']} with "
          f"Triton's words first (and 400 where Triton says 500), {counts['DIFF']} otherwise")
    print(f"{len(theirs_good)} good requests: {good_alike} answered alike (shape, types, fixed "
          f"values)")
    print(f"{len(steps_theirs)} steps in explicit model control: {steps_alike} answered alike")
    return 0


if __name__ == "__main__":
    sys.exit(main())
