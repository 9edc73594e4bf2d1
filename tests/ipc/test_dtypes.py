"""Triton datatype tables and the BYTES wire layout."""
import struct

import ml_dtypes
import numpy as np
import pytest

from shmserve.ipc import dtypes


def wire(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


@pytest.mark.parametrize("array, expected", [
    (np.array(["a", "bc", ""], dtype=object), [b"a", b"bc", b""]),
    (np.array([b"\x00\xff", b"xyz"], dtype=object), [b"\x00\xff", b"xyz"]),
    (np.array(["héllo", "日本", "🙂"], dtype=object), ["héllo".encode(), "日本".encode(), "🙂".encode()]),
    (np.array(["ab", "ü"]), [b"ab", "ü".encode()]),               # numpy 'U' array
    (np.array([b"ab", b"c"]), [b"ab", b"c"]),                      # numpy 'S' array
    (np.array([["a", "b"], ["c", "d"]], dtype=object), [b"a", b"b", b"c", b"d"]),
    (np.array([], dtype=object), []),
], ids=["str", "bytes", "non-ascii", "U", "S", "2d", "empty"])
def test_bytes_round_trip(array, expected):
    data = dtypes.serialize_bytes(array).tobytes()
    assert data == wire(*expected)
    out = dtypes.deserialize_bytes(data)
    assert out.dtype == object and out.shape == (len(expected),)
    assert out.tolist() == expected
    assert dtypes.deserialize_bytes(data, count=len(expected)).tolist() == expected
    dtypes.count_bytes_elements(data, len(expected))
    dtypes.count_bytes_elements(memoryview(data), len(expected))


def test_deserialize_equal_length_elements_stays_one_dimensional():
    out = dtypes.deserialize_bytes(wire(b"ab", b"cd"))
    assert out.shape == (2,) and out.tolist() == [b"ab", b"cd"]


def test_deserialize_from_a_memoryview_slice():
    data = b"xx" + wire(b"abc") + b"yy"
    assert dtypes.deserialize_bytes(memoryview(data)[2:-2]).tolist() == [b"abc"]


@pytest.mark.parametrize("data, match", [
    (b"\x01\x00", "partial length prefix"),
    (wire(b"ab") + b"\x01", "partial length prefix"),
    (struct.pack("<I", 5) + b"abc", "declares 5 bytes but only 3 remain"),
])
def test_deserialize_errors(data, match):
    with pytest.raises(ValueError, match=match):
        dtypes.deserialize_bytes(data)


def test_deserialize_wrong_count():
    with pytest.raises(ValueError, match="expected 3 BYTES elements, got 2"):
        dtypes.deserialize_bytes(wire(b"a", b"b"), count=3)


@pytest.mark.parametrize("data, expected, match", [
    (b"\x01\x00\x00", 1, "truncated length prefix at byte 0"),
    (wire(b"abc") + b"\x00\x00", 2, "truncated length prefix at byte 7"),
    (struct.pack("<I", 4) + b"abc", 1, "element 0 extends past the end"),
    (wire(b"a") + struct.pack("<I", 100), 2, "element 1 extends past the end"),
    (wire(b"a", b"b"), 3, "expected 3 elements, got 2"),
    (wire(b"a", b"b", b"c"), 2, "expected 2 elements, got more"),
    (wire(b""), 0, "expected 0 elements, got more"),
    (b"", 1, "expected 1 elements, got 0"),
])
def test_count_bytes_elements_errors(data, expected, match):
    with pytest.raises(ValueError, match=match):
        dtypes.count_bytes_elements(data, expected)


def test_count_bytes_elements_accepts_empty_elements():
    dtypes.count_bytes_elements(b"", 0)
    dtypes.count_bytes_elements(wire(b"", b"", b""), 3)


@pytest.mark.parametrize("dtype, name", [
    (np.bool_, "BOOL"), (np.uint8, "UINT8"), (np.uint16, "UINT16"), (np.uint32, "UINT32"),
    (np.uint64, "UINT64"), (np.int8, "INT8"), (np.int16, "INT16"), (np.int32, "INT32"),
    (np.int64, "INT64"), (np.float16, "FP16"), (np.float32, "FP32"), (np.float64, "FP64"),
    (object, "BYTES"), (ml_dtypes.bfloat16, "BF16"), ("U7", "BYTES"), ("S3", "BYTES"),
])
def test_numpy_to_wire(dtype, name):
    assert dtypes.numpy_to_wire(dtype) == name
    assert dtypes.numpy_to_wire(np.dtype(dtype)) == name


def test_numpy_to_wire_of_arrays():
    assert dtypes.numpy_to_wire(np.array(["a", "bcd"]).dtype) == "BYTES"
    assert dtypes.numpy_to_wire(np.array([b"a"]).dtype) == "BYTES"
    assert dtypes.numpy_to_wire(np.zeros(2, dtype=ml_dtypes.bfloat16).dtype) == "BF16"


@pytest.mark.parametrize("dtype", [np.complex64, np.float128 if hasattr(np, "float128") else np.complex128,
                                   "datetime64[s]", ml_dtypes.float8_e4m3fn])
def test_numpy_to_wire_unsupported(dtype):
    assert dtypes.numpy_to_wire(dtype) is None


def test_tables_agree():
    for name in dtypes.WIRE_TYPES:
        assert dtypes.CONFIG_TO_WIRE[dtypes.WIRE_TO_CONFIG[name]] == name
        np_dtype = dtypes.WIRE_TO_NUMPY[name]
        assert dtypes.numpy_to_wire(np_dtype) == name
        if name != "BYTES":
            assert dtypes.ELEMENT_SIZE[name] == np_dtype.itemsize
    assert dtypes.WIRE_TO_CONFIG["BYTES"] == "TYPE_STRING"
    assert dtypes.ELEMENT_SIZE["BYTES"] == 0


@pytest.mark.parametrize("datatype, shape, size", [
    ("FP32", [2, 3], 24), ("INT64", [4], 32), ("BOOL", [3, 1], 3), ("BF16", [5], 10),
    ("FP16", [0, 7], 0), ("UINT8", [], 1), ("BYTES", [3], None), ("BYTES", [], None),
])
def test_byte_size(datatype, shape, size):
    assert dtypes.byte_size(datatype, shape) == size


def test_element_count():
    assert dtypes.element_count([]) == 1
    assert dtypes.element_count([2, 0, 3]) == 0
    assert dtypes.element_count([2, 3, 4]) == 24
