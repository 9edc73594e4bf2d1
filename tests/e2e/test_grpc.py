"""gRPC (inference.GRPCInferenceService and grpc.health.v1) with tritonclient.grpc, sync and aio."""
import asyncio
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _simple_inputs():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", a.shape, "INT32"), grpcclient.InferInput("INPUT1", b.shape, "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return a, b, inputs


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "5")
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("no_such_model")
    assert "NOT_FOUND" in str(e.value.status())
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("simple", "x")
    assert "INVALID_ARG" in str(e.value.status())
    meta = client.get_server_metadata()
    assert meta.name == "shmserve-test" and "system_shared_memory" in meta.extensions
    m = client.get_model_metadata("simple")
    assert m.platform == "python" and list(m.inputs[0].shape) == [-1, 16]
    cfg = client.get_model_config("mlp_onnx").config
    assert cfg.max_batch_size == 64 and cfg.instance_group[0].count == 2
    assert cfg.backend == "onnxruntime"
    as_json = client.get_model_config("simple", as_json=True)
    assert as_json["config"]["name"] == "simple"


def test_grpc_health_service(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_infer_raw_contents(client):
    a, b, inputs = _simple_inputs()
    res = client.infer("simple", inputs, request_id="g-1",
                       outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    assert res.get_response().id == "g-1" and [o.name for o in res.get_response().outputs] == ["OUTPUT1"]


def _typed_request(model, name, datatype, shape, field, values):
    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add(name=name, datatype=datatype, shape=shape)
    getattr(t.contents, field).extend(values)
    return req


@pytest.mark.parametrize("wire, field, values", [
    ("INT32", "int_contents", [1, -2, 3]), ("INT64", "int64_contents", [2 ** 40, -1, 0]),
    ("UINT8", "uint_contents", [0, 7, 255]), ("UINT64", "uint64_contents", [2 ** 63, 1, 2]),
    ("FP32", "fp32_contents", [1.5, -2.25, 0.0]), ("FP64", "fp64_contents", [1e300, 2.0, -3.0]),
    ("BOOL", "bool_contents", [True, False, True]), ("BYTES", "bytes_contents", [b"a", b"", b"xyz"]),
])
def test_typed_contents_are_accepted(server, wire, field, values):
    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        resp = stub.ModelInfer(_typed_request(f"id_{wire.lower()}", "INPUT0", wire, [1, 3], field, values),
                               timeout=30)
    assert len(resp.raw_output_contents) == 1          # outputs always come back raw
    raw = resp.raw_output_contents[0]
    if wire == "BYTES":
        from shmserve.ipc.dtypes import deserialize_bytes
        assert list(deserialize_bytes(raw)) == values
    else:
        from shmserve.ipc.dtypes import WIRE_TO_NUMPY
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=WIRE_TO_NUMPY[wire]),
                                      np.array(values, dtype=WIRE_TO_NUMPY[wire]))


def test_typed_and_raw_together_is_refused(server):
    req = _typed_request("id_int32", "INPUT0", "INT32", [1, 3], "int_contents", [1, 2, 3])
    req.raw_input_contents.append(np.array([1, 2, 3], dtype=np.int32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "contents field must not be specified" in e.value.details()


@pytest.mark.parametrize("mutate, code, text", [
    (lambda r: setattr(r, "model_name", "nope"), "NOT_FOUND", "unknown model: 'nope'"),
    (lambda r: setattr(r, "model_version", "x"), "INVALID_ARGUMENT", "'x'"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 8), "INVALID_ARGUMENT", "byte size mismatch for input 'INPUT0'"),
    (lambda r: setattr(r.inputs[0], "datatype", "FP32"), "INVALID_ARGUMENT", "data-type is 'FP32'"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 10), "INVALID_ARGUMENT", "Expected 64, got 10"),
    (lambda r: r.raw_input_contents.pop(), "INVALID_ARGUMENT", "unable to find data for input tensor"),
    (lambda r: r.raw_input_contents.append(b"\0" * 64), "INVALID_ARGUMENT", "raw_input_contents"),
    (lambda r: (r.inputs.pop(), r.raw_input_contents.pop()), "INVALID_ARGUMENT", "missing required input(s) ['INPUT1']"),
])
def test_bad_requests_map_to_status_codes(server, mutate, code, text):
    a = np.zeros((1, 16), dtype=np.int32)
    req = service_pb2.ModelInferRequest(model_name="simple")
    for n in ("INPUT0", "INPUT1"):
        req.inputs.add(name=n, datatype="INT32", shape=[1, 16])
        req.raw_input_contents.append(a.tobytes())
    mutate(req)
    with grpc.insecure_channel(server.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code().name == code
    assert text in e.value.details()


def test_stream_answers_in_order_and_reports_errors(server):
    results = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(20):
            x = np.full((1, 4), i, dtype=np.float32)
            inp = grpcclient.InferInput("INPUT0", x.shape, "FP32")
            inp.set_data_from_numpy(x)
            if i == 7:   # a bad one in the middle: wrong model version
                c.async_stream_infer("identity_fp32", [inp], request_id=str(i), model_version="9")
            else:
                c.async_stream_infer("identity_fp32", [inp], request_id=str(i))
        got = [results.get(timeout=30) for _ in range(20)]
    finally:
        c.stop_stream()
        c.close()
    for i, (result, error) in enumerate(got):
        if i == 7:
            assert result is None and "version 9" in str(error)
        else:
            assert error is None
            assert result.get_response().id == str(i)
            assert result.as_numpy("OUTPUT0")[0, 0] == i


def test_aio_client(server):
    async def run():
        c = aioclient.InferenceServerClient(server.grpc_url)
        try:
            assert await c.is_server_ready()
            tasks = []
            for i in range(16):
                x = np.full((1, 8), i, dtype=np.float32)
                inp = aioclient.InferInput("INPUT0", x.shape, "FP32")
                inp.set_data_from_numpy(x)
                tasks.append(c.infer("identity_fp32", [inp]))
            results = await asyncio.gather(*tasks)
            return [r.as_numpy("OUTPUT0")[0, 0] for r in results]
        finally:
            await c.close()
    assert asyncio.run(run()) == list(range(16))


def test_large_tensor_over_grpc(client):
    x = np.random.default_rng(1).standard_normal((1, 1 << 20)).astype(np.float32)   # 4 MiB
    inp = grpcclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)


def test_repository_rpcs(client):
    idx = {m.name: m for m in client.get_model_repository_index().models}
    assert idx["simple"].state == "READY" and idx["simple"].version == "1"
    with pytest.raises(InferenceServerException) as e:
        client.load_model("simple")
    assert "polling is enabled" in e.value.message()
    stats = client.get_inference_statistics("simple").model_stats
    assert [(s.name, s.version) for s in stats] == [("simple", "1")]
    with pytest.raises(InferenceServerException) as e:
        client.get_inference_statistics("no_such_model")
    assert "is not available" in e.value.message()
