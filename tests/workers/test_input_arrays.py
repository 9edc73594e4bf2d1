"""tensors.to_numpy: a request's input as the model sees it, from the message's bytes or from
shared memory (a real segment): the shape and type it was sent with, read-only, and an input
whose bytes do not match its shape is refused as a ValueError (the worker answers it with
"invalid request tensors") rather than read short or long."""
import numpy as np
import pytest

from shmserve.ipc.messages.common import Tensor
from shmserve.workers import tensors


def test_an_inline_input_has_its_shape_and_type_and_cannot_be_written(maps):
    data = np.arange(32, dtype=np.float32)
    arr = tensors.to_numpy(Tensor("x", "FP32", [2, 16], data.tobytes()), maps)
    assert arr.shape == (2, 16) and arr.dtype == np.float32
    assert arr.ravel().tolist() == data.tolist()
    assert not arr.flags.writeable
    empty = tensors.to_numpy(Tensor("x", "INT64", [0, 4], b""), maps)
    assert empty.shape == (0, 4) and empty.dtype == np.int64


def test_an_input_in_shared_memory_is_read_in_place_and_cannot_be_written(arena, maps):
    slot = arena.alloc(64)
    slot.view[:] = np.arange(16, dtype=np.int32).tobytes()
    arr = tensors.to_numpy(Tensor("x", "INT32", [4, 4], None, slot.ref), maps)
    assert arr.tolist() == np.arange(16).reshape(4, 4).tolist()
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0, 0] = 7
    slot.view[:4] = np.int32(99).tobytes()      # the segment's bytes, not a copy
    assert arr[0, 0] == 99


@pytest.mark.parametrize("nbytes", [60, 68, 0])
def test_bytes_that_do_not_match_the_shape_are_refused(nbytes, arena, maps):
    with pytest.raises(ValueError):
        tensors.to_numpy(Tensor("x", "FP32", [16], bytes(nbytes)), maps)
    slot = arena.alloc(max(nbytes, 1))
    ref = slot.ref
    ref = type(ref)(ref.segment, ref.offset, nbytes) if nbytes != ref.nbytes else ref
    with pytest.raises(ValueError):
        tensors.to_numpy(Tensor("x", "FP32", [16], None, ref), maps)


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_an_input_without_data_is_refused(datatype, maps):
    with pytest.raises(ValueError, match="neither data nor a shared-memory reference"):
        tensors.to_numpy(Tensor("x", datatype, [16]), maps)
