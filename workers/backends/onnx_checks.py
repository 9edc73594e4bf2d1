"""The model configuration checked against its ONNX model when an instance loads, as Triton's
onnxruntime backend checks it (its ValidateInputs and ValidateOutputs): a config that
contradicts the graph is refused at load, with Triton's words, instead of loading READY and
failing every request.

Compared, for every input and output the config declares: that the model has it (an input may
be one of the model's overridable initializers), its data type, and its dims (the ``reshape``
shape where the tensor has one). With max_batch_size > 0 the model's first dimension is the
batch dimension: it must be variable, and the config's dims are the rest. A model dimension that
is variable (-1, or a symbolic one such as "batch") takes any config dimension; a fixed one
must be equal (a config -1 where the model has a fixed size is refused, as Triton does). A
scalar model tensor (no dimensions) takes config dims of 1s only. Also checked: every input the
graph needs is in the config (as an input, a sequence control or state, or a batch input), and
no optional input on a model that batches. One deviation: Triton compares output dims exactly
(a model's variable output dimension needs -1 in the config); here a variable model dimension
takes a fixed config one for outputs as for inputs.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shmserve.ipc.errors import BackendLoadError
from shmserve.workers import sequence
from shmserve.workers.backends.autocomplete import CONFIG_DATATYPES, config_datatype, model_dims

Info = tuple[str, list[int]]        # config data_type, dims (-1: variable)


def check(cfg: dict, session: Any) -> None:
    """Raises BackendLoadError at the first contradiction between ``cfg`` (the model config as
    JSON fields) and the onnxruntime ``session``."""
    model = str(cfg.get("name", ""))
    mbs = int(cfg.get("max_batch_size") or 0)
    required = _infos(session.get_inputs())
    inputs = {**required, **_infos(session.get_overridable_initializers())}
    for io in cfg.get("input") or []:
        _check_input(model, io, inputs, mbs)
    _check_required(model, cfg, required)
    outputs = _infos(session.get_outputs())
    batch_outputs = {n for b in cfg.get("batch_output") or [] for n in b.get("target_name") or []}
    for io in cfg.get("output") or []:
        name = str(io.get("name", ""))
        if name not in outputs:
            raise BackendLoadError(f"unable to load model '{model}', unexpected inference output "
                                   f"'{name}', allowed outputs are: {', '.join(sorted(outputs))}")
        _check_type(model, "output", name, io, outputs[name][0])
        if name not in batch_outputs:     # a batch output's shape need not be the model's
            _check_dims(model, name, outputs[name][1], _config_dims(io), mbs)


def _infos(args: Iterable[Any]) -> dict[str, Info]:
    return {a.name: (config_datatype(a.type), model_dims(a.shape or [])) for a in args}


def _check_input(model: str, io: dict, inputs: dict[str, Info], mbs: int) -> None:
    name = str(io.get("name", ""))
    optional = bool(io.get("optional"))
    if optional and mbs != 0:
        raise BackendLoadError(f"unable to load model '{model}', optional input '{name}' is not "
                               f"supported for models that support batching")
    if name not in inputs:
        raise BackendLoadError(f"unable to load model '{model}', unexpected inference input "
                               f"'{name}', allowed inputs are: {', '.join(sorted(inputs))}")
    dtype, dims = inputs[name]
    _check_type(model, "input", name, io, dtype)
    if io.get("allow_ragged_batch"):
        if optional:
            raise BackendLoadError(f"unable to load model '{model}', configuration expects model "
                                   f"provides input with shape [-1] for ragged input '{name}', "
                                   f"which is not supported for optional input")
        if dims != [-1]:
            raise BackendLoadError(f"unable to load model '{model}', configuration expects model "
                                   f"provides input with shape [-1] for ragged input '{name}', "
                                   f"model provides {_shape(dims)}")
        return
    _check_dims(model, name, dims, _config_dims(io), mbs)


def _check_required(model: str, cfg: dict, required: dict[str, Info]) -> None:
    """Every input the graph needs (not one with an initializer) comes from the config."""
    ios = cfg.get("input") or []
    names = {str(io.get("name", "")) for io in ios}
    # what Triton counts: the non-optional inputs, the sequence controls and states, the batch
    # inputs
    expects = sum(not io.get("optional") for io in ios)
    more = {*sequence.declared(cfg)[0],
            *(n for b in cfg.get("batch_input") or [] for n in b.get("target_name") or [])}
    expects += len(more - names - {""})
    missing = [n for n in required if n not in names and n not in more]
    if missing:
        raise BackendLoadError(f"unable to load model '{model}', configuration expects "
                               f"{expects} inputs, model provides "
                               f"{len(required)} (model input(s) the configuration does not "
                               f"declare: {', '.join(repr(n) for n in missing)})")


def _check_type(model: str, kind: str, name: str, io: dict, provides: str) -> None:
    dtype = str(io.get("data_type") or "TYPE_INVALID")
    if dtype not in CONFIG_DATATYPES:
        raise BackendLoadError(f"unsupported datatype {dtype} for {kind} '{name}' for model "
                               f"'{model}'")
    if dtype != provides:
        raise BackendLoadError(f"unable to load model '{model}', configuration expects datatype "
                               f"{dtype} for {kind} '{name}', model provides {provides}")


def _config_dims(io: dict) -> list[int]:
    """The dims the model sees: the reshape shape where the tensor has one."""
    reshape = io.get("reshape")
    if reshape is not None:
        return [int(d) for d in reshape.get("shape") or []]
    return [int(d) for d in io.get("dims") or []]


def _check_dims(model: str, name: str, shape: list[int], dims: list[int], mbs: int) -> None:
    if not shape:       # a scalar: the config may only say 1s (Triton compares no more)
        if any(d != 1 for d in dims):
            raise BackendLoadError(f"unable to load model '{model}', scalar tensor '{name}', "
                                   f"should only provide 1 in the model configuration when the "
                                   f"model doesn't support batching. Model configuration "
                                   f"provided: {_shape(dims)}.")
        return
    if mbs > 0:
        if shape[0] != -1:
            raise BackendLoadError(f"model '{model}', tensor '{name}': for the model to support "
                                   f"batching the shape should have at least 1 dimension and the "
                                   f"first dimension must be -1; but shape expected by the model "
                                   f"is {_shape(shape)}")
        full = [-1, *dims]
        if not _matches(shape, full):
            raise BackendLoadError(f"model '{model}', tensor '{name}': the model expects "
                                   f"{len(shape)} dimensions (shape {_shape(shape)}) but the model "
                                   f"configuration specifies {len(full)} dimensions (an initial "
                                   f"batch dimension because max_batch_size > 0 followed by the "
                                   f"explicit tensor shape, making complete shape {_shape(full)})")
    elif not _matches(shape, dims):
        raise BackendLoadError(f"model '{model}', tensor '{name}': the model expects {len(shape)} "
                               f"dimensions (shape {_shape(shape)}) but the model configuration "
                               f"specifies {len(dims)} dimensions (shape {_shape(dims)})")


def _matches(shape: list[int], dims: list[int]) -> bool:
    """A variable model dimension takes any config dimension; a fixed one only itself."""
    return len(shape) == len(dims) and all(m == -1 or m == d for m, d in zip(shape, dims))


def _shape(dims: Iterable[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"      # Triton's ShapeToString
