"""Checking a request against the model's configuration: one path for every protocol."""
from __future__ import annotations

from shmserve.ipc import dtypes
from shmserve.ipc.messages import Tensor

from .catalog import ModelView
from .errors import invalid


def check_shape(model: ModelView, name: str, dims: list[int], shape: list[int],
                full_shape: list[int] | None = None) -> None:
    """``shape`` without the batch dim is checked; ``full_shape`` (with it) is what the error shows."""
    ok = len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))
    if not ok:
        lead = [-1] if model.max_batch_size > 0 else []
        raise invalid(f"unexpected shape for input '{name}' for model '{model.name}'. Expected "
                      f"{lead + dims}, got {shape if full_shape is None else full_shape}")


def validate_inputs(model: ModelView, inputs: list[Tensor]) -> int:
    """Raise InferError naming the problem; return the request's batch size (1 without batching)."""
    mbs = model.max_batch_size
    batch = None
    seen = set()
    for t in inputs:
        spec = model.inputs.get(t.name)
        if spec is None:
            raise invalid(f"unexpected inference input '{t.name}' for model '{model.name}'")
        if t.name in seen:
            raise invalid(f"input '{t.name}' already exists in request for model "
                          f"'{model.name}'")
        seen.add(t.name)
        if t.datatype != spec.datatype:
            raise invalid(f"inference input '{t.name}' data-type is '{t.datatype}', but model "
                          f"'{model.name}' expects '{spec.datatype}'")
        shape = t.shape
        if mbs > 0:
            if not shape:
                raise invalid(f"input '{t.name}' for model '{model.name}' has no batch dimension; "
                              f"model has max_batch_size {mbs}, so its shape must start with the "
                              f"batch size")
            b = shape[0]
            if batch is None:
                batch = b
            elif b != batch:
                raise invalid(f"input '{t.name}' has batch size {b} but other inputs of the "
                              f"request have batch size {batch} for model '{model.name}'")
            if b > mbs:
                raise invalid(f"inference request batch-size must be <= {mbs} for '{model.name}'")
            check_shape(model, t.name, spec.dims, shape[1:], shape)
        else:
            check_shape(model, t.name, spec.dims, shape)
    missing = [n for n in model.required_inputs if n not in seen]
    if missing:
        required, total = len(model.required_inputs), len(model.inputs)
        expected = f"expected {required} inputs" if required == total else \
            f"expected number of inputs between {required} and {total}"
        raise invalid(f"{expected} but got {len(inputs)} inputs for model '{model.name}'. Got "
                      f"input(s) {_names(sorted(seen))}, but missing required input(s) "
                      f"{_names(missing)}. Please provide all required input(s).")
    return batch if batch is not None else 1


def _names(names) -> str:
    """A list of names as Triton writes it: ['A','B']."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def check_load_name(name: str) -> None:
    """A model name to load must name a directory of the repository: Triton refuses an empty one
    and one that could leave the repository, before it looks."""
    if not name.strip():
        raise invalid("Model name cannot be empty. Please enter a valid name to deploy.")
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        raise invalid(f"model name must not contain path traversal characters (got '{name}')")


def check_byte_size(model: ModelView, t: Tensor, nbytes: int, data=None) -> None:
    """The bytes given for a tensor must be exactly what its shape and datatype need."""
    expected = dtypes.byte_size(t.datatype, t.shape)
    if expected is not None:
        if nbytes != expected:
            raise invalid(f"input byte size mismatch for input '{t.name}' for model "
                          f"'{model.name}'. Expected {expected}, got {nbytes}")
        return
    if data is not None:
        count = dtypes.element_count(t.shape)
        try:
            dtypes.count_bytes_elements(data, count)
        except dtypes.BytesCountError as e:
            where = f"for inference input '{t.name}' for model '{model.name}'"
            if e.count > count:
                raise invalid(f"unexpected number of string elements {e.count} {where}, "
                              f"expecting {count}") from None
            raise invalid(f"expected {count} string elements {where}, got {e.count}") from None
        except ValueError as e:
            raise invalid(f"input '{t.name}' for model '{model.name}' has invalid BYTES data: "
                          f"{e}") from None


def check_outputs(model: ModelView, names) -> None:
    for n in names:
        if n not in model.outputs:
            raise invalid(f"unexpected inference output '{n}' for model '{model.name}'")
