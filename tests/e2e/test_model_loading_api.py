"""The python backend's model loading API (pb_utils.load_model / unload_model /
is_model_ready) against a real server: a "manager" model loads, checks, uses (BLS) and unloads
another model, with a config override and with override files; failures raise with the
server's words; outside explicit mode loads are refused."""
import base64
import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server

MANAGER = """
name: "manager"
backend: "python"
max_batch_size: 0
input [ { name: "CMD", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "RESULT", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""
# CMD is JSON: {"op": load|unload|ready|infer, ...}; RESULT is JSON: {"ok": ..., "error": ...}
MANAGER_CODE = '''
import base64, json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def run(self, cmd):
        op = cmd["op"]
        if op == "ready":
            return pb_utils.is_model_ready(cmd["model"], cmd.get("version", ""))
        if op == "load":
            files = {k: base64.b64decode(v) for k, v in cmd.get("files", {}).items()} or None
            pb_utils.load_model(cmd["model"], config=cmd.get("config", ""), files=files)
            return True
        if op == "unload":
            pb_utils.unload_model(cmd["model"], unload_dependents=cmd.get("dependents", False))
            return True
        if op == "infer":
            x = pb_utils.Tensor("INPUT0", np.array(cmd["x"], np.float32))
            r = pb_utils.InferenceRequest(model_name=cmd["model"], inputs=[x],
                                          requested_output_names=["OUTPUT0"]).exec()
            if r.has_error():
                raise pb_utils.TritonModelException(r.error().message())
            return pb_utils.get_output_tensor_by_name(r, "OUTPUT0").as_numpy().tolist()
        raise ValueError(op)

    def execute(self, requests):
        out = []
        for r in requests:
            cmd = json.loads(pb_utils.get_input_tensor_by_name(r, "CMD").as_numpy()[0])
            try:
                answer = {"ok": self.run(cmd)}
            except pb_utils.TritonModelException as e:
                answer = {"error": e.message()}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "RESULT", np.array([json.dumps(answer)], dtype=object))]))
        return out
'''
TARGET = """
name: "target"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""
TARGET_CODE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + {add})])
            for r in requests]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("loading") / "models")
    write_model(r, "manager", MANAGER, MANAGER_CODE)
    write_model(r, "target", TARGET, TARGET_CODE.replace("{add}", "1"))
    return r


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "manager")
    yield s
    s.stop()


def ask(server, **cmd):
    c = httpclient.InferenceServerClient(server.url, network_timeout=120)
    x = httpclient.InferInput("CMD", [1], "BYTES")
    x.set_data_from_numpy(np.array([json.dumps(cmd).encode()], dtype=object))
    return json.loads(c.infer("manager", [x]).as_numpy("RESULT")[0])


def test_load_check_use_and_unload_a_model(server):
    c = httpclient.InferenceServerClient(server.url)
    assert ask(server, op="ready", model="target") == {"ok": False}
    assert ask(server, op="load", model="target") == {"ok": True}
    assert c.is_model_ready("target")
    assert ask(server, op="ready", model="target") == {"ok": True}
    assert ask(server, op="ready", model="target", version="1") == {"ok": True}
    assert ask(server, op="ready", model="target", version="7") == {"ok": False}
    assert ask(server, op="infer", model="target", x=[[1.0, 2.0]]) == {"ok": [[2.0, 3.0]]}
    assert ask(server, op="unload", model="target") == {"ok": True}
    assert not c.is_model_ready("target")
    assert ask(server, op="ready", model="target") == {"ok": False}
    assert ask(server, op="ready", model="nowhere") == {"ok": False}


def test_a_config_override_and_override_files(server):
    c = httpclient.InferenceServerClient(server.url)
    config = json.dumps({"backend": "python", "max_batch_size": 2,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [2]}],
                         "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32",
                                     "dims": [2]}]})
    assert ask(server, op="load", model="target", config=config) == {"ok": True}
    assert c.get_model_config("target")["max_batch_size"] == 2
    code = TARGET_CODE.replace("{add}", "100").encode()
    files = {"file:1/model.py": base64.b64encode(code).decode()}
    assert ask(server, op="load", model="uploaded", config=config, files=files) == {"ok": True}
    assert ask(server, op="infer", model="uploaded", x=[[1.0, 2.0]]) == {"ok": [[101.0, 102.0]]}
    assert ask(server, op="unload", model="uploaded") == {"ok": True}
    assert ask(server, op="unload", model="target") == {"ok": True}


def test_failures_raise_with_the_servers_words(server):
    missing = ask(server, op="load", model="nowhere")
    assert "nowhere" in missing["error"]
    # files without a config: a client's upload gets the same refusal
    files = {"file:1/model.py": base64.b64encode(b"x = 1").decode()}
    no_config = ask(server, op="load", model="up2", files=files)
    assert "'config'" in no_config["error"] and "must be given with" in no_config["error"]
    bad_key = ask(server, op="load", model="up3", config="{}",
                  files={"1/model.py": base64.b64encode(b"x").decode()})
    assert "file keys must start with 'file:'" in bad_key["error"]
    # the manager serves on
    assert ask(server, op="ready", model="manager") == {"ok": True}


def test_outside_explicit_mode_a_load_is_refused(repo):
    s = Server(repo)
    try:
        answer = ask(s, op="load", model="target")
        assert "error" in answer and "explicit" in answer["error"].lower(), answer
    finally:
        s.stop()
