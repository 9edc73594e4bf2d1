"""DLPack without a framework: read what a legacy ``dltensor`` capsule points at, and make one.

numpy imports and exports CPU tensors itself (``np.from_dlpack``, ``ndarray.__dlpack__``), and
that is what pb_utils uses for them. A GPU tensor numpy refuses, so pb_utils reads its capsule
here (pointer, device, shape, datatype) and keeps the capsule, which keeps the memory alive; and
it exports one (``Tensor.to_dlpack()`` of a GPU tensor) with ``capsule``.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import numpy as np
from ml_dtypes import bfloat16

from shmserve.ipc.gpu.device import DeviceTensor

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDAHost", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                10: "ROCm", 11: "ROCmHost", 13: "CUDAManaged", 14: "OneAPI"}
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

_api = ctypes.pythonapi
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api))

_TO_DL = {"b": _BOOL, "i": _INT, "u": _UINT, "f": _FLOAT}
_BF16 = np.dtype(bfloat16)


def _numpy_dtype(dt: DLDataType) -> np.dtype:
    if dt.lanes != 1:
        raise ValueError(f"DLPack vector types (lanes={dt.lanes}) are not supported")
    if dt.code == _BFLOAT and dt.bits == 16:
        return _BF16
    if dt.code == _BOOL and dt.bits == 8:
        return np.dtype(np.bool_)
    kind = {_INT: "i", _UINT: "u", _FLOAT: "f"}.get(dt.code)
    if kind is None or dt.bits % 8:
        raise ValueError(f"DLPack datatype code {dt.code} with {dt.bits} bits has no Triton type")
    return np.dtype(f"{kind}{dt.bits // 8}")


def _dl_dtype(dtype: np.dtype) -> DLDataType:
    dtype = np.dtype(dtype)
    if dtype == _BF16:
        return DLDataType(_BFLOAT, 16, 1)
    code = _TO_DL.get(dtype.kind)
    if code is None:
        raise ValueError(f"numpy dtype {dtype} cannot go through DLPack")
    return DLDataType(code, dtype.itemsize * 8, 1)


def read(capsule) -> DeviceTensor:
    """What an unconsumed ``dltensor`` capsule describes; the result keeps the capsule (so the
    producer's memory) alive as its ``owner``. Only dense row-major tensors."""
    if not _is_valid(capsule, b"dltensor"):
        raise ValueError("not an unconsumed DLPack capsule (name 'dltensor')")
    managed = DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor"))
    t = managed.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    dtype = _numpy_dtype(t.dtype)
    if t.strides:
        expected, compact = dtype.itemsize, True
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] * dtype.itemsize != expected:
                compact = False
            expected *= shape[i]
        if not compact:
            raise ValueError("the DLPack tensor is not dense and row-major (make it contiguous "
                             "first)")
    dev = t.device.device_type
    return DeviceTensor((t.data or 0) + t.byte_offset, shape, dtype, t.device.device_id,
                        "cuda" if dev in (KDL_CUDA, KDL_CUDA_MANAGED) else
                        "cpu" if dev in (KDL_CPU, KDL_CUDA_HOST) else DEVICE_NAMES.get(dev, str(dev)),
                        capsule)


# Capsules made here whose tensors are still held: address of the DLManagedTensor -> what must
# stay alive (the struct, its shape array, the tensor, the capsule). A consumer that takes a
# capsule renames it 'used_dltensor' and calls the deleter when it is done, which drops the
# entry. A capsule nobody consumed has no destructor (see capsule()): the next capsule() or
# exported_count() finds it held by this table alone and drops it.
_exported: dict[int, tuple] = {}
_exported_lock = threading.Lock()


@_DELETER
def _delete(managed_ptr) -> None:
    # the consumer is done with the tensor (numpy: the array was freed). Like any ctypes
    # callback, this must not run while the consumer has an exception set; consumers call it
    # when they release a tensor they imported, not on their error paths
    _exported.pop(ctypes.addressof(managed_ptr.contents), None)


def _sweep() -> None:
    """Drop the entries of capsules that were never consumed and that nobody else holds."""
    with _exported_lock:
        for address, entry in list(_exported.items()):
            cap = entry[3]
            # references: the entry, ``cap``, getrefcount's argument
            if sys.getrefcount(cap) <= 3 and _is_valid(cap, b"dltensor"):
                del _exported[address]
            del cap


def capsule(t: DeviceTensor):
    """A ``dltensor`` capsule for ``t``; the capsule (or its consumer) keeps ``t`` alive.

    The capsule has no destructor of its own: a destructor written in Python (a ctypes
    callback) runs while the consumer that dropped the capsule may have an exception set, which
    the callback would swallow (numpy refusing a datatype it cannot import then returns NULL
    with no exception). Unconsumed capsules are collected by ``_sweep`` instead."""
    _sweep()
    ndim = len(t.shape)
    shape = (ctypes.c_int64 * max(1, ndim))(*t.shape)
    managed = DLManagedTensor()
    managed.dl_tensor.data = t.ptr
    managed.dl_tensor.device = DLDevice(KDL_CUDA if t.device_type == "cuda" else KDL_CPU,
                                        t.device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = _dl_dtype(t.dtype)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None        # compact row-major
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    cap = _new(address, b"dltensor", None)
    with _exported_lock:
        _exported[address] = (managed, shape, t, cap)
    return cap


def host_array(t: DeviceTensor) -> np.ndarray:
    """A CPU DLPack tensor numpy cannot import itself (bfloat16) as an array on its memory;
    the array keeps ``t`` (its owner) alive."""
    buf: Any = (ctypes.c_char * max(1, t.nbytes)).from_address(t.ptr)
    buf.owner = t
    return np.frombuffer(buf, dtype=t.dtype, count=int(np.prod(t.shape, dtype=np.int64))).reshape(t.shape)


def exported_count() -> int:
    """Capsules made here whose tensors are still held (for tests: none may leak)."""
    _sweep()
    with _exported_lock:
        return len(_exported)
