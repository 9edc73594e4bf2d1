"""Several frontend processes (--frontends N) sharing the HTTP and gRPC ports through SO_REUSEPORT:
connections spread over them, client shared memory registered through one is usable through every
other, leases stay correct while two frontends race for one instance, a killed frontend is
restarted while the others serve, and the server stops clean."""
import os
import signal
import subprocess
import threading

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import IDENTITY, write_model
from serverproc import Server, alive, connections, descendants, frontend_pids, segments_of, wait_for

ONE_INSTANCE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return out
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("frontends"))
    write_model(root, "double", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
        instance_group [ { count: 1, kind: KIND_CPU } ]
    ''', ONE_INSTANCE)
    write_model(root, "echo_big", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    ''', IDENTITY)
    return root


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, "--frontends", "2")
    yield s
    s.stop()


def double(client, value: float, mod=httpclient):
    x = np.full((1, 16), value, dtype=np.float32)
    i = mod.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    out = client.infer("double", [i]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, x * 2)


def grpc_client(srv):
    # gRPC channels of one process share their connections unless told not to
    return lambda: grpcclient.InferenceServerClient(
        srv.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def clients_on_every_frontend(srv, make, port: int, first: int = 8) -> list:
    """Open clients (each one connection, used once) until every frontend holds one: the kernel
    picks a frontend per connection by a hash, so a few are enough almost always."""
    pids = frontend_pids(srv)
    assert len(pids) == 2, pids
    clients = []

    def spread() -> bool:
        c = make()
        clients.append(c)
        double(c, len(clients), grpcclient if isinstance(c, grpcclient.InferenceServerClient)
               else httpclient)
        return len(clients) >= first and all(connections(pids, port).values())

    wait_for(spread, 30, "connections on both frontends")
    return clients


def test_connections_spread_over_the_frontends_http_and_grpc(srv):
    http = clients_on_every_frontend(
        srv, lambda: httpclient.InferenceServerClient(srv.url), srv.http_port)
    grpc = clients_on_every_frontend(srv, grpc_client(srv), srv.grpc_port)
    for c in http + grpc:
        double(c, 7.0, grpcclient if c in grpc else httpclient)
        c.close()


def test_a_region_registered_through_one_frontend_serves_every_frontend(srv):
    key = f"/fe_region_{os.getpid()}"
    handle = shm.create_shared_memory_region("fe_in", key, 128)
    try:
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        shm.set_shared_memory_region(handle, [x])
        control = httpclient.InferenceServerClient(srv.url)
        control.register_system_shared_memory("fe_io", key, 128)
        clients = clients_on_every_frontend(
            srv, lambda: httpclient.InferenceServerClient(srv.url), srv.http_port)
        for c in clients:
            assert [r["name"] for r in c.get_system_shared_memory_status()] == ["fe_io"]
            with pytest.raises(Exception, match="already in manager"):
                c.register_system_shared_memory("fe_io", key, 128)
            i = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            i.set_shared_memory("fe_io", 64)
            o = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
            o.set_shared_memory("fe_io", 64, offset=64)
            r = c.infer("double", [i], outputs=[o])
            out = shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=64)
            np.testing.assert_array_equal(out, x * 2)
            assert r.get_output("OUTPUT0") is not None
        control.unregister_system_shared_memory("fe_io")
        for c in clients:
            i = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            i.set_shared_memory("fe_io", 64)
            with pytest.raises(Exception, match="Unable to find shared memory region"):
                c.infer("double", [i])
            assert c.get_system_shared_memory_status() == []
            c.close()
        control.close()
    finally:
        shm.destroy_shared_memory_region(handle)


def test_two_frontends_racing_for_one_instance_lose_nothing(srv):
    """The model has one instance and no dynamic batching, so each frontend may hold its lease
    in turn; clients on both frontends at once, and the worker killed in the middle. (gRPC
    clients: an HTTP client of tritonclient belongs to the thread that made it.)"""
    clients = clients_on_every_frontend(srv, grpc_client(srv), srv.grpc_port)
    stats = httpclient.InferenceServerClient(srv.url)
    before = int(stats.get_inference_statistics("double")["model_stats"][0]["inference_count"])
    errors, done = [], []
    half = threading.Event()
    per_client = 60

    def run(c, seed):
        try:
            for k in range(per_client):
                double(c, seed * 1000 + k, grpcclient)
                done.append(1)
                if len(done) >= per_client * len(clients) // 2:
                    half.set()
        except Exception as e:          # noqa: BLE001  (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(c, n)) for n, c in enumerate(clients)]
    for t in threads:
        t.start()
    assert half.wait(60), f"half the requests in time: {len(done)} done, errors {errors[:3]}"
    worker = [p for p in descendants(srv.proc.pid)
              if b'"model_name":"double"' in open(f"/proc/{p}/cmdline", "rb").read()]
    assert worker
    os.kill(worker[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    total = per_client * len(clients)
    assert len(done) == total
    wait_for(lambda: int(stats.get_inference_statistics("double")["model_stats"][0]
                         ["inference_count"]) >= before + total, 20,
             "every request counted in the statistics")
    for c in clients + [stats]:
        c.close()


@pytest.mark.xdist_group("perf_analyzer_system_shm")     # see tests/e2e/test_perf_analyzer.py
def test_perf_analyzer_with_system_shared_memory_over_two_frontends(srv, perf_analyzer,  # noqa: F811
                                                                    tmp_path):
    cmd = [perf_analyzer, "-m", "double", "-u", f"127.0.0.1:{srv.http_port}", "-i", "http",
           "--shared-memory", "system", "--output-shared-memory-size", "64",
           "--concurrency-range", "4", "--measurement-interval", "800", "--max-trials", "4",
           "--stability-percentage", "999"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "Throughput:" in out.stdout and "error" not in out.stdout.lower(), out.stdout


def _segments_named(server, part: str) -> list[str]:
    return [n for n in segments_of(server.proc.pid) if part in n]


def test_a_killed_frontend_is_restarted_while_the_others_serve(repo):
    """kill -9 of one of two frontends under HTTP load: the other goes on answering, a new
    frontend takes the dead one's place (same ports, its own arena, its id's scheduler link,
    the dead one's leases given back), and the dead one's shared memory is unlinked. Only
    requests in flight on the dead one's connections fail. Before, the whole server stopped."""
    s = Server(repo, "--frontends", "2")
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        pids = frontend_pids(s)
        assert len(pids) == 2
        ok, failed = [], []
        spread = [0]        # bumped to have every client connect again (see below)

        def load(k):
            # one connection each, kept; a failed request reconnects (perhaps to the other one)
            i = 0
            while not stop.is_set():
                c = httpclient.InferenceServerClient(s.url, network_timeout=30)
                turn = spread[0]
                try:
                    while not stop.is_set() and spread[0] == turn:
                        i += 1
                        # 80 KB: through the frontend's shared-memory arena
                        x = np.full((1, 20000), k * 100000 + i, dtype=np.float32)
                        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
                        inp.set_data_from_numpy(x)
                        out = c.infer("echo_big", [inp]).as_numpy("OUTPUT0")
                        np.testing.assert_array_equal(out, x)
                        ok.append(1)
                except Exception as e:          # noqa: BLE001  (counted below)
                    failed.append(repr(e))
                finally:
                    c.close()

        threads += [threading.Thread(target=load, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        def on_both() -> bool:
            """The kernel picks a frontend per connection by a hash: until both hold some of
            the clients' connections, they connect again. Each frontend's arena is named by
            its id; frontend-1's exists once it held a tensor."""
            if len(ok) >= 40 and all(connections(pids, s.http_port).values()) and \
                    _segments_named(s, "_f1_"):
                return True
            if len(ok) >= 40:
                spread[0] += 1
                ok.clear()
            return False
        wait_for(on_both, 60, "the load to reach both frontends", interval=0.2)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: len(frontend_pids(s)) == 2 and pids[1] not in frontend_pids(s), 30,
                 "a new frontend in the dead one's place")
        served = len(ok)
        wait_for(lambda: len(ok) >= served + 100, 60, "more answers after the restart")
        stop.set()
        for t in threads:
            t.join(60)
        assert s.proc.poll() is None                    # the server never stopped
        # at most the requests in flight on the killed frontend's connections: the connection
        # closed under them (before the answer, or in the middle of its 80 KB: the client's
        # parser then says the response is incomplete), no wrong answer, no server error
        assert len(failed) <= len(threads), failed
        assert all("Connection" in f or "Incomplete response" in f for f in failed), failed
        assert pids[0] in frontend_pids(s)              # the other one was never touched
        assert "frontend-1 process exited (killed by SIGKILL); starting another" in s.log_text()
        assert _segments_named(s, "_f1_") == []         # the dead one's arena is gone
        # the new one serves, HTTP and gRPC, alongside the first
        for make, port in ((lambda: httpclient.InferenceServerClient(s.url), s.http_port),
                           (grpc_client(s), s.grpc_port)):
            for c in clients_on_every_frontend(s, make, port):
                c.close()
        # frontend 0, which also serves /metrics: its successor has the same port
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: len(frontend_pids(s)) == 2 and pids[0] not in frontend_pids(s), 30,
                 "a new frontend 0")

        def metrics_served():
            try:
                return requests.get(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                    timeout=5).status_code == 200
            except requests.RequestException:
                return False
        wait_for(metrics_served, 30, "/metrics on its port again")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        assert s.stop() == 0
    assert segments_of(s.proc.pid) == []


def test_frontends_that_keep_dying_stop_the_server_and_nothing_is_left(repo):
    """A restart does not mend a frontend that dies again and again: the sixth death within a
    minute stops the server with exit code 1, for its supervisor to start it afresh."""
    s = Server(repo, "--frontends", "2")
    try:
        tree = descendants(s.proc.pid)
        killed: list[int] = []

        def kill_one() -> bool:
            if s.proc.poll() is not None:
                return True
            for pid in frontend_pids(s):
                if pid not in killed:
                    killed.append(pid)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return False

        wait_for(kill_one, 60, "the server to give up restarting its frontends")
        assert s.proc.wait(60) == 1
        log = s.log_text()
        assert "frontends died 6 times within 60 s, which restarting them does not mend: " \
               "stopping the server" in log, log
        wait_for(lambda: not any(alive(p) for p in tree), 20, "every process of the server to exit")
    finally:
        s.stop()
    assert segments_of(s.proc.pid) == []


def test_frontends_flag_is_checked():
    out = subprocess.run(["python3", "-m", "shmserve.engine.launch.cli", "--model-repository", "/tmp",
                          "--frontends", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--frontends: must be between 1 and 64" in out.stderr
