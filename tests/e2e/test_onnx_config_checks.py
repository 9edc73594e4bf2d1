"""A config.pbtxt that contradicts its ONNX model is refused at load, as Triton's onnxruntime
backend refuses it (workers/backends/onnx_checks.py): the model is UNAVAILABLE with Triton's
words naming the tensor, the config's value and the model's, instead of loading READY and
failing every request with 500. The models that agree with their graphs serve, and so does the
server."""
import os

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from serverproc import Server, wait_for

onnx = pytest.importorskip("onnx", reason="the onnx package builds the test models ([test] extra)")


def _save(path: str, inputs, outputs, nodes, initializers=()) -> None:
    from onnx import helper
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _identity(path: str, first="batch") -> None:
    """INPUT0 -> OUTPUT0, FP32 [first, 4]."""
    from onnx import TensorProto, helper
    _save(path, [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [first, 4])],
          [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [first, 4])],
          [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])])


def _add(path: str) -> None:
    """OUTPUT0 = INPUT0 + INPUT1, FP32 [batch, 4]."""
    from onnx import TensorProto, helper
    _save(path, [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4])
                 for n in ("INPUT0", "INPUT1")],
          [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
          [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"])])


def _with_bias(path: str) -> None:
    """Y = X + B, X [N, 4]; B an initializer [4] (ones) that a request may override."""
    from onnx import TensorProto, helper, numpy_helper
    _save(path, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4]),
                 helper.make_tensor_value_info("B", TensorProto.FLOAT, [4])],
          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
          [helper.make_node("Add", ["X", "B"], ["Y"])],
          [numpy_helper.from_array(np.ones(4, np.float32), "B")])


def _config(name: str, mbs: int = 8, in_name="INPUT0", in_type="TYPE_FP32", in_dims="4",
            out_type="TYPE_FP32", out_dims="4") -> str:
    return f'''name: "{name}"
backend: "onnxruntime"
max_batch_size: {mbs}
input [ {{ name: "{in_name}", data_type: {in_type}, dims: [ {in_dims} ] }} ]
output [ {{ name: "OUTPUT0", data_type: {out_type}, dims: [ {out_dims} ] }} ]
'''


# name -> (graph builder, config, what the reason must hold)
WRONG = {
    "wrong_dtype": (_identity, _config("wrong_dtype", in_type="TYPE_INT32"),
                    "unable to load model 'wrong_dtype', configuration expects datatype "
                    "TYPE_INT32 for input 'INPUT0', model provides TYPE_FP32"),
    "wrong_out_dtype": (_identity, _config("wrong_out_dtype", out_type="TYPE_FP16"),
                        "unable to load model 'wrong_out_dtype', configuration expects datatype "
                        "TYPE_FP16 for output 'OUTPUT0', model provides TYPE_FP32"),
    "wrong_rank": (_identity, _config("wrong_rank", in_dims="4, 2"),
                   "model 'wrong_rank', tensor 'INPUT0': the model expects 2 dimensions (shape "
                   "[-1,4]) but the model configuration specifies 3 dimensions (an initial batch "
                   "dimension because max_batch_size > 0 followed by the explicit tensor shape, "
                   "making complete shape [-1,4,2])"),
    "wrong_dim": (_identity, _config("wrong_dim", out_dims="5"),
                  "model 'wrong_dim', tensor 'OUTPUT0': the model expects 2 dimensions (shape "
                  "[-1,4]) but the model configuration specifies 2 dimensions (an initial batch "
                  "dimension because max_batch_size > 0 followed by the explicit tensor shape, "
                  "making complete shape [-1,5])"),
    "wrong_dim_nobatch": (_identity, _config("wrong_dim_nobatch", mbs=0, in_dims="-1, 3"),
                          "model 'wrong_dim_nobatch', tensor 'INPUT0': the model expects 2 "
                          "dimensions (shape [-1,4]) but the model configuration specifies 2 "
                          "dimensions (shape [-1,3])"),
    "unknown_input": (_identity, _config("unknown_input", in_name="INPUT9"),
                      "unable to load model 'unknown_input', unexpected inference input "
                      "'INPUT9', allowed inputs are: INPUT0"),
    "missing_input": (_add, _config("missing_input"),
                      "unable to load model 'missing_input', configuration expects 1 inputs, "
                      "model provides 2 (model input(s) the configuration does not declare: "
                      "'INPUT1')"),
    "fixed_batch": (lambda p: _identity(p, first=1), _config("fixed_batch"),
                    "model 'fixed_batch', tensor 'INPUT0': for the model to support batching "
                    "the shape should have at least 1 dimension and the first dimension must be "
                    "-1; but shape expected by the model is [1,4]"),
}

GOOD = {
    "good": (_identity, _config("good")),
    # no batching: the model's symbolic first dimension takes the config's 1
    "good_nobatch": (_identity, _config("good_nobatch", mbs=0, in_dims="1, 4",
                                        out_dims="-1, 4")),
    "good_bias": (_with_bias, '''name: "good_bias"
backend: "onnxruntime"
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1, 4 ] },
        { name: "B", data_type: TYPE_FP32, dims: [ 4 ], optional: true } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
'''),
}


def _write(repo: str, name: str, build, config: str) -> None:
    os.makedirs(os.path.join(repo, name, "1"))
    build(os.path.join(repo, name, "1", "model.onnx"))
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(config)


def _index(srv) -> dict:
    return {e["name"]: e for e in
            requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("onnx_checks"))
    for name, (build, config, _) in WRONG.items():
        _write(repo, name, build, config)
    for name, (build, config) in GOOD.items():
        _write(repo, name, build, config)
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "*", wait_ready=False)
    try:
        wait_for(lambda: all(e.get("state") not in (None, "LOADING")
                             for e in _index(s).values()) and len(_index(s)) == len(WRONG) +
                 len(GOOD), 90, "every model to finish loading")
    except BaseException:
        print(s.log_text())
        s.stop()
        raise
    yield s
    assert s.stop() == 0


def _infer_good(srv) -> None:
    c = httpclient.InferenceServerClient(srv.url, network_timeout=30)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    i = httpclient.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("good", [i]).as_numpy("OUTPUT0"), x)
    c.close()


@pytest.mark.parametrize("name", list(WRONG))
def test_a_contradicting_config_is_unavailable_with_the_reason(srv, name):
    entry = _index(srv)[name]
    assert entry["state"] == "UNAVAILABLE", entry
    assert WRONG[name][2] in entry["reason"], entry["reason"]
    assert not srv.model_ready(name)
    r = requests.post(f"{srv.base}/v2/models/{name}/infer", timeout=10, json={"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    # not loaded ("has no available versions", with the reason): no 500 from a broken instance
    assert r.status_code in (400, 404) and WRONG[name][2] in r.text, r.text
    _infer_good(srv)


def test_loading_it_again_is_refused_with_the_reason(srv):
    r = requests.post(f"{srv.base}/v2/repository/models/wrong_dtype/load", timeout=60)
    assert r.status_code == 400, r.text
    assert WRONG["wrong_dtype"][2] in r.json()["error"]
    assert _index(srv)["wrong_dtype"]["state"] == "UNAVAILABLE"
    _infer_good(srv)


def test_the_models_that_agree_with_their_graphs_serve(srv):
    idx = _index(srv)
    assert all(idx[n]["state"] == "READY" for n in GOOD), idx
    _infer_good(srv)
    c = httpclient.InferenceServerClient(srv.url, network_timeout=30)
    x = np.ones((1, 4), np.float32)
    i = httpclient.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("good_nobatch", [i]).as_numpy("OUTPUT0"), x)
    # the optional input with an initializer: left out, the graph's ones; given, the client's
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ix = httpclient.InferInput("X", x.shape, "FP32")
    ix.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("good_bias", [ix]).as_numpy("Y"), x + 1)
    b = np.full(4, 10, np.float32)
    ib = httpclient.InferInput("B", b.shape, "FP32")
    ib.set_data_from_numpy(b)
    np.testing.assert_array_equal(c.infer("good_bias", [ix, ib]).as_numpy("Y"), x + 10)
    c.close()
    assert requests.get(f"{srv.base}/v2/health/live", timeout=10).status_code == 200
