"""CUDA shared memory from clients on a GPU, end to end (all marked gpu; bench/gpu_check.sh runs
them): regions made by tritonclient.utils.cuda_shared_memory (cudaMalloc + cudaIpcGetMemHandle in
this process), registered over HTTP and gRPC, inputs and outputs in them for an onnxruntime model
on KIND_GPU (the input bound on the device where it is), a TensorRT engine when TensorRT is
installed, and a python identity model (host copies), checked against onnxruntime on the CPU; a
64 MiB identity; a handle that does not open and a byte size past the allocation refused as
Triton refuses them. The CPU side of all this: tests/e2e/test_cuda_shm_cpu.py."""
from __future__ import annotations

import base64
import os
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from gpu_models import MLP_IO, MLP_ONNX, build_engine, ort_cuda_missing
from serverproc import REPO_ROOT, Server, wait_for
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.gpu

PROTOCOLS = ["http", "grpc"]
IDENTITY_MIB = 64


@pytest.fixture(scope="module")
def cudashm():
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as e:      # cuda-python missing
        pytest.skip(f"tritonclient's CUDA shared memory is not usable here: {e}")
    return cudashm


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory, cudashm):
    repo = str(tmp_path_factory.mktemp("cuda_shm_models"))
    models = ["identity_fp32"]
    if not ort_cuda_missing():      # without it, the python model's cases still run
        d = os.path.join(repo, "mlp_gpu", "1")
        os.makedirs(d)
        shutil.copy(MLP_ONNX, d)
        with open(os.path.join(repo, "mlp_gpu", "config.pbtxt"), "w") as f:
            f.write(f'backend: "onnxruntime"\nmax_batch_size: 64\n{MLP_IO}'
                    'instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]\n')
        models.append("mlp_gpu")
    shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", "identity_fp32"),
                    os.path.join(repo, "identity_fp32"))
    if _has_tensorrt():
        d = os.path.join(repo, "mlp_trt", "1")
        os.makedirs(d)
        build_engine(MLP_ONNX, os.path.join(d, "model.plan"), "INPUT0", (1, 256), (4, 256),
                     (16, 256))
        with open(os.path.join(repo, "mlp_trt", "config.pbtxt"), "w") as f:
            f.write(f'platform: "tensorrt_plan"\nmax_batch_size: 16\n{MLP_IO}')
        models.append("mlp_trt")
    srv = Server(repo, wait_ready=False, timeout=180)
    try:
        wait_for(lambda: all(srv.model_ready(m) for m in models), 180, f"{models} to load")
    except BaseException:
        print(srv.log_text())
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0


def client(server, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.url, network_timeout=120)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


class Regions:
    """CUDA regions this test made (destroyed, and unregistered, at the end)."""

    def __init__(self, cudashm, c):
        self.cudashm, self.c, self.made = cudashm, c, []

    def __call__(self, name: str, nbytes: int, register: bool = True):
        h = self.cudashm.create_shared_memory_region(name, nbytes, 0)
        self.made.append(h)
        if register:
            self.c.register_cuda_shared_memory(name, self.cudashm.get_raw_handle(h), 0, nbytes)
        return h

    def close(self):
        try:
            self.c.unregister_cuda_shared_memory()
        finally:
            for h in self.made:
                self.cudashm.destroy_shared_memory_region(h)


@pytest.fixture
def regions(cudashm):
    made = []

    def make(c):
        r = Regions(cudashm, c)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def _reference(x):
    import onnxruntime as ort
    return ort.InferenceSession(MLP_ONNX, providers=["CPUExecutionProvider"]).run(None, {"INPUT0": x})[0]


def _io(mod, name, shape, region, nbytes, output=False):
    t = mod.InferRequestedOutput(name) if output else mod.InferInput(name, shape, "FP32")
    t.set_shared_memory(region, nbytes)
    return t


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", ["mlp_gpu", "mlp_trt", "identity_fp32"])
def test_inputs_and_outputs_in_cuda_regions(cuda_server, cudashm, regions, protocol, model):
    if model == "mlp_trt" and not _has_tensorrt():
        pytest.skip("TensorRT's Python package (shmserve[gpu])")
    if model == "mlp_gpu" and ort_cuda_missing():
        pytest.skip(ort_cuda_missing())
    mod, c = client(cuda_server, protocol)
    make = regions(c)
    x = np.random.default_rng(7).standard_normal((4, 256), dtype=np.float32)
    hin = make(f"{model}_{protocol}_in", x.nbytes)
    hout = make(f"{model}_{protocol}_out", x.nbytes)
    cudashm.set_shared_memory_region(hin, [x])
    status = c.get_cuda_shared_memory_status(f"{model}_{protocol}_in")
    if protocol == "http":
        assert status == [{"name": f"{model}_{protocol}_in", "device_id": 0, "byte_size": x.nbytes}]
    else:
        assert status.regions[f"{model}_{protocol}_in"].byte_size == x.nbytes
    for _ in range(3):      # the worker keeps the handles open between requests
        c.infer(model, [_io(mod, "INPUT0", list(x.shape), f"{model}_{protocol}_in", x.nbytes)],
                outputs=[_io(mod, "OUTPUT0", None, f"{model}_{protocol}_out", x.nbytes, True)])
        got = cudashm.get_contents_as_numpy(hout, np.float32, list(x.shape))
        want = x if model == "identity_fp32" else _reference(x)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_64_mib_identity(cuda_server, cudashm, regions):
    mod, c = client(cuda_server, "http")
    make = regions(c)
    nbytes = IDENTITY_MIB << 20
    x = np.arange(nbytes // 4, dtype=np.float32).reshape(1, -1)
    hin, hout = make("big_in", nbytes), make("big_out", nbytes)
    cudashm.set_shared_memory_region(hin, [x])
    c.infer("identity_fp32", [_io(mod, "INPUT0", list(x.shape), "big_in", nbytes)],
            outputs=[_io(mod, "OUTPUT0", None, "big_out", nbytes, True)])
    got = cudashm.get_contents_as_numpy(hout, np.float32, list(x.shape))
    assert np.array_equal(got, x)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_registrations_triton_refuses(cuda_server, cudashm, regions, protocol):
    mod, c = client(cuda_server, protocol)
    make = regions(c)
    h = make("small", 1024, register=False)
    raw = cudashm.get_raw_handle(h)
    with pytest.raises(InferenceServerException) as e:
        c.register_cuda_shared_memory("past", raw, 0, 1 << 30)
    assert "failed to register shared memory region 'past': invalid args" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.register_cuda_shared_memory("junk", base64.b64encode(b"\7" * 64), 0, 64)
    assert "failed to register shared memory region: invalid args" in e.value.message()
    c.register_cuda_shared_memory("small", raw, 0, 1024)
    with pytest.raises(InferenceServerException) as e:
        c.register_cuda_shared_memory("small", raw, 0, 1024)
    assert "shared memory region 'small' already in manager" in e.value.message()
