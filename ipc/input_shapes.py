"""Whether the tensors given to a model fit its inputs' dims: one check for the two places an
ensemble step is given tensors another model made (the scheduler's ensemble runner, and the
worker that hands a step of a chained ensemble to the next: workers/leases/chain.py). The frontend
checks a client's own request with the same words (engine/requests/validation.py)."""
from __future__ import annotations

from shmserve.ipc.messages.common import Tensor


def input_shape_problem(model: str, max_batch_size: int, input_dims: dict[str, list[int]],
                        inputs: list[Tensor]) -> str:
    """Triton's words for the first input whose shape does not fit, or "" when they fit;
    ``input_dims`` without the batch dimension."""
    batched = max_batch_size > 0
    for t in inputs:
        dims = input_dims.get(t.name)
        if dims is None:
            continue
        shape = t.shape
        if batched:
            if not shape:
                return (f"input '{t.name}' for model '{model}' has no batch dimension, "
                        f"but the model has max_batch_size {max_batch_size}")
            if shape[0] > max_batch_size:
                return (f"inference request batch-size must be <= {max_batch_size} for "
                        f"'{model}'")
            shape = shape[1:]
        if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)):
            lead = [-1] if batched else []
            return (f"unexpected shape for input '{t.name}' for model '{model}'. "
                    f"Expected {lead + dims}, got {t.shape}")
    return ""
