"""The trace extension against a real server, with tritonclient (HTTP and gRPC): the settings
API (global and per model, Triton's errors, null), and the trace file a stopped server leaves,
with each request's times in order, for requests sent under a lease and through the scheduler.
"""
import json
import os
import queue
import subprocess

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for
from tritonclient.utils import InferenceServerException

IDENTITY = """
name: "ident"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
CODE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
"""
CORE = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("trace") / "models")
    write_model(r, "ident", IDENTITY, CODE)
    write_model(r, "other", IDENTITY.replace('"ident"', '"other"'), CODE)
    return r


def start(repo, tmp_path, *extra):
    path = str(tmp_path / "trace.json")
    return Server(repo, "--trace-config", f"triton,file={path}", *extra), path


def http_infer(server, request_id, shape=(1, 4), model="ident"):
    c = httpclient.InferenceServerClient(server.url)
    x = httpclient.InferInput("INPUT0", list(shape), "FP32")
    x.set_data_from_numpy(np.ones(shape, np.float32))
    return c.infer(model, [x], request_id=request_id)


def grpc_input():
    x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    return x


def traces(records):
    """id -> (the head record, [(name, ns)] in the file's order)."""
    out = {}
    for r in records:
        head, times = out.setdefault(r["id"], ({}, []))
        if "model_name" in r:
            head.update(r)
        else:
            times += [(t["name"], t["ns"]) for t in r["timestamps"]]
    return out


def by_request(path):
    with open(path) as f:
        found = traces(json.load(f))
    return {head["request_id"]: (head, times) for head, times in found.values()}


@pytest.mark.parametrize("leases", ["true", "false"])
def test_a_stopped_server_leaves_each_traced_request_with_its_times_in_order(
        repo, tmp_path, leases):
    server, path = start(repo, tmp_path, "--trace-config", "level=TIMESTAMPS",
                         "--trace-config", "rate=1", "--instance-leases", leases)
    try:
        http_infer(server, "h1")
        with pytest.raises(InferenceServerException):
            http_infer(server, "bad", shape=(1, 3))     # failed: its trace is not written
        g = grpcclient.InferenceServerClient(server.grpc_url)
        g.infer("ident", [grpc_input()], request_id="g1")
        answers: queue.Queue = queue.Queue()
        g.start_stream(lambda result, error: answers.put((result, error)))
        g.async_stream_infer("ident", [grpc_input()], request_id="s1")
        result, error = answers.get(timeout=30)
        assert error is None
        g.stop_stream()
        assert not os.path.exists(path)         # log_frequency 0: written at the stop
    finally:
        assert server.stop() == 0
    got = by_request(path)
    assert sorted(got) == ["g1", "h1", "s1"]
    for rid, (head, times) in got.items():
        assert head["model_name"] == "ident" and head["model_version"] == 1
        names = [n for n, _ in times]
        edge = ["HTTP_RECV_START", "HTTP_RECV_END"] if rid == "h1" else \
            ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END"]
        send = ["HTTP_SEND_START", "HTTP_SEND_END"] if rid == "h1" else \
            ["GRPC_SEND_START", "GRPC_SEND_END"]
        assert sorted(names) == sorted(edge + CORE + send), names
        when = dict(times)
        order = edge + CORE + send
        assert [when[n] for n in order] == sorted(when[n] for n in order), times


def test_settings_over_http_and_grpc(repo, tmp_path):
    server, path = start(repo, tmp_path)
    try:
        h = httpclient.InferenceServerClient(server.url)
        g = grpcclient.InferenceServerClient(server.grpc_url)
        assert "trace" in h.get_server_metadata()["extensions"]
        assert h.get_trace_settings() == {
            "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
            "log_frequency": "0", "trace_file": path, "trace_mode": "triton"}
        now = h.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"],
                                                "trace_rate": "1", "log_frequency": "1"})
        assert now["trace_level"] == ["TIMESTAMPS"] and now["log_frequency"] == "1"
        # a model of its own, over gRPC: two traces, then it stops
        own = g.update_trace_settings(model_name="ident", settings={"trace_count": "2"},
                                      as_json=True)["settings"]
        assert own["trace_count"]["value"] == ["2"] and own["trace_rate"]["value"] == ["1"]
        for i in range(3):
            http_infer(server, f"r{i}")
        assert h.get_trace_settings(model_name="ident")["trace_count"] == "0"
        assert h.get_trace_settings()["trace_count"] == "-1"
        # log_frequency 1: each trace is written as it ends
        files = [f"{path}.0", f"{path}.1"]
        wait_for(lambda: all(os.path.exists(f) for f in files), 10, "the trace files")
        assert not os.path.exists(f"{path}.2")
        assert [list(by_request(f)) for f in files] == [["r0"], ["r1"]]
        http_infer(server, "o1", model="other")     # the global settings: traced
        wait_for(lambda: os.path.exists(f"{path}.2"), 10, "the third trace file")
        # null: the model follows the global settings again
        back = h.update_trace_settings(model_name="ident", settings={"trace_count": None})
        assert back == h.get_trace_settings()
    finally:
        server.stop()


def test_bad_settings_are_refused_and_the_server_serves_on(repo, tmp_path):
    server, _ = start(repo, tmp_path)
    try:
        base = f"{server.base}/v2"
        for url, body, status, says in [
            (f"{base}/trace/setting", {"trace_rate": "abc"}, 400,
             "Unable to parse 'trace_rate', got: abc"),
            (f"{base}/trace/setting", {"trace_rate": "0"}, 400, "sample rate must be non-zero"),
            (f"{base}/trace/setting", {"trace_count": "-2"}, 400,
             "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
            (f"{base}/trace/setting", {"trace_level": "TIMESTAMPS"}, 400,
             "attempt to access JSON non-array as array"),
            (f"{base}/trace/setting", {"trace_level": ["LOUD"]}, 400, "invalid trace level 'LOUD'"),
            (f"{base}/trace/setting", {"trace_file": "/tmp/elsewhere.json"}, 501,
             "trace file location can not be updated through network protocol"),
            (f"{base}/trace/setting", {"tracerate": "1"}, 400, "unknown trace setting 'tracerate'"),
            (f"{base}/models/nosuch/trace/setting", {}, 400, "Request for unknown model : nosuch"),
            # the unknown model is the error, before what the settings ask for (as Triton)
            (f"{base}/models/nosuch/trace/setting", {"trace_file": "m.log"}, 400,
             "Request for unknown model : nosuch"),
        ]:
            r = requests.post(url, json=body, timeout=10)
            assert r.status_code == status and says in r.json()["error"], (body, r.text)
        r = requests.post(f"{base}/trace/setting", data=b"{not json", timeout=10)
        assert r.status_code == 400 and "failed to parse the trace settings request JSON" in r.text
        assert requests.get(f"{base}/models/nosuch/trace/setting", timeout=10).status_code == 400
        # a version in the path: no such endpoint, as Triton
        assert requests.get(f"{base}/models/ident/versions/1/trace/setting",
                            timeout=10).status_code == 404
        g = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException) as e:
            g.update_trace_settings(settings={"trace_file": "/x"})
        assert e.value.status() == "StatusCode.UNIMPLEMENTED"
        with pytest.raises(InferenceServerException) as e:
            g.get_trace_settings(model_name="nosuch")
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "Request for unknown model : nosuch" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            g.update_trace_settings(model_name="nosuch", settings={"trace_file": "m.log"})
        assert "Request for unknown model : nosuch" in e.value.message()
        # nothing changed, and requests are served
        assert requests.get(f"{base}/trace/setting", timeout=10).json()["trace_rate"] == "1000"
        assert http_infer(server, "ok").as_numpy("OUTPUT0").tolist() == [[1.0] * 4]
    finally:
        server.stop()


def test_the_restricted_trace_group(repo, tmp_path):
    server, _ = start(repo, tmp_path, "--http-restricted-api", "trace:admin-key=secret")
    try:
        url = f"{server.base}/v2/trace/setting"
        assert requests.get(url, timeout=10).status_code == 403
        assert requests.get(url, headers={"admin-key": "secret"}, timeout=10).status_code == 200
    finally:
        server.stop()


def test_the_tensors_level_writes_inputs_and_outputs(repo, tmp_path):
    server, path = start(repo, tmp_path, "--trace-config", "level=TENSORS",
                         "--trace-config", "rate=1")
    try:
        r = requests.post(f"{server.base}/v2/models/ident/infer", timeout=30, json={
            "id": "t1", "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                    "data": [0.5, 1, 2, -3]}]})
        assert r.status_code == 200, r.text
        g = grpcclient.InferenceServerClient(server.grpc_url)
        g.infer("ident", [grpc_input()], request_id="g1")
    finally:
        assert server.stop() == 0
    with open(path) as f:
        records = json.load(f)
    assert [(r["id"], r["activity"], r["tensor"]) for r in records] == [
        (1, "TENSOR_QUEUE_INPUT", {"name": "INPUT0", "data": "0.5,1,2,-3", "shape": "1,4",
                                   "dtype": "FP32"}),
        (1, "TENSOR_BACKEND_OUTPUT", {"name": "OUTPUT0", "data": "0.5,1,2,-3", "shape": "1,4",
                                      "dtype": "FP32"}),
        (2, "TENSOR_QUEUE_INPUT", {"name": "INPUT0", "data": "1,1,1,1", "shape": "1,4",
                                   "dtype": "FP32"}),
        (2, "TENSOR_BACKEND_OUTPUT", {"name": "OUTPUT0", "data": "1,1,1,1", "shape": "1,4",
                                      "dtype": "FP32"})]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzers_trace_flags(repo, tmp_path, perf_analyzer, protocol):
    """perf_analyzer --trace-level/-rate/-count --log-frequency set the server's settings over
    the protocol it tests; the server writes the numbered files they ask for."""
    server, path = start(repo, tmp_path)
    try:
        port = server.grpc_port if protocol == "grpc" else server.http_port
        cmd = [perf_analyzer, "-m", "ident", "-u", f"127.0.0.1:{port}", "-i", protocol,
               "--shape", "INPUT0:4", "--trace-level", "TIMESTAMPS", "--trace-rate", "2",
               "--trace-count", "6", "--log-frequency", "3", "--measurement-interval", "500",
               "--max-trials", "4", "--stability-percentage", "999"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
        settings = requests.get(f"{server.base}/v2/trace/setting", timeout=10).json()
        assert settings["trace_rate"] == "2" and settings["trace_count"] == "0"
        files = [f"{path}.0", f"{path}.1"]
        wait_for(lambda: all(os.path.exists(f) for f in files), 10, "the trace files")
        for f in files:
            with open(f) as fh:
                assert len(traces(json.load(fh))) == 3
        assert not os.path.exists(f"{path}.2")
    finally:
        server.stop()


def test_several_frontends_share_the_settings_and_write_files_of_their_own(repo, tmp_path):
    """A change made at one frontend reaches the other (its traces prove it); each writes its
    own numbered files (log_frequency 1: one per trace)."""
    server, path = start(repo, tmp_path, "--frontends", "2")
    sent = []

    def one_more() -> bool:
        rid = f"r{len(sent)}"
        sent.append(rid)
        r = requests.post(f"{server.base}/v2/models/ident/infer", timeout=30,
                          headers={"Connection": "close"},    # a new connection each time
                          json={"id": rid, "inputs": [{"name": "INPUT0", "shape": [1, 4],
                                                        "datatype": "FP32", "data": [1, 2, 3, 4]}]})
        assert r.status_code == 200, r.text
        names = os.listdir(tmp_path)
        return len(sent) >= 4 and all(any(n.startswith(f"trace.json.frontend{k}.") for n in names)
                                      for k in (0, 1))
    try:
        requests.post(f"{server.base}/v2/trace/setting", timeout=10, json={
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"}
        ).raise_for_status()
        wait_for(one_more, 60, "traces from both frontends")
    finally:
        assert server.stop() == 0
    seen = []
    for f in os.listdir(tmp_path):
        assert f.startswith(("trace.json.frontend0.", "trace.json.frontend1.")), f
        seen += list(by_request(str(tmp_path / f)))
    # each traced once; the other frontend may read the change just after a first request
    assert len(seen) == len(set(seen)) and set(seen) <= set(sent) and len(seen) >= len(sent) - 1
