"""Model upload through the load API (Triton's "load with file override"): 'file:<path>'
parameters with a 'config', over HTTP (base64) and gRPC (bytes), against the real server.

An uploaded model serves, replaces a repository model of the same name while loaded, and a plain
load goes back to the repository's copy. Bad names, bad base64, files without a config and
uploads past --model-upload-max-bytes are refused with a message naming the parameter, and the
server keeps serving. The files live in a private directory under the server's run directory,
which goes away on unload, on replacement and at stop; the repository is never written to.
The unit tests: tests/frontend/test_upload_paths.py, tests/engine/test_upload_dirs.py."""
import base64
import glob
import http.client
import json
import os
import shutil
import stat
import tempfile
import urllib.parse

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import Server, wait_for
from tritonclient.utils import InferenceServerException

onnx = pytest.importorskip("onnx", reason="the onnx package builds the test model ([test] extra)")

ONNX_CONFIG = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})   # I/O auto-completed

# a python 'simple' that answers a constant, so a reply shows which copy of 'simple' served it
MARKED_SIMPLE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        with open(args["model_repository"] + "/marker.txt") as f:
            self.marker = int(f.read())

    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            mark = np.full_like(a, self.marker)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", mark),
                                                   pb_utils.Tensor("OUTPUT1", mark)]))
        return out
'''
SIMPLE_CONFIG = json.dumps({
    "backend": "python", "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
              {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
               {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}]})


def scale_onnx(factor: float) -> bytes:
    """FP32 [-1, 4] -> OUTPUT0 = INPUT0 * factor."""
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "scale",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def listing(root: str) -> dict[str, tuple]:
    """Every path under ``root`` with its size and mtime: what "nothing written" compares."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def uploads_of(srv: Server) -> list[str]:
    """The server's upload directories: <run dir>/uploads/* (the run dir carries its pid)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"shmserve-{srv.proc.pid}-*",
                                  "uploads", "*"))


def scale(client, model: str, x: np.ndarray, grpc: bool = False) -> np.ndarray:
    mod = grpcclient if grpc else httpclient
    inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUTPUT0")


def simple_output(client) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return client.infer("simple", inputs).as_numpy("OUTPUT0")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, example_repo):
    path = str(tmp_path_factory.mktemp("upload") / "repo")
    shutil.copytree(example_repo, path, symlinks=True)
    return path


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "simple",
               "--model-upload-max-bytes", str(1 << 20))
    yield s
    s.stop()


def test_upload_onnx_over_http_and_grpc_then_unload_removes_it(srv, repo):
    before = listing(repo)
    h = httpclient.InferenceServerClient(srv.url)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    h.load_model("scale_http", config=ONNX_CONFIG, files={"file:1/model.onnx": scale_onnx(2.0)})
    # a leading '/' names the model directory, as in Triton's own model control tests
    g.load_model("scale_grpc", config=ONNX_CONFIG, files={"file:/1/model.onnx": scale_onnx(3.0)})
    np.testing.assert_array_equal(scale(h, "scale_http", x), x * 2)
    np.testing.assert_array_equal(scale(g, "scale_grpc", x, grpc=True), x * 3)
    assert h.get_model_config("scale_grpc")["input"][0]["name"] == "INPUT0"    # auto-completed
    dirs = uploads_of(srv)
    assert len(dirs) == 2
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert os.path.isfile(os.path.join(d, "1", "model.onnx"))
    h.unload_model("scale_http")
    g.unload_model("scale_grpc")
    wait_for(lambda: uploads_of(srv) == [], 30, "the upload directories to be removed")
    # the scheduler removes the directories, then publishes the table the frontend answers from
    wait_for(lambda: not {"scale_http", "scale_grpc"} & {     # as Triton: the repository's
        e["name"] for e in h.get_model_repository_index()}, 30, "the index to forget them")
    assert listing(repo) == before


def test_upload_replaces_the_repository_model_and_a_plain_load_restores_it(srv, repo):
    before = listing(repo)
    h = httpclient.InferenceServerClient(srv.url)
    a = np.arange(16, dtype=np.int32)
    np.testing.assert_array_equal(simple_output(h)[0], a + a)          # the repository's copy
    for marker, client in ((7, h), (9, grpcclient.InferenceServerClient(srv.grpc_url))):
        client.load_model("simple", config=SIMPLE_CONFIG,
                          files={"file:1/model.py": MARKED_SIMPLE.encode(),
                                 "file:marker.txt": str(marker).encode()})
        assert set(simple_output(h)[0]) == {marker}
        # the earlier upload's directory went with the version it served
        wait_for(lambda: len(uploads_of(srv)) == 1, 30, "one upload directory")
    h.load_model("simple")                                              # plain: the repository
    np.testing.assert_array_equal(simple_output(h)[0], a + a)
    wait_for(lambda: uploads_of(srv) == [], 30, "the upload directory to be removed")
    assert listing(repo) == before


B64_OK = "AAAA"


@pytest.mark.parametrize("params, needle", [
    ({"config": ONNX_CONFIG, "file:../escape.onnx": B64_OK}, "'file:../escape.onnx'"),
    ({"config": ONNX_CONFIG, "file:1/../../x": B64_OK}, "'file:1/../../x'"),
    ({"config": ONNX_CONFIG, "file://tmp/abs.onnx": B64_OK}, "'file://tmp/abs.onnx' has an empty"),
    ({"config": ONNX_CONFIG, "file:1/a\u0000b": B64_OK}, "'file:1/a\\x00b' contains a NUL"),
    ({"config": ONNX_CONFIG, "file:1\\model.onnx": B64_OK}, "backslash"),
    ({"config": ONNX_CONFIG, "file:1//model.onnx": B64_OK}, "empty path component"),
    ({"config": ONNX_CONFIG, "file:1/model.onnx": "not*base64"}, "'file:1/model.onnx' is not valid"),
    ({"file:1/model.onnx": B64_OK}, "load parameter 'config' must be given with 'file:1/model"),
    ({"config": ONNX_CONFIG, "file:1/model.onnx": "A" * (1 << 21)},
     "'file:1/model.onnx' takes the upload past --model-upload-max-bytes"),
])
def test_bad_uploads_are_refused_over_http_naming_the_parameter(srv, repo, params, needle):
    before = listing(repo)
    r = requests.post(f"{srv.base}/v2/repository/models/bad/load",
                      json={"parameters": params}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.startswith("failed to load 'bad', failed to poll from model repository")
    assert needle in error
    assert uploads_of(srv) == [] and listing(repo) == before
    assert not os.path.exists("/tmp/abs.onnx") and not os.path.exists(os.path.dirname(repo) + "/x")
    assert srv.model_ready("simple")                                    # still serving


@pytest.mark.parametrize("files, config, needle", [
    ({"file:../../escape": b"x"}, ONNX_CONFIG, "'file:../../escape' has a '.' or '..'"),
    ({"file://etc/shmserve": b"x"}, ONNX_CONFIG, "has an empty path component"),
    ({"file:1/model.onnx": b"x"}, None, "load parameter 'config' must be given"),
    ({"file:1/model.onnx": b"x" * ((1 << 20) + 1)}, ONNX_CONFIG, "--model-upload-max-bytes"),
])
def test_bad_uploads_are_refused_over_grpc_naming_the_parameter(srv, repo, files, config, needle):
    before = listing(repo)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.load_model("bad", config=config, files=files)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to poll from model repository" in e.value.message()
    assert needle in e.value.message()
    assert uploads_of(srv) == [] and listing(repo) == before
    assert g.is_model_ready("simple")


def test_an_http_body_past_its_limit_is_a_413(srv):
    # the JSON part's limit plus 1 MiB of files as base64: a longer body is refused by its
    # Content-Length, before it is read (so this sends none)
    limit = (64 << 20) + (1 << 20) // 3 * 4 + 4
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    try:
        conn.putrequest("POST", "/v2/repository/models/bad/load")
        conn.putheader("Content-Length", str(limit + 1))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413
        assert f"exceeds the maximum allowed input size of {limit} bytes" in \
            json.loads(r.read())["error"]
    finally:
        conn.close()
    assert srv.model_ready("simple")


def test_a_name_past_name_max_is_refused_as_triton_refuses_it(srv):
    # Triton's simple_grpc_model_control.py expects INTERNAL and "failed to poll" here
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
    assert e.value.status() == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in e.value.message()
    assert "'file:AAAA" in e.value.message() and "File name too long" in e.value.message()
    assert uploads_of(srv) == [] and g.is_model_ready("simple") and g.is_server_live()


def test_a_model_that_fails_to_load_leaves_nothing(srv, repo):
    before = listing(repo)
    h = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException) as e:
        h.load_model("broken", config=ONNX_CONFIG, files={"file:1/model.onnx": b"not onnx"})
    assert "failed to load" in e.value.message() or "load failed" in e.value.message()
    assert uploads_of(srv) == [] and listing(repo) == before
    assert "broken" not in {m["name"] for m in h.get_model_repository_index()}


PY_IDENTITY = b"""import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0",
                pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""


@pytest.mark.parametrize("name", ["model;test", "model|test", "model$test", "model`test`",
                                  "model(test)", "model'test'", "model*test", "model!test",
                                  "model\\test"])
def test_a_python_model_named_with_shell_characters_fails_to_load_as_in_triton(srv, name):
    """Triton's python backend refuses them (its stub starts through a shell); Triton's
    model_control QA test loads such names through raw HTTP and expects no 200."""
    config = {"name": name, "backend": "python", "max_batch_size": 4,
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}
    body = {"parameters": {"config": json.dumps(config),
                           "file:/1/model.py": base64.b64encode(PY_IDENTITY).decode()}}
    r = requests.post(f"{srv.base}/v2/repository/models/{urllib.parse.quote(name, safe='')}/load",
                      json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "Invalid stub name: contains invalid characters" in r.json()["error"]
    assert uploads_of(srv) == []
    assert srv.model_ready("simple")


def test_uploads_go_with_the_server(repo):
    srv = Server(repo, "--model-control-mode", "explicit", "--grpc-max-message-size", str(1 << 20))
    try:
        h = httpclient.InferenceServerClient(srv.url)
        h.load_model("scale", config=ONNX_CONFIG, files={"file:1/model.onnx": scale_onnx(2.0)})
        (upload,) = uploads_of(srv)
        # a gRPC message past --grpc-max-message-size is refused by gRPC itself, clearly
        g = grpcclient.InferenceServerClient(srv.grpc_url)
        with pytest.raises(InferenceServerException) as e:
            g.load_model("big", config=ONNX_CONFIG, files={"file:1/model.onnx": b"x" * (2 << 20)})
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert g.is_server_live() and uploads_of(srv) == [upload]
    finally:
        assert srv.stop() == 0
    assert not os.path.exists(upload) and not os.path.exists(os.path.dirname(upload))
