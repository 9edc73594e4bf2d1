"""Nested ensembles against the real server (HTTP and gRPC): an ensemble whose step is another
ensemble computes through both, large tensors pass by reference through both levels without a
leaked slot, both ensembles count in the statistics, an inner step's error names both, and
unloading a model retires both."""
import os
from unittest import mock

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, segments_of, wait_for
from test_ensemble_data import AFFINE, FAULTY, affine, ensemble, step
from tritonclient.utils import InferenceServerException

from shmserve.ipc.shm import IDLE_RELEASE_ENV

F32 = "TYPE_FP32"
DIMS = "[ -1 ]"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nested"))
    write_model(root, "add1", affine(F32, 8, DIMS, 1, 1), AFFINE)
    write_model(root, "times2", affine(F32, 8, DIMS, 2, 0), AFFINE)
    write_model(root, "faulty", f'''
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT0", data_type: {F32}, dims: {DIMS} }} ]
        output [ {{ name: "OUTPUT0", data_type: {F32}, dims: {DIMS} }} ]
    ''', FAULTY)
    # inner: (x + 1) * 2; outer: inner(x) + 1, and x * 2 beside it
    write_model(root, "inner", ensemble(8, [("INPUT0", F32, DIMS)], [("OUTPUT0", F32, DIMS)], [
        step("add1", {"INPUT0": "INPUT0"}, {"OUTPUT0": "plus"}),
        step("times2", {"INPUT0": "plus"}, {"OUTPUT0": "OUTPUT0"})]), None)
    write_model(root, "outer", ensemble(8, [("IN", F32, DIMS)],
                                        [("OUT", F32, DIMS), ("DOUBLE", F32, DIMS)], [
        step("inner", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
        step("add1", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"}),
        step("times2", {"INPUT0": "IN"}, {"OUTPUT0": "DOUBLE"})]), None)
    # three levels: top -> outer -> inner
    write_model(root, "top", ensemble(8, [("X", F32, DIMS)], [("Y", F32, DIMS)], [
        step("outer", {"IN": "X"}, {"OUT": "Y"})]), None)
    write_model(root, "inner_faulty", ensemble(8, [("INPUT0", F32, DIMS)],
                                               [("OUTPUT0", F32, DIMS)], [
        step("faulty", {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT0"})]), None)
    write_model(root, "outer_faulty", ensemble(8, [("IN", F32, DIMS)], [("OUT", F32, DIMS)], [
        step("inner_faulty", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})]), None)
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "top",
               "--load-model", "outer_faulty")
    yield s
    s.stop()


def client(server, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.url, network_timeout=120)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


def infer(mod, c, model, name, x, outputs):
    i = mod.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return c.infer(model, [i], outputs=[mod.InferRequestedOutput(o) for o in outputs])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("n", [3, 1 << 16])         # inline, and 256 KiB in shared memory
def test_values_go_through_every_level(server, protocol, n):
    mod, c = client(server, protocol)
    x = np.arange(2 * n, dtype=np.float32).reshape(2, n)
    res = infer(mod, c, "outer", "IN", x, ["OUT", "DOUBLE"])
    np.testing.assert_array_equal(res.as_numpy("OUT"), (x + 1) * 2 + 1)
    np.testing.assert_array_equal(res.as_numpy("DOUBLE"), x * 2)
    top = infer(mod, c, "top", "X", x, ["Y"])
    np.testing.assert_array_equal(top.as_numpy("Y"), (x + 1) * 2 + 1)


def test_statistics_count_each_level(server):
    c = httpclient.InferenceServerClient(server.url)

    def count(model):
        return c.get_inference_statistics(model)["model_stats"][0]["inference_count"]
    before = {m: count(m) for m in ("top", "outer", "inner", "add1")}
    infer(httpclient, c, "top", "X", np.ones((1, 4), np.float32), ["Y"])
    after = {m: count(m) for m in before}
    assert {m: after[m] - before[m] for m in before} == \
        {"top": 1, "outer": 1, "inner": 1, "add1": 2}


def test_an_inner_steps_error_names_both_ensembles_and_the_server_serves_on(server):
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as e:
        infer(httpclient, c, "outer_faulty", "IN", np.full((1, 3), 2, np.float32), ["OUT"])
    assert "in ensemble 'outer_faulty', step 0 (model 'inner_faulty'): in ensemble " \
           "'inner_faulty', step 0 (model 'faulty'): faulty refuses the value 2" in str(e.value)
    ok = infer(httpclient, c, "outer_faulty", "IN", np.full((1, 3), 5, np.float32), ["OUT"])
    np.testing.assert_array_equal(ok.as_numpy("OUT"), np.full((1, 3), 5, np.float32))


def test_no_slot_is_left_behind(repo):
    """Arena chunks nothing uses go back after 0.3 s: a slot never given back (an inner
    ensemble's answer the outer one holds) keeps its chunk, and so a segment, for ever."""
    with mock.patch.dict(os.environ, {IDLE_RELEASE_ENV: "0.3"}):
        s = Server(repo, "--model-control-mode", "explicit", "--load-model", "top")
    try:
        c = httpclient.InferenceServerClient(s.url, network_timeout=120)
        g = grpcclient.InferenceServerClient(s.grpc_url)
        x = np.ones((2, 1 << 16), np.float32)       # 512 KiB: every tensor in a slot
        for i in range(20):
            mod, cl = (httpclient, c) if i % 2 else (grpcclient, g)
            model, name, out = [("top", "X", "Y"), ("outer", "IN", "DOUBLE"),
                                ("inner", "INPUT0", "OUTPUT0")][i % 3]
            infer(mod, cl, model, name, x, [out])
        assert segments_of(s.proc.pid), "the tensors should have gone through shared memory"
        wait_for(lambda: segments_of(s.proc.pid) == [], 30,
                 "the server's segments to go after the requests: a leaked slot keeps its chunk")
    finally:
        assert s.stop() == 0


def test_unloading_a_model_retires_both_ensembles(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "outer")
    try:
        c = httpclient.InferenceServerClient(s.url)
        c.unload_model("times2")
        wait_for(lambda: not c.is_model_ready("outer"), 30, "outer to be unloaded")
        index = {m["name"]: m for m in c.get_model_repository_index()}
        assert index["inner"]["reason"] == \
            "ensemble 'inner' contains models that are not available: times2"
        assert index["outer"]["reason"].startswith("ensemble 'outer' contains models that are "
                                                   "not available: ")
        c.load_model("outer")           # loads what it needs again
        res = infer(httpclient, c, "outer", "IN", np.ones((1, 2), np.float32), ["OUT"])
        np.testing.assert_array_equal(res.as_numpy("OUT"), np.full((1, 2), 5, np.float32))
    finally:
        s.stop()
