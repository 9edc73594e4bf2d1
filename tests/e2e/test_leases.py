"""Leased instances end to end (engine/leases.py): a frontend sends requests straight to an idle
worker the scheduler lent it. The real server, the real clients; what the lease must survive:
a worker dying under a leased request, an unload while leased, clients racing for the one
instance, and a client cancelling a leased request."""
import os
import textwrap
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import PID_SLOW, write_model
from serverproc import Server, alive, leased_requests, model_sleeping, wait_for
from tritonclient.utils import InferenceServerException

ECHO_CONFIG = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
             { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
'''

# Killed (SIGKILL, as from outside) on the first request with the value -1 it ever sees, echoes
# everything else: a worker lost under a leased request, which its retry on the restarted worker
# then serves.
CRASH_ONCE = textwrap.dedent('''
    import os, signal
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.marker = os.path.join(args["model_repository"], "crashed")

        def execute(self, requests):
            out = []
            for r in requests:
                x = r.inputs()[0].as_numpy()
                if (x == -1).any() and not os.path.exists(self.marker):
                    open(self.marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)    # as the OOM killer would
                pid = np.full((x.shape[0], 1), os.getpid(), dtype=np.int64)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x),
                                                       pb_utils.Tensor("PID", pid)]))
            return out
''')

# Waits until its client goes away when asked to (parameter "wait"), and leaves a file saying
# it saw the cancellation; answers at once otherwise.
CANCELLABLE = textwrap.dedent('''
    import json, os, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.marker = os.path.join(args["model_repository"], "saw_cancel")

        def execute(self, requests):
            out = []
            for r in requests:
                x = r.inputs()[0].as_numpy()
                if json.loads(r.parameters()).get("wait"):
                    deadline = time.monotonic() + 20
                    while not r.is_cancelled() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    if r.is_cancelled():
                        open(self.marker, "w").close()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("leases"))
    write_model(root, "echo", ECHO_CONFIG, PID_SLOW)
    write_model(root, "crash_once", ECHO_CONFIG, CRASH_ONCE)
    write_model(root, "batched_echo", ECHO_CONFIG + '''
        instance_group [ { count: 1, kind: KIND_CPU } ]
        dynamic_batching { }
    ''', PID_SLOW)
    write_model(root, "batched_pair", ECHO_CONFIG + '''
        instance_group [ { count: 2, kind: KIND_CPU } ]
        dynamic_batching { }
    ''', PID_SLOW)
    write_model(root, "cancellable", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', CANCELLABLE)
    return root


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "*")
    yield s
    s.stop()


def echo(client, model: str, value: float, **params):
    x = np.full((1, 4), value, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    r = client.infer(model, [inp], parameters=params or None)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
    return int(r.as_numpy("PID")[0, 0])


def inference_count(client, model: str) -> int:
    return int(client.get_inference_statistics(model)["model_stats"][0]["inference_count"])


def take_lease(srv, client, model: str, send) -> None:
    """Send requests one at a time until the frontend uses a lease for them."""
    before = leased_requests(srv, model)
    wait_for(lambda: send() is not None and leased_requests(srv, model) > before, 20,
             f"requests for '{model}' to go under a lease")


@pytest.fixture
def client(srv):
    c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    yield c
    c.close()


def test_one_at_a_time_requests_go_straight_to_the_worker_and_are_counted(srv, client):
    count, before = inference_count(client, "echo"), leased_requests(srv, "echo")
    pids = {echo(client, "echo", i) for i in range(40)}
    assert len(pids) == 1
    # after the first request (through the scheduler) the frontend holds a lease; the lease is
    # renewed every 2 s, so a request may go through the scheduler now and then
    assert leased_requests(srv, "echo") - before >= 30
    assert inference_count(client, "echo") == count + 40        # the scheduler counts them all
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    x = np.ones((1, 4), dtype=np.float32)
    inp = grpcclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(10):
        np.testing.assert_array_equal(g.infer("echo", [inp]).as_numpy("OUTPUT0"), x)
    g.close()
    assert inference_count(client, "echo") == count + 50


def test_worker_death_under_a_leased_request_is_retried_on_the_new_worker(srv, client):
    take_lease(srv, client, "crash_once", lambda: echo(client, "crash_once", 1))
    old = echo(client, "crash_once", 2)
    new = echo(client, "crash_once", -1)        # kills the leased worker; the retry succeeds
    assert new != old
    wait_for(lambda: not alive(old), 10, "the dead worker to be reaped")
    assert "leased worker" in srv.log_text()
    take_lease(srv, client, "crash_once", lambda: echo(client, "crash_once", 3))


def test_concurrent_clients_of_the_one_instance_lose_nothing(srv):
    count = inference_count(httpclient.InferenceServerClient(srv.url), "echo")
    before = leased_requests(srv, "echo")
    errors, done = [], []

    def run(k):
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        try:
            for i in range(40):
                echo(c, "echo", k * 1000 + i)       # checks the answer is its own
            done.append(k)
        except Exception as e:                      # reported below, with the others
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and sorted(done) == [0, 1, 2, 3]
    assert inference_count(httpclient.InferenceServerClient(srv.url), "echo") == count + 160
    # one frontend's concurrent load on a single-instance model: the scheduler hands its queue
    # over with the lease, and the frontend pipelines into the worker
    assert leased_requests(srv, "echo") - before >= 80


def test_cancelling_a_leased_request_reaches_the_model(srv, repo, client):
    marker = os.path.join(repo, "cancellable", "saw_cancel")
    x = np.ones(1, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(x)
    take_lease(srv, client, "cancellable", lambda: client.infer("cancellable", [inp]))
    quick = httpclient.InferenceServerClient(srv.url, network_timeout=2.0)
    with pytest.raises(TimeoutError):
        quick.infer("cancellable", [inp], parameters={"wait": 1})   # gives up, hangs up
    quick.close()
    wait_for(lambda: os.path.exists(marker), 10, "the model to see the cancellation")
    np.testing.assert_array_equal(client.infer("cancellable", [inp]).as_numpy("OUTPUT0"), x)


def test_unload_while_leased_finishes_the_leased_request(srv, client):
    take_lease(srv, client, "echo", lambda: echo(client, "echo", 1))
    pid = echo(client, "echo", 2)
    x = np.ones((1, 4), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    slow = client.async_infer("echo", [inp], parameters={"delay_ms": 1500})
    wait_for(lambda: model_sleeping(srv, "echo"), 20, "the leased request to be executing")
    other = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    other.unload_model("echo")
    np.testing.assert_array_equal(slow.get_result().as_numpy("OUTPUT0"), x)
    wait_for(lambda: not alive(pid), 20, "the unloaded model's worker to exit")
    with pytest.raises(InferenceServerException) as e:
        echo(client, "echo", 3)
    assert "has no available versions" in e.value.message()
    other.load_model("echo")
    take_lease(srv, client, "echo", lambda: echo(client, "echo", 4))
    other.close()


def test_leased_requests_of_a_dynamic_batching_model_batch_in_the_worker(srv):
    """A single-instance dynamic-batching model is lent too; what its frontend sends meanwhile
    waits in the worker's inbox and runs in batches (workers/leases/batch.py), counted as such."""
    client = httpclient.InferenceServerClient(srv.url, concurrency=16, network_timeout=60)
    take_lease(srv, client, "batched_echo", lambda: echo(client, "batched_echo", 1))
    stats = client.get_inference_statistics("batched_echo")["model_stats"][0]
    before = (int(stats["inference_count"]), int(stats["execution_count"]),
              leased_requests(srv, "batched_echo"))
    pending = []
    for i in range(16):
        x = np.full((1, 4), i, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        # the first runs for 100 ms, and the others reach the worker's inbox meanwhile
        pending.append((x, client.async_infer("batched_echo", [inp],
                                              parameters={"delay_ms": 100})))
    for x, p in pending:
        np.testing.assert_array_equal(p.get_result().as_numpy("OUTPUT0"), x)

    def counted():
        st = client.get_inference_statistics("batched_echo")["model_stats"][0]
        return int(st["inference_count"]) == before[0] + 16 and st
    stats = wait_for(counted, 20, "the 16 requests in the statistics")
    executions = int(stats["execution_count"]) - before[1]
    assert executions < 16, "nothing was batched"
    assert max(int(b["batch_size"]) for b in stats["batch_stats"]) <= 8
    # the lease is renewed every 2 s, so one may have gone through the scheduler
    wait_for(lambda: leased_requests(srv, "batched_echo") - before[2] >= 8, 20,
             "the requests to be counted as leased")
    client.close()


def _send_16(client, model: str, delay_ms: int) -> list:
    pending = []
    for i in range(16):
        x = np.full((1, 4), i, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        pending.append((x, client.async_infer(model, [inp], parameters={"delay_ms": delay_ms})))
    return pending


def test_a_batching_pair_is_lent_whole_and_the_frontend_spreads_over_it(srv):
    """Both instances of a dynamic-batching model are lent to the frontend, which spreads its
    requests over them; each worker batches what reaches its inbox."""
    client = httpclient.InferenceServerClient(srv.url, concurrency=16, network_timeout=60)
    take_lease(srv, client, "batched_pair", lambda: echo(client, "batched_pair", 1))
    before = leased_requests(srv, "batched_pair")
    pids = set()
    for x, p in _send_16(client, "batched_pair", 100):
        r = p.get_result()
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
        pids.add(int(r.as_numpy("PID")[0, 0]))
    assert len(pids) == 2, "one instance ran everything"
    # the leases are renewed every 2 s, so a few may have gone through the scheduler
    wait_for(lambda: leased_requests(srv, "batched_pair") - before >= 8, 20,
             "the requests to be counted as leased")
    client.close()


def test_killing_one_of_a_lent_pair_loses_no_request(srv):
    client = httpclient.InferenceServerClient(srv.url, concurrency=16, network_timeout=60)
    take_lease(srv, client, "batched_pair", lambda: echo(client, "batched_pair", 1))
    victim = echo(client, "batched_pair", 2)
    pending = _send_16(client, "batched_pair", 300)
    wait_for(lambda: _sleeping(victim), 20, "a request to run on the victim")
    os.kill(victim, 9)
    for x, p in pending:            # retried on the other instance or the restarted one
        np.testing.assert_array_equal(p.get_result().as_numpy("OUTPUT0"), x)
    wait_for(lambda: not alive(victim), 10, "the victim to be reaped")
    wait_for(lambda: len(_pids_of_16(client) - {victim}) == 2, 60, "the pair to serve again")
    client.close()


def _sleeping(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "nanosleep" in f.read()
    except OSError:
        return False


def _pids_of_16(client) -> set:
    """The workers that ran 16 concurrent requests (both, when both serve)."""
    try:
        return {int(p.get_result().as_numpy("PID")[0, 0])
                for _, p in _send_16(client, "batched_pair", 50)}
    except InferenceServerException:
        return set()
