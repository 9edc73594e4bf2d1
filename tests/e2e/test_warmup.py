"""model_warmup runs on every instance before the version is READY; a failing one fails the load."""
import os
import textwrap

import numpy as np
import requests
from serverproc import Server, wait_for

RECORDER = textwrap.dedent('''
    import json, os
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"])["parameters"]
            self.log = params["log"]["string_value"]

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                if x.dtype.kind == "f" and (x > 1000).any():
                    raise ValueError("refusing warm-up data")
                with open(self.log, "a") as f:
                    f.write(f"{os.getpid()} {list(x.shape)} {float(x.sum()):.3f}\\n")
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')


def _model(repo, name, log, warmup):
    d = repo / name
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.py").write_text(RECORDER)
    (d / "config.pbtxt").write_text(textwrap.dedent(f'''
        backend: "python"
        max_batch_size: 4
        input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 3 ] }} ]
        output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 3 ] }} ]
        instance_group [ {{ count: 2, kind: KIND_CPU }} ]
        parameters {{ key: "log" value: {{ string_value: "{log}" }} }}
    ''') + warmup)


def test_warmup_runs_on_each_instance_before_ready(tmp_path):
    repo = tmp_path / "repo"
    ok_log, bad_log = tmp_path / "ok.log", tmp_path / "bad.log"
    _model(repo, "warm", ok_log, textwrap.dedent('''
        model_warmup [
          { name: "zeros" batch_size: 2 count: 2
            inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } },
          { name: "from_file" batch_size: 1
            inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "in.bin" } } }
        ]'''))
    (repo / "warm" / "warmup").mkdir()
    (repo / "warm" / "warmup" / "in.bin").write_bytes(np.array([1, 2, 3.5], dtype=np.float32).tobytes())
    _model(repo, "cold", bad_log, textwrap.dedent('''
        model_warmup [ { name: "too_hot" batch_size: 1
            inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "in.bin" } } } ]'''))
    (repo / "cold" / "warmup").mkdir()
    (repo / "cold" / "warmup" / "in.bin").write_bytes(np.full(3, 5000, dtype=np.float32).tobytes())
    srv = Server(str(repo), wait_ready=False)
    try:
        wait_for(lambda: srv.model_ready("warm"), 60, "model 'warm' to be ready")
        lines = ok_log.read_text().splitlines()
        pids = {line.split()[0] for line in lines}
        assert len(pids) == 2                                     # both instances warmed up
        assert len(lines) == 2 * (2 + 1)                          # per instance: 2 x zeros, 1 x file
        assert sum(1 for line in lines if "[2, 3] 0.000" in line) == 4
        assert sum(1 for line in lines if "[1, 3] 6.500" in line) == 2

        def cold_state():
            idx = {e["name"]: e for e in requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}
            return idx["cold"] if idx["cold"].get("state") == "UNAVAILABLE" else None
        entry = wait_for(cold_state, 60, "model 'cold' to fail")
        assert "warmup 'too_hot' failed" in entry["reason"] and "refusing warm-up data" in entry["reason"]
        assert not os.path.exists(bad_log)
    finally:
        assert srv.stop() == 0
