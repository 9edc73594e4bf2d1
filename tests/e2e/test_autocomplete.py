"""Auto-complete: configs filled in from the ONNX graph and by python's auto_complete_config."""
import os
import shutil
import textwrap

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from serverproc import Server, wait_for

PY_AUTOCOMPLETE = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [3]})
            auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [3]})
            auto_complete_model_config.set_max_batch_size(8)
            auto_complete_model_config.set_dynamic_batching()
            return auto_complete_model_config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
''')


@pytest.fixture(scope="module")
def ac_repo(tmp_path_factory, example_repo):
    repo = tmp_path_factory.mktemp("ac")
    onnx = os.path.join(example_repo, "mlp_onnx", "1", "model.onnx")
    for name in ("onnx_noconfig", "onnx_partial"):
        os.makedirs(repo / name / "1")
        shutil.copy(onnx, repo / name / "1")
    (repo / "onnx_partial" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 16\n')
    os.makedirs(repo / "py_ac" / "1")
    (repo / "py_ac" / "1" / "model.py").write_text(PY_AUTOCOMPLETE)
    (repo / "py_ac" / "config.pbtxt").write_text('backend: "python"\n')
    os.makedirs(repo / "py_noconfig" / "1")      # python_backend's auto_complete example: no config
    (repo / "py_noconfig" / "1" / "model.py").write_text(PY_AUTOCOMPLETE)
    return str(repo)


def _config(srv, name):
    r = requests.get(f"{srv.base}/v2/models/{name}/config", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_configs_are_completed(ac_repo):
    srv = Server(ac_repo)
    try:
        cfg = _config(srv, "onnx_noconfig")
        assert cfg["backend"] == "onnxruntime" and cfg["platform"] == "onnxruntime_onnx"
        assert cfg["max_batch_size"] == 4                     # Triton's default-max-batch-size
        assert cfg["input"] == [{**cfg["input"][0], "name": "INPUT0", "data_type": "TYPE_FP32",
                                 "dims": [256]}]
        assert cfg["output"][0]["name"] == "OUTPUT0" and cfg["output"][0]["dims"] == [256]
        assert cfg["dynamic_batching"]["preferred_batch_size"] == [4]
        partial = _config(srv, "onnx_partial")
        assert partial["max_batch_size"] == 16 and partial["input"][0]["dims"] == [256]
        assert "dynamic_batching" not in partial    # a max_batch_size given keeps its scheduler
        py = _config(srv, "py_ac")
        assert py["max_batch_size"] == 8 and py["input"][0]["name"] == "IN"
        assert "dynamic_batching" in py
        c = httpclient.InferenceServerClient(srv.url)
        x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
        i = httpclient.InferInput("INPUT0", x.shape, "FP32")
        i.set_data_from_numpy(x)
        assert c.infer("onnx_noconfig", [i]).as_numpy("OUTPUT0").shape == (2, 256)
        a = np.array([[1, 2, 3]], dtype=np.int32)
        i = httpclient.InferInput("IN", a.shape, "INT32")
        i.set_data_from_numpy(a)
        np.testing.assert_array_equal(c.infer("py_ac", [i]).as_numpy("OUT"), a * 2)
        assert c.get_model_metadata("py_ac")["inputs"][0]["shape"] == [-1, 3]
        bare = _config(srv, "py_noconfig")
        assert bare["backend"] == "python" and bare["max_batch_size"] == 8
        assert bare["input"][0]["name"] == "IN" and bare["output"][0]["name"] == "OUT"
        np.testing.assert_array_equal(c.infer("py_noconfig", [i]).as_numpy("OUT"), a * 2)
    finally:
        assert srv.stop() == 0


def test_disable_auto_complete(ac_repo):
    srv = Server(ac_repo, "--disable-auto-complete-config", wait_ready=False)
    try:
        wait_for(lambda: all(_state(srv, n) for n in ("onnx_noconfig", "onnx_partial", "py_ac",
                                                       "py_noconfig")),
                 60, "every model to finish loading")
        idx = {e["name"]: e for e in
               requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
        assert idx["onnx_noconfig"]["state"] == "UNAVAILABLE"
        assert "model configuration is not provided" in idx["onnx_noconfig"]["reason"]
        assert "model configuration is not provided" in idx["py_noconfig"]["reason"]
        assert _config(srv, "py_ac")["input"] == []           # the hook did not run
    finally:
        assert srv.stop() == 0


def _state(srv, name):
    idx = {e["name"]: e for e in requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
    return idx.get(name, {}).get("state") not in (None, "LOADING")


@pytest.mark.parametrize("setting, mbs, dims", [
    ("default-max-batch-size=8", 8, [256]),
    ("onnxruntime,default-max-batch-size=0", 0, [-1, 256]),     # 0: it does not batch
])
def test_the_default_max_batch_size_comes_from_backend_config(ac_repo, setting, mbs, dims):
    srv = Server(ac_repo, "--backend-config", setting)
    try:
        cfg = _config(srv, "onnx_noconfig")
        assert cfg["max_batch_size"] == mbs and cfg["input"][0]["dims"] == dims
        assert ("dynamic_batching" in cfg) == (mbs > 0)
        assert _config(srv, "onnx_partial")["max_batch_size"] == 16     # given: kept
        assert "--backend-config is accepted" not in srv.log_text()     # read, not ignored
    finally:
        srv.stop()
