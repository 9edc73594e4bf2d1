"""The identity backend in-process: its config rules, its answers, its delays and its metric."""
import json
import time

import numpy as np
import pytest

from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest, load_backend
from shmserve.workers.backends.identity import RESPONSE_PARAMETERS
from shmserve.workers.python_backend import metrics as pb_metrics


def _spec(inputs, outputs, max_batch_size=8, parameters=None, index=0, name="ident"):
    cfg = {"name": name, "backend": "identity", "max_batch_size": max_batch_size,
           "input": inputs, "output": outputs, "parameters": parameters or {}}
    return InstanceSpec(name, 1, "/nonexistent", json.dumps(cfg), f"{name}_0", "CPU", 0,
                        "identity", instance_index=index)


def _io(name, dtype="TYPE_INT32", dims=(-1,), **extra):
    return {"name": name, "data_type": dtype, "dims": list(dims), **extra}


def _counter(model="ident"):
    family = pb_metrics.REGISTRY.families["input_byte_size_counter"]
    return family.Metric({"model": model, "version": "1"}).value()


@pytest.mark.parametrize("inputs,outputs,message", [
    ([_io("INPUT0"), _io("INPUT1")], [_io("OUTPUT0")],
     "model configuration must have equal input/output pairs"),
    ([_io("IN0")], [_io("OUTPUT0")], "expected input name to follow INPUT<index> pattern, got 'IN0'"),
    ([_io("INPUT0")], [_io("OUT0")],
     "expected output name to follow OUTPUT<index> pattern, got 'OUT0'"),
    ([_io("INPUT0")], [_io("OUTPUT1")], "expected input and output indices to match"),
    ([_io("INPUT0")], [_io("OUTPUT0", "TYPE_FP32")],
     "expected input and output datatype to match, got TYPE_INT32 and TYPE_FP32"),
    ([_io("INPUT0", dims=(4,))], [_io("OUTPUT0", dims=(2, 2))],
     "expected input and output shape to match, got [4] and [2,2]"),
])
def test_bad_configs_fail_the_load_with_the_identity_backends_words(inputs, outputs, message):
    with pytest.raises(BackendLoadError) as e:
        load_backend(_spec(inputs, outputs))
    assert str(e.value) == message


def test_a_reshape_is_the_shape_compared():
    load_backend(_spec([_io("INPUT0", dims=(4,), reshape={"shape": [2, 2]})],
                       [_io("OUTPUT0", dims=(2, 2))]))


def test_each_requested_output_is_its_input_as_sent_with_the_example_parameters():
    backend = load_backend(_spec([_io("INPUT0"), _io("INPUT1", "TYPE_STRING")],
                                 [_io("OUTPUT0"), _io("OUTPUT1", "TYPE_STRING")], name="ident_a"))
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    s = np.array([[b"x", b"yz"]], dtype=object)
    every, only_one = backend.execute([
        WorkRequest({"INPUT0": a, "INPUT1": s}, {"INPUT0": "INT32", "INPUT1": "BYTES"}, []),
        WorkRequest({"INPUT0": a, "INPUT1": s}, {"INPUT0": "INT32", "INPUT1": "BYTES"},
                    ["OUTPUT1"])])
    assert [(n, t) for n, t, _ in every.outputs] == [("OUTPUT0", "INT32"), ("OUTPUT1", "BYTES")]
    np.testing.assert_array_equal(every.outputs[0][2], a)
    assert every.outputs[1][2].tolist() == [[b"x", b"yz"]]
    assert [n for n, _, _ in only_one.outputs] == ["OUTPUT1"]
    assert every.parameters == RESPONSE_PARAMETERS and not every.error
    # the bytes of the inputs copied: 24 + (4+1 + 4+2) for the first, 11 for the second
    assert _counter("ident_a") == 24 + 11 + 11


def test_an_absent_optional_input_answers_zeros_of_the_configs_shape():
    backend = load_backend(_spec([_io("INPUT0"), _io("INPUT1", "TYPE_FP32", (-1, 3), optional=True)],
                                 [_io("OUTPUT0"), _io("OUTPUT1", "TYPE_FP32", (-1, 3))]))
    (resp,) = backend.execute([WorkRequest({"INPUT0": np.zeros((2, 5), np.int32)},
                                           {"INPUT0": "INT32"}, [])])
    out1 = resp.outputs[1]
    assert out1[:2] == ("OUTPUT1", "FP32") and out1[2].shape == (2, 1, 3)
    assert not out1[2].any()


def test_an_absent_input_that_is_not_optional_is_an_error_of_its_own():
    backend = load_backend(_spec([_io("INPUT0"), _io("INPUT1")], [_io("OUTPUT0"), _io("OUTPUT1")]))
    (resp,) = backend.execute([WorkRequest({"INPUT0": np.zeros((1, 2), np.int32)},
                                           {"INPUT0": "INT32"}, ["OUTPUT1"])])
    assert resp.error == "failed to get input 'INPUT1'" and resp.code == ErrorCode.UNSUPPORTED


@pytest.mark.parametrize("index", [0, 1, 2])
def test_execute_delay_times_the_instance_wise_multiplier(index):
    params = {"execute_delay_ms": {"string_value": "20"},
              "instance_wise_delay_multiplier": {"string_value": "2"}}
    backend = load_backend(_spec([_io("INPUT0")], [_io("OUTPUT0")], parameters=params,
                                 index=index))
    # index 0 sleeps the delay once (a multiplier of 0 counts as 1), index n sleeps n x 2 times it
    assert backend.delay_s == pytest.approx(max(index * 2, 1) * 20 / 1000)
    t0 = time.monotonic()
    backend.execute([WorkRequest({"INPUT0": np.zeros((1, 1), np.int32)}, {"INPUT0": "INT32"}, [])])
    assert time.monotonic() - t0 >= max(index * 2, 1) * 20 / 1000


def test_a_parameter_that_is_not_an_integer_fails_the_load():
    with pytest.raises(BackendLoadError, match="parameter 'execute_delay_ms' must be an integer"):
        load_backend(_spec([_io("INPUT0")], [_io("OUTPUT0")],
                           parameters={"execute_delay_ms": {"string_value": "soon"}}))
