"""Models for the limit and back-pressure tests: answers far larger than their requests."""
from repo_builder import IDENTITY, write_model

# OUT holds SIZE bytes, each SIZE % 251: a request of a few bytes asks for an answer of any size
SIZED = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "SIZE").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.full(n, n % 251, dtype=np.uint8))]))
        return out
'''

FIXED = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(2000, np.float32))])
                for _ in requests]
'''


def write_sized(repo: str) -> None:
    write_model(repo, "sized", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "SIZE", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
    ''', SIZED)


def write_limit_models(repo: str) -> None:
    """``sized``; identities over FP32 and BYTES with two inputs; ``fixed_out``, whose output
    has fixed dims [2000]."""
    write_sized(repo)
    for name, dtype in (("ident", "TYPE_FP32"), ("ident_bytes", "TYPE_STRING")):
        write_model(repo, name, f'''
            backend: "python"
            max_batch_size: 0
            input [ {{ name: "INPUT0", data_type: {dtype}, dims: [ -1 ] }},
                    {{ name: "INPUT1", data_type: {dtype}, dims: [ -1 ], optional: true }} ]
            output [ {{ name: "OUTPUT0", data_type: {dtype}, dims: [ -1 ] }} ]
        ''', IDENTITY)
    write_model(repo, "fixed_out", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2000 ] } ]
    ''', FIXED)
