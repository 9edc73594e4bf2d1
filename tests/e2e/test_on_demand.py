"""--model-control-mode=on_demand: every model of the repository is listed and loads at its
first request; models are unloaded when idle or to keep their workers' memory (PSS) under
--model-memory-budget. Real servers, tritonclient and the HTTP API; every wait has a deadline.
bench/on_demand.py runs the 500-model version of test_many_models_under_a_budget."""
import os
import random
import signal
import textwrap
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import BAD_INIT, IDENTITY, write_model
from serverproc import Server, alive, descendants, model_sleeping, segments_of, wait_for
from tritonclient.utils import InferenceServerException

MIB = 1 << 20

# A model that holds ``ballast_mib`` MiB (touched, so it counts in its PSS), can sleep in
# initialize() (init_delay_s) and in execute() (the request parameter delay_ms).
BALLAST = textwrap.dedent('''
    import json, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"]).get("parameters", {})
            mib = int(params.get("ballast_mib", {}).get("string_value", "0"))
            self.ballast = np.ones(mib << 18, dtype=np.float32)
            time.sleep(float(params.get("init_delay_s", {}).get("string_value", "0")))

        def execute(self, requests):
            out = []
            for r in requests:
                time.sleep(json.loads(r.parameters()).get("delay_ms", 0) / 1000.0)
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')


# An identity model whose inputs and outputs come from auto_complete_config() (none in its
# config.pbtxt): the server learns them only when it loads it.
AUTO = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
            config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
            config.set_max_batch_size(8)
            return config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                    for r in requests]
''')


def config(ballast_mib: int = 0, init_delay_s: float = 0) -> str:
    return textwrap.dedent(f'''
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        instance_group [ {{ count: 1, kind: KIND_CPU }} ]
        parameters {{ key: "ballast_mib" value: {{ string_value: "{ballast_mib}" }} }}
        parameters {{ key: "init_delay_s" value: {{ string_value: "{init_delay_s}" }} }}
    ''')


def identity_repo(root: str, n: int) -> str:
    repo = os.path.join(root, f"identity{n}")
    for i in range(n):
        write_model(repo, f"m{i:03d}", config(), IDENTITY)
    return repo


def on_demand(repo: str, *flags: str) -> Server:
    return Server(repo, "--model-control-mode", "on_demand", *flags)


def index(srv) -> dict:
    return {e["name"]: e for e in requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}


def metrics(srv) -> str:
    return requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text


def metric(srv, sample: str) -> float:
    """The value of the sample line that starts with ``sample`` (name and labels), 0 if none."""
    for line in metrics(srv).splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def x_for(value: float) -> np.ndarray:
    return np.full((1, 4), value, dtype=np.float32)


def infer_http(client, model: str, value: float, **kw) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x_for(value))
    return client.infer(model, [inp], **kw).as_numpy("OUTPUT0")


def infer_grpc(client, model: str, value: float) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x_for(value))
    return client.infer(model, [inp]).as_numpy("OUTPUT0")


def raw_infer(srv, model: str) -> requests.Response:
    return requests.post(f"{srv.base}/v2/models/{model}/infer", timeout=120, json={
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})


def worker_pss(srv) -> dict[int, int]:
    """pid -> PSS bytes of every worker process of the server (not its fork server)."""
    out = {}
    for pid in descendants(srv.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"shmserve.workers.main" not in f.read():
                    continue
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        out[pid] = int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return out


def workers_of(srv, model: str) -> list[int]:
    found = []
    for pid in descendants(srv.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f'"model_name":"{model}"'.encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def stop_clean(srv) -> None:
    """Stop the server; nothing of it may be left: no process, no shared-memory segment."""
    pid = srv.proc.pid
    tree = descendants(pid)
    assert srv.stop() == 0, srv.log_text()[-3000:]
    wait_for(lambda: not any(alive(p) for p in tree), 20, "the server's processes to end")
    assert segments_of(pid) == []


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("on_demand"))
    repo = identity_repo(root, 6)
    write_model(repo, "broken", config(), BAD_INIT)
    write_model(repo, "slow_init", config(init_delay_s=60), BALLAST)
    write_model(repo, "auto", 'backend: "python"\n', AUTO)     # no inputs: auto-complete
    return repo


@pytest.fixture(scope="module")
def small(small_repo):
    srv = on_demand(small_repo, "--model-load-wait-secs", "2")
    yield srv
    stop_clean(srv)


# ---- loading ---------------------------------------------------------------------------------------
def test_every_model_is_listed_and_ready_before_it_loads(small):
    idx = index(small)
    assert idx["m000"] == {"name": "m000", "version": "1", "state": "UNAVAILABLE",
                           "reason": "unloaded"}
    c = httpclient.InferenceServerClient(small.url)
    assert c.is_server_ready()
    assert c.is_model_ready("m005")         # a request would be served: it loads it
    meta = c.get_model_metadata("m005")     # from its config.pbtxt, nothing loads
    assert meta["versions"] == ["1"] and meta["inputs"][0]["name"] == "INPUT0"
    assert c.get_model_config("m005")["max_batch_size"] == 8
    assert index(small)["m005"]["state"] == "UNAVAILABLE" and workers_of(small, "m005") == []
    assert requests.get(f"{small.base}/v2/models/no_such_model/ready", timeout=10).status_code == 404
    r = raw_infer(small, "no_such_model")
    assert r.status_code == 404 and "unknown model" in r.json()["error"]


def test_the_first_request_loads_the_model_http_and_grpc(small):
    h = httpclient.InferenceServerClient(small.url)
    np.testing.assert_array_equal(infer_http(h, "m000", 3.0), x_for(3.0))
    g = grpcclient.InferenceServerClient(small.grpc_url)
    np.testing.assert_array_equal(infer_grpc(g, "m001", 4.0), x_for(4.0))
    idx = index(small)
    assert idx["m000"]["state"] == "READY" and idx["m001"]["state"] == "READY"
    assert idx["m002"]["state"] == "UNAVAILABLE"
    assert g.is_model_ready("m001") and len(workers_of(small, "m001")) == 1
    assert metric(small, 'shmserve_on_demand_loads_total{model="m000"}') == 1
    assert metric(small, 'shmserve_on_demand_model_memory_bytes{model="m000"}') > 0
    assert metric(small, "shmserve_on_demand_load_wait_us_count") >= 2
    assert metric(small, "shmserve_on_demand_budget_bytes") == 0


def test_concurrent_first_requests_trigger_one_load(small):
    out: dict[int, np.ndarray] = {}
    go = threading.Barrier(8)

    def one(i):
        # closed in its own thread: a client left to the collector closes its gevent pool in
        # whichever thread collects it, where gevent has no hub (an ignored exception)
        c = httpclient.InferenceServerClient(small.url, network_timeout=120)
        try:
            go.wait(timeout=30)
            out[i] = infer_http(c, "m003", float(i))
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(out) == list(range(8))
    for i, y in out.items():
        np.testing.assert_array_equal(y, x_for(float(i)))
    assert metric(small, 'shmserve_on_demand_loads_total{model="m003"}') == 1
    assert len(workers_of(small, "m003")) == 1


def test_a_failing_load_gives_a_clear_error_and_the_server_keeps_serving(small):
    r = raw_infer(small, "broken")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err.startswith("load failed for model 'broken'") and "initialize failed on purpose" in err
    g = grpcclient.InferenceServerClient(small.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        infer_grpc(g, "broken", 1.0)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "initialize failed on purpose" in e.value.message()
    assert not g.is_model_ready("broken")
    assert index(small)["broken"]["state"] == "UNAVAILABLE"
    np.testing.assert_array_equal(infer_grpc(g, "m004", 5.0), x_for(5.0))


def test_a_load_past_the_wait_answers_still_loading(small):
    r = raw_infer(small, "slow_init")       # initialize() takes 60 s; the wait is 2 s
    assert r.status_code == 503
    assert "model 'slow_init' is still loading after 2 s" in r.json()["error"]
    assert index(small)["slow_init"]["state"] == "LOADING"
    c = httpclient.InferenceServerClient(small.url)
    np.testing.assert_array_equal(infer_http(c, "m000", 6.0), x_for(6.0))


def test_a_model_whose_config_the_model_completes_loads_through_the_api_first(small):
    r = raw_infer(small, "auto")
    assert r.status_code == 503 and "load it once first" in r.json()["error"]
    c = httpclient.InferenceServerClient(small.url)
    c.load_model("auto")
    np.testing.assert_array_equal(infer_http(c, "auto", 7.0), x_for(7.0))


# ---- memory ----------------------------------------------------------------------------------------
@pytest.fixture
def ballast_repo(tmp_path):
    repo = str(tmp_path / "ballast")
    for name in ("a", "b", "c", "s1", "s2"):
        write_model(repo, name, config(ballast_mib=96), BALLAST)
    return repo


def test_the_budget_evicts_the_least_recently_used_and_never_a_busy_model(ballast_repo):
    # each model holds 96 MiB (plus the worker's own 10-30): two fit in 95% of 300 MiB, three
    # do not
    srv = on_demand(ballast_repo, "--model-memory-budget", "300M", "--instance-leases", "false")
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=120, concurrency=4)
        for model, v in (("a", 1.0), ("b", 2.0), ("a", 3.0)):       # b is now the LRU
            np.testing.assert_array_equal(infer_http(c, model, v), x_for(v))
        np.testing.assert_array_equal(infer_http(c, "c", 4.0), x_for(4.0))
        size = metric(srv, 'shmserve_on_demand_model_memory_bytes{model="a"}')
        assert 96 * MIB < size < 142 * MIB, size        # the premise: two fit, three do not
        idx = index(srv)
        assert [idx[m]["state"] for m in "abc"] == ["READY", "UNAVAILABLE", "READY"]
        assert idx["b"]["reason"] == "unloaded" and workers_of(srv, "b") == []
        assert metric(srv, 'shmserve_on_demand_evictions_total{model="b",reason="budget"}') == 1
        assert metric(srv, 'shmserve_on_demand_evictions_total{model="a",reason="budget"}') == 0
        assert 0 < metric(srv, "shmserve_on_demand_resident_bytes") <= 300 * MIB
        assert metric(srv, "shmserve_on_demand_budget_bytes") == 300 * MIB

        # a is the least recently used, but busy: c goes for s1 instead
        slow = c.async_infer("a", [_input(8.0)], parameters={"delay_ms": 3000})
        wait_for(lambda: model_sleeping(srv, "a"), 30, "a's request to be executing")
        np.testing.assert_array_equal(infer_http(c, "s1", 9.0), x_for(9.0))
        np.testing.assert_array_equal(slow.get_result().as_numpy("OUTPUT0"), x_for(8.0))
        idx = index(srv)
        assert idx["a"]["state"] == "READY" and idx["c"]["state"] == "UNAVAILABLE"

        # both resident models busy: s2's load waits for one of them, then serves
        busy = [c.async_infer(m, [_input(10.0)], parameters={"delay_ms": 2000}) for m in ("a", "s1")]
        wait_for(lambda: model_sleeping(srv, "a") and model_sleeping(srv, "s1"), 30,
                 "both requests to be executing")
        waiting = c.async_infer("s2", [_input(11.0)])
        while model_sleeping(srv, "a") and model_sleeping(srv, "s1"):
            assert index(srv)["s2"]["state"] == "UNAVAILABLE"       # not loading past the budget
            time.sleep(0.1)
        np.testing.assert_array_equal(waiting.get_result().as_numpy("OUTPUT0"), x_for(11.0))
        for f in busy:
            np.testing.assert_array_equal(f.get_result().as_numpy("OUTPUT0"), x_for(10.0))
    finally:
        stop_clean(srv)


def _input(value: float):
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x_for(value))
    return inp


def test_idle_models_unload(tmp_path):
    srv = on_demand(identity_repo(str(tmp_path), 2), "--model-idle-unload-secs", "1")
    try:
        c = httpclient.InferenceServerClient(srv.url)
        np.testing.assert_array_equal(infer_http(c, "m000", 1.0), x_for(1.0))
        [pid] = workers_of(srv, "m000")
        wait_for(lambda: index(srv)["m000"].get("reason") == "unloaded", 30,
                 "the idle model to be unloaded")
        wait_for(lambda: not alive(pid), 30, "its worker to exit")
        assert metric(srv, 'shmserve_on_demand_evictions_total{model="m000",reason="idle"}') == 1
        np.testing.assert_array_equal(infer_http(c, "m000", 2.0), x_for(2.0))   # loads again
        assert metric(srv, 'shmserve_on_demand_loads_total{model="m000"}') == 2
    finally:
        stop_clean(srv)


# ---- many models -----------------------------------------------------------------------------------
def run_many(srv, models: list[str], threads: int, per_thread: int, budget: int, seed: int = 7):
    """Requests to random models from ``threads`` clients; every answer checked, the workers'
    PSS summed every 100 ms meanwhile. Returns ([peak PSS, workers then], errors, latency of
    each request)."""
    errors: list[str] = []
    latencies: list[float] = []
    peak = [0, 0]           # bytes, workers then
    done = threading.Event()

    def sample():
        while not done.is_set():
            pss = worker_pss(srv)
            total = sum(pss.values())
            if total > peak[0]:
                peak[0], peak[1] = total, len(pss)
            done.wait(0.1)

    def client(k: int):
        rng = random.Random(seed * 1000 + k)
        c = httpclient.InferenceServerClient(srv.url, network_timeout=300)
        for i in range(per_thread):
            model = rng.choice(models)
            value = float(k * 100000 + i)
            t = time.monotonic()
            try:
                y = infer_http(c, model, value)
                if not np.array_equal(y, x_for(value)):
                    errors.append(f"{model}: wrong answer {y}")
            except Exception as e:      # noqa: BLE001 - every failure is reported
                errors.append(f"{model}: {e}")
            latencies.append(time.monotonic() - t)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=900)
    done.set()
    sampler.join(timeout=10)
    return peak, errors, latencies


def probe_size(repo: str, models: list[str]) -> int:
    """What one worker of these (identity) models measures, PSS, with all of them alive."""
    srv = on_demand(repo)
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=120)
        for m in models:
            infer_http(c, m, 1.0)
        sizes = worker_pss(srv)
        assert len(sizes) == len(models)
        return sum(sizes.values()) // len(sizes)
    finally:
        stop_clean(srv)


def test_many_models_under_a_budget(tmp_path):
    """500 models, a budget that holds about 50 of them, random requests from 4 clients: every
    answer right, the workers' memory (PSS, summed every 100 ms) under the budget all along,
    nothing left at the end. (About 30 s here; bench/on_demand.py is the longer run.)"""
    n, fit = 500, 50
    names = [f"m{i:03d}" for i in range(n)]
    repo = identity_repo(str(tmp_path), n)
    size = probe_size(repo, names[:fit])
    budget = fit * size
    srv = on_demand(repo, "--model-memory-budget", str(budget))
    try:
        t = time.monotonic()
        peak, errors, latencies = run_many(srv, names, 4, 100, budget)
        print(f"{len(latencies)} requests in {time.monotonic() - t:.1f} s; peak worker PSS "
              f"{peak[0] / MIB:.1f} MiB in {peak[1]} workers, budget {budget / MIB:.1f} MiB "
              f"(one worker: {size / MIB:.1f} MiB)")
        assert errors == []
        assert len(latencies) == 400
        assert 0 < peak[0] <= budget
        page = metrics(srv)
        assert metric(srv, "shmserve_on_demand_resident_bytes") <= budget
        evictions = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                        if line.startswith("shmserve_on_demand_evictions_total{"))
        assert evictions > 0
    finally:
        stop_clean(srv)


def test_sigterm_while_requests_wait_for_a_load(tmp_path):
    repo = str(tmp_path / "slow")
    write_model(repo, "slow_init", config(init_delay_s=60), BALLAST)
    # the frontend lets held requests finish for --exit-timeout-secs, then they fail
    srv = on_demand(repo, "--exit-timeout-secs", "2")
    c = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    waiting = c.async_infer("slow_init", [_input(1.0)])
    wait_for(lambda: index(srv)["slow_init"]["state"] == "LOADING", 30, "the load to start")
    pid = srv.proc.pid
    tree = descendants(pid)
    srv.proc.send_signal(signal.SIGTERM)
    with pytest.raises(InferenceServerException) as e:
        waiting.get_result()
    assert "shutting down" in e.value.message()
    srv.proc.wait(timeout=60)
    assert srv.stop() == 0
    wait_for(lambda: not any(alive(p) for p in tree), 20, "the server's processes to end")
    assert segments_of(pid) == []


def test_the_example_repository_on_demand(example_repo):
    """Every example model listed; an ensemble's first request loads it with its three models
    (one of them ONNX); Triton's `simple` answers its first request too."""
    srv = on_demand(example_repo, "--model-memory-budget", "4G")
    try:
        idx = index(srv)
        assert all(e["state"] == "UNAVAILABLE" for e in idx.values()), idx
        g = grpcclient.InferenceServerClient(srv.grpc_url)
        image = np.arange(256, dtype=np.uint8).reshape(1, 256)
        inp = grpcclient.InferInput("IMAGE", [1, 256], "UINT8")
        inp.set_data_from_numpy(image)
        out = g.infer("ensemble_mlp", [inp])
        probs = out.as_numpy("PROBS")
        assert probs.shape == (1, 256) and abs(float(probs.sum()) - 1.0) < 1e-3
        assert out.as_numpy("CLASS")[0, 0] == int(np.argmax(probs[0]))
        idx = index(srv)
        for m in ("ensemble_mlp", "mlp_preprocess", "mlp_onnx", "mlp_postprocess"):
            assert idx[m]["state"] == "READY", (m, idx[m])
        assert idx["simple"]["state"] == "UNAVAILABLE"
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        ins = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in ins:
            i.set_data_from_numpy(a)
        res = g.infer("simple", ins)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + a)
    finally:
        stop_clean(srv)
