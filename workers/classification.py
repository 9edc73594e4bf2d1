"""The classification extension (docs/triton-compat.md §1.9): an output asked for with the
``classification`` parameter K comes back as a BYTES tensor of its K largest entries per batch
item, largest first, each ``b"<value>:<index>"`` or ``b"<value>:<index>:<label>"``.

The worker applies it to the model's array before the output is placed, so the client gets a few
short strings instead of the whole tensor. Labels come from the output's ``label_filename`` in
the model directory and are read once, when the instance loads (``ipc/model_files.py``); an
ensemble's output has the ensemble's labels, read when it loads, which come with the request
(``OutputSpec.labels``) to the step that produces it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shmserve.ipc import dtypes

# Triton refuses to rank more entries than this per batch item (pathological sizes)
MAX_ELEMENTS = 1_000_000


class ClassificationError(ValueError):
    """The output cannot be classified; the request fails with INVALID_ARG and this text."""


def unsupported_type(datatype: str) -> str:
    """Triton's words for an output whose datatype the extension does not rank."""
    return f"class result not available for output due to unsupported type '{datatype}'"


def classify(arr: np.ndarray, datatype: str, k: int, batching: bool,
             labels: Sequence[bytes] = ()) -> np.ndarray:
    """The top ``k`` entries of ``arr`` as an object array of bytes: shape [batch, K'] when the
    model batches (the first dim is the batch), else [K'] over the whole tensor, where K' is
    ``k`` clamped to the entries per batch item. Ties keep the lower index first and NaN ranks
    last. Raises ClassificationError for a datatype it cannot rank or a huge item."""
    if datatype not in dtypes.CLASSIFIABLE:
        raise ClassificationError(unsupported_type(datatype))
    batched = batching and arr.ndim > 0
    if batched:
        rows = arr.reshape(arr.shape[0], dtypes.element_count(arr.shape[1:]))
    else:
        rows = arr.reshape(1, arr.size)
    n = rows.shape[1]
    if n > MAX_ELEMENTS:
        raise ClassificationError(f"classification output tensor too large: {n} entries per "
                                  f"batch item, at most {MAX_ELEMENTS} can be ranked")
    top = min(k, n)
    order = _descending(rows)[:, :top]
    values = np.take_along_axis(rows, order, axis=1)
    # the value as C++'s std::to_string prints it: "%f" for floats, plain digits for integers
    fmt = b"%f:%d" if rows.dtype.kind == "f" else b"%d:%d"
    out = np.empty((rows.shape[0], top), dtype=np.object_)
    count = len(labels)
    for b, (vals, idxs) in enumerate(zip(values.tolist(), order.tolist())):
        for j, (v, i) in enumerate(zip(vals, idxs)):
            s = fmt % (v, i)
            if i < count and labels[i]:     # an empty line is no label, as in Triton
                s += b":" + labels[i]
            out[b, j] = s
    return out if batched else out.reshape(top)


def _descending(rows: np.ndarray) -> np.ndarray:
    """Per row, the column indices from the largest value to the smallest; equal values in
    index order, NaN after everything else."""
    n = rows.shape[1]
    # a stable ascending sort of each row reversed, read backwards: descending, and equal values
    # come out in increasing original index
    order = (n - 1) - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1]
    if rows.dtype.kind == "f":
        nan = np.isnan(np.take_along_axis(rows, order, axis=1))
        if nan.any():
            order = np.take_along_axis(order, np.argsort(nan, axis=1, kind="stable"), axis=1)
    return order
