"""Writes the test-only model repositories (python models) into a temporary directory."""
from __future__ import annotations

import os
import shutil
import textwrap

from shmserve.ipc.dtypes import WIRE_TO_CONFIG

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IDENTITY = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                t = r.inputs()[0]
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", t.as_numpy())]))
            return out
''')

PID_SLOW = textwrap.dedent('''
    import json, os, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                delay = json.loads(r.parameters()).get("delay_ms", 0)
                time.sleep(delay / 1000.0)
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                pid = np.full((x.shape[0], 1), os.getpid(), dtype=np.int64)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x),
                                                       pb_utils.Tensor("PID", pid)]))
            return out
''')

FAULTY = textwrap.dedent('''
    import os, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                v = int(pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()[0])
                if v == 1:
                    raise ValueError("model raised on purpose")
                if v == 2:
                    out.append(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("value 2 is refused", pb_utils.TritonError.INVALID_ARG)))
                    continue
                if v == 3:
                    os._exit(3)
                if v == 6:
                    import ctypes
                    ctypes.string_at(0)         # a segfault in native code
                if v == 4:
                    time.sleep(60)
                res = np.array([os.getpid() if v == 5 else v], dtype=np.int64)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", res)]))
            return out
''')

RESHAPE = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                # one row per request in the batch, as the config's [-1, 3] says
                shape = np.array([x.shape] * x.shape[0], dtype=np.int64)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x),
                                                       pb_utils.Tensor("SEEN_SHAPE", shape)]))
            return out
''')

OPTIONAL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                b = pb_utils.get_input_tensor_by_name(r, "B")
                total = a + (b.as_numpy() if b is not None else 0)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total.astype(np.int32))]))
            return out
''')

BAD_INIT = textwrap.dedent('''
    class TritonPythonModel:
        def initialize(self, args):
            raise RuntimeError("initialize failed on purpose")

        def execute(self, requests):
            return []
''')


# Exits the worker process on the value -1, echoes anything else: one poison request among good
# ones (issue 13's poison test, also driven by bench/poison.py).
POISON = textwrap.dedent('''
    import os
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = r.inputs()[0].as_numpy()
                if (x == -1).any():
                    os._exit(3)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
''')
POISON_CONFIG = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    instance_group [ { count: 2, kind: KIND_CPU } ]
    dynamic_batching { max_queue_delay_microseconds: 200 }
'''


def write_model(repo: str, name: str, config: str, code: str | None, version: int = 1) -> None:
    d = os.path.join(repo, name)
    os.makedirs(os.path.join(d, str(version)), exist_ok=True)
    with open(os.path.join(d, "config.pbtxt"), "w") as f:
        f.write(textwrap.dedent(config))
    if code is not None:
        with open(os.path.join(d, str(version), "model.py"), "w") as f:
            f.write(code)


def build_test_repository(root: str) -> str:
    repo = os.path.join(root, "test_models")
    for wire, cfg_type in WIRE_TO_CONFIG.items():
        write_model(repo, f"id_{wire.lower()}", f'''
            backend: "python"
            max_batch_size: 8
            input [ {{ name: "INPUT0", data_type: {cfg_type}, dims: [ -1 ] }} ]
            output [ {{ name: "OUTPUT0", data_type: {cfg_type}, dims: [ -1 ] }} ]
        ''', IDENTITY)
    write_model(repo, "nobatch_fp32", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2, -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2, -1 ] } ]
    ''', IDENTITY)
    write_model(repo, "pid_slow", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
                 { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
        instance_group [ { count: 2, kind: KIND_CPU } ]
    ''', PID_SLOW)
    write_model(repo, "faulty", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT64, dims: [ 1 ] } ]
        parameters { key: "execution_timeout_ms" value: { string_value: "3000" } }
        parameters { key: "retry_on_worker_death" value: { string_value: "false" } }
    ''', FAULTY)
    write_model(repo, "reshaped", '''
        backend: "python"
        max_batch_size: 4
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ], reshape: { shape: [ 2, 2 ] } } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ], reshape: { shape: [ 2, 2 ] } },
                 { name: "SEEN_SHAPE", data_type: TYPE_INT64, dims: [ 3 ] } ]
    ''', RESHAPE)
    write_model(repo, "optional_in", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "A", data_type: TYPE_INT32, dims: [ 3 ] },
                { name: "B", data_type: TYPE_INT32, dims: [ 3 ], optional: true } ]
        output [ { name: "SUM", data_type: TYPE_INT32, dims: [ 3 ] } ]
    ''', OPTIONAL)
    add_versioned_model(repo)
    add_batching_models(repo)
    return repo


VERSION_ECHO = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.version = int(args["model_version"])

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("VERSION", np.array([self.version], dtype=np.int32))])
                    for _ in requests]
''')


def add_versioned_model(repo: str) -> None:
    """Versions 1, 2 and 3 on disk; the policy serves 1 and 3."""
    for v in (1, 2, 3):
        write_model(repo, "versioned", '''
            backend: "python"
            max_batch_size: 0
            version_policy: { specific { versions: [ 1, 3 ] } }
            input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
            output [ { name: "VERSION", data_type: TYPE_INT32, dims: [ 1 ] } ]
        ''', VERSION_ECHO, version=v)


BATCH_ECHO = textwrap.dedent('''
    import itertools, json, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    _calls = itertools.count(1)

    class TritonPythonModel:
        def execute(self, requests):
            call = next(_calls)
            delay = max(json.loads(r.parameters()).get("delay_ms", 0) for r in requests)
            time.sleep(delay / 1000.0)
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                n = x.shape[0]
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT0", x),
                    pb_utils.Tensor("CALL", np.full((n, 1), call, dtype=np.int64)),
                    pb_utils.Tensor("REQUESTS", np.full((n, 1), len(requests), dtype=np.int64))]))
            return out
''')

BATCH_IO = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
             { name: "CALL", data_type: TYPE_INT64, dims: [ 1 ] },
             { name: "REQUESTS", data_type: TYPE_INT64, dims: [ 1 ] } ]
'''


def add_batching_models(repo: str) -> None:
    """Python models that report which execution served a request and how many shared it."""
    variants = {
        # waits up to 10 s for a batch of 4 (so the test, not the clock, decides the batch)
        "batch4": "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 10000000 }",
        # a lone request waits out the 300 ms delay
        "delayed": "dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 300000 }",
        "timeout_reject": "dynamic_batching { default_queue_policy { timeout_action: REJECT "
                          "default_timeout_microseconds: 100000 } }",
        "bounded": "dynamic_batching { default_queue_policy { max_queue_size: 1 } }",
        "prio": "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
        "ordered": "dynamic_batching { preserve_ordering: true }\n"
                   "instance_group [ { count: 2, kind: KIND_CPU } ]",
        "unordered": "dynamic_batching { }\ninstance_group [ { count: 2, kind: KIND_CPU } ]",
    }
    for name, extra in variants.items():
        config = BATCH_IO + extra
        if name in ("prio", "ordered", "unordered", "bounded", "timeout_reject"):
            config = config.replace("max_batch_size: 8", "max_batch_size: 1")
        write_model(repo, name, config, BATCH_ECHO)


def build_bad_repository(root: str) -> str:
    repo = os.path.join(root, "bad_models")
    write_model(repo, "good", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    ''', IDENTITY)
    write_model(repo, "bad_pbtxt", '''
        backend: "python"
        max_batch_size: eight
    ''', IDENTITY)
    write_model(repo, "no_model_file", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', None)
    write_model(repo, "bad_init", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', BAD_INIT)
    write_model(repo, "init_exit", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', "import os\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
         "        os._exit(3)\n\n    def execute(self, requests):\n        return []\n")
    write_model(repo, "wrong_name", '''
        name: "another_name"
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', IDENTITY)
    onnx_gpu = os.path.join(repo, "onnx_gpu", "1")
    os.makedirs(onnx_gpu)
    shutil.copy(os.path.join(REPO_ROOT, "configs", "models", "mlp_onnx", "1", "model.onnx"), onnx_gpu)
    with open(os.path.join(repo, "onnx_gpu", "config.pbtxt"), "w") as f:
        f.write('backend: "onnxruntime"\nmax_batch_size: 8\n'
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]\n'
                'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]\n'
                'instance_group [ { kind: KIND_GPU } ]\n')
    write_model(repo, "bad_backend", '''
        backend: "tensorflow"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    ''', IDENTITY)
    return repo
