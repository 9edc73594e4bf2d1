"""--rate-limit execution_count against a real server: two models whose instances share one
resource never execute at the same time, whatever the clients do; a model that could never
run fails its load with Triton's words; the server serves on."""
import concurrent.futures as cf

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, leased_requests, wait_for

# answers when its execution started and ended (CLOCK_MONOTONIC, one clock for all processes)
TIMED = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        start = time.monotonic_ns()
        time.sleep(0.05)            # the work: long enough for executions to overlap
        end = time.monotonic_ns()
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "SPAN", np.array([start, end], np.int64))]) for _ in requests]
"""


def config(name, resource_count=1):
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "SPAN", data_type: TYPE_INT64, dims: [ 2 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU
    rate_limiter {{ resources [ {{ name: "R" count: {resource_count} }} ] }} }} ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("limited") / "models")
    write_model(r, "one", config("one"), TIMED)
    write_model(r, "two", config("two"), TIMED)
    write_model(r, "greedy", config("greedy", 3), TIMED)
    return r


def span(url, model):
    c = httpclient.InferenceServerClient(url)
    x = httpclient.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    return tuple(int(v) for v in c.infer(model, [x]).as_numpy("SPAN"))


def test_instances_that_share_a_resource_never_run_together(repo):
    s = Server(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "R:1",
               "--model-control-mode", "explicit", "--load-model", "one", "--load-model", "two")
    try:
        # four instances in all, eight clients: without the limiter they would overlap
        with cf.ThreadPoolExecutor(8) as pool:
            spans = list(pool.map(lambda i: span(s.url, ("one", "two")[i % 2]), range(24)))
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0, f"executions overlapped: {spans}"
        ok = span(s.url, "one")
        assert ok[1] > ok[0]
    finally:
        s.stop()


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_a_limited_model_alone_is_lent_and_a_model_sharing_its_resource_takes_it_back(
        repo, frontends):
    """Requests one at a time to "one": its resource is free, so an instance is lent and they
    go straight to its worker. Then both models at once, from clients spread over the
    frontends: "two" waits for the resource the lease holds, takes the lease back, and no two
    executions overlap."""
    s = Server(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "R:1",
               "--model-control-mode", "explicit", "--load-model", "one", "--load-model", "two",
               "--frontends", frontends)
    try:
        before = leased_requests(s, "one")
        wait_for(lambda: span(s.url, "one") and leased_requests(s, "one") > before + 2, 30,
                 "one's requests to go under a lease")
        with cf.ThreadPoolExecutor(4) as pool:
            spans = list(pool.map(lambda i: span(s.url, ("one", "two")[i % 2]), range(16)))
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0, f"executions overlapped: {spans}"
    finally:
        s.stop()


def test_an_instance_that_could_never_run_fails_its_load(repo):
    s = Server(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "R:2",
               "--model-control-mode", "explicit", "--load-model", "one")
    try:
        c = httpclient.InferenceServerClient(s.url)
        with pytest.raises(Exception) as e:
            c.load_model("greedy")
        assert "Resource count for 'R' is limited to 2 which will prevent scheduling of one " \
               "or more model instances" in str(e.value)
        assert span(s.url, "one")[1] > 0
    finally:
        s.stop()
