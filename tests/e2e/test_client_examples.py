"""What Triton's Python client examples do, in our own words, against the models in configs/:
the same calls with the same arguments and the same checks (tests/compat/run_triton_examples.py
runs the real examples where their repository is at hand)."""
import os
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from serverproc import Server
from tritonclient import utils
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def srv(example_repo):
    s = Server(example_repo)
    yield s
    assert s.stop() == 0


def _strings(values):
    return np.array([str(v).encode() for v in values], dtype=np.object_).reshape(1, 16)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_string_example(srv, binary):
    # simple_http_string_infer_client: simple_string sums numbers held in strings
    c = httpclient.InferenceServerClient(srv.url)
    a, b = np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"),
              httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(_strings(a), binary_data=binary)
    inputs[1].set_data_from_numpy(_strings(b), binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    r = c.infer("simple_string", inputs, outputs=outputs)
    sums, diffs = r.as_numpy("OUTPUT0"), r.as_numpy("OUTPUT1")
    for i in range(16):
        assert int(sums[0][i]) == a[i] + b[i] and int(diffs[0][i]) == a[i] - b[i]
    # then simple_identity with NUL characters and with raw bytes, binary and JSON
    for data in (np.array(["he\x00llo".encode()] * 16, dtype=np.object_).reshape(1, 16),
                 np.array([b"\x00\x01\x02\x03"] * 16, dtype=np.bytes_).reshape(1, 16)):
        i = httpclient.InferInput("INPUT0", [1, 16], "BYTES")
        i.set_data_from_numpy(data, binary_data=binary)
        out = c.infer("simple_identity", [i], outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]).as_numpy("OUTPUT0")
        # JSON carries strings, which tritonclient hands back as str
        got = [x if isinstance(x, bytes) else str(x).encode() for x in out.flatten()]
        assert got == [bytes(x) for x in data.flatten()]


def test_grpc_string_example(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "BYTES"),
              grpcclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(_strings(range(16)))
    inputs[1].set_data_from_numpy(_strings([1] * 16))
    r = c.infer("simple_string", inputs)
    assert [int(x) for x in r.as_numpy("OUTPUT0")[0]] == [i + 1 for i in range(16)]
    assert [int(x) for x in r.as_numpy("OUTPUT1")[0]] == [i - 1 for i in range(16)]


def _raw_request(model, datatype, fill):
    request = service_pb2.ModelInferRequest(model_name=model, model_version="")
    for name, values in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
        t = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        fill(t.contents, values)
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


def test_grpc_explicit_contents_examples(srv):
    # grpc_explicit_{byte,int8,int}_content_client: raw stubs, tensors in `contents`
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        r = stub.ModelInfer(_raw_request(
            "simple_string", "BYTES", lambda c, v: c.bytes_contents.extend(str(x).encode() for x in v)))
        got = [utils.deserialize_bytes_tensor(raw) for raw in r.raw_output_contents]
        assert [int(x) for x in got[0]] == [i + 1 for i in range(16)]
        assert [int(x) for x in got[1]] == [i - 1 for i in range(16)]
        for model, datatype, dtype in (("simple_int8", "INT8", np.int8),
                                       ("simple", "INT32", np.int32)):
            r = stub.ModelInfer(_raw_request(model, datatype, lambda c, v: c.int_contents.extend(v)))
            assert len(r.raw_output_contents) == 2
            np.testing.assert_array_equal(np.frombuffer(r.raw_output_contents[0], dtype),
                                          np.arange(16) + 1)
            np.testing.assert_array_equal(np.frombuffer(r.raw_output_contents[1], dtype),
                                          np.arange(16) - 1)


def test_int8_wraps_like_int8(srv):
    c = httpclient.InferenceServerClient(srv.url)
    a = np.array([[127, -128] + [0] * 14], dtype=np.int8)
    b = np.array([[1, 1] + [0] * 14], dtype=np.int8)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT8"),
              httpclient.InferInput("INPUT1", [1, 16], "INT8")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    r = c.infer("simple_int8", inputs)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0")[0][:2], [-128, -127])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1")[0][:2], [126, 127])


def test_grpc_shm_string_example(srv):
    # simple_grpc_shm_string_client: serialized strings in system shared memory, both ways
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    c.unregister_system_shared_memory()
    a, b = _strings(range(16)).flatten(), _strings([1] * 16).flatten()
    ser = [utils.serialize_byte_tensor(x) for x in (a, b)]
    sums = utils.serialize_byte_tensor(np.array([str(i + 1).encode() for i in range(16)],
                                                dtype=np.object_))
    key = f"/ex_shm_{os.getpid()}"
    sizes = [utils.serialized_byte_size(s) for s in ser]
    out_size = utils.serialized_byte_size(sums)
    handles = [shm.create_shared_memory_region(f"in{i}", f"{key}_in{i}", sizes[i])
               for i in range(2)]
    handles += [shm.create_shared_memory_region(f"out{i}", f"{key}_out{i}", out_size + 16)
                for i in range(2)]
    try:
        for i in range(2):
            shm.set_shared_memory_region(handles[i], [ser[i]])
            c.register_system_shared_memory(f"in{i}", f"{key}_in{i}", sizes[i])
            c.register_system_shared_memory(f"out{i}", f"{key}_out{i}", out_size + 16)
        inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "BYTES") for i in range(2)]
        for i in range(2):
            inputs[i].set_shared_memory(f"in{i}", sizes[i])
        outputs = [grpcclient.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
        for i in range(2):
            outputs[i].set_shared_memory(f"out{i}", out_size + 16)
        r = c.infer("simple_string", inputs, outputs=outputs)
        o0 = r.get_output("OUTPUT0")
        got = shm.get_contents_as_numpy(handles[2], utils.triton_to_np_dtype(o0.datatype),
                                        o0.shape)
        assert [int(x) for x in got.flatten()] == [i + 1 for i in range(16)]
        assert len(c.get_system_shared_memory_status().regions) == 4
    finally:
        c.unregister_system_shared_memory()
        for h in handles:
            shm.destroy_shared_memory_region(h)


def test_grpc_custom_args_and_headers_example(srv):
    # simple_grpc_custom_args_client / keepalive client: channel arguments and custom headers
    args = [("grpc.max_send_message_length", 1024 * 1024),
            ("grpc.max_receive_message_length", 1024 * 1024),
            ("grpc.keepalive_time_ms", 2 ** 31 - 1), ("grpc.keepalive_timeout_ms", 20000),
            ("grpc.keepalive_permit_without_calls", False),
            ("grpc.http2.max_pings_without_data", 2)]
    c = grpcclient.InferenceServerClient(srv.grpc_url, channel_args=args)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    r = c.infer("simple", inputs, headers={"test": "1"})
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + 1)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - 1)


@pytest.fixture
def explicit_srv(tmp_path, example_repo):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(example_repo, "simple"), repo / "simple")
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model=simple")
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_model_control_example(explicit_srv, client_mod):
    # simple_{http,grpc}_model_control: reload with a broken override, then with one that sets
    # only max_batch_size (the model fills in its inputs and outputs), unload, a missing model
    url = explicit_srv.url if client_mod is httpclient else explicit_srv.grpc_url
    c = client_mod.InferenceServerClient(url)
    c.load_model("simple")
    assert c.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        c.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    c.load_model("simple", config='{"max_batch_size":"16"}')
    cfg = c.get_model_config("simple")
    cfg = cfg if client_mod is httpclient else \
        {"max_batch_size": cfg.config.max_batch_size, "input": cfg.config.input}
    assert cfg["max_batch_size"] == 16 and len(cfg["input"]) == 2
    inputs = [client_mod.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
    for i in inputs:
        i.set_data_from_numpy(np.full((1, 16), 3, dtype=np.int32))
    np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"),
                                  np.full((1, 16), 6, dtype=np.int32))
    c.unload_model("simple")
    assert not c.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        c.load_model("wrong_model_name")


def test_grpc_client_example_on_densenet_onnx(srv):
    # grpc_client.py: health, metadata and config of densenet_onnx, then one raw infer of a
    # [3, 224, 224] FP32 image given as 602,112 raw bytes
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name="densenet_onnx")).ready
        meta = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="densenet_onnx"))
        assert [(i.name, list(i.shape)) for i in meta.inputs] == [("data_0", [3, 224, 224])]
        cfg = stub.ModelConfig(service_pb2.ModelConfigRequest(name="densenet_onnx")).config
        assert cfg.output[0].label_filename == "labels.txt"
        request = service_pb2.ModelInferRequest(model_name="densenet_onnx", id="my request id")
        request.inputs.add(name="data_0", datatype="FP32", shape=[3, 224, 224])
        request.outputs.add(name="fc6_1")
        request.raw_input_contents.append(b"a" * 602112)
        r = stub.ModelInfer(request)
        assert r.id == "my request id" and list(r.outputs[0].shape) == [12]
        probabilities = np.frombuffer(r.raw_output_contents[0], np.float32)
        assert abs(float(probabilities.sum()) - 1.0) < 1e-4        # a softmax


def test_image_client_classification_on_densenet_onnx(srv):
    # image_client.py -m densenet_onnx -c 3 -s INCEPTION: a red picture scaled to [-1, 1]
    c = httpclient.InferenceServerClient(srv.url)
    image = np.empty((3, 224, 224), dtype=np.float32)
    image[0], image[1], image[2] = 1.0, -1.0, -1.0
    i = httpclient.InferInput("data_0", [3, 224, 224], "FP32")
    i.set_data_from_numpy(image)
    out = c.infer("densenet_onnx", [i], outputs=[
        httpclient.InferRequestedOutput("fc6_1", class_count=3)]).as_numpy("fc6_1")
    first = out[0].decode().split(":")
    assert out.shape == (3,) and first[1:] == ["3", "red"]


def test_bls_simple_calls_simple_through_the_scheduler(srv):
    c = httpclient.InferenceServerClient(srv.url)
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    ins = [httpclient.InferInput(n, s, "INT32") for n, s in
           (("INPUT0", [1, 16]), ("INPUT1", [1, 16]), ("SCALE", [1]))]
    ins[0].set_data_from_numpy(x)
    ins[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    ins[2].set_data_from_numpy(np.array([10], dtype=np.int32))
    r = c.infer("bls_simple", ins)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), (x + 1) * 10)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), (x - 1) * 10)
    stats = c.get_inference_statistics("simple")["model_stats"][0]
    assert int(stats["inference_count"]) >= 1          # simple ran it, and counted it


def _image_file(rgb, fmt: str) -> bytes:
    import io

    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (160, 120), rgb).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_image_client_on_preprocess_inception_ensemble(srv, protocol):
    # ensemble_image_client.py -c 3 <folder>: encoded image files as BYTES [batch, 1] into the
    # ensemble, whose first step decodes them and whose second classifies them; class_count
    # on the ensemble's output
    files = [_image_file((250, 10, 10), "JPEG"), _image_file((10, 10, 250), "PNG")]
    data = np.array([[f] for f in files], dtype=np.object_)
    mod = httpclient if protocol == "http" else grpcclient
    c = mod.InferenceServerClient(srv.url if protocol == "http" else srv.grpc_url)
    meta = c.get_model_metadata("preprocess_inception_ensemble")
    cfg = c.get_model_config("preprocess_inception_ensemble")
    if protocol == "grpc":
        assert meta.platform == "ensemble" and cfg.config.max_batch_size == 8
        assert [s.model_name for s in cfg.config.ensemble_scheduling.step] == \
            ["image_preprocess", "classifier_onnx"]
    else:
        assert meta["platform"] == "ensemble" and cfg["max_batch_size"] == 8
    i = mod.InferInput("INPUT", list(data.shape), "BYTES")
    i.set_data_from_numpy(data)
    out = c.infer("preprocess_inception_ensemble", [i],
                  outputs=[mod.InferRequestedOutput("OUTPUT", class_count=3)]).as_numpy("OUTPUT")
    assert out.shape == (2, 3)
    assert [row[0].decode().split(":")[2] for row in out] == ["red", "blue"]
    # a file that is no image fails in the first step, which the error names
    bad = mod.InferInput("INPUT", [1, 1], "BYTES")
    bad.set_data_from_numpy(np.array([[b"not an image"]], dtype=np.object_))
    with pytest.raises(InferenceServerException,
                       match=r"in ensemble 'preprocess_inception_ensemble', step 0 \(model "
                             r"'image_preprocess'\): cannot decode the image"):
        c.infer("preprocess_inception_ensemble", [bad])
