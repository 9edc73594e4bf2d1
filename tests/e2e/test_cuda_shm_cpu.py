"""CUDA shared memory from clients through a real server, on a machine without a GPU.

1. As this machine is (no GPU, no cuda-python): tritonclient's register over HTTP and gRPC is a
   400 that says CUDA shared memory needs a GPU and cuda-python, and why; a malformed request is a
   400 naming its field; status is empty, unregister is no error, and the server keeps serving.
2. With a fake cuda-python in the server's processes (tests/e2e/fake_cuda_python: its IPC handles
   name POSIX shared-memory segments, so client, frontends and workers reach the same bytes):
   the whole path, over two frontends: register (checked by opening the handle once), status,
   inputs and outputs in CUDA regions for a python and an onnxruntime model over HTTP and gRPC,
   Triton's texts for bad ranges, and unregister closing the workers' handles.

The real thing on a GPU: tests/e2e/test_cuda_shm_gpu.py (marked gpu)."""
from __future__ import annotations

import base64
import mmap
import os
import sys
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import REPO_ROOT, Server, connections, descendants, frontend_pids, wait_for
from tritonclient.utils import InferenceServerException

from shmserve.ipc.gpu import device as gpu

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "workers"))
import fake_cuda  # noqa: E402

PROTOCOLS = ["http", "grpc"]


def clients(server) -> dict:
    """A client of each protocol, each on a connection of its own (gRPC channels of one process
    share their connections unless told not to)."""
    return {"http": (httpclient, httpclient.InferenceServerClient(server.url, network_timeout=60)),
            "grpc": (grpcclient, grpcclient.InferenceServerClient(
                server.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)]))}


def refused(fn, text: str, status=("400", "StatusCode.INVALID_ARGUMENT")) -> str:
    with pytest.raises(InferenceServerException) as e:
        fn()
    assert text in e.value.message(), e.value.message()
    assert str(e.value.status()) in status, e.value.status()
    return e.value.message()


# ---- 1. this machine: no GPU, no cuda-python ------------------------------------------------------
@pytest.fixture
def no_gpu(server):
    if gpu.driver_device_count()[0]:
        pytest.skip("this machine has a GPU and cuda-python: see test_cuda_shm_gpu.py")
    return server


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_register_without_a_gpu_says_why_and_the_server_keeps_serving(no_gpu, protocol):
    mod, c = clients(no_gpu)[protocol]
    handle = base64.b64encode(b"\0" * 64)       # as cuda_shared_memory.get_raw_handle() gives it
    text = refused(lambda: c.register_cuda_shared_memory("c0", handle, 0, 64),
                   "failed to register CUDA shared memory region: 'c0', GPUs not supported "
                   "(CUDA shared memory needs a GPU that CUDA can use and cuda-python on the "
                   "server: ")
    assert "cuda-python is not installed" in text
    status = c.get_cuda_shared_memory_status()
    assert (status if protocol == "http" else list(status.regions)) == []
    c.unregister_cuda_shared_memory("c0")       # unknown: no error
    c.unregister_cuda_shared_memory()
    refused(lambda: c.get_cuda_shared_memory_status("c0"),
            "Unable to find cuda shared memory region: 'c0'", ("404", "StatusCode.NOT_FOUND"))
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [mod.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(x)
    assert (c.infer("simple", inputs).as_numpy("OUTPUT0") == 2 * x).all()


@pytest.mark.parametrize("handle, words", [
    (b"%%%", "'raw_handle.b64' is not valid base64"),
    (base64.b64encode(b"\0" * 10), "'raw_handle' has 10 bytes, a CUDA IPC handle has 64"),
    (b"", "'raw_handle' has 0 bytes"),
])
def test_malformed_handles_over_http(no_gpu, handle, words):
    c = httpclient.InferenceServerClient(no_gpu.url)
    text = refused(lambda: c.register_cuda_shared_memory("c1", handle, 0, 64), words)
    assert "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t" in text     # Triton's


def test_malformed_requests_over_grpc_and_http(no_gpu):
    g = grpcclient.InferenceServerClient(no_gpu.grpc_url)
    refused(lambda: g.register_cuda_shared_memory("c1", base64.b64encode(b"\1" * 63), 0, 64),
            "'raw_handle' has 63 bytes")
    h = httpclient.InferenceServerClient(no_gpu.url)
    handle = base64.b64encode(b"\0" * 64)
    refused(lambda: h.register_cuda_shared_memory("c1", handle, 0, -1),
            "cuda shared memory region 'c1': 'byte_size' must be a non-negative integer, got -1")
    refused(lambda: h.register_cuda_shared_memory("c1", handle, -2, 64),
            "'device_id' must be a non-negative integer, got -2")
    refused(lambda: h.register_cuda_shared_memory("c1", handle, 0, None),
            "Shared memory register request has no 'byte_size' field")
    body = b'{"device_id": 0, "byte_size": 64}'      # no handle at all
    import requests
    r = requests.post(f"{no_gpu.base}/v2/cudasharedmemory/region/c1/register", data=body, timeout=10)
    assert r.status_code == 400 and "has no 'raw_handle' field" in r.json()["error"]


# ---- 2. a fake cuda-python in the server -------------------------------------------------------------
class Segment:
    """A client's "device allocation" for the fake driver: a POSIX segment, its IPC handle."""

    def __init__(self, size: int):
        self.name = f"cudashm_{uuid.uuid4().hex[:12]}"
        self.size = size
        fd = os.open(f"/dev/shm/{self.name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.handle = fake_cuda.shm_handle(self.name)
        self.b64 = base64.b64encode(self.handle)

    def write(self, arr: np.ndarray, offset: int = 0) -> None:
        self.mem[offset:offset + arr.nbytes] = arr.tobytes()

    def read(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self.mem[offset:offset + count * np.dtype(dtype).itemsize], dtype)

    def close(self) -> None:
        self.mem.close()
        os.unlink(f"/dev/shm/{self.name}")


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    """The example repository over two frontends, every process with the fake cuda-python."""
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, "fake_cuda_python"),
                                                           env_path) if p)
    try:
        srv = Server(os.path.join(REPO_ROOT, "configs", "models"), "--frontends", "2")
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def segments():
    made: list[Segment] = []

    def make(size: int) -> Segment:
        made.append(Segment(size))
        return made[-1]
    yield make
    for s in made:
        s.close()


def mapped_by(server, segment: Segment, what: bytes) -> list[int]:
    """Processes of the server (frontends, or a model's workers) that map the segment now."""
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if what not in f.read():
                    continue
            with open(f"/proc/{pid}/maps") as f:
                if segment.name in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_register_status_unregister_with_a_fake_gpu(fake_server, segments, protocol):
    mod, c = clients(fake_server)[protocol]
    c.unregister_cuda_shared_memory()
    a, b = segments(4096), segments(256)
    c.register_cuda_shared_memory("a", a.b64, 0, 4096)
    c.register_cuda_shared_memory("b", b.b64, 0, 128)
    status = c.get_cuda_shared_memory_status()
    if protocol == "http":
        assert sorted(status, key=lambda s: s["name"]) == [
            {"name": "a", "device_id": 0, "byte_size": 4096},
            {"name": "b", "device_id": 0, "byte_size": 128}]
    else:
        assert set(status.regions) == {"a", "b"} and status.regions["b"].byte_size == 128
    # the frontends checked the handles and keep nothing open
    assert mapped_by(fake_server, a, b"shmserve.frontend.main") == []
    refused(lambda: c.register_cuda_shared_memory("a", a.b64, 0, 64),
            "shared memory region 'a' already in manager",
            ("400", "StatusCode.ALREADY_EXISTS"))
    refused(lambda: c.register_cuda_shared_memory("d", a.b64, 3, 64),
            "'device_id' 3 is not a GPU of this server (it has 1 GPU: 0 to 0)")
    refused(lambda: c.register_cuda_shared_memory("big", b.b64, 0, 257),
            "failed to register shared memory region 'big': invalid args (byte_size 257 exceeds "
            "the 256 bytes of the device allocation the handle exports)")
    refused(lambda: c.register_cuda_shared_memory("bad", base64.b64encode(b"\7" * 64), 0, 8),
            "failed to register shared memory region: invalid args (region 'bad': cannot open "
            "the CUDA IPC handle on GPU 0")
    refused(lambda: c.get_system_shared_memory_status("a"),
            "The region named 'a' is registered as CUDA shared memory, not system shared memory",
            ("404", "StatusCode.NOT_FOUND"))
    c.unregister_cuda_shared_memory("a")
    names = [s["name"] for s in c.get_cuda_shared_memory_status()] if protocol == "http" else \
        list(c.get_cuda_shared_memory_status().regions)
    assert names == ["b"]
    c.unregister_cuda_shared_memory()


def _cuda_io(mod, name: str, shape, region: str, nbytes: int, offset: int = 0, output=False):
    t = mod.InferRequestedOutput(name) if output else mod.InferInput(name, shape, "FP32")
    t.set_shared_memory(region, nbytes, offset=offset)
    return t


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_python_model_inputs_and_outputs_in_cuda_regions(fake_server, segments, protocol):
    """identity_fp32 (python): the worker copies the input to the host and the output into the
    region; the answer carries no bytes. Several connections, so both frontends serve."""
    mod, c = clients(fake_server)[protocol]
    x = np.arange(1000, dtype=np.float32).reshape(1, 1000)
    src, dst = segments(8192), segments(8192)
    src.write(x, offset=4096)
    c.register_cuda_shared_memory(f"in_{protocol}", src.b64, 0, 8192)
    c.register_cuda_shared_memory(f"out_{protocol}", dst.b64, 0, 8192)
    pids = frontend_pids(fake_server)
    port = fake_server.http_port if protocol == "http" else fake_server.grpc_port
    made = [c]
    try:
        def one_more() -> bool:
            """Infer through a new connection, until both frontends have served some."""
            k = len(made)
            m, ck = clients(fake_server)[protocol]
            made.append(ck)
            result = ck.infer("identity_fp32",
                              [_cuda_io(m, "INPUT0", [1, 1000], f"in_{protocol}", 4000, 4096)],
                              outputs=[_cuda_io(m, "OUTPUT0", None, f"out_{protocol}", 4000,
                                                offset=8 * (k % 8), output=True)])
            out = result.get_output("OUTPUT0")
            if protocol == "http":      # no bytes in the answer (Triton adds no parameters)
                assert "data" not in out and "binary_data_size" not in out.get("parameters", {})
            np.testing.assert_array_equal(dst.read(np.float32, 1000, offset=8 * (k % 8)), x[0])
            return k >= 4 and all(connections(pids, port).values())
        wait_for(one_more, 60, "requests through both frontends")
        pids = mapped_by(fake_server, src, b'"model_name":"identity_fp32"')
        assert len(pids) == 1       # the worker has the handle open
    finally:
        c.unregister_cuda_shared_memory(f"in_{protocol}")
        c.unregister_cuda_shared_memory(f"out_{protocol}")
        for ck in made:
            ck.close()
    # the worker closes the handles once the frontend says no region uses them
    wait_for(lambda: not mapped_by(fake_server, src, b'"model_name":"identity_fp32"')
             and not mapped_by(fake_server, dst, b'"model_name":"identity_fp32"'), 10,
             "the worker to close the CUDA IPC handles")


def test_onnx_model_over_grpc_with_bad_ranges_in_triton_words(fake_server, segments):
    """mlp_onnx (onnxruntime on the CPU: the input is copied to the host) against the same
    request with the tensor in the message."""
    mod, c = clients(fake_server)["grpc"]
    x = np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)
    src, dst = segments(2048), segments(4096)
    src.write(x)
    c.register_cuda_shared_memory("mlp_in", src.b64, 0, 2048)
    c.register_cuda_shared_memory("mlp_out", dst.b64, 0, 4096)
    try:
        c.infer("mlp_onnx", [_cuda_io(mod, "INPUT0", [2, 256], "mlp_in", 2048)],
                outputs=[_cuda_io(mod, "OUTPUT0", None, "mlp_out", 2048, output=True)])
        plain = mod.InferInput("INPUT0", [2, 256], "FP32")
        plain.set_data_from_numpy(x)
        want = c.infer("mlp_onnx", [plain]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(dst.read(np.float32, 512).reshape(2, 256), want, rtol=1e-6)
        for region, nbytes, offset, words in [
            ("mlp_in", 2048, 2048, "Invalid offset for shared memory region: 'mlp_in'"),
            ("mlp_in", 2048, 8, "Invalid offset + byte size for shared memory region: 'mlp_in'"),
            ("mlp_in", 1024, 0, "input byte size mismatch for input 'INPUT0' for model 'mlp_onnx'. "
                                "Expected 2048, got 1024"),
            ("nope", 2048, 0, "Unable to find shared memory region: 'nope'"),
        ]:
            # an unregistered region is NOT_FOUND, as Triton answers it
            status = ("StatusCode.NOT_FOUND",) if region == "nope" else \
                ("400", "StatusCode.INVALID_ARGUMENT")
            refused(lambda: c.infer("mlp_onnx", [_cuda_io(mod, "INPUT0", [2, 256], region,
                                                          nbytes, offset)]), words, status)
        refused(lambda: c.infer("mlp_onnx", [_cuda_io(mod, "INPUT0", [2, 256], "mlp_in", 2048)],
                                outputs=[_cuda_io(mod, "OUTPUT0", None, "mlp_out", 1024,
                                                  output=True)]),
                "should be at least 2048 bytes to hold the results")
        refused(lambda: c.unregister_cuda_shared_memory("mlp_in") or
                c.infer("mlp_onnx", [_cuda_io(mod, "INPUT0", [2, 256], "mlp_in", 2048)]),
                "Unable to find shared memory region: 'mlp_in'", ("StatusCode.NOT_FOUND",))
    finally:
        c.unregister_cuda_shared_memory()
