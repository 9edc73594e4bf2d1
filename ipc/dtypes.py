"""Triton datatypes: wire names, config enum names, numpy dtypes and element sizes in one table."""
from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

# wire name -> (config enum name, numpy dtype or None, element size or 0 for variable)
_TABLE = {
    "BOOL": ("TYPE_BOOL", np.dtype(np.bool_), 1),
    "UINT8": ("TYPE_UINT8", np.dtype(np.uint8), 1),
    "UINT16": ("TYPE_UINT16", np.dtype(np.uint16), 2),
    "UINT32": ("TYPE_UINT32", np.dtype(np.uint32), 4),
    "UINT64": ("TYPE_UINT64", np.dtype(np.uint64), 8),
    "INT8": ("TYPE_INT8", np.dtype(np.int8), 1),
    "INT16": ("TYPE_INT16", np.dtype(np.int16), 2),
    "INT32": ("TYPE_INT32", np.dtype(np.int32), 4),
    "INT64": ("TYPE_INT64", np.dtype(np.int64), 8),
    "FP16": ("TYPE_FP16", np.dtype(np.float16), 2),
    "FP32": ("TYPE_FP32", np.dtype(np.float32), 4),
    "FP64": ("TYPE_FP64", np.dtype(np.float64), 8),
    # numpy has no bfloat16 of its own; ml_dtypes' is the one tritonclient uses as well
    "BF16": ("TYPE_BF16", np.dtype(bfloat16), 2),
    "BYTES": ("TYPE_STRING", np.dtype(object), 0),
}

WIRE_TYPES = tuple(_TABLE)
CONFIG_TO_WIRE = {cfg: wire for wire, (cfg, _, _) in _TABLE.items()}
WIRE_TO_CONFIG = {wire: cfg for wire, (cfg, _, _) in _TABLE.items()}
ELEMENT_SIZE = {wire: size for wire, (_, _, size) in _TABLE.items()}
WIRE_TO_NUMPY = {wire: dt for wire, (_, dt, _) in _TABLE.items()}

_NUMPY_TO_WIRE = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64", np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
    np.dtype(object): "BYTES", np.dtype(bfloat16): "BF16",
}


def numpy_to_wire(dtype: np.dtype) -> str | None:
    """Wire name for a numpy dtype; str and bytes arrays are BYTES."""
    dtype = np.dtype(dtype)
    if dtype.kind in "SU":
        return "BYTES"
    return _NUMPY_TO_WIRE.get(dtype)


def element_count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def byte_size(datatype: str, shape) -> int | None:
    """Bytes a fixed-size tensor occupies; None for BYTES, whose size depends on the data."""
    size = ELEMENT_SIZE[datatype]
    return element_count(shape) * size if size else None


def serialize_bytes(array: np.ndarray) -> bytes:
    """Triton's BYTES layout: per element a little-endian uint32 length, then the bytes."""
    flat = array.reshape(-1)
    items = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in flat]
    lengths = np.fromiter((len(x) for x in items), dtype="<u4", count=len(items))
    out = bytearray(4 * len(items) + int(lengths.sum(dtype=np.int64)))
    pos = 0
    for item, length in zip(items, lengths.tolist()):
        out[pos:pos + 4] = length.to_bytes(4, "little")
        out[pos + 4:pos + 4 + length] = item
        pos += 4 + length
    return bytes(out)


def deserialize_bytes(buffer, count: int | None = None) -> np.ndarray:
    """Parse Triton's BYTES layout into an object array of bytes.

    With ``count`` given the buffer must hold exactly that many elements; ValueError otherwise.
    """
    mv = memoryview(buffer).cast("B")
    total = len(mv)
    items = []
    pos = 0
    while pos < total:
        if pos + 4 > total:
            raise ValueError("truncated length prefix in BYTES data")
        length = int.from_bytes(mv[pos:pos + 4], "little")
        pos += 4
        if pos + length > total:
            raise ValueError("BYTES element extends past the end of the data")
        items.append(bytes(mv[pos:pos + length]))
        pos += length
    if count is not None and len(items) != count:
        raise ValueError(f"expected {count} BYTES elements, got {len(items)}")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def count_bytes_elements(buffer, expected: int) -> None:
    """Walk the length prefixes of BYTES data without copying; ValueError unless exactly ``expected``."""
    mv = memoryview(buffer).cast("B")
    total = len(mv)
    pos = 0
    n = 0
    while pos < total:
        if pos + 4 > total:
            raise ValueError(f"truncated length prefix at byte {pos}")
        pos += 4 + int.from_bytes(mv[pos:pos + 4], "little")
        n += 1
        if pos > total:
            raise ValueError(f"element {n - 1} extends past the end of the data")
        if n > expected:
            break
    if n != expected:
        raise ValueError(f"expected {expected} elements, got {'more' if n > expected else n}")
