"""Backends that are not built in, on the real server: python-based backends (``<backend
directory>/<name>/model.py``, Triton's way; the shipped ``expression`` one and one of the user's)
and a plug-in from an installed package's ``shmserve.backends`` entry point, served with dynamic
batching, statistics and metrics as the built-in backends are; the load errors of a backend or a
platform that does not exist."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for

EXPRESSION = """backend: "expression"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 2000 }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
parameters: { key: "Y" value: { string_value: "%s" } }
"""

# a python-based backend of the user's: it answers with what Triton gives such a backend's
# instance (the model's own directory, name and config), so the test sees them
ECHO_BACKEND = """import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.facts = json.dumps({"repository": args["model_repository"],
                                 "name": args["model_name"], "version": args["model_version"],
                                 "greeting": cfg["parameters"]["GREETING"]["string_value"]})

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("FACTS", np.array(
            [self.facts.encode()], dtype=object))]) for _ in requests]
"""
ECHO_CONFIG = """backend: "echo_facts"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "FACTS" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters: { key: "GREETING" value: { string_value: "%s" } }
"""



def _doc_block(lang: str, after: str) -> str:
    """The first ```lang block after the line ``after`` in docs/backends.md: the test installs
    the documented backend package as a reader would write it."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "docs", "backends.md")) as f:
        text = f.read()
    rest = text[text.index(after):]
    start = rest.index(f"```{lang}\n") + len(lang) + 4
    return rest[start:rest.index("```", start)]


# the plug-in backend package of docs/backends.md, verbatim, and a second entry point that
# names a module that does not exist
PLUGIN = _doc_block("python", "A complete backend package")
PLUGIN_PYPROJECT = _doc_block("toml", "A complete backend package") + \
    'broken = "tiny_backend_missing:Nothing"\n'
SCALE_CONFIG = """backend: "%s"
max_batch_size: 16
dynamic_batching { max_queue_delay_microseconds: 20000 }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
parameters: { key: "FACTOR" value: { string_value: "%s" } }
"""


def _index(server) -> dict:
    r = requests.post(f"{server.base}/v2/repository/index", json={}, timeout=10)
    return {m["name"]: m for m in r.json()}


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The plug-in package, installed by pip (no network) into a folder the servers import from."""
    src = tmp_path_factory.mktemp("tiny_backend_src")
    (src / "tiny_backend.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-build-isolation", "--target", str(site), str(src)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return str(site)


@pytest.fixture(scope="module")
def server(tmp_path_factory, plugin_site):
    repo = str(tmp_path_factory.mktemp("repo"))
    backends = tmp_path_factory.mktemp("backends")
    (backends / "echo_facts").mkdir()
    (backends / "echo_facts" / "model.py").write_text(ECHO_BACKEND)
    write_model(repo, "double", EXPRESSION % "X * 2 + 1", None)
    write_model(repo, "squash", EXPRESSION % "tanh(X) + where(X > 0, 1, 0)", None)
    write_model(repo, "hello", ECHO_CONFIG % "hello", None)
    write_model(repo, "bonjour", ECHO_CONFIG % "bonjour", None)
    write_model(repo, "scale", SCALE_CONFIG % ("scale", "3"), None)
    # what must not load, each with its reason
    write_model(repo, "sneaky", EXPRESSION % "__import__('os').getcwd()", None)
    write_model(repo, "unknown_name", EXPRESSION % "X + Z", None)
    write_model(repo, "too_long", EXPRESSION % ("X + " * 1100 + "X"), None)
    write_model(repo, "too_deep", EXPRESSION % ("-" * 4000 + "X"), None)
    write_model(repo, "nosuch", EXPRESSION.replace("expression", "nosuch") % "X", None)
    write_model(repo, "escaping", EXPRESSION.replace("expression", "../backends/echo_facts") % "X", None)
    write_model(repo, "platform", EXPRESSION.replace('backend: "expression"',
                                                     'platform: "pytorch_libtorch"') % "X", None)
    write_model(repo, "negative", SCALE_CONFIG % ("scale", "-1"), None)
    write_model(repo, "broken", SCALE_CONFIG % ("broken", "1"), None)
    pythonpath = os.pathsep.join(p for p in (plugin_site, os.environ.get("PYTHONPATH")) if p)
    # (models that fail their load keep the server from reading ready: Triton's rule)
    s = Server(repo, "--backend-directory", str(backends), "--model-control-mode", "explicit",
               "--load-model", "*", env={"PYTHONPATH": pythonpath},
               wait_ready=False)
    s.repo = repo
    wait_for(lambda: all(s.model_ready(m) for m in ("double", "squash", "hello", "bonjour",
                                                     "scale")), 90, "the models to load")
    yield s
    assert s.stop() == 0


def test_the_shipped_expression_backend_serves_two_models(server):
    x = np.array([[-1.0, 0.0, 0.5, 2.0]], np.float32)
    h = httpclient.InferenceServerClient(server.url)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    for client, mod in ((h, httpclient), (g, grpcclient)):
        inp = mod.InferInput("X", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("double", [inp]).as_numpy("Y"), x * 2 + 1)
        np.testing.assert_allclose(client.infer("squash", [inp]).as_numpy("Y"),
                                   np.tanh(x) + (x > 0), rtol=1e-6)
    # Triton reports a python-based backend's runtime so
    cfg = h.get_model_config("double")
    assert cfg["backend"] == "expression" and cfg["runtime"] == "model.py"


def test_a_backend_in_the_users_directory_gets_each_models_own_directory_and_config(server):
    import json
    h = httpclient.InferenceServerClient(server.url)
    for model, greeting in (("hello", "hello"), ("bonjour", "bonjour")):
        inp = httpclient.InferInput("IN", [1], "FP32")
        inp.set_data_from_numpy(np.zeros(1, np.float32))
        facts = json.loads(h.infer(model, [inp]).as_numpy("FACTS")[0])
        assert facts == {"repository": os.path.join(server.repo, model), "name": model,
                         "version": "1", "greeting": greeting}


def test_a_plug_in_from_an_installed_package_batches_and_counts_like_a_built_in(server):
    h = httpclient.InferenceServerClient(server.url, concurrency=16)
    pending = []
    for k in range(64):
        inp = httpclient.InferInput("IN", [1, 2], "FP32")
        inp.set_data_from_numpy(np.array([[k, -k]], np.float32))
        pending.append(h.async_infer("scale", [inp]))
    for k, p in enumerate(pending):
        np.testing.assert_array_equal(p.get_result(timeout=60).as_numpy("OUT"), [[3 * k, -3 * k]])
    stats = h.get_inference_statistics("scale")["model_stats"][0]
    assert stats["inference_count"] == 64
    # the 20 ms queue delay gathers concurrent requests into batches
    assert stats["execution_count"] < 64
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert 'nv_inference_request_success{model="scale",version="1"} 64' in metrics
    assert 'nv_inference_exec_count{model="scale",version="1"}' in metrics


@pytest.mark.parametrize("model, words", [
    ("sneaky", ["the expression of output 'Y'", "only calls of"]),
    ("unknown_name", ["unknown name 'Z'", "inputs: X"]),
    ("too_long", ["the expression of output 'Y'", "longer than 4096 characters"]),
    ("too_deep", ["initialize() of model 'too_deep' failed"]),
    ("nosuch", ["unable to find backend library for backend 'nosuch'", "nosuch/model.py",
                "'shmserve.backends' entry points", "the backends that exist: broken, echo_facts, "
                "expression, identity, onnxruntime, python, repeat, scale, square, tensorrt"]),
    ("escaping", ["unable to find backend library for backend '../backends/echo_facts'"]),
    ("platform", ["unexpected platform type 'pytorch_libtorch' for platform",
                  "supported platforms: ensemble, onnxruntime_onnx, tensorrt_plan"]),
    ("negative", ["backend 'scale' (tiny_backend:Scale) failed to load model 'negative'",
                  "FACTOR must not be negative"]),
    ("broken", ["failed to import backend 'broken' (tiny_backend_missing:Nothing)",
                "ModuleNotFoundError"]),
])
def test_what_cannot_load_is_unavailable_with_its_reason(server, model, words):
    entry = wait_for(lambda: (m := _index(server)[model]).get("state") == "UNAVAILABLE" and m,
                     60, f"{model} to fail its load")
    for w in words:
        assert w in entry["reason"], entry["reason"]
    assert server.model_ready("double")


def test_the_backends_directory_is_read_at_each_load(server, tmp_path):
    """A python-based backend added to the directory is found by the next load (no restart),
    as a model added to the repository is."""
    backends = None
    for arg_at, arg in enumerate(server.proc.args):
        if arg == "--backend-directory":
            backends = server.proc.args[arg_at + 1]
    assert backends
    os.makedirs(os.path.join(backends, "late"), exist_ok=True)
    with open(os.path.join(backends, "late", "model.py"), "w") as f:
        f.write(ECHO_BACKEND)
    write_model(server.repo, "late_model", (ECHO_CONFIG % "late").replace("echo_facts", "late"), None)
    r = requests.post(f"{server.base}/v2/repository/models/late_model/load", timeout=60)
    assert r.status_code == 200, r.text
    assert server.model_ready("late_model")
