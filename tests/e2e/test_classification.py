"""The classification extension end to end (docs/triton-compat.md §1.9), over HTTP (JSON and
binary outputs) and gRPC: an output asked for with ``classification`` K comes back as BYTES,
the top K entries per batch item as "<value>:<index>[:<label>]", checked against numpy. Also the
example classifier in configs/models, driven with the same calls Triton's image_client.py makes.
"""
import os
import queue
import shutil
import textwrap
import uuid

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import IDENTITY, write_model
from serverproc import REPO_ROOT, Server
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

CLASSIFIER = os.path.join(REPO_ROOT, "configs", "models", "classifier_onnx")
with open(os.path.join(CLASSIFIER, "labels.txt")) as _f:
    COLOR_LABELS = _f.read().split()
RANK_LABELS = [b"l0", b"l1", b"", b"l3"]        # index 2: an empty line, no label
ENSEMBLE_LABELS = [b"e0", b"e1", b"e2", b"e3", b"e4"]
PROTOCOLS = ["http-json", "http-binary", "grpc"]


def _write_repo(repo: str) -> None:
    shutil.copytree(CLASSIFIER, os.path.join(repo, "classifier_onnx"))
    nobatch = os.path.join(repo, "classifier_nobatch")
    shutil.copytree(CLASSIFIER, nobatch)
    with open(os.path.join(nobatch, "config.pbtxt"), "w") as f:     # densenet_onnx's shape
        f.write(textwrap.dedent('''
            name: "classifier_nobatch"
            backend: "onnxruntime"
            max_batch_size: 0
            input [ { name: "IMAGE", data_type: TYPE_FP32, format: FORMAT_NCHW,
                      dims: [ 3, 224, 224 ], reshape: { shape: [ 1, 3, 224, 224 ] } } ]
            output [ { name: "PROBABILITIES", data_type: TYPE_FP32, dims: [ 12 ],
                       reshape: { shape: [ 1, 12 ] }, label_filename: "labels.txt" } ]
        '''))
    models = {
        "rank_fp32": ("max_batch_size: 8", "TYPE_FP32", "-1", 'label_filename: "labels.txt"'),
        "rank_int32": ("max_batch_size: 0", "TYPE_INT32", "2, -1", ""),
        "rank_bytes": ("max_batch_size: 0", "TYPE_STRING", "-1", ""),
        "missing_labels": ("max_batch_size: 0", "TYPE_FP32", "-1", 'label_filename: "nope.txt"'),
        "escaping_labels": ("max_batch_size: 0", "TYPE_FP32", "-1",
                            'label_filename: "../rank_fp32/labels.txt"'),
    }
    for name, (batching, dtype, dims, labels) in models.items():
        write_model(repo, name, f'''
            backend: "python"
            {batching}
            input [ {{ name: "INPUT0", data_type: {dtype}, dims: [ {dims} ] }} ]
            output [ {{ name: "OUTPUT0", data_type: {dtype}, dims: [ {dims} ] {labels} }} ]
        ''', IDENTITY)
    with open(os.path.join(repo, "rank_fp32", "labels.txt"), "wb") as f:
        f.write(b"\n".join(RANK_LABELS) + b"\n")
    # an ensemble whose own output names a label file (Triton's old docs ensemble example has its
    # labels there): its labels, not the step model's, name the classes
    for name, labels in (("rank_ensemble", 'label_filename: "ensemble_labels.txt"'),
                         ("ensemble_no_labels_file", 'label_filename: "nope.txt"')):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(textwrap.dedent(f'''
                platform: "ensemble"
                max_batch_size: 8
                input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
                output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] {labels} }} ]
                ensemble_scheduling {{ step [
                  {{ model_name: "rank_fp32", model_version: -1,
                     input_map {{ key: "INPUT0" value: "IN" }},
                     output_map {{ key: "OUTPUT0" value: "MID" }} }},
                  {{ model_name: "rank_fp32", model_version: -1,
                     input_map {{ key: "INPUT0" value: "MID" }},
                     output_map {{ key: "OUTPUT0" value: "OUT" }} }} ] }}
            '''))
    with open(os.path.join(repo, "rank_ensemble", "ensemble_labels.txt"), "wb") as f:
        f.write(b"\n".join(ENSEMBLE_LABELS) + b"\n")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("classification"))
    _write_repo(repo)
    loads = []
    for m in ("classifier_onnx", "classifier_nobatch", "rank_fp32", "rank_int32", "rank_bytes",
              "rank_ensemble"):
        loads += ["--load-model", m]
    s = Server(repo, "--model-control-mode", "explicit", *loads)
    yield s
    s.stop()


def expected(arr: np.ndarray, k: int, batching: bool, labels=()) -> list:
    """Triton's strings for ``arr``, computed here independently: sort each item's entries by
    value (largest first, equal values in index order), print the value as C's "%f" (integers
    as digits) and append the label when there is a non-empty one."""
    rows = arr.reshape(arr.shape[0], -1) if batching else arr.reshape(1, -1)
    out = []
    for row in rows:
        ranked = sorted(enumerate(row.tolist()), key=lambda p: (-p[1], p[0]))[:k]
        items = []
        for i, v in ranked:
            s = ("%f" % v if isinstance(v, float) else "%d" % v) + f":{i}"
            label = labels[i] if i < len(labels) else b""
            items.append(s.encode() + (b":" + label if label else b""))
        out.append(items)
    return out if batching else out[0]


def _as_bytes(values) -> list:
    """tritonclient gives JSON BYTES outputs as str and binary ones as bytes."""
    if isinstance(values, list):
        return [_as_bytes(v) for v in values]
    return values if isinstance(values, bytes) else values.encode()


def infer(srv, protocol: str, model: str, arr: np.ndarray, k: int, datatype: str = "FP32",
          input_name: str = "INPUT0", output_name: str = "OUTPUT0"):
    """Send ``arr``, ask for the top ``k`` of the output; returns (datatype, shape, values)."""
    if protocol == "grpc":
        c = grpcclient.InferenceServerClient(srv.grpc_url)
        inp = grpcclient.InferInput(input_name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr)
        out = grpcclient.InferRequestedOutput(output_name, class_count=k)
    else:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        inp = httpclient.InferInput(input_name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr)
        out = httpclient.InferRequestedOutput(output_name, binary_data=protocol == "http-binary",
                                              class_count=k)
    try:
        r = c.infer(model, [inp], outputs=[out])
    finally:
        c.close()
    if protocol == "grpc":
        o = r.get_output(output_name)
        meta = (o.datatype, list(o.shape))
    else:
        o = r.get_output(output_name)
        meta = (o["datatype"], o["shape"])
        assert ("data" in o) == (protocol == "http-json")
    return meta[0], meta[1], _as_bytes(r.as_numpy(output_name).tolist())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_batched_top_k_with_labels_matches_numpy(srv, protocol):
    arr = np.random.default_rng(3).standard_normal((4, 20)).astype(np.float32)
    arr[1, 5] = arr[1, 7] = 9.0                   # a tie: the lower index comes first
    datatype, shape, values = infer(srv, protocol, "rank_fp32", arr, 5)
    assert (datatype, shape) == ("BYTES", [4, 5])
    assert values == expected(arr, 5, True, RANK_LABELS)
    assert values[1][:2] == [b"9.000000:5", b"9.000000:7"]
    # labels where the file has them: index 0, 1 and 3, never for the empty line or past the end
    rows = np.array([[3, 2, 1, 0, -1]], np.float32)
    assert infer(srv, protocol, "rank_fp32", rows, 5)[2] == \
        [[b"3.000000:0:l0", b"2.000000:1:l1", b"1.000000:2", b"0.000000:3:l3", b"-1.000000:4"]]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_ensemble_output_is_classified_with_the_ensembles_labels(srv, protocol):
    rows = np.array([[3, 2, 1, 0, -1]], np.float32)
    want = [[b"3.000000:0:e0", b"2.000000:1:e1", b"1.000000:2:e2", b"0.000000:3:e3",
             b"-1.000000:4:e4"]]
    # the first request may go through the scheduler, the next worker to worker: both
    for _ in range(4):
        assert infer(srv, protocol, "rank_ensemble", rows, 5, input_name="IN",
                     output_name="OUT") == ("BYTES", [1, 5], want)
    # the step model asked directly keeps its own labels
    assert infer(srv, protocol, "rank_fp32", rows, 2)[2] == [[b"3.000000:0:l0", b"2.000000:1:l1"]]


def test_an_ensemble_label_file_that_cannot_be_read_fails_its_load(srv):
    c = httpclient.InferenceServerClient(srv.url)
    try:
        with pytest.raises(InferenceServerException, match="unable to read the label file .*nope.txt"):
            c.load_model("ensemble_no_labels_file")
        assert not c.is_model_ready("ensemble_no_labels_file")
    finally:
        c.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_not_batched_ranks_the_whole_tensor_without_labels(srv, protocol):
    arr = np.array([[5, -2, 40, 7], [8, 40, 0, 3]], dtype=np.int32)
    datatype, shape, values = infer(srv, protocol, "rank_int32", arr, 3, "INT32")
    assert (datatype, shape) == ("BYTES", [3])
    assert values == expected(arr, 3, False) == [b"40:2", b"40:5", b"8:4"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_k_larger_than_the_classes_is_clamped(srv, protocol):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert infer(srv, protocol, "rank_fp32", arr, 10)[:2] == ("BYTES", [2, 3])
    ints = np.arange(8, dtype=np.int32).reshape(2, 4)
    datatype, shape, values = infer(srv, protocol, "rank_int32", ints, 1 << 40, "INT32")
    assert shape == [8] and values == expected(ints, 8, False)


def _post(srv, model: str, outputs: list) -> requests.Response:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32",
                        "data": [1, 2, 3]}], "outputs": outputs}
    return requests.post(f"{srv.base}/v2/models/{model}/infer", json=body, timeout=30)


def _grpc_infer(srv, model: str, params: dict) -> grpc.RpcError:
    """A raw ModelInfer whose requested output carries ``params`` (InferParameter fields), as
    tritonclient would not send some of them; returns the error it must get."""
    req = service_pb2.ModelInferRequest(model_name=model)
    inp = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3])
    inp.contents.fp32_contents.extend([1, 2, 3])
    out = req.outputs.add(name="OUTPUT0")
    for key, (field, value) in params.items():
        setattr(out.parameters[key], field, value)
    with grpc.insecure_channel(srv.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    return e.value


@pytest.mark.parametrize("k", [0, -1, "3", 2.5, True])
def test_bad_k_is_a_400_naming_the_output(srv, k):
    r = _post(srv, "rank_fp32", [{"name": "OUTPUT0", "parameters": {"classification": k}}])
    assert r.status_code == 400
    assert "output 'OUTPUT0': invalid value for 'classification' parameter" in r.json()["error"]


@pytest.mark.parametrize("param", [("int64_param", 0), ("int64_param", -4),
                                   ("string_param", "3"), ("bool_param", True)])
def test_bad_k_over_grpc(srv, param):
    err = _grpc_infer(srv, "rank_fp32", {"classification": param})
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output 'OUTPUT0': invalid value for 'classification' parameter" in err.details()


def test_bytes_output_cannot_be_classified(srv):
    want = "output 'OUTPUT0': class result not available for output due to unsupported type 'BYTES'"
    arr = np.array([b"a", b"b"], dtype=np.object_)
    for protocol in ("http-binary", "grpc"):
        with pytest.raises(InferenceServerException) as e:
            infer(srv, protocol, "rank_bytes", arr, 1, "BYTES")
        assert want in e.value.message()
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_an_item_too_large_to_rank_fails_that_request_only(srv):
    big = np.zeros((1, 1_000_001), dtype=np.float32)
    for protocol in ("http-binary", "grpc"):
        with pytest.raises(InferenceServerException) as e:
            infer(srv, protocol, "rank_fp32", big, 1)
        assert "classification output tensor too large" in e.value.message()
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert infer(srv, "grpc", "rank_fp32", big[:, :3] + 1, 1)[2] == [[b"1.000000:0:l0"]]


def test_classification_with_a_shared_memory_region_is_refused(srv):
    name = f"cls{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 64)
    c = httpclient.InferenceServerClient(srv.url)
    try:
        c.register_system_shared_memory(name, f"/{name}", 64)
        region = {"shared_memory_region": name, "shared_memory_byte_size": 64}
        r = _post(srv, "rank_fp32", [{"name": "OUTPUT0",
                                      "parameters": {"classification": 2, **region}}])
        assert r.status_code == 400
        assert r.json()["error"] == ("output 'OUTPUT0': classification cannot be written to "
                                     "shared memory")
        err = _grpc_infer(srv, "rank_fp32", {
            "classification": ("int64_param", 2), "shared_memory_region": ("string_param", name),
            "shared_memory_byte_size": ("int64_param", 64)})
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "classification cannot be written to shared memory" in err.details()
        # the region is not held by the refused requests: it unregisters at once
        c.unregister_system_shared_memory(name)
    finally:
        c.close()
        shm.destroy_shared_memory_region(handle)


def test_label_file_problems_fail_the_load(srv):
    c = httpclient.InferenceServerClient(srv.url)
    try:
        with pytest.raises(InferenceServerException, match="unable to read the label file "
                                                           ".*nope.txt' for output 'OUTPUT0'"):
            c.load_model("missing_labels")
        with pytest.raises(InferenceServerException, match="outside the model directory"):
            c.load_model("escaping_labels")
        assert c.is_model_ready("rank_fp32")
    finally:
        c.close()


# ---- the example classifier, driven the way Triton's image_client.py drives it ---------------

COLORS = {"red": (250, 10, 10), "blue": (20, 30, 240), "orange": (250, 160, 5)}


def _image_input(metadata_shape, rgb, batching: bool) -> np.ndarray:
    """image_client's preprocess() of a solid-colour picture, without Pillow: resize is moot,
    INCEPTION scaling, then HWC -> CHW for an NCHW input."""
    if batching:
        metadata_shape = metadata_shape[1:]
    c, h, w = metadata_shape
    assert c == 3
    pixels = np.broadcast_to(np.array(rgb, dtype=np.float32), (h, w, 3))
    return np.transpose(pixels / 127.5 - 1, (2, 0, 1)).astype(np.float32)


def _parse_model(protocol, client, model):
    """What image_client's parse_model() checks and takes from the metadata and config."""
    if protocol == "grpc":
        meta = client.get_model_metadata(model)
        config = client.get_model_config(model).config
        inputs = [(i.name, i.datatype, list(i.shape)) for i in meta.inputs]
        outputs = [(o.name, o.datatype, list(o.shape)) for o in meta.outputs]
        max_batch, n_config_inputs = config.max_batch_size, len(config.input)
        fmt = config.input[0].format
    else:
        meta, config = client.get_model_metadata(model), client.get_model_config(model)
        inputs = [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]]
        outputs = [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]]
        max_batch, n_config_inputs = config.get("max_batch_size", 0), len(config["input"])
        fmt = dict(mc.ModelInput.Format.items())[config["input"][0]["format"]]
    assert len(inputs) == 1 and len(outputs) == 1 and n_config_inputs == 1
    assert outputs[0][1] == "FP32"
    dims = outputs[0][2][1:] if max_batch > 0 else outputs[0][2]
    assert sum(d > 1 for d in dims) == 1                # a vector of classes
    assert len(inputs[0][2]) == 3 + (max_batch > 0)
    assert fmt == mc.ModelInput.FORMAT_NCHW
    return max_batch, inputs[0], outputs[0][0]


@pytest.mark.parametrize("protocol", ["http", "grpc", "grpc-stream"])
@pytest.mark.parametrize("model", ["classifier_onnx", "classifier_nobatch"])
def test_image_client_calls(srv, protocol, model):
    mod = grpcclient if protocol.startswith("grpc") else httpclient
    url = srv.grpc_url if mod is grpcclient else srv.url
    client = mod.InferenceServerClient(url)
    try:
        max_batch, (input_name, dtype, shape), output_name = _parse_model(
            protocol.split("-")[0], client, model)
        batching = max_batch > 0
        names = list(COLORS) if batching else ["orange"]
        images = [_image_input(shape, COLORS[n], batching) for n in names]
        data = np.stack(images) if batching else images[0]
        inp = mod.InferInput(input_name, list(data.shape), dtype)
        inp.set_data_from_numpy(data)
        # image_client asks for "-c" classes; 3 here, and again for the raw tensor to compare
        outs = [mod.InferRequestedOutput(output_name, class_count=3)]
        if protocol == "grpc-stream":
            answers: queue.Queue = queue.Queue()
            client.start_stream(lambda result, error: answers.put((result, error)))
            client.async_stream_infer(model, [inp], request_id="7", outputs=outs)
            result, error = answers.get(timeout=60)
            client.stop_stream()
            assert error is None
        else:
            result = client.infer(model, [inp], request_id="7", outputs=outs)
        raw = client.infer(model, [inp], outputs=[mod.InferRequestedOutput(output_name)])
    finally:
        client.close()
    this_id = result.get_response().id if mod is grpcclient else result.get_response()["id"]
    assert this_id == "7"
    classes = result.as_numpy(output_name)
    probs = raw.as_numpy(output_name)
    assert classes.shape == ((len(names), 3) if batching else (3,))
    # image_client's postprocess(): each element split on ':' into value, index, label
    per_item = classes if batching else [classes]
    for name, item in zip(names, per_item):
        fields = ["".join(chr(x) for x in s).split(":") for s in item]
        assert fields[0][2] == name and COLOR_LABELS[int(fields[0][1])] == name
        assert all(len(f) == 3 for f in fields)
    labels = [label.encode() for label in COLOR_LABELS]
    assert _as_bytes(classes.tolist()) == expected(probs, 3, batching, labels)


def test_the_extension_is_advertised(srv):
    assert "classification" in requests.get(f"{srv.base}/v2", timeout=30).json()["extensions"]
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert "classification" in c.get_server_metadata().extensions
    finally:
        c.close()
