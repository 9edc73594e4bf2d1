"""BYTES tensors into and out of onnxruntime models (issue 15): a model shaped like Triton's own
``simple_string`` (two string inputs cast to int32, their sum and difference cast back to
strings), over HTTP (JSON and binary) and gRPC, batched and not. onnxruntime's string tensors
take str; given Python bytes it read "b'1'" and failed in Cast with "stoll"."""
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import Server
from tritonclient.utils import InferenceServerException

onnx = pytest.importorskip("onnx", reason="the onnx package builds the test model ([test] extra)")


def _simple_string_onnx(path: str) -> None:
    from onnx import TensorProto, helper
    dims = ["batch", 16]
    inputs = [helper.make_tensor_value_info(n, TensorProto.STRING, dims)
              for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.STRING, dims)
               for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
             helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
             helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("Sub", ["a", "b"], ["diff"]),
             helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
             helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING)]
    model = helper.make_model(helper.make_graph(nodes, "simple_string", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _write(repo: str, name: str, max_batch_size: int) -> None:
    d = os.path.join(repo, name)
    os.makedirs(os.path.join(d, "1"))
    _simple_string_onnx(os.path.join(d, "1", "model.onnx"))
    with open(os.path.join(d, "config.pbtxt"), "w") as f:
        f.write(f'''name: "{name}"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_STRING dims: [ {"16" if max_batch_size else "1, 16"} ] }},
        {{ name: "INPUT1" data_type: TYPE_STRING dims: [ {"16" if max_batch_size else "1, 16"} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_STRING dims: [ {"16" if max_batch_size else "1, 16"} ] }},
         {{ name: "OUTPUT1" data_type: TYPE_STRING dims: [ {"16" if max_batch_size else "1, 16"} ] }} ]
''')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("strings"))
    _write(repo, "simple_string", 8)
    _write(repo, "simple_string_nobatch", 0)
    s = Server(repo)
    yield s
    s.stop()


def _data(rows: int):
    a = np.array([[str(r * 16 + i).encode() for i in range(16)] for r in range(rows)],
                 dtype=np.object_)
    b = np.array([[b"1"] * 16] * rows, dtype=np.object_)
    return a, b


def _expected(a):
    ints = np.vectorize(lambda x: int(x))(a)
    return (np.vectorize(lambda x: str(x).encode())(ints + 1),
            np.vectorize(lambda x: str(x).encode())(ints - 1))


@pytest.mark.parametrize("model,rows", [("simple_string", 1), ("simple_string", 3),
                                        ("simple_string_nobatch", 1)])
@pytest.mark.parametrize("binary", [True, False])
def test_strings_over_http(srv, model, rows, binary):
    a, b = _data(rows)
    c = httpclient.InferenceServerClient(srv.url)
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), "BYTES"),
              httpclient.InferInput("INPUT1", list(b.shape), "BYTES")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    r = c.infer(model, inputs, outputs=outs)
    want_sum, want_diff = _expected(a)
    # JSON outputs come back to tritonclient as str, binary ones as bytes
    assert _as_bytes(r.as_numpy("OUTPUT0")) == want_sum.tolist()
    assert _as_bytes(r.as_numpy("OUTPUT1")) == want_diff.tolist()
    c.close()


def _as_bytes(arr):
    return [[x if isinstance(x, bytes) else x.encode() for x in row] for row in arr.tolist()]


def test_strings_over_grpc(srv):
    a, b = _data(2)
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "BYTES"),
              grpcclient.InferInput("INPUT1", list(b.shape), "BYTES")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    r = c.infer("simple_string", inputs)
    want_sum, want_diff = _expected(a)
    assert r.as_numpy("OUTPUT0").tolist() == want_sum.tolist()
    assert r.as_numpy("OUTPUT1").tolist() == want_diff.tolist()
    c.close()


def test_bytes_that_are_not_text_get_a_clear_400(srv):
    a, b = _data(1)
    a[0, 3] = b"\xff\xfe"
    c = httpclient.InferenceServerClient(srv.url)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"),
              httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    with pytest.raises(InferenceServerException) as e:
        c.infer("simple_string", inputs)
    assert e.value.status() == "400"
    assert "input 'INPUT0'" in e.value.message() and "UTF-8" in e.value.message()
    a, _ = _data(1)
    inputs[0].set_data_from_numpy(a)            # the server keeps serving
    assert c.infer("simple_string", inputs).as_numpy("OUTPUT0")[0, 0] == b"1"
    c.close()
