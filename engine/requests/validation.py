"""Checking a request against the model's configuration: one path for every protocol."""
from __future__ import annotations

from shmserve.engine.requests.catalog import ModelView
from shmserve.ipc import dtypes
from shmserve.ipc.dtypes import shape_text
from shmserve.ipc.errors import invalid
from shmserve.ipc.messages.common import Tensor

# Triton adds this to a shape error of a model with batching (a client that left out the batch
# dimension is the usual cause); its text is part of the message clients see.
BATCH_DIM_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
                  "dimension to be prepended to each input shape. If you want to specify the full "
                  "shape including the batch dim in your input dims config, try setting "
                  "max_batch_size to zero. See the model configuration docs for more info on "
                  "max_batch_size.")


def request_tag(request_id: str) -> str:
    """How Triton's core starts the errors it finds in a request: with the request's id."""
    return f"[request id: {request_id or '<id_unknown>'}] "


def check_shape(model: ModelView, name: str, dims: list[int], shape: list[int],
                full_shape: list[int] | None = None, request_id: str = "") -> None:
    """``shape`` without the batch dim is checked; ``full_shape`` (with it) is what the error shows."""
    ok = len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))
    if not ok:
        lead = [-1] if model.max_batch_size > 0 else []
        note = BATCH_DIM_NOTE if lead else ""
        raise invalid(f"{request_tag(request_id)}unexpected shape for input '{name}' for model "
                      f"'{model.name}'. Expected {shape_text(lead + dims)}, got "
                      f"{shape_text(shape if full_shape is None else full_shape)}. {note}")


def validate_inputs(model: ModelView, inputs: list[Tensor], request_id: str = "") -> int:
    """Raise InferError naming the problem; return the request's batch size (1 without batching).
    The checks come in Triton's order, so that a request with several problems gets the error
    Triton would give: a repeated input, the count of inputs, then each input."""
    seen: set[str] = set()
    for t in inputs:
        if t.name in seen:
            raise invalid(f"{request_tag(request_id)}input '{t.name}' already exists in request")
        seen.add(t.name)
    required = model.required_inputs
    specs = model.inputs
    if len(inputs) > len(specs) or len(inputs) < len(required):
        _count_error(model, request_id, seen)
    mbs = model.max_batch_size
    batch = None
    for t in inputs:
        spec = specs.get(t.name)
        if spec is None:
            raise invalid(f"unexpected inference input '{t.name}' for model '{model.name}'")
        if t.datatype != spec.datatype:
            raise invalid(f"{request_tag(request_id)}inference input '{t.name}' data-type is "
                          f"'{t.datatype}', but model '{model.name}' expects '{spec.datatype}'")
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
                raise invalid(f"{request_tag(request_id)}inference request batch-size must be "
                              f"<= {mbs} for '{model.name}'")
            if shape[1:] != spec.dims:      # (equal: the usual case, no dim to compare)
                check_shape(model, t.name, spec.dims, shape[1:], shape, request_id)
        elif shape != spec.dims:
            check_shape(model, t.name, spec.dims, shape, None, request_id)
    # every input is one of the model's (checked above): all of them there, none missing
    if len(seen) < len(specs) and any(n not in seen for n in required):
        _count_error(model, request_id, seen)
    return batch if batch is not None else 1


def _count_error(model: ModelView, request_id: str, given: set[str]) -> None:
    required, total = model.required_inputs, len(model.inputs)
    expected = f"expected {len(required)} inputs" if len(required) == total else \
        f"expected number of inputs between {len(required)} and {total}"
    missing = [n for n in required if n not in given]
    # Triton writes an empty list of missing inputs as "]" (its list loses its opening
    # bracket); clients compare these texts, so the quirk is kept
    missing_text = _names(missing) if missing else "]"
    raise invalid(f"{request_tag(request_id)}{expected} but got {len(given)} inputs for model "
                  f"'{model.name}'. Got input(s) {_names(sorted(given))}, but missing required "
                  f"input(s) {missing_text}. Please provide all required input(s).")


def _names(names) -> str:
    """A list of names as Triton writes it: ['A','B']."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def check_load_name(name: str) -> None:
    """A model name to load must name a directory of the repository: Triton refuses an empty one
    and one that could leave the repository, before it looks."""
    if not name.strip():
        raise invalid("Model name cannot be empty. Please enter a valid name to deploy.")
    # (a backslash is an ordinary character of a Linux file name, as for Triton: a python
    # model so named then fails its load with Triton's "Invalid stub name")
    if "/" in name or name.strip() in (".", ".."):
        raise invalid(f"model name must not contain path traversal characters (got '{name}')")


def string_count_error(model: ModelView, name: str, expected: int, got: int,
                       request_id: str = ""):
    """BYTES data with other than ``expected`` elements, in the words of Triton's core."""
    where = f"for inference input '{name}' for model '{model.name}'"
    if got > expected:
        return invalid(f"{request_tag(request_id)}unexpected number of string elements {got} "
                       f"{where}, expecting {expected}")
    return invalid(f"{request_tag(request_id)}expected {expected} string elements {where}, "
                   f"got {got}")


def check_byte_size(model: ModelView, t: Tensor, nbytes: int, data=None,
                    request_id: str = "") -> None:
    """The bytes given for a tensor must be exactly what its shape and datatype need."""
    expected = dtypes.byte_size(t.datatype, t.shape)
    if expected is not None:
        if nbytes != expected:
            raise invalid(f"{request_tag(request_id)}input byte size mismatch for input "
                          f"'{t.name}' for model '{model.name}'. Expected {expected}, got {nbytes}")
        return
    if data is not None:
        count = dtypes.element_count(t.shape)
        try:
            dtypes.count_bytes_elements(data, count)
        except dtypes.BytesCountError as e:
            raise string_count_error(model, t.name, count, e.count, request_id) from None
        except dtypes.BytesCutError as e:
            if e.prefix:
                raise invalid(f"{request_tag(request_id)}incomplete string length indicator for "
                              f"inference input '{t.name}' for model '{model.name}', expecting "
                              f"4 bytes but only {e.have} bytes available. Please make sure the "
                              f"string length indicator is in one buffer.") from None
            raise invalid(f"incomplete string data for inference input '{t.name}', expecting "
                          f"string of length {e.need} but only {e.have} bytes available") from None


def check_outputs(model: ModelView, names) -> None:
    for n in names:
        if n not in model.outputs:
            raise invalid(f"unexpected inference output '{n}' for model '{model.name}'")
