"""System shared memory from clients (tritonclient.utils.shared_memory) over HTTP and gRPC."""
import base64
import os
import threading
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from serverproc import Server, model_sleeping, wait_for, worker_pid
from test_data_path import ipc_metrics
from tritonclient.utils import InferenceServerException

from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.gpu import device as gpu

PROTOCOLS = ["http", "grpc"]


def make_client(server, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.url, network_timeout=120)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


class Region:
    """A client-owned segment, destroyed (unlinked) by the client at the end."""

    def __init__(self, size):
        self.name = f"r{uuid.uuid4().hex[:10]}"
        self.key = f"/shmtest_{self.name}"
        self.size = size
        self.handle = shm.create_shared_memory_region(self.name, self.key, size)

    def exists(self):
        return os.path.exists(f"/dev/shm{self.key}")

    def destroy(self):
        shm.destroy_shared_memory_region(self.handle)


@pytest.fixture
def regions():
    made = []

    def make(size):
        r = Region(size)
        made.append(r)
        return r
    yield make
    for r in made:
        r.destroy()


@pytest.fixture(params=PROTOCOLS)
def proto(request, server):
    mod, client = make_client(server, request.param)
    client.unregister_system_shared_memory()
    yield request.param, mod, client
    client.unregister_system_shared_memory()
    client.close()


def test_register_status_unregister(proto, regions):
    name, mod, c = proto
    a, b = regions(256), regions(512)
    c.register_system_shared_memory(a.name, a.key, 256)
    c.register_system_shared_memory(b.name, b.key, 256, offset=128)
    status = c.get_system_shared_memory_status()
    if name == "http":
        by_name = {s["name"]: s for s in status}
        assert by_name[b.name] == {"name": b.name, "key": b.key, "offset": 128, "byte_size": 256}
        assert [s["name"] for s in c.get_system_shared_memory_status(a.name)] == [a.name]
    else:
        assert set(status.regions) == {a.name, b.name}
        assert status.regions[b.name].offset == 128 and status.regions[b.name].byte_size == 256
    c.unregister_system_shared_memory(a.name)
    remaining = c.get_system_shared_memory_status()
    names = [s["name"] for s in remaining] if name == "http" else list(remaining.regions)
    assert names == [b.name]
    c.unregister_system_shared_memory()
    empty = c.get_system_shared_memory_status()
    assert (empty == []) if name == "http" else (len(empty.regions) == 0)
    # unregistering never unlinks what the client owns
    assert a.exists() and b.exists()


def test_inputs_and_outputs_in_regions_mixed_with_inline(proto, regions):
    _, mod, c = proto
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int32)
    inr, outr = regions(4096), regions(4096)
    shm.set_shared_memory_region(inr.handle, [a], offset=1024)
    c.register_system_shared_memory(inr.name, inr.key, 4096)
    c.register_system_shared_memory(outr.name, outr.key, 2048, offset=1024)
    i0 = mod.InferInput("INPUT0", [1, 16], "INT32")
    i0.set_shared_memory(inr.name, 64, offset=1024)
    i1 = mod.InferInput("INPUT1", [1, 16], "INT32")
    i1.set_data_from_numpy(b)                                   # inline, next to a region input
    o0 = mod.InferRequestedOutput("OUTPUT0")
    o0.set_shared_memory(outr.name, 64, offset=256)
    o1 = mod.InferRequestedOutput("OUTPUT1")                    # returned in the response
    res = c.infer("simple", [i0, i1], outputs=[o0, o1])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    # region offset 1024 + output offset 256 inside the segment
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outr.handle, np.int32, [1, 16], offset=1280), a + b)


def test_many_regions_and_large_tensors_stay_off_the_sockets(server, proto, regions):
    _, mod, c = proto
    n = 4 << 20          # 16 MiB of FP32
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.standard_normal((1, n)).astype(np.float32)
        inr, outr = regions(x.nbytes), regions(x.nbytes)
        shm.set_shared_memory_region(inr.handle, [x])
        c.register_system_shared_memory(inr.name, inr.key, x.nbytes)
        c.register_system_shared_memory(outr.name, outr.key, x.nbytes)
        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory(inr.name, x.nbytes)
        out = mod.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(outr.name, x.nbytes)
        res = c.infer("identity_fp32", [inp], outputs=[out])
        out_meta = res.get_output("OUTPUT0")                 # the data is in the region only
        if isinstance(out_meta, dict):
            assert "data" not in out_meta and "parameters" not in out_meta
        else:
            assert res.get_response().raw_output_contents[0] == b""
        np.testing.assert_array_equal(shm.get_contents_as_numpy(outr.handle, np.float32, x.shape), x)
    for (metric, process, direction), value in ipc_metrics(server).items():
        if metric == "shmserve_ipc_largest_message_bytes":
            assert value < 4 * INLINE_LIMIT, (process, direction, value)


def test_bytes_tensor_through_regions(proto, regions):
    _, mod, c = proto
    data = np.array([[b"alpha", b"", "ünï".encode()]], dtype=object)
    from tritonclient.utils import serialize_byte_tensor, serialized_byte_size
    blob = serialize_byte_tensor(data)
    size = serialized_byte_size(blob)
    inr, outr = regions(size), regions(256)
    shm.set_shared_memory_region(inr.handle, [blob])
    c.register_system_shared_memory(inr.name, inr.key, size)
    c.register_system_shared_memory(outr.name, outr.key, 256)
    inp = mod.InferInput("INPUT0", [1, 3], "BYTES")
    inp.set_shared_memory(inr.name, size)
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory(outr.name, 256)
    c.infer("id_bytes", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(outr.handle, np.object_, [1, 3])
    assert list(got.reshape(-1)) == list(data.reshape(-1))


def _expect_error(fn, text, status=("400", "StatusCode.INVALID_ARGUMENT")):
    with pytest.raises(InferenceServerException) as e:
        fn()
    assert text in e.value.message(), e.value.message()
    assert str(e.value.status()) in status, e.value.status()


def test_bad_registrations(server, proto, regions):
    _, mod, c = proto
    r = regions(128)
    _expect_error(lambda: c.register_system_shared_memory("ghost", "/shmtest_does_not_exist", 64),
                  "Unable to open shared memory region: '/shmtest_does_not_exist' (region 'ghost': "
                  "no segment with that key exists)", ("500", "StatusCode.INTERNAL"))    # as Triton
    # Triton's words (its QA matches "failed to register shared memory region.*invalid args")
    for size, offset in ((129, 0), (128, 1), (64, 100)):
        _expect_error(lambda: c.register_system_shared_memory("big", r.key, size, offset=offset),
                      "failed to register shared memory region 'big': invalid args (offset "
                      f"{offset} + byte_size {size} exceeds the 128 bytes")
    c.register_system_shared_memory(r.name, r.key, 128)
    _expect_error(lambda: c.register_system_shared_memory(r.name, r.key, 128),
                  f"shared memory region '{r.name}' already in manager",
                  ("400", "StatusCode.ALREADY_EXISTS"))
    # a large HTTP body makes the frontend put it into one of its own segments
    big = np.zeros((1, 1 << 18), dtype=np.float32)
    h = httpclient.InferenceServerClient(server.url)
    i = httpclient.InferInput("INPUT0", list(big.shape), "FP32")
    i.set_data_from_numpy(big)
    h.infer("identity_fp32", [i])
    internal = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve_{server.proc.pid}_")]
    assert internal, "the server should own segments by now"
    _expect_error(lambda: c.register_system_shared_memory("mine", "/" + internal[0], 64),
                  "server's own segments")
    assert os.path.exists("/dev/shm/" + internal[0])


def test_bad_references_in_requests(proto, regions):
    _, mod, c = proto
    r = regions(256)
    c.register_system_shared_memory(r.name, r.key, 256)

    def infer(in_region="", in_size=64, in_offset=0, out_size=None, out_region=None):
        i = mod.InferInput("INPUT0", [1, 16], "FP32")
        i.set_shared_memory(in_region or r.name, in_size, offset=in_offset)
        outs = None
        if out_size is not None:
            o = mod.InferRequestedOutput("OUTPUT0")
            o.set_shared_memory(out_region or r.name, out_size)
            outs = [o]
        return c.infer("identity_fp32", [i], outputs=outs)

    not_found = ("404", "StatusCode.NOT_FOUND")     # Triton's code for a region it does not know
    _expect_error(lambda: infer(in_region="nowhere"), "Unable to find shared memory region: 'nowhere'",
                  not_found)
    _expect_error(lambda: infer(in_offset=200),
                  f"Invalid offset + byte size for shared memory region: '{r.name}'")
    _expect_error(lambda: infer(in_offset=256),
                  f"Invalid offset for shared memory region: '{r.name}'")
    if mod is httpclient:       # JSON carries unsigned 64-bit values; gRPC's int64 cannot
        _expect_error(lambda: infer(in_offset=2 ** 64 - 32),
                      f"Invalid offset for shared memory region: '{r.name}'")
        _expect_error(lambda: infer(in_offset=32, in_size=2 ** 64 - 32),
                      "Integer overflow detected: byte_size (18446744073709551584) + offset (32) "
                      f"exceeds maximum value (18446744073709551615) for region '{r.name}'")
    _expect_error(lambda: infer(in_size=60), "byte size mismatch")
    _expect_error(lambda: infer(out_size=32), "should be at least 64 bytes")
    _expect_error(lambda: infer(out_size=64, out_region="nowhere"), "Unable to find shared memory region",
                  not_found)
    infer(out_size=64)                # and a good one still works


def test_unregister_in_use_is_refused_then_allowed(server, regions):
    c = httpclient.InferenceServerClient(server.url)
    r = regions(64)
    shm.set_shared_memory_region(r.handle, [np.ones((1, 16), dtype=np.float32)])
    c.register_system_shared_memory(r.name, r.key, 64)
    done = []

    def slow():
        cc = httpclient.InferenceServerClient(server.url, network_timeout=60)
        i = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        i.set_shared_memory(r.name, 64)
        done.append(cc.infer("pid_slow", [i], parameters={"delay_ms": 1500}))
        cc.close()

    t = threading.Thread(target=slow)
    t.start()
    wait_for(lambda: model_sleeping(server, "pid_slow"), 20, "the request to reach execute()")
    _expect_error(lambda: c.unregister_system_shared_memory(r.name), "in flight")
    t.join(30)
    assert done and done[0].as_numpy("OUTPUT0")[0, 0] == 1.0
    c.unregister_system_shared_memory(r.name)
    assert r.exists()


def test_worker_mapping_released_on_unregister(server, regions):
    c = httpclient.InferenceServerClient(server.url)
    r = regions(64)
    c.register_system_shared_memory(r.name, r.key, 64)
    i = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    i.set_shared_memory(r.name, 64)
    pid = int(c.infer("pid_slow", [i]).as_numpy("PID")[0, 0])

    def mapped():
        with open(f"/proc/{pid}/maps") as f:
            return r.key in f.read()
    assert mapped()
    c.unregister_system_shared_memory(r.name)
    wait_for(lambda: not mapped(), 10, "the worker to unmap the client's segment")


def test_a_worker_holds_no_descriptor_per_mapped_region(server, regions):
    """A worker maps each client segment it reads or writes, and keeps the mapping for the
    next request; before, every mapping kept a descriptor (Python's mmap holds a dup of it):
    300 regions made +300 fds in the worker. 150 here, each used for an input and an output."""
    c = httpclient.InferenceServerClient(server.url)
    made = [regions(64) for _ in range(151)]
    for r in made:
        c.register_system_shared_memory(r.name, r.key, 64)

    def through(r):
        i = httpclient.InferInput("INPUT0", [1, 8], "FP32")
        i.set_shared_memory(r.name, 32)
        o = httpclient.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory(r.name, 32, offset=32)
        c.infer("id_fp32", [i], outputs=[o])
    try:
        through(made[0])                # the worker is up, its own descriptors open
        pid = worker_pid(server, "id_fp32")
        before = len(os.listdir(f"/proc/{pid}/fd"))
        for r in made[1:]:
            through(r)
        with open(f"/proc/{pid}/maps") as f:
            mapped = sum(r.key in line for line in f for r in made[-10:])
        assert mapped >= 10             # the mappings are kept (the worker did map them)
        grown = len(os.listdir(f"/proc/{pid}/fd")) - before
        assert grown < 20
    finally:
        c.unregister_system_shared_memory()


def test_cuda_shared_memory_needs_a_gpu(server):
    """More in test_cuda_shm_cpu.py; with a GPU: test_cuda_shm_gpu.py."""
    if gpu.driver_device_count()[0]:
        pytest.skip("this machine has a GPU and cuda-python")
    handle = base64.b64encode(b"\0" * 64)      # what cuda_shared_memory.get_raw_handle gives
    h = httpclient.InferenceServerClient(server.url)
    _expect_error(lambda: h.register_cuda_shared_memory("c0", handle, 0, 64),
                  "failed to register CUDA shared memory region: 'c0', GPUs not supported")
    assert h.get_cuda_shared_memory_status() == []
    g = grpcclient.InferenceServerClient(server.grpc_url)
    _expect_error(lambda: g.register_cuda_shared_memory("c0", handle, 0, 64),
                  "failed to register CUDA shared memory region: 'c0', GPUs not supported")
    assert len(g.get_cuda_shared_memory_status().regions) == 0


def test_client_shm_can_be_disabled(example_repo, regions):
    srv = Server(example_repo, "--allow-client-shm", "false")
    try:
        r = regions(64)
        c = httpclient.InferenceServerClient(srv.url)
        _expect_error(lambda: c.register_system_shared_memory(r.name, r.key, 64), "disabled",
                      ("501",))
    finally:
        assert srv.stop() == 0
