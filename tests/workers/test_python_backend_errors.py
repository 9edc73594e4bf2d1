"""What a python model's failure reads like: Triton's words, naming the model instance, then
where the model raised, as Triton's stub writes it."""
import json

import numpy as np
import pytest

from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest
from shmserve.workers.python_backend.backend import PythonBackend

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


def _load(root, name: str, dtype: str) -> PythonBackend:
    """The python model ``root/name/1/model.py`` with one input IN and one output OUT [1]."""
    cfg = {"name": name, "backend": "python", "max_batch_size": 0,
           "input": [{"name": "IN", "data_type": dtype, "dims": [1]}],
           "output": [{"name": "OUT", "data_type": dtype, "dims": [1]}]}
    return PythonBackend(InstanceSpec(name, 1, str(root / name), json.dumps(cfg), f"{name}_0_0",
                                      "CPU", 0, "python"))


def test_model_py_imports_its_neighbours_relatively_and_absolutely(tmp_path):
    """As under Triton's stub (its multi_file test): `from . import file2` and `import file2`."""
    d = tmp_path / "multi_file" / "1"
    d.mkdir(parents=True)
    (d / "file2.py").write_text("VALUE = 7\n")
    (d / "model.py").write_text(
        "import numpy as np\n"
        "import triton_python_backend_utils as pb_utils\n"
        "from . import file2\n"
        "import file2 as absolute\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        v = np.array([file2.VALUE + absolute.VALUE], np.float32)\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', v)])\n"
        "                for _ in requests]\n")
    backend = _load(tmp_path, "multi_file", "TYPE_FP32")
    request = WorkRequest({"IN": np.zeros(1, np.float32)}, {"IN": "FP32"}, [])
    [response] = backend.execute([request])
    assert response.outputs[0][2].tolist() == [14.0]


def test_bls_in_initialize_fails_the_load_with_tritons_words(tmp_path):
    """Triton's bls_init_error test: BLS is for execute() only."""
    from shmserve.ipc.errors import BackendLoadError
    d = tmp_path / "bls_init_error" / "1"
    d.mkdir(parents=True)
    (d / "model.py").write_text(
        "import numpy as np\n"
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        pb_utils.InferenceRequest(model_name='square_int32', requested_output_names=['OUT'],\n"
        "            inputs=[pb_utils.Tensor('IN', np.array([1], np.int32))]).exec(decoupled=True)\n"
        "    def execute(self, requests):\n"
        "        return None\n")
    with pytest.raises(BackendLoadError) as e:
        _load(tmp_path, "bls_init_error", "TYPE_INT32")
    assert "BLS is only supported during the 'execute' function." in str(e.value)
