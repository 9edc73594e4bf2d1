"""Triton's onnxruntime config options on a served model: a config that sets them loads and
answers as the plain model does; one with a value Triton refuses fails its load with Triton's
words, and the rest serve."""
import os
import shutil

import numpy as np
import requests
import tritonclient.http as httpclient
from serverproc import Server, wait_for

IO = """
    backend: "onnxruntime"
    max_batch_size: 64
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
"""
TUNED = IO + """
    optimization { graph { level: 2 } }
    parameters { key: "execution_mode" value: { string_value: "1" } }
    parameters { key: "inter_op_thread_count" value: { string_value: "2" } }
    parameters { key: "enable_mem_arena" value: { string_value: "1" } }
    parameters { key: "enable_mem_pattern" value: { string_value: "0" } }
    parameters { key: "memory.enable_memory_arena_shrinkage" value: { string_value: "cpu:0" } }
"""
BAD_MODE = IO + 'parameters { key: "execution_mode" value: { string_value: "3" } }\n'
OPENVINO = IO + """
    optimization { execution_accelerators {
      cpu_execution_accelerator : [ { name : "openvino" } ] } }
"""


def _model(repo, name, config, onnx):
    os.makedirs(repo / name / "1")
    shutil.copy(onnx, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config)


def test_onnxruntime_options_load_serve_and_fail_as_in_triton(tmp_path, example_repo):
    onnx = os.path.join(example_repo, "mlp_onnx", "1", "model.onnx")
    for name, config in (("plain", IO), ("tuned", TUNED), ("bad_mode", BAD_MODE),
                         ("openvino", OPENVINO)):
        _model(tmp_path, name, config, onnx)
    srv = Server(str(tmp_path), "--strict-readiness", "false")
    try:
        wait_for(lambda: srv.model_ready("plain") and srv.model_ready("tuned"), 60,
                 "plain and tuned to load")
        c = httpclient.InferenceServerClient(srv.url)
        x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
        i = httpclient.InferInput("INPUT0", [3, 256], "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_allclose(c.infer("tuned", [i]).as_numpy("OUTPUT0"),
                                   c.infer("plain", [i]).as_numpy("OUTPUT0"), rtol=1e-5, atol=1e-5)

        def index():
            return {e["name"]: e for e in
                    requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
        wait_for(lambda: all(index()[n]["state"] == "UNAVAILABLE" for n in ("bad_mode", "openvino")),
                 60, "the two refused models to fail their load")
        idx = index()
        assert "Expected values for  execution_mode are 0 or 1 but got 3 ." in \
            idx["bad_mode"]["reason"]
        assert "Execution Accelerator 'openvino' is requested" in idx["openvino"]["reason"]
        assert srv.model_ready("plain")
    finally:
        assert srv.stop() == 0
