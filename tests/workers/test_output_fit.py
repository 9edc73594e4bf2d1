"""OutputChecks.fit: what Triton's python backend passes on although numpy's type differs from
the config's (its examples return np.array([0]) for INT32 and np.array([]) for BYTES) gets the
config's type; everything else stays for OutputChecks.problem to refuse."""
import numpy as np

from shmserve.workers.tensors import OutputChecks

CONFIG = {"name": "m", "max_batch_size": 0, "output": [
    {"name": "I32", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "TEXT", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "F32", "data_type": "TYPE_FP32", "dims": [-1]}]}


def test_integers_that_fit_take_the_config_type():
    checks = OutputChecks(CONFIG)
    datatype, arr = checks.fit("I32", "INT64", np.array([0, -5, 2 ** 31 - 1]))
    assert datatype == "INT32" and arr.dtype == np.int32 and arr.tolist() == [0, -5, 2 ** 31 - 1]
    assert checks.problem("I32", datatype, arr.shape) == ""


def test_integers_that_do_not_fit_stay_and_are_refused():
    checks = OutputChecks(CONFIG)
    datatype, arr = checks.fit("I32", "INT64", np.array([2 ** 40]))
    assert datatype == "INT64"
    assert "unexpected datatype INT64 for inference output 'I32'" in \
        checks.problem("I32", datatype, arr.shape)


def test_empty_outputs_take_the_config_type():
    checks = OutputChecks(CONFIG)
    datatype, arr = checks.fit("TEXT", "FP64", np.array([]))
    assert datatype == "BYTES" and arr.dtype == object and arr.shape == (0,)


def test_floats_are_not_converted():
    checks = OutputChecks(CONFIG)
    assert checks.fit("F32", "FP64", np.ones(2))[0] == "FP64"
    assert checks.fit("I32", "FP32", np.ones(2, np.float32))[0] == "FP32"
