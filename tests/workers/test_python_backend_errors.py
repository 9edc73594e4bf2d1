"""What a python model's failure reads like: Triton's words, naming the model instance, then
where the model raised, as Triton's stub writes it."""
import json

import numpy as np
import pytest

from shmserve.ipc.messages import ErrorCode, InstanceSpec
from shmserve.workers.backend import WorkRequest
from shmserve.workers.python_backend import PythonBackend

RAISES = """
class TritonPythonModel:
    def execute(self, requests):
        return helper()


def helper():
    raise RuntimeError("boom")
"""
RAISES_ASYNC = RAISES.replace("    def execute", "    async def execute")


@pytest.mark.parametrize("source", [RAISES, RAISES_ASYNC], ids=["sync", "async"])
def test_an_exception_in_execute_fails_each_request_naming_the_instance(tmp_path, source):
    (tmp_path / "raises" / "1").mkdir(parents=True)
    path = tmp_path / "raises" / "1" / "model.py"
    path.write_text(source)
    cfg = {"name": "raises", "backend": "python", "max_batch_size": 0,
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}
    backend = PythonBackend(InstanceSpec("raises", 1, str(tmp_path / "raises"), json.dumps(cfg),
                                         "raises_0", "CPU", 0, "python"))
    request = WorkRequest({"IN": np.zeros(1, np.float32)}, {"IN": "FP32"}, [])
    [response] = backend.execute([request])
    # Triton 2.51's words for the same model: the instance, the exception, then the model's
    # frames innermost first (none of the server's own, nor asyncio's)
    assert response.error == (f"Failed to process the request(s) for model 'raises_0', message: "
                              f"RuntimeError: boom\n\nAt:\n  {path}(8): helper\n"
                              f"  {path}(4): execute\n")
    assert response.code == ErrorCode.INTERNAL
