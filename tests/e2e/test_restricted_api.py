"""--http-restricted-api / --grpc-restricted-protocol against a real server, with tritonclient."""
import subprocess
import sys

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import Server
from tritonclient.utils import InferenceServerException

ADMIN = {"admin-key": "s3cret"}
INFER_KEY = {"triton-grpc-protocol-infer-key": "k1"}


@pytest.fixture(scope="module")
def server(example_repo):
    s = Server(example_repo, "--http-restricted-api", "model-repository,shared-memory:admin-key=s3cret",
               "--grpc-restricted-protocol", "inference:infer-key=k1")
    yield s
    assert s.stop() == 0


def _x():
    return np.arange(16, dtype=np.float32).reshape(1, 16)


def test_http_restricted_groups_need_the_header(server):
    r = requests.post(f"{server.base}/v2/repository/index", timeout=30)
    assert r.status_code == 403
    assert r.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    r = requests.post(f"{server.base}/v2/repository/index", headers={"Admin-Key": "s3cret"},
                      timeout=30)
    assert r.status_code == 200
    r = requests.get(f"{server.base}/v2/systemsharedmemory/status", timeout=30)
    assert r.status_code == 403
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as e:
        c.get_model_repository_index()
    assert "expecting header 'admin-key'" in e.value.message()
    assert c.get_model_repository_index(headers=ADMIN)
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(_x())
    c.infer("identity_fp32", [inp])             # inference is not restricted over HTTP


def test_grpc_restricted_protocol_needs_the_header(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(_x())
    with pytest.raises(InferenceServerException) as e:
        c.infer("identity_fp32", [inp])
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    assert "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'" in \
        e.value.message()
    out = c.infer("identity_fp32", [inp], headers=INFER_KEY)
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), _x())
    assert c.get_model_repository_index()       # restricted over HTTP only


def test_grpc_stream_is_restricted_too(server):
    results = []
    c = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(_x())
    c.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        c.async_stream_infer("identity_fp32", [inp])
    except InferenceServerException:
        pass            # the stream may already be closed by the refusal, which the callback got
    c.stop_stream()
    assert results and results[0][1] is not None
    assert "expecting header 'triton-grpc-protocol-infer-key'" in str(results[0][1])


@pytest.mark.parametrize("flags, text", [
    (["--http-restricted-api", "inferencing:k=v"], "unknown restricted api 'inferencing'"),
    # the words Triton's L0_grpc greps its log for
    (["--grpc-restricted-protocol=model-reposit,health:k1=v1",
      "--grpc-restricted-protocol=metadata,health:k2=v2"], "unknown restricted protocol 'model-reposit'"),
    (["--grpc-restricted-protocol=model-repository,health:k1=v1",
      "--grpc-restricted-protocol=metadata,health:k2=v2"],
     "protocol 'health' can not be specified in multiple config groups"),
])
def test_a_bad_restriction_stops_the_start(flags, text):
    p = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", "/tmp",
                        *flags], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count(text) == 1, p.stderr
