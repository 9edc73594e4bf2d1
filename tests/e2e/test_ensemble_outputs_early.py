"""Ensembles whose outputs come from steps before the last run worker to worker too: the last
step's worker answers with every output, whichever step made it. An output no later step reads
is written as the client asked (into its shared-memory region) by the step that makes it; one
that a later step reads, wanted in a region, takes the scheduler's path. Large outputs of
earlier steps live in their workers' slots until the frontend has read them, and then go back
to them (the last worker passes them on): none is left behind."""
import os
import re
import signal
import socket
import uuid
from unittest import mock

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import write_model
from serverproc import Server, alive, leased_requests, segments_of, wait_for, worker_pid
from test_ensemble_side_by_side import STEP, step_config
from tritonclient.utils import InferenceServerException

from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.shm import IDLE_RELEASE_ENV

OUTPUTS = ["P", "Q", "OUT"]


# P = IN + 1 (an output, and read by the join); Q = 2 * IN (an output nothing reads);
# OUT = P + IN. The steps that read IN could run side by side: light, they go worker to worker.
FAN = '''
    platform: "ensemble"
    max_batch_size: 8
    input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "P", data_type: TYPE_FP32, dims: [ -1 ] },
             { name: "Q", data_type: TYPE_FP32, dims: [ -1 ] },
             { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
    ensemble_scheduling { step [
      { model_name: "f_inc" model_version: -1 input_map { key: "X" value: "IN" }
        output_map { key: "Z" value: "P" } },
      { model_name: "f_dbl" model_version: -1 input_map { key: "X" value: "IN" }
        output_map { key: "Z" value: "Q" } },
      { model_name: "f_add" model_version: -1 input_map { key: "X" value: "P" }
        input_map { key: "Y" value: "IN" } output_map { key: "Z" value: "OUT" } } ] }
'''


def expected(x: np.ndarray) -> dict:
    return {"P": x + 1, "Q": 2 * x, "OUT": 2 * x + 1}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("fan"))
    write_model(repo, "f_inc", step_config(("X",), "-1", SHIFT=1), STEP)
    write_model(repo, "f_dbl", step_config(("X",), "-1", SCALE=2), STEP)
    write_model(repo, "f_add", step_config(("X", "Y"), "-1"), STEP)
    write_model(repo, "fan", FAN, None)
    # arena chunks nothing uses go back after 0.3 s: a slot never given back keeps its segment
    with mock.patch.dict(os.environ, {IDLE_RELEASE_ENV: "0.3"}):
        s = Server(repo)
    yield s
    assert s.stop() == 0, s.log_text()


def infer(mod, c, x: np.ndarray, outputs=None):
    i = mod.InferInput("IN", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    outs = None if outputs is None else [mod.InferRequestedOutput(n) for n in outputs]
    return c.infer("fan", [i], outputs=outs)


def check(res, x: np.ndarray, names=OUTPUTS) -> None:
    want = expected(x)
    for name in names:
        np.testing.assert_array_equal(res.as_numpy(name), want[name], err_msg=name)


def worker_to_worker(srv, c) -> None:
    """Requests one at a time until they run worker to worker (the steps' costs are looked at
    every second)."""
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    before = leased_requests(srv, "fan")

    def lent() -> bool:
        check(infer(httpclient, c, x), x)
        return leased_requests(srv, "fan") > before
    wait_for(lent, 30, "the ensemble to run worker to worker")


def shm_usage(srv) -> int:
    """How many segments the server holds in /dev/shm."""
    return len(segments_of(srv.proc.pid))


@pytest.fixture
def http(srv):
    c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    yield c
    c.close()


def test_every_output_and_any_subset_worker_to_worker(srv, http):
    worker_to_worker(srv, http)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        before = leased_requests(srv, "fan")
        for i, wanted in enumerate([None, ["Q"], ["P"], ["OUT"], ["Q", "P"], ["OUT", "Q"]] * 2):
            x = np.full((1 + i % 3, 5), float(i), dtype=np.float32)
            mod, c = (httpclient, http) if i % 2 == 0 else (grpcclient, g)
            res = infer(mod, c, x, wanted)
            check(res, x, wanted or OUTPUTS)
            for other in set(OUTPUTS) - set(wanted or OUTPUTS):
                assert res.as_numpy(other) is None, f"{other} was not asked for"
        # (a lease is renewed every 2 s: a request may take the scheduler now and then)
        assert leased_requests(srv, "fan") - before >= 9
    finally:
        g.close()


def test_large_outputs_of_earlier_steps_go_back_to_their_workers(srv, http):
    worker_to_worker(srv, http)
    wait_for(lambda: shm_usage(srv) == 0, 30, "the server's segments to go before the test")
    before = leased_requests(srv, "fan")
    most = 0
    for i in range(40):
        x = np.full((1, INLINE_LIMIT // 4 + 1000), float(i), dtype=np.float32)   # > inline
        check(infer(httpclient, http, x, None if i % 2 == 0 else ["Q", "OUT"]), x,
              OUTPUTS if i % 2 == 0 else ["Q", "OUT"])
        most = max(most, shm_usage(srv))
    assert most > 0, "the outputs should have gone through the workers' slots"
    assert leased_requests(srv, "fan") - before >= 30
    wait_for(lambda: shm_usage(srv) == 0, 30,
             "the server's segments to go after the requests: a slot not given back keeps its "
             "chunk")


class Region:
    def __init__(self, client, nbytes: int):
        self.name = f"fan{uuid.uuid4().hex[:10]}"
        self.handle = shm.create_shared_memory_region(self.name, f"/{self.name}", nbytes)
        self.client, self.nbytes = client, nbytes
        client.register_system_shared_memory(self.name, f"/{self.name}", nbytes)

    def close(self):
        self.client.unregister_system_shared_memory(self.name)
        shm.destroy_shared_memory_region(self.handle)


@pytest.mark.parametrize("name, lent", [("Q", True), ("P", False)])
def test_an_output_in_a_client_region(srv, http, name, lent):
    """Q, which nothing reads after its step, is written into the region by its own step,
    worker to worker; P, which the join reads, takes the scheduler's path, which writes it
    there at the end."""
    worker_to_worker(srv, http)
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    region = Region(http, x.nbytes)
    try:
        before = leased_requests(srv, "fan")
        for k in range(6):
            x = x + k
            i = httpclient.InferInput("IN", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            out = httpclient.InferRequestedOutput(name, binary_data=True)
            out.set_shared_memory(region.name, x.nbytes)
            res = http.infer("fan", [i], outputs=[out, httpclient.InferRequestedOutput("OUT")])
            got = shm.get_contents_as_numpy(region.handle, np.float32, list(x.shape))
            np.testing.assert_array_equal(got, expected(x)[name])
            check(res, x, ["OUT"])
        went = leased_requests(srv, "fan") - before
        assert went >= 4 if lent else went == 0, went
    finally:
        region.close()


def classes_request(x: np.ndarray, name: str) -> dict:
    i = httpclient.InferInput("IN", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return {"inputs": [i], "outputs": [httpclient.InferRequestedOutput(name, class_count=2),
                                       httpclient.InferRequestedOutput("OUT")]}


def test_an_output_as_classes(srv, http):
    """The classification extension on Q, an output of an earlier step that nothing reads
    after it: its own step ranks it, worker to worker. P, which the join reads, is refused as
    classes, as on the scheduler's path, and the ensemble serves on."""
    worker_to_worker(srv, http)
    before = leased_requests(srv, "fan")
    for k in range(6):
        x = np.array([[3.0, 1.0, 4.0, 1.5 + k]], dtype=np.float32)
        res = http.infer("fan", **classes_request(x, "Q"))
        want = expected(x)["Q"][0]
        top = np.argsort(-want, kind="stable")[:2]
        assert [c.decode().split(":")[:2] for c in res.as_numpy("Q")[0]] == \
            [[f"{want[j]:f}", str(j)] for j in top]
        check(res, x, ["OUT"])
    assert leased_requests(srv, "fan") - before >= 4
    with pytest.raises(InferenceServerException) as e:
        http.infer("fan", **classes_request(x, "P"))
    assert "'P' feeds another step" in e.value.message()
    check(infer(httpclient, http, x), x)


def test_a_region_too_small_for_an_earlier_steps_output_fails_that_request_only(srv, http):
    """Q asked into a region too small for it, worker to worker: its step refuses to write it,
    the request fails naming the step and the size, the slots the request held go back, and
    the ensemble serves on."""
    worker_to_worker(srv, http)
    x = np.full((1, INLINE_LIMIT // 4 + 1000), 2.0, dtype=np.float32)     # P's slot is held
    region = Region(http, 64)
    try:
        before = leased_requests(srv, "fan")
        for _ in range(3):
            i = httpclient.InferInput("IN", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            out = httpclient.InferRequestedOutput("Q", binary_data=True)
            out.set_shared_memory(region.name, 64)
            with pytest.raises(InferenceServerException) as e:
                http.infer("fan", [i], outputs=[out, httpclient.InferRequestedOutput("OUT")])
            assert e.value.status() == "400", e.value
            # (named as the scheduler's path names it: the step, and its model's output)
            assert "step 1 (model 'f_dbl')" in e.value.message() and \
                "(64 bytes) should be at least" in e.value.message(), e.value
        check(infer(httpclient, http, x), x)
        wait_for(lambda: leased_requests(srv, "fan") > before, 10, "worker to worker all along")
    finally:
        region.close()
    wait_for(lambda: shm_usage(srv) == 0, 30,
             "the server's segments to go: a failed request keeps no slot")


def test_slots_of_earlier_steps_go_back_though_the_last_steps_worker_died(srv, http):
    """The frontend still writes an answer whose outputs lie in three workers' slots (its client
    reads slowly) when the last step's worker dies. Each slot goes back to the worker that holds
    it, not through the dead one: the earlier workers keep none, and their chunks go."""
    worker_to_worker(srv, http)
    wait_for(lambda: shm_usage(srv) == 0, 30, "the server's segments to go before the test")
    x = np.full((1, 1 << 20), 3.0, dtype=np.float32)        # 4 MiB: 12 MiB of outputs
    i = httpclient.InferInput("IN", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in OUTPUTS]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([i], outs)
    head = (f"POST /v2/models/fan/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {json_size}\r\n\r\n").encode()
    last = worker_pid(srv, "f_add")
    before = leased_requests(srv, "fan")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # the answer waits on us
        s.settimeout(60)
        s.connect(("127.0.0.1", srv.http_port))
        s.sendall(head + body)
        got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        os.kill(last, signal.SIGKILL)
        wait_for(lambda: not alive(last), 10, "the last step's worker to die")
        header, _, rest = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", header).group(1))
        json_len = int(re.search(rb"(?i)inference-header-content-length: *(\d+)",
                                 header).group(1))
        chunks = [rest]
        n = len(rest)
        while n < length:
            chunk = s.recv(1 << 20)
            assert chunk, f"the answer ended after {n} of {length} bytes"
            chunks.append(chunk)
            n += len(chunk)
    res = httpclient.InferResult.from_response_body(b"".join(chunks), header_length=json_len)
    check(res, x)
    assert leased_requests(srv, "fan") > before, "it should have run worker to worker"
    wait_for(lambda: shm_usage(srv) == 0, 30,
             "the server's segments to go: slots of the earlier steps' workers given back")
    wait_for(lambda: worker_pid(srv, "f_add") not in (0, last), 30, "f_add's new worker")
    worker_to_worker(srv, http)
