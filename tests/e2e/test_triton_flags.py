"""A tritonserver command line starts shmserve unchanged: the keep-alive, connection age and
compression flags go to the gRPC server, the flags of parts shmserve lacks are logged as having
no effect, and the server serves both protocols (tests/engine/test_compat_flags.py checks each
flag; here, the real processes)."""
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import Server
from triton_line import TRITON_LINE


@pytest.fixture(scope="module")
def srv(example_repo):
    s = Server(example_repo, *TRITON_LINE, "--grpc-max-connection-age-grace", "1000")
    yield s
    s.stop()


def simple_inputs(module):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return a, inputs


def test_it_serves_http_and_grpc_with_compressed_grpc_requests(srv):
    a, inputs = simple_inputs(httpclient)
    r = httpclient.InferenceServerClient(srv.url).infer("simple", inputs)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + a)
    a, inputs = simple_inputs(grpcclient)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    for algorithm in (None, "gzip", "deflate"):
        r = g.infer("simple", inputs, compression_algorithm=algorithm)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - a)


def test_flags_without_effect_are_logged(srv):
    log = srv.log_text()
    for flag in ("--pinned-memory-pool-byte-size", "--backend-config", "--host-policy"):
        assert f"{flag} is accepted for compatibility and has no effect" in log


def test_a_flag_that_turns_on_a_missing_feature_stops_the_start(example_repo):
    p = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository",
                        example_repo, "--model-namespacing", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "--model-namespacing true: model namespacing is not supported" in p.stderr
