"""The response cache against clients that write their own shared-memory regions while their
requests run: what other clients get from the cache is what the model computed, never bytes a
client wrote. A real server, tritonclient, and a thread of the test that keeps writing the
attacker's region (the attack as the security sweep ran it, scaled down)."""
import os
import threading
import uuid

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import write_model
from serverproc import Server

MODEL = """
name: "plus1"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
response_cache { enable: true }
"""
# the input is read 3 ms after the request reached the worker (a slower model's window)
CODE = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        time.sleep(0.003)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]) for x in inputs]
"""
N = 1 << 18             # floats of an output: 1 MiB, so the worker and the frontend take a while
M = 1024                # floats of a flipped input: hashed in microseconds, between two flips
ROUNDS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("poison") / "models")
    write_model(repo, "plus1", MODEL, CODE)
    s = Server(repo, "--cache-config", f"local,size={64 << 20}")
    yield s
    s.stop()


class Region:
    """A client's region, created and registered as tritonclient's utilities do, with a numpy
    view of it for the writing thread."""

    def __init__(self, client, nbytes: int):
        self.name = f"p{uuid.uuid4().hex[:12]}"
        self.handle = shm.create_shared_memory_region(self.name, f"/{self.name}", nbytes)
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR)
        try:
            import mmap
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.floats = np.frombuffer(self.map, np.float32)
        client.register_system_shared_memory(self.name, f"/{self.name}", nbytes)
        self.client = client

    def close(self):
        self.client.unregister_system_shared_memory(self.name)
        del self.floats
        self.map.close()
        shm.destroy_shared_memory_region(self.handle)


class Writer(threading.Thread):
    """Keeps writing ``values`` in turn into a region (each fills it whole, or its first
    ``span`` floats) until stopped."""

    def __init__(self, floats, span: int = 0):
        super().__init__(daemon=True)
        self.floats = floats if not span else floats[:span]
        self.values: list[np.ndarray] = []
        self.stop = threading.Event()

    def run(self):
        i = 0
        while not self.stop.wait(0.0002):
            values = self.values
            if values:
                self.floats[:] = values[i % len(values)]
                i += 1


def inline(value: float, n: int = N) -> httpclient.InferInput:
    x = httpclient.InferInput("INPUT0", [n], "FP32")
    x.set_data_from_numpy(np.full(n, value, np.float32))
    return x


def poisoned(client, value: float, n: int = N) -> bool:
    """Whether a victim asking for ``value`` inline gets anything but value + 1."""
    out = client.infer("plus1", [inline(value, n)]).as_numpy("OUTPUT0")
    return not np.array_equal(out, np.full(n, value + 1, np.float32))


def test_a_client_writing_its_output_region_cannot_poison_the_cache(server):
    """The attacker asks for X with its output in its own region and keeps overwriting the
    region: the entry must hold what the worker computed, not what the region held when the
    answer came back."""
    attacker, victim = (httpclient.InferenceServerClient(server.url) for _ in range(2))
    region = Region(attacker, N * 4)
    writer = Writer(region.floats, span=16)
    writer.values = [np.full(16, -7.0, np.float32)]
    base = float(uuid.uuid4().int % 10_000) * 16
    try:
        # without the writer, a miss still writes its answer into the region
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(region.name, N * 4)
        attacker.infer("plus1", [inline(base)], outputs=[out])
        assert np.array_equal(region.floats, np.full(N, base + 1, np.float32))
        writer.start()
        bad = 0
        for i in range(1, ROUNDS + 1):
            attacker.infer("plus1", [inline(base + i)], outputs=[out])
            bad += poisoned(victim, base + i)
        assert bad == 0, f"{bad} of {ROUNDS} victims got the attacker's bytes"
    finally:
        writer.stop.set()
        writer.join(10)
        writer.floats = None
        region.close()


def test_a_client_flipping_its_input_region_cannot_poison_the_cache(server):
    """The attacker's input is in its own region, which a thread flips between A and B while
    the requests run: the key and the computation must see the same bytes, so a victim asking
    for A (or B) gets A + 1 (B + 1), never the other one's answer or a mix."""
    attacker, victim = (httpclient.InferenceServerClient(server.url) for _ in range(2))
    region = Region(attacker, M * 4)
    writer = Writer(region.floats)
    writer.start()
    base = float(uuid.uuid4().int % 10_000) * 16 + 0.5
    bad = 0
    try:
        for i in range(ROUNDS):
            a, b = base + 2 * i, base + 2 * i + 1
            writer.values = [np.full(M, a, np.float32), np.full(M, b, np.float32)]
            x = httpclient.InferInput("INPUT0", [M], "FP32")
            x.set_shared_memory(region.name, M * 4)
            for _ in range(3):
                attacker.infer("plus1", [x])
            writer.values = []
            bad += poisoned(victim, a, M) + poisoned(victim, b, M)
        assert bad == 0, f"{bad} of {2 * ROUNDS} victims got another input's answer"
    finally:
        writer.stop.set()
        writer.join(10)
        writer.floats = None
        region.close()


def test_a_miss_whose_output_region_is_too_small_fails_in_the_workers_words(server):
    """The worker now writes a cached request's outputs into its own slots, so the frontend
    says what the worker said of a region too small; the answer is kept all the same (it is
    the model's), and its slots go back (the next requests are served)."""
    c = httpclient.InferenceServerClient(server.url)
    region = Region(c, 64)
    value = float(uuid.uuid4().int % 10_000) + 0.25
    try:
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(region.name, 64)
        before = c.get_inference_statistics("plus1")["model_stats"][0]["inference_stats"]
        with pytest.raises(Exception, match=f"should be at least {M * 4} bytes to hold the results"):
            c.infer("plus1", [inline(value, M)], outputs=[out])
        assert not poisoned(c, value, M)            # the kept answer, a hit
        after = c.get_inference_statistics("plus1")["model_stats"][0]["inference_stats"]
        assert after["cache_hit"]["count"] == before["cache_hit"]["count"] + 1
        for i in range(20):                         # served on, slots and all
            assert not poisoned(c, value + 1 + i, M)
    finally:
        region.close()
