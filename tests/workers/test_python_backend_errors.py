"""What a python model's failure reads like: Triton's words, naming the model instance."""
import json

import numpy as np

from shmserve.ipc.messages import ErrorCode, InstanceSpec
from shmserve.workers.backend import WorkRequest
from shmserve.workers.python_backend import PythonBackend

RAISES = """
class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("boom")
"""


def test_an_exception_in_execute_fails_each_request_naming_the_instance(tmp_path):
    (tmp_path / "raises" / "1").mkdir(parents=True)
    (tmp_path / "raises" / "1" / "model.py").write_text(RAISES)
    cfg = {"name": "raises", "backend": "python", "max_batch_size": 0,
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}
    backend = PythonBackend(InstanceSpec("raises", 1, str(tmp_path / "raises"), json.dumps(cfg),
                                         "raises_0", "CPU", 0, "python"))
    request = WorkRequest({"IN": np.zeros(1, np.float32)}, {"IN": "FP32"}, [])
    [response] = backend.execute([request])
    # Triton 2.51 gives the same words (then the traceback): the instance, not the model
    assert response.error == "Failed to process the request(s) for model 'raises_0', message: " \
                             "RuntimeError: boom"
    assert response.code == ErrorCode.INTERNAL
