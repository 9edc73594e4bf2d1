"""A python model that is not decoupled and returns None (or a list of the wrong length, or not a
list) from execute(): the client gets 500 with Triton's words at once, instead of waiting for the
request deadline (an hour), and the model goes on serving. The details per return are tested
in-process (tests/workers/test_python_backend_returns.py)."""
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server
from tritonclient.utils import InferenceServerException

MODEL = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            x = requests[0].inputs()[0].as_numpy()
            if x[0, 0] == 1:
                return None
            if x[0, 0] == 2:
                return []
            if x[0, 0] == 3:
                return "not a list"
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                    for r in requests]
''')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("returns"))
    write_model(root, "returns", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', MODEL)
    s = Server(root)
    yield s
    assert s.stop() == 0


def _infer(srv, value: float, mod=httpclient):
    x = np.full((1, 1), value, dtype=np.float32)
    inp = mod.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    if mod is httpclient:
        with httpclient.InferenceServerClient(srv.url, network_timeout=30) as c:
            return c.infer("returns", [inp])
    with grpcclient.InferenceServerClient(srv.grpc_url) as c:
        return c.infer("returns", [inp], client_timeout=30)


PREFIX = "Failed to process the request(s) for model 'returns_0_0', message: "


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
@pytest.mark.parametrize("value, words", [
    (1, "Expected a list in the execute return, found type '<class 'NoneType'>'."),
    (2, "Number of InferenceResponse objects do not match the number of InferenceRequest "
        "objects. InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0"),
    (3, "Expected a list in the execute return, found type '<class 'str'>'."),
])
def test_a_wrong_return_is_answered_at_once_with_tritons_words(srv, mod, value, words):
    # the client's 30 s timeout ends the wait: before, no answer came until the deadline
    with pytest.raises(InferenceServerException) as e:
        _infer(srv, value, mod)
    assert e.value.message().startswith(PREFIX + words), e.value.message()
    assert e.value.status() in ("500", "StatusCode.INTERNAL")
    assert _infer(srv, 5, mod).as_numpy("OUTPUT0").tolist() == [[5.0]]   # it serves on
