"""The response cache against a real server (--cache-config local,size=N, models with
response_cache { enable: true }), with tritonclient over HTTP and gRPC and the real
perf_analyzer: hits answer without running the model and count as Triton counts them, what
changes an answer changes the key, outputs reach clients' regions on a hit, entries go when the
cache is full or the model is reloaded, and models the cache cannot serve are left alone."""
import subprocess
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import write_model
from serverproc import Server
from tritonclient.utils import InferenceServerException

# RUNS says which execution of the instance answered: a hit repeats the first one's
MODEL = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }},
         {{ name: "RUNS", data_type: TYPE_INT64, dims: [ 1 ] }} ]
{extra}
"""
CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        out = []
        for r in requests:
            self.runs += 1
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if x.sum() < 0:
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input")))
                continue
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", x * 2),
                pb_utils.Tensor("RUNS", np.full((x.shape[0], 1), self.runs, np.int64))]))
        return out
"""
CACHED = "response_cache { enable: true }"
STRINGS = """
name: "strings"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ -1 ] } ]
response_cache { enable: true }
"""
STRINGS_CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(
            [s[::-1] for s in pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()],
            dtype=object))]) for r in requests]
"""
DECOUPLED = MODEL.format(name="streaming", extra=CACHED + "\nmodel_transaction_policy { "
                                                          "decoupled: true }")
ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "plain" model_version: -1
    input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
response_cache { enable: true }
"""
BIG = """
name: "big"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
         { name: "RUNS", data_type: TYPE_INT64, dims: [ 1 ] } ]
response_cache { enable: true }
"""
BIG_CODE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        self.runs += len(requests)
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1),
            pb_utils.Tensor("RUNS", np.array([self.runs], np.int64))]) for r in requests]
"""
SIZE = 16 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("cache") / "models")
    write_model(r, "cached", MODEL.format(name="cached", extra=CACHED), CODE)
    write_model(r, "plain", MODEL.format(name="plain", extra=""), CODE)
    write_model(r, "sequenced", MODEL.format(name="sequenced", extra=CACHED + "\n"
                                             "sequence_batching { max_sequence_idle_microseconds:"
                                             " 60000000 }"), CODE)
    write_model(r, "strings", STRINGS, STRINGS_CODE)
    write_model(r, "streaming", DECOUPLED, CODE)
    write_model(r, "pipeline", ENSEMBLE, None)
    write_model(r, "big", BIG, BIG_CODE)
    return r


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, "--cache-config", f"local,size={SIZE}", "--model-control-mode", "explicit",
               *[a for m in ("cached", "plain", "sequenced", "strings", "pipeline", "big")
                 for a in ("--load-model", m)])
    yield s
    s.stop()


def http(server):
    return httpclient.InferenceServerClient(server.url)


def infer(client, mod, model="cached", value=1.0, outputs=None, **kw):
    x = mod.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), value, np.float32))
    wanted = None if outputs is None else [mod.InferRequestedOutput(o) for o in outputs]
    return client.infer(model, [x], outputs=wanted, **kw)


def runs(result) -> int:
    return int(result.as_numpy("RUNS")[0, 0])


def stats(client, model):
    s = client.get_inference_statistics(model)["model_stats"][0]
    st = s["inference_stats"]
    return {"hits": st["cache_hit"]["count"], "misses": st["cache_miss"]["count"],
            "success": st["success"]["count"], "queue": st["queue"]["count"],
            "infer": st["compute_infer"]["count"], "inferences": s["inference_count"],
            "executions": s["execution_count"]}


def delta(after, before):
    return {k: after[k] - before[k] for k in after}


def test_a_repeated_request_is_answered_from_the_cache_over_both_protocols(server):
    c, g = http(server), grpcclient.InferenceServerClient(server.grpc_url)
    before = stats(c, "cached")
    value = float(uuid.uuid4().int % 1000)
    first = infer(c, httpclient, value=value)
    again = [infer(c, httpclient, value=value), infer(c, httpclient, value=value),
             infer(g, grpcclient, value=value)]
    for r in again:
        assert runs(r) == runs(first)       # no execution: the first one's answer
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 4), 2 * value))
    # Triton's counting: a hit is a success (and queued), not an inference or execution
    assert delta(stats(c, "cached"), before) == {
        "hits": 3, "misses": 1, "success": 4, "queue": 4, "infer": 1, "inferences": 1,
        "executions": 1}


def test_what_changes_the_answer_changes_the_key(server):
    c = http(server)
    base = runs(infer(c, httpclient, value=11))
    seen = [runs(infer(c, httpclient, value=12)),                        # the input's bytes
            runs(infer(c, httpclient, value=11, outputs=["RUNS"])),      # the outputs asked for
            runs(infer(c, httpclient, value=11, parameters={"k": "v"}))]  # custom parameters
    assert sorted(seen) == seen and seen[0] > base and len(set(seen)) == 3
    # the same again: each is a hit now, and the response format is not part of the key
    assert runs(infer(c, httpclient, value=11, outputs=["RUNS"])) == seen[1]
    assert runs(infer(c, httpclient, value=11, parameters={"k": "v"})) == seen[2]
    binary = c.infer("cached", [_input(11)], outputs=[
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
        httpclient.InferRequestedOutput("RUNS", binary_data=True)])
    assert runs(binary) == base


def _input(value, mod=httpclient):
    x = mod.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return x


def test_models_without_the_cache_or_with_a_sequence_batcher_always_run(server):
    c = http(server)
    a, b = runs(infer(c, httpclient, "plain", 3)), runs(infer(c, httpclient, "plain", 3))
    assert b == a + 1 and stats(c, "plain")["misses"] == 0
    seq = [runs(infer(c, httpclient, "sequenced", 3, sequence_id=7, sequence_start=i == 0,
                      sequence_end=i == 2)) for i in range(3)]
    assert seq == [seq[0], seq[0] + 1, seq[0] + 2] and stats(c, "sequenced")["hits"] == 0


def test_failures_and_bad_requests_are_not_kept(server):
    c = http(server)
    before = stats(c, "cached")
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="negative input"):
            infer(c, httpclient, value=-1)
    x = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="INPUT0"):
        c.infer("cached", [x])          # refused before any lookup
    d = delta(stats(c, "cached"), before)
    assert (d["hits"], d["misses"], d["executions"]) == (0, 2, 2)
    assert runs(infer(c, httpclient, value=5)) >= 1      # and it serves on


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_tensors_in_shared_memory_are_hashed_and_kept(server, protocol):
    """Inputs the frontend received into its arena are hashed where they are; outputs the
    worker left in its slots are copied into the entry before the slots go back."""
    mod = httpclient if protocol == "http" else grpcclient
    c = http(server) if protocol == "http" else grpcclient.InferenceServerClient(server.grpc_url)
    data = np.random.default_rng().random(1 << 18, dtype=np.float32)        # 1 MiB
    x = mod.InferInput("INPUT0", [data.size], "FP32")
    x.set_data_from_numpy(data)
    first, again = c.infer("big", [x]), c.infer("big", [x])
    assert again.as_numpy("RUNS")[0] == first.as_numpy("RUNS")[0]
    np.testing.assert_array_equal(again.as_numpy("OUTPUT0"), data + 1)
    data[-1] += 1                   # one element differs, at the end: another key
    x.set_data_from_numpy(data)
    assert c.infer("big", [x]).as_numpy("RUNS")[0] > first.as_numpy("RUNS")[0]


def test_strings_are_cached(server):
    c = http(server)
    x = httpclient.InferInput("IN", [2], "BYTES")
    x.set_data_from_numpy(np.array([b"abc", b"hello"], dtype=object))
    for _ in range(2):
        out = c.infer("strings", [x]).as_numpy("OUT")
        assert out.tolist() == [b"cba", b"olleh"]
    s = stats(c, "strings")
    assert (s["hits"], s["misses"], s["executions"]) == (1, 1, 1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_hit_writes_outputs_into_the_clients_region(server, protocol):
    mod = httpclient if protocol == "http" else grpcclient
    c = http(server) if protocol == "http" else grpcclient.InferenceServerClient(server.grpc_url)
    name = f"r{uuid.uuid4().hex[:10]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 256)
    try:
        c.register_system_shared_memory(name, f"/{name}", 256)
        value = float(uuid.uuid4().int % 1000) + 0.5

        def ask(size=16):
            o = mod.InferRequestedOutput("OUTPUT0")
            o.set_shared_memory(name, size, offset=64)
            return c.infer("cached", [_input(value, mod)],
                           outputs=[o, mod.InferRequestedOutput("RUNS")])
        first = ask()
        shm.set_shared_memory_region(handle, [np.zeros(64, np.uint8)])
        shm.set_shared_memory_region(handle, [np.zeros(64, np.uint8)], offset=64)
        hit = ask()
        assert runs(hit) == runs(first)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 4],
                                                                offset=64),
                                      np.full((1, 4), 2 * value, np.float32))
        # a region too small for the cached output: that request fails, in the worker's words
        with pytest.raises(InferenceServerException, match="should be at least 16 bytes"):
            ask(size=8)
        c.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)
    assert runs(infer(c, mod, value=value)) >= 1        # it serves on


def test_an_ensemble_is_cached_as_a_whole(server):
    c = http(server)
    x = httpclient.InferInput("IN", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), 21, np.float32))
    before = stats(c, "plain")
    for _ in range(3):
        np.testing.assert_array_equal(c.infer("pipeline", [x]).as_numpy("OUT"),
                                      np.full((1, 4), 42, np.float32))
    assert delta(stats(c, "plain"), before)["executions"] == 1     # its step ran once
    s = stats(c, "pipeline")
    assert (s["hits"], s["misses"]) == (2, 1)


def test_a_decoupled_model_with_the_cache_does_not_load(server):
    with pytest.raises(InferenceServerException) as e:
        http(server).load_model("streaming")
    assert "Response Cache does not currently support model 'streaming' with 'decoupled' " \
           "transaction policy" in str(e.value)


def test_a_reloaded_model_does_not_answer_from_the_old_entries(server):
    c = http(server)
    infer(c, httpclient, value=76)
    first = runs(infer(c, httpclient, value=77))
    assert first > 1 and runs(infer(c, httpclient, value=77)) == first
    c.unload_model("cached")
    c.load_model("cached")
    assert runs(infer(c, httpclient, value=77)) == 1        # a new instance ran it
    assert runs(infer(c, httpclient, value=77)) == 1        # and its answer is kept
    # a load of the loaded model reloads it (the same version, the same config, READY all
    # along): what the old instance answered is not served for the new one
    c.load_model("cached")
    assert runs(infer(c, httpclient, value=77)) == 1


def test_the_cache_counters_are_on_the_metrics_page(server):
    infer(http(server), httpclient, value=99)
    infer(http(server), httpclient, value=99)
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    hits = [line for line in text.splitlines()
            if line.startswith('nv_cache_num_hits_per_model{model="cached"')]
    assert hits and float(hits[0].split()[-1]) >= 1


def test_a_full_cache_evicts_the_least_recently_used(repo):
    # an entry of this model is ~440 bytes (the outputs plus fixed costs): two fit
    s = Server(repo, "--cache-config", "local,size=1000", "--model-control-mode", "explicit",
               "--load-model", "cached")
    try:
        c = http(s)
        a, b, d = (runs(infer(c, httpclient, value=v)) for v in (1, 2, 3))   # a is evicted
        assert (a, b, d) == (1, 2, 3)
        assert runs(infer(c, httpclient, value=3)) == 3         # hit
        assert runs(infer(c, httpclient, value=1)) == 4         # evicted: runs again
    finally:
        s.stop()


def test_an_answer_larger_than_the_cache_is_never_kept(repo):
    # Triton's insertion failure case: every request is a miss
    s = Server(repo, "--cache-config", "local,size=200", "--model-control-mode", "explicit",
               "--load-model", "cached")
    try:
        c = http(s)
        assert [runs(infer(c, httpclient, value=1)) for _ in range(2)] == [1, 2]
        st = stats(c, "cached")
        assert (st["hits"], st["misses"], st["success"]) == (0, 2, 2)
    finally:
        s.stop()


def test_without_a_cache_nothing_is_cached_and_no_counters_show(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "cached")
    try:
        c = http(s)
        assert [runs(infer(c, httpclient, value=1)) for _ in range(2)] == [1, 2]
        assert stats(c, "cached")["misses"] == 0
        text = requests.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).text
        assert "nv_cache_num_hits_per_model" not in text
    finally:
        s.stop()


def test_perf_analyzer_reports_the_hits(server, perf_analyzer):
    out = subprocess.run([perf_analyzer, "-m", "cached", "-u", server.url,
                          "--concurrency-range", "2", "--measurement-interval", "500",
                          "--max-trials", "4", "--stability-percentage", "999"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    hits = [line for line in out.stdout.splitlines() if "Cache hit count:" in line]
    assert hits and int(hits[0].split(":")[1]) > 0, out.stdout
