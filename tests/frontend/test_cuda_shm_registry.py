"""CUDA shared memory from clients, in the frontend: registering a CUDA IPC handle (checked as
Triton checks it: opened once on its GPU, the allocation's size read, closed again), status,
unregister (which tells workers which handles to close), one namespace with system regions
shared by every frontend, and resolving tensors into CUDA regions. Runs on CPU against
fake_cuda (a fake of cuda-python's driver bindings) or with cuda-python missing; the same
through a real server: tests/e2e/test_cuda_shm_cpu.py, and on a GPU tests/e2e/test_cuda_shm_gpu.py."""
import base64
import json
import os
import sys
import uuid

import grpc
import pytest
from frontend_fakes import FakeClient, http, make_service, rpc
from tritonclient.grpc import service_pb2 as pb

from shmserve.frontend.grpc.service import InferenceService
from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.shm.regions import CudaRegion, RegionTable, SystemRegion
from shmserve.frontend.shm.registry import ShmRegistry, raw_handle_from_json
from shmserve.ipc.errors import InferError
from shmserve.ipc.gpu import device as gpu
from shmserve.ipc.messages.common import CudaRef, ErrorCode, ShmRef

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import fake_cuda  # noqa: E402


@pytest.fixture
def drv(monkeypatch):
    return fake_cuda.install(monkeypatch, devices=2)


@pytest.fixture
def segment():
    name = f"cudashmtest_{uuid.uuid4().hex}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    yield name
    os.unlink(f"/dev/shm/{name}")


def refused(code: ErrorCode, call, *args, **kw) -> str:
    with pytest.raises(InferError) as e:
        call(*args, **kw)
    assert e.value.code == code, e.value.message
    return e.value.message


def b64(raw: bytes) -> dict:
    return {"b64": base64.b64encode(raw).decode()}


# ---- registration --------------------------------------------------------------------------------
def test_register_opens_the_handle_once_checks_the_size_and_closes_it(drv):
    handle, _ = drv.export(4096)
    reg = ShmRegistry()
    region = reg.register_cuda("c", handle, 1, 4096)
    assert region == reg.regions["c"] and type(region) is CudaRegion
    assert (region.handle, region.device_id, region.byte_size) == (handle, 1, 4096)
    assert [c for c in drv.calls if c.startswith(("cuIpc", "cuMemGetAddressRange"))] == \
        ["cuIpcOpenMemHandle", "cuMemGetAddressRange", "cuIpcCloseMemHandle"]
    assert drv.ipc_open == {}                   # the frontend keeps nothing open
    assert reg.status_cuda("") == [{"name": "c", "device_id": 1, "byte_size": 4096}]
    assert reg.status_cuda("c") == reg.status_cuda("")
    assert reg.status_system("") == []
    # a part of the allocation is a region too (Triton checks byte_size <= the allocation)
    reg.register_cuda("part", handle, 1, 100)


def test_a_handle_from_http_json(drv):
    handle, _ = drv.export(64)
    assert raw_handle_from_json("c", b64(handle)) == handle
    ShmRegistry().register_cuda("c", b64(handle), 0, 64)


@pytest.mark.parametrize("raw, words", [
    (None, "Shared memory register request has no 'raw_handle' field (region 'c')"),
    ({"b64": "!!not base64!!"}, "'raw_handle.b64' is not valid base64"),
    ({"b64": "QUJ"}, "'raw_handle.b64' is not valid base64"),
    ({"b64": base64.b64encode(b"x" * 63).decode()}, "'raw_handle' has 63 bytes, a CUDA IPC handle has 64"),
    ({"b64": ""}, "'raw_handle' has 0 bytes"),
    (b"x" * 65, "'raw_handle' has 65 bytes"),
    ({"base64": "AAAA"}, "'raw_handle' must be an object {\"b64\""),
    ("AAAA", "'raw_handle' must be an object"),
])
def test_malformed_handles_name_the_field(drv, raw, words):
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", raw, 0, 64)
    assert words in text
    if raw is not None:     # Triton's HTTP words; one of the wrong size has its gRPC words first
        assert "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t" in text
        assert text.startswith("failed to register shared memory region 'c': invalid args") == \
            ("bytes, a CUDA IPC handle has" in text)
    assert "cuIpcOpenMemHandle" not in drv.calls


@pytest.mark.parametrize("device, size, words", [
    (0, -1, "cuda shared memory region 'c': 'byte_size' must be a non-negative integer, got -1"),
    (0, None, "Shared memory register request has no 'byte_size' field (region 'c')"),
    (0, "64", "'byte_size' must be a non-negative integer, got '64'"),
    (None, 64, "Shared memory register request has no 'device_id' field (region 'c')"),
    (-1, 64, "'device_id' must be a non-negative integer, got -1"),
    (True, 64, "'device_id' must be a non-negative integer, got True"),
    (2, 64, "'device_id' 2 is not a GPU of this server (it has 2 GPUs: 0 to 1)"),
])
def test_bad_sizes_and_devices_name_the_field(drv, device, size, words):
    handle, _ = drv.export(64)
    assert words in refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", handle,
                            device, size)


def test_a_handle_that_does_not_open_or_a_region_past_the_allocation(drv):
    reg = ShmRegistry()
    text = refused(ErrorCode.INVALID_ARG, reg.register_cuda, "c", os.urandom(64), 0, 64)
    assert text.startswith("failed to register shared memory region: invalid args (region 'c': "
                           "cannot open the CUDA IPC handle on GPU 0: cuIpcOpenMemHandle failed: "
                           "CUDA_ERROR_INVALID_VALUE")
    handle, _ = drv.export(64)
    text = refused(ErrorCode.INVALID_ARG, reg.register_cuda, "c", handle, 0, 65)
    assert text == ("failed to register shared memory region 'c': invalid args (byte_size 65 "
                    "exceeds the 64 bytes of the device allocation the handle exports)")
    assert drv.ipc_open == {} and reg.regions == {}


def test_one_namespace_with_system_regions(drv, segment):
    reg = ShmRegistry()
    handle, _ = drv.export(64)
    reg.register_system("s", f"/{segment}", 0, 64)
    reg.register_cuda("c", handle, 0, 64)
    for call in (lambda: reg.register_cuda("s", handle, 0, 64),
                 lambda: reg.register_cuda("c", handle, 0, 64),
                 lambda: reg.register_system("c", f"/{segment}", 0, 64)):
        assert refused(ErrorCode.ALREADY_EXISTS, call).endswith("already in manager")
    assert refused(ErrorCode.NOT_FOUND, reg.status_system, "c") == \
        "The region named 'c' is registered as CUDA shared memory, not system shared memory"
    assert refused(ErrorCode.NOT_FOUND, reg.status_cuda, "s") == \
        "The region named 's' is registered as system shared memory, not CUDA shared memory"
    assert refused(ErrorCode.NOT_FOUND, reg.status_cuda, "x") == \
        "Unable to find cuda shared memory region: 'x'"
    assert [r["name"] for r in reg.status_system("")] == ["s"]
    assert [r["name"] for r in reg.status_cuda("")] == ["c"]
    # unregistering one kind never touches the other, by name or all at once
    assert reg.unregister_system("c") == [] and reg.unregister_cuda("s") == []
    assert reg.unregister_cuda("") == [handle]
    assert list(reg.regions) == ["s"]
    assert reg.unregister_system("") == [segment] and reg.regions == {}


def test_unregister_returns_the_handles_no_region_uses(drv):
    reg = ShmRegistry()
    h1, _ = drv.export(128)
    h2, _ = drv.export(128)
    reg.register_cuda("a", h1, 0, 128)
    reg.register_cuda("b", h1, 0, 64)           # the same allocation, another name
    reg.register_cuda("c", h2, 1, 128)
    assert reg.unregister_cuda("nope") == []    # unknown: not an error
    assert reg.unregister_cuda("a") == []       # "b" still uses h1
    assert reg.unregister_cuda("b") == [h1]
    reg.regions["c"].in_use = 1                 # a request in flight through this frontend
    assert "while requests that use them are in flight" in \
        refused(ErrorCode.INVALID_ARG, reg.unregister_cuda, "c")
    reg.regions["c"].in_use = 0
    assert reg.unregister_cuda("") == [h2] and reg.regions == {}


def test_the_service_tells_workers_which_handles_to_close(drv):
    client = FakeClient()
    svc = make_service(client)
    handle, _ = drv.export(64)
    svc.register_cuda("c", handle, 0, 64)
    assert client.forgotten_cuda == []
    svc.unregister_cuda("c")
    assert client.forgotten_cuda == [[handle]] and client.forgotten == []
    svc.unregister_cuda("c")                    # unknown now: nothing to close
    assert client.forgotten_cuda == [[handle]]


def test_only_local_clients_and_only_when_allowed(drv):
    handle, _ = drv.export(64)
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", handle, 0, 64,
                   peer="ipv4:10.1.2.3:5000")
    assert "accepted only from clients on this host (--client-shm-from=local)" in text
    ShmRegistry(local_only=False).register_cuda("c", handle, 0, 64, peer="ipv4:10.1.2.3:5000")
    off = ShmRegistry(allowed=False)
    for call in (lambda: off.register_cuda("c", handle, 0, 64), lambda: off.unregister_cuda("")):
        assert "--allow-client-shm=true" in refused(ErrorCode.UNSUPPORTED, call)


# ---- without a GPU, or without cuda-python --------------------------------------------------------
def test_without_cuda_python(monkeypatch):
    fake_cuda.uninstall(monkeypatch)
    monkeypatch.setattr(gpu, "_nvml_count", lambda: None)
    monkeypatch.setattr(gpu, "_proc_count", lambda: None)
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", b"\0" * 64, 0, 64)
    assert text.startswith("failed to register CUDA shared memory region: 'c', GPUs not "
                           "supported (CUDA shared memory needs a GPU that CUDA can use and "
                           "cuda-python on the server: no NVIDIA driver")
    assert "cuda-python is not installed" in text


def test_gpus_but_no_cuda_python(monkeypatch):
    fake_cuda.uninstall(monkeypatch)
    monkeypatch.setattr(gpu, "_nvml_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", b"\0" * 64, 0, 64)
    assert "GPUs not supported" in text
    assert "this machine has 2 GPUs, but cuda-python is not installed" in text


def test_cuda_python_but_no_gpu(monkeypatch):
    fake_cuda.install(monkeypatch, devices=0)
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", b"\0" * 64, 0, 64)
    assert "GPUs not supported" in text and "finds no CUDA device" in text


def test_a_faked_device_count(monkeypatch):
    """The count alone decides what is refused before any CUDA call."""
    monkeypatch.setattr(gpu, "driver_device_count", lambda: (1, ""))
    text = refused(ErrorCode.INVALID_ARG, ShmRegistry().register_cuda, "c", b"\0" * 64, 3, 64)
    assert "'device_id' 3 is not a GPU of this server (it has 1 GPU: 0 to 0)" in text


# ---- tensors in CUDA regions ----------------------------------------------------------------------
def test_resolve_gives_a_cuda_reference_with_system_regions_texts(drv, segment):
    reg = ShmRegistry()
    handle, _ = drv.export(256)
    reg.register_cuda("c", handle, 1, 256)
    region, ref = reg.resolve("c", 64, 128, "input 'X'")
    assert region is reg.regions["c"] and ref == CudaRef(handle, 1, 128, 64)
    reg.register_system("s", f"/{segment}", 16, 48)
    assert reg.resolve("s", 8, 8, "input 'X'")[1] == ShmRef(segment, 24, 8)
    for args, words in [
        (("c", 64, 256), "input 'X': Invalid offset for shared memory region: 'c'"),
        (("c", 200, 100), "input 'X': Invalid offset + byte size for shared memory region: 'c'"),
        (("c", 2 ** 64 - 1, 1), "input 'X': Integer overflow detected"),
        (("c", None, 0), "input 'X': shared_memory_byte_size must be given"),
    ]:
        assert refused(ErrorCode.INVALID_ARG, reg.resolve, *args, "input 'X'").startswith(words)
    assert refused(ErrorCode.NOT_FOUND, reg.resolve, "nope", 8, 0, "input 'X'") == \
        "Unable to find shared memory region: 'nope' (input 'X')"


# ---- one table for every frontend ------------------------------------------------------------------
def test_cuda_regions_are_shared_by_frontends_with_their_own_in_use_counts(drv, tmp_path):
    path = str(tmp_path / "client-shm")
    a, b = ShmRegistry(table=RegionTable(path)), ShmRegistry(table=RegionTable(path))
    handle, _ = drv.export(64)
    a.register_cuda("c", handle, 0, 64)
    assert b.status_cuda("") == [{"name": "c", "device_id": 0, "byte_size": 64}]
    assert refused(ErrorCode.ALREADY_EXISTS, b.register_cuda, "c", handle, 0, 64)
    held = b.regions["c"]
    held.in_use = 1                             # b's request in flight
    with a.table.change() as t:                 # another change elsewhere: b's region object stays
        t["s"] = SystemRegion("s", "/k", 0, 1, "k")
    assert b.regions["c"] is held and held.in_use == 1
    assert a.unregister_cuda("c") == [handle]   # a has nothing in flight
    assert "c" not in b.regions and list(b.regions) == ["s"]


# ---- HTTP and gRPC -------------------------------------------------------------------------------
def test_http_and_grpc_register_status_unregister(drv):
    client = FakeClient()
    svc = make_service(client)
    app, grpc_svc = KServeHttpApp(svc, 1 << 20), InferenceService(svc)
    h1, _ = drv.export(64)
    h2, _ = drv.export(128)
    body = json.dumps({"raw_handle": b64(h1), "device_id": 0, "byte_size": 64}).encode()
    assert http(app, "POST", "/v2/cudasharedmemory/region/h/register", body)[0] == 200
    resp, aborted = rpc(grpc_svc, "CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(
        name="g", raw_handle=h2, device_id=1, byte_size=128))
    assert aborted is None
    status, got, _ = http(app, "GET", "/v2/cudasharedmemory/status")
    assert status == 200 and json.loads(got) == [{"name": "h", "device_id": 0, "byte_size": 64},
                                                 {"name": "g", "device_id": 1, "byte_size": 128}]
    resp, _ = rpc(grpc_svc, "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="h"))
    assert dict(resp.regions) == {"h": pb.CudaSharedMemoryStatusResponse.RegionStatus(
        name="h", device_id=0, byte_size=64)}
    _, aborted = rpc(grpc_svc, "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="x"))
    assert aborted == (grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory region: 'x'")
    assert http(app, "POST", "/v2/cudasharedmemory/region/h/unregister")[0] == 200
    _, aborted = rpc(grpc_svc, "CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest())
    assert aborted is None
    assert client.forgotten_cuda == [[h1], [h2]]
    assert json.loads(http(app, "GET", "/v2/cudasharedmemory/status")[1]) == []


@pytest.mark.parametrize("doc, words", [
    ({"device_id": 0, "byte_size": 64}, "has no 'raw_handle' field"),
    ({"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 64}, "'raw_handle.b64' is not valid base64"),
    ({"raw_handle": b64(b"\0" * 64), "device_id": 0}, "has no 'byte_size' field"),
    ({"raw_handle": b64(b"\0" * 64), "device_id": 0, "byte_size": -5}, "'byte_size' must be a non-negative integer, got -5"),
    ({"raw_handle": b64(b"\0" * 64), "byte_size": 64}, "has no 'device_id' field"),
    ({"raw_handle": b64(b"\0" * 64), "device_id": 7, "byte_size": 64}, "'device_id' 7 is not a GPU of this server"),
])
def test_http_400_names_the_field(drv, doc, words):
    status, body, _ = http(KServeHttpApp(make_service(), 1 << 20), "POST",
                           "/v2/cudasharedmemory/region/c/register", json.dumps(doc).encode())
    assert status == 400 and words in json.loads(body)["error"]
