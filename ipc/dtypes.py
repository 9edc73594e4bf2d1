"""Triton datatypes: wire names, config enum names, numpy dtypes and element sizes in one table."""
from __future__ import annotations

import struct

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

_U32 = struct.Struct("<I")

WIRE_TYPES = tuple(_TABLE)
CONFIG_TO_WIRE = {cfg: wire for wire, (cfg, _, _) in _TABLE.items()}
WIRE_TO_CONFIG = {wire: cfg for wire, (cfg, _, _) in _TABLE.items()}
ELEMENT_SIZE = {wire: size for wire, (_, _, size) in _TABLE.items()}
WIRE_TO_NUMPY = {wire: dt for wire, (_, dt, _) in _TABLE.items()}
# what the classification extension can rank (Triton's set: the integer types, FP32 and FP64)
CLASSIFIABLE = frozenset(("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                          "INT64", "FP32", "FP64"))

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


def shape_text(shape) -> str:
    """A shape as Triton's messages print it: ``[2,-1,3]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def element_count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def byte_size(datatype: str, shape) -> int | None:
    """Bytes a fixed-size tensor occupies; None for BYTES, whose size depends on the data."""
    size = ELEMENT_SIZE[datatype]
    return element_count(shape) * size if size else None


def _as_bytes(x) -> bytes:
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, (bytes, bytearray, memoryview, np.bytes_)):
        return bytes(x)
    return str(x).encode("utf-8")  # numbers etc., as tritonclient does


def serialize_bytes(array: np.ndarray) -> np.ndarray:
    """Triton's BYTES layout as a uint8 array: per element a little-endian uint32 length, then
    the bytes (str elements as UTF-8)."""
    items = [x if type(x) is bytes else _as_bytes(x) for x in np.asarray(array).ravel().tolist()]
    n = len(items)
    if n == 0:
        return np.empty(0, np.uint8)
    lens = np.fromiter(map(len, items), dtype=np.int64, count=n)
    if int(lens.max()) > 0xFFFFFFFF:
        raise ValueError("a BYTES element exceeds 4 GiB, which the 32-bit length prefix cannot express")
    data_start = np.arange(4, 4 * n + 1, 4, dtype=np.int64) + (np.cumsum(lens) - lens)
    out = np.empty(int(data_start[-1] + lens[-1]), np.uint8)
    prefix_idx = ((data_start - 4)[:, None] + np.arange(4)).ravel()
    out[prefix_idx] = lens.astype("<u4").view(np.uint8)
    if n <= 64 or out.size >= 1024 * n:
        # large elements: one memcpy each beats a byte mask over the whole output
        for b, start in zip(items, data_start.tolist()):
            out[start:start + len(b)] = np.frombuffer(b, np.uint8)
    else:
        is_data = np.ones(out.size, bool)
        is_data[prefix_idx] = False
        out[is_data] = np.frombuffer(b"".join(items), np.uint8)
    return out


def deserialize_bytes(buffer, count: int | None = None) -> np.ndarray:
    """Parse Triton's BYTES layout into a 1-D object array of bytes.

    With ``count`` given the buffer must hold exactly that many elements; ValueError otherwise.
    """
    buf = buffer if type(buffer) is bytes else memoryview(buffer).tobytes()
    end = len(buf)
    unpack = _U32.unpack_from
    out: list[bytes] = []
    off = 0
    while off < end:
        if off + 4 > end:
            raise ValueError(f"truncated BYTES buffer: element {len(out)} has a partial length "
                             f"prefix ({end - off} of 4 bytes at offset {off})")
        (n,) = unpack(buf, off)
        off += 4
        if off + n > end:
            raise ValueError(f"truncated BYTES buffer: element {len(out)} declares {n} bytes but "
                             f"only {end - off} remain at offset {off}")
        out.append(buf[off:off + n])
        off += n
    if count is not None and len(out) != count:
        raise ValueError(f"expected {count} BYTES elements, got {len(out)}")
    result = np.empty(len(out), dtype=np.object_)
    result[:] = out
    return result


class BytesCutError(ValueError):
    """BYTES data that ends inside an element: ``prefix`` when inside a 4-byte length prefix,
    else inside the element's data; ``need`` bytes were due where ``have`` were left."""

    def __init__(self, message: str, prefix: bool, need: int, have: int):
        super().__init__(message)
        self.prefix, self.need, self.have = prefix, need, have


class BytesCountError(ValueError):
    """BYTES data that is well formed but holds a different number of elements: ``count`` is
    how many were found (``expected + 1`` when there are more)."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


def count_bytes_elements(buffer, expected: int) -> None:
    """Walk the length prefixes of BYTES data without copying: BytesCutError for data cut
    short, BytesCountError for well-formed data with other than ``expected`` elements."""
    mv = memoryview(buffer).cast("B")
    total = len(mv)
    pos = 0
    n = 0
    while pos < total:
        if pos + 4 > total:
            raise BytesCutError(f"truncated length prefix at byte {pos}", True, 4, total - pos)
        length = int.from_bytes(mv[pos:pos + 4], "little")
        pos += 4 + length
        n += 1
        if pos > total:
            raise BytesCutError(f"element {n - 1} extends past the end of the data", False,
                                length, total - (pos - length))
        if n > expected:
            break
    if n != expected:
        raise BytesCountError(f"expected {expected} elements, got "
                              f"{'more' if n > expected else n}", n)
