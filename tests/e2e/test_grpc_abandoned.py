"""A gRPC call that ends before its answer (the client's deadline, or its cancel) gives back
everything the answer holds when it comes: the worker's output slots and the request's input
slots, so the server's shared-memory segments all go once it is at rest."""
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from repo_builder import write_model
from serverproc import Server, segments_of, wait_for
from tritonclient.utils import InferenceServerException

SLOW_BIG = '''
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        threading.Event().wait(0.6)     # past the clients' deadline
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.tile(x, 4))]))
        return out
'''

CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 262144 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1048576 ] } ]
'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("abandoned"))
    write_model(root, "slow_big", CONFIG, SLOW_BIG)
    s = Server(root)
    yield s
    s.stop()


def shm_segments(srv) -> int:
    return len(segments_of(srv.proc.pid))


def _input():
    i = grpcclient.InferInput("INPUT0", [262144], "FP32")       # 1 MiB in, 4 MiB out
    i.set_data_from_numpy(np.arange(262144, dtype=np.float32))
    return i


def test_a_call_past_its_deadline_leaks_no_shared_memory(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        for _ in range(3):
            with pytest.raises(InferenceServerException, match="Deadline Exceeded") as e:
                c.infer("slow_big", [_input()], client_timeout=0.2)
            assert e.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
        # the answers come after their calls ended; each gives its slots back
        wait_for(lambda: shm_segments(srv) == 0, 30,
                 f"the server's segments to go (now {segments_of(srv.proc.pid)})")
        # and the server serves on
        r = c.infer("slow_big", [_input()], client_timeout=30)
        assert r.as_numpy("OUTPUT0").shape == (1048576,)
    finally:
        c.close()


def test_a_cancelled_call_leaks_no_shared_memory(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        done = threading.Event()
        errors = []
        call = c.async_infer("slow_big", [_input()],
                             callback=lambda result, error: (errors.append(error), done.set()))
        wait_for(lambda: shm_segments(srv) > 0, 20, "the request's input to reach the server")
        call.cancel()
        assert done.wait(20)
        assert errors and errors[0] is not None
        wait_for(lambda: shm_segments(srv) == 0, 30,
                 f"the server's segments to go (now {segments_of(srv.proc.pid)})")
    finally:
        c.close()

