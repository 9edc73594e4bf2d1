"""A worker takes its model's objects out of the collector's reach once the model has loaded
(ipc/proc.freeze_startup_heap), so a full collection never walks them mid-request."""
import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server

HEAP = '''
import gc
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.tables = [[i] for i in range(50000)]      # a model's long-lived state

    def execute(self, requests):
        seen = np.array([gc.get_freeze_count(), len(gc.get_objects())], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]) for _ in requests]
'''

CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "SEEN", data_type: TYPE_INT64, dims: [ 2 ] } ]
'''


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_freezes_what_its_model_made_at_load(tmp_path, start):
    write_model(str(tmp_path), "heap", CONFIG, HEAP)
    srv = Server(str(tmp_path), "--worker-start", start)
    c = httpclient.InferenceServerClient(srv.url)
    try:
        inp = httpclient.InferInput("INPUT0", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], dtype=np.int32))
        frozen, tracked = c.infer("heap", [inp]).as_numpy("SEEN").tolist()
    finally:
        c.close()
        srv.stop()
    assert frozen >= 50_000         # the model's tables among them
    assert tracked < 5_000          # what the collector still walks: made since
