"""Triton's test hook TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC, which its QA suites use to
test clients' timeouts: every gRPC answer but an inference's is held that long."""
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serverproc import Server
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def server(example_repo):
    s = Server(example_repo, env={"TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC": "2"})
    yield s
    assert s.stop() == 0


def test_non_inference_answers_are_held_and_inference_is_not(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    for call in (lambda: c.get_server_metadata(client_timeout=0.5),
                 lambda: c.is_model_ready("simple", client_timeout=0.5),
                 lambda: c.get_model_repository_index(client_timeout=0.5)):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert "Deadline Exceeded" in str(e.value)
    assert c.is_server_live(client_timeout=10)          # held 2 s, within its deadline
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    out = c.infer("simple", inputs, client_timeout=1.5).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, a + a)
