"""/dev/shm full and idle arena memory (issue 13), against the real server.

A server with a 16 MiB /dev/shm of its own (a private mount namespace, as Docker's default of
64 MB is in practice) answers a tensor that does not fit with a clear error: HTTP 507 and gRPC
RESOURCE_EXHAUSTED, whether the frontend cannot hold the input or the worker the output. It
stays up, still serves what fits, and gives back every page once the requests are over. And an
arena chunk that a large request left behind goes back to /dev/shm without another request.
"""
import http.client
import json
import os
import re
import threading
from unittest import mock

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oshelpers import small_shm_possible
from repo_builder import IDENTITY, write_model
from serverproc import Server, descendants, wait_for
from tritonclient.utils import InferenceServerException

from shmserve.ipc.shm import IDLE_RELEASE_ENV

MiB = 1 << 20
SHM_SIZE = 16 * MiB
MODEL = "identity"
FULL = (r"not enough shared memory: /dev/shm is full \(\d+ bytes free, \d+ needed to hold "
        r"\d+ bytes\); enlarge /dev/shm \(docker run --shm-size\)")





needs_small_shm = pytest.mark.skipif(
    not small_shm_possible(),
    reason="needs `unshare -m` and permission to mount a tmpfs (root) for a small /dev/shm")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shm_full"))
    write_model(root, MODEL, '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    ''', IDENTITY)
    return root


def start(repo: str, idle_release_s: float, prefix: tuple[str, ...] = ()) -> Server:
    with mock.patch.dict(os.environ, {IDLE_RELEASE_ENV: str(idle_release_s)}):
        return Server(repo, prefix=prefix)


@pytest.fixture(scope="module")
def small(repo):
    """A server whose /dev/shm is a 16 MiB tmpfs only it sees; chunks idle for 1 s go back."""
    srv = start(repo, 1.0, ("unshare", "-m", "sh", "-c",
                            f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$@"',
                            "sh"))
    srv.baseline = usage(srv)
    yield srv
    assert srv.stop() == 0, srv.log_text()


def server_pids(srv: Server) -> list[int]:
    return [srv.proc.pid, *descendants(srv.proc.pid)]


def usage(srv: Server) -> tuple[list[str], int, int]:
    """The server's /dev/shm as its processes see it (through /proc/<pid>/root): its segments,
    the bytes they hold, and the bytes the tmpfs has in use (pages of unlinked segments that
    are still mapped somewhere count there, not in the first two)."""
    d = f"/proc/{srv.proc.pid}/root/dev/shm"
    names, held = [], 0
    for n in os.listdir(d):
        if n.startswith(f"shmserve_{srv.proc.pid}_"):
            try:
                held += os.stat(os.path.join(d, n)).st_blocks * 512
                names.append(n)
            except FileNotFoundError:
                pass
    st = os.statvfs(d)
    return sorted(names), held, (st.f_blocks - st.f_bfree) * st.f_frsize


def deleted_mappings(srv: Server) -> list[str]:
    """Mappings of the server's segments that were already unlinked: they pin pages."""
    out = []
    for pid in server_pids(srv):
        try:
            with open(f"/proc/{pid}/maps") as f:
                out += [line.split()[-2] for line in f
                        if "/dev/shm/shmserve_" in line and line.endswith("(deleted)\n")]
        except OSError:
            continue
    return out


def all_given_back(srv: Server, timeout: float) -> None:
    wait_for(lambda: usage(srv) == srv.baseline and not deleted_mappings(srv), timeout,
             f"the server's /dev/shm to be back to {srv.baseline}")


def tensor(nbytes: int, fill: float) -> np.ndarray:
    return np.full((1, nbytes // 4), fill, dtype=np.float32)


def http_infer(srv: Server, x: np.ndarray):
    client = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    try:
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(MODEL, [inp]).as_numpy("OUTPUT0")
    finally:
        # closed by the thread that made it: collected later on another thread, its gevent
        # pool finds no hub there and says so as an unraisable exception
        client.close()


def grpc_infer(srv: Server, x: np.ndarray):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        inp = grpcclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(MODEL, [inp], client_timeout=60).as_numpy("OUTPUT0")
    finally:
        client.close()


def still_serving(srv: Server) -> None:
    assert srv.proc.poll() is None and srv.ready()
    for infer in (http_infer, grpc_infer):
        for nbytes in (1024, 1 * MiB):          # inline, and through shared memory both ways
            x = tensor(nbytes, 3.0)
            np.testing.assert_array_equal(infer(srv, x), x)


@needs_small_shm
@pytest.mark.parametrize("protocol, status", [("http", "507"),
                                              ("grpc", "StatusCode.RESOURCE_EXHAUSTED")])
def test_a_tensor_that_does_not_fit_is_a_clear_error_and_the_server_lives(small, protocol, status):
    infer = http_infer if protocol == "http" else grpc_infer
    # 10 MiB: the frontend holds the input, then the worker has no room for the output
    with pytest.raises(InferenceServerException) as e:
        infer(small, tensor(10 * MiB, 1.0))
    assert str(e.value.status()) == status
    assert re.fullmatch("failed to return outputs: " + FULL, e.value.message()), e.value.message()
    # 20 MiB: more than the whole /dev/shm, so the frontend cannot take the input
    with pytest.raises(InferenceServerException) as e:
        infer(small, tensor(20 * MiB, 2.0))
    assert str(e.value.status()) == status
    assert re.fullmatch(FULL, e.value.message()), e.value.message()
    still_serving(small)
    all_given_back(small, timeout=8)
    assert "SIGBUS" not in small.log_text()


@needs_small_shm
def test_a_refused_http_body_is_read_and_the_connection_kept(small):
    """The frontend reads a body it has no room for and answers once it is in: closing at once
    would reset a client that is still sending, which then never learns why."""
    def body(nbytes):
        inp = httpclient.InferInput("INPUT0", [1, nbytes // 4], "FP32")
        inp.set_data_from_numpy(tensor(nbytes, 1.0))
        data, json_size = httpclient.InferenceServerClient.generate_request_body([inp])
        return data, {"Inference-Header-Content-Length": str(json_size),
                      "Content-Type": "application/octet-stream"}

    conn = http.client.HTTPConnection("127.0.0.1", small.http_port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", *body(20 * MiB))
        resp = conn.getresponse()
        assert resp.status == 507 and resp.getheader("Connection") != "close"
        assert re.fullmatch(FULL, json.loads(resp.read())["error"])
        sock = conn.sock
        conn.request("POST", f"/v2/models/{MODEL}/infer", *body(1 * MiB))
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
        assert conn.sock is sock                # the same connection served the next request
    finally:
        conn.close()
    all_given_back(small, timeout=8)


@needs_small_shm
def test_concurrent_requests_that_overflow_all_get_answers(small):
    """Several 6 MiB identities at once fit one or two at a time: each one either succeeds or
    gets the error, and nothing is left behind."""
    from concurrent.futures import ThreadPoolExecutor
    xs = [tensor(6 * MiB, float(i)) for i in range(6)]

    def one(x):
        try:
            np.testing.assert_array_equal(http_infer(small, x), x)
            return "ok"
        except InferenceServerException as e:
            assert str(e.status()) == "507" and re.search(FULL, e.message()), e.message()
            return "full"

    with ThreadPoolExecutor(len(xs)) as pool:
        outcomes = list(pool.map(one, xs, timeout=60))
    assert set(outcomes) <= {"ok", "full"} and len(outcomes) == len(xs)
    still_serving(small)
    all_given_back(small, timeout=8)


def raw_identity(srv: Server, x: np.ndarray) -> None:
    """One binary HTTP request, without tritonclient's copies (it triples the time of 100 MiB)."""
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=[head, memoryview(x).cast("B")],
                     headers={"Inference-Header-Content-Length": str(len(head)),
                              "Content-Length": str(len(head) + x.nbytes)})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:500]
        hlen = int(resp.getheader("Inference-Header-Content-Length"))
        np.testing.assert_array_equal(np.frombuffer(data, np.float32, offset=hlen), x.reshape(-1))
    finally:
        conn.close()


def test_idle_chunks_go_back_to_dev_shm_without_another_request(repo):
    idle = 1.0
    srv = start(repo, idle)
    seen: list[int] = []
    done = threading.Event()

    def watch():                    # what the server holds, from before the request on
        while not done.is_set():
            seen.append(usage(srv)[1])
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    try:
        baseline = usage(srv)[:2]
        watcher.start()
        raw_identity(srv, tensor(100 * MiB, 5.0))
        # nothing is sent from here on: the frontend's timer and the worker's idle receive give
        # back the input chunk and the output chunk, and drop their mappings of each other's
        wait_for(lambda: usage(srv)[:2] == baseline and not deleted_mappings(srv),
                 idle + 5, "the 100 MiB chunks to be unlinked and unmapped")
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join(10)
        assert srv.stop() == 0, srv.log_text()
    assert max(seen) >= 200 * MiB           # both were there, and kept for reuse a while
