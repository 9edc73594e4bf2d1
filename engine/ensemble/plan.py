"""An ensemble's data flow, checked: which step needs which tensors and feeds which others.

``plan(cfg)`` reads ``ensemble_scheduling`` and checks what the config alone decides (every
input used, every output written once, every step's inputs produced somewhere, no cycle).
``bind(plan, configs)`` then checks it against the composing models' configs (names, data types,
batching), which are known only once those models are loaded. Pure: no sockets, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tritonclient.grpc import model_config_pb2 as mc

from shmserve.ipc.backend_catalog import config_runs_python
from shmserve.ipc.input_shapes import input_shape_problem
from shmserve.ipc.messages.common import Tensor
from shmserve.ipc.model_config import ConfigError, ModelConfig


@dataclass
class Step:
    index: int
    model: str
    version: int                    # -1: the latest ready version
    inputs: dict[str, str]          # composing model input -> ensemble tensor
    outputs: dict[str, str]         # composing model output -> ensemble tensor
    # filled by bind()
    max_batch_size: int = 0
    decoupled: bool = False
    variable_inputs: frozenset = frozenset()
    optional_inputs: frozenset = frozenset()
    input_dims: dict[str, list[int]] = field(default_factory=dict)     # without the batch
    device_inputs: bool = False     # its model reads inputs in GPU memory where they are
    stateful: bool = False          # its model has a sequence batcher

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model}')"


@dataclass
class EnsemblePlan:
    name: str
    steps: list[Step]
    inputs: list[str]               # the ensemble's own inputs
    outputs: list[str]              # the ensemble's own outputs
    producer: dict[str, int] = field(default_factory=dict)      # tensor -> step index
    consumers: dict[str, list[int]] = field(default_factory=dict)   # tensor -> step indexes
    decoupled: bool = False         # a step streams (filled by bind())
    # tensors a step makes that only steps taking device inputs read (filled by bind()): the
    # producer may leave them on its GPU and hand them over as CUDA IPC handles
    device_tensors: frozenset = frozenset()
    # the steps in an order they can run in, one after the other, when the last makes every
    # output (filled by bind()): such an ensemble may run worker to worker
    # (workers/leases/chain.py)
    chain: list[Step] = field(default_factory=list)
    # some of those steps could run at once (the scheduler runs them so): worker to worker
    # they run one after the other, which it does only while that costs less than the hops it
    # saves (``serial_ok``, set from the steps' statistics: engine/ensemble/step_costs.py)
    side_by_side: bool = False
    serial_ok: bool = False

    def chained(self) -> list[Step]:
        """The steps to run worker to worker now, in order; [] when the scheduler runs them."""
        return self.chain if not self.side_by_side or self.serial_ok else []

    def composing(self) -> list[str]:
        seen: list[str] = []
        for s in self.steps:
            if s.model not in seen:
                seen.append(s.model)
        return seen


def plan(cfg: ModelConfig) -> EnsemblePlan:
    """Check the ensemble's own config; raises ConfigError naming the problem."""
    name = cfg.name
    sched = cfg.ensemble_scheduling
    # a batcher is checked first: it shares a oneof with ensemble_scheduling, so an ensemble
    # that sets one has no steps, and "no steps" would hide the reason
    for other in ("dynamic_batching", "sequence_batching"):
        if cfg.HasField(other):
            raise ConfigError(f"ensemble '{name}': {other} cannot be specified for an "
                              f"ensemble; its composing models batch")
    if not sched.step:
        raise ConfigError(f"ensemble '{name}' must have at least one step in ensemble_scheduling")
    if cfg.instance_group:
        raise ConfigError(f"ensemble '{name}': instance_group cannot be specified for an "
                          f"ensemble; its composing models have instances")
    inputs = [t.name for t in cfg.input]
    outputs = [t.name for t in cfg.output]
    p = EnsemblePlan(name, [], inputs, outputs)
    for i, s in enumerate(sched.step):
        if not s.model_name:
            raise ConfigError(f"ensemble '{name}': step {i} must name a model (model_name)")
        if s.model_name == name:
            raise ConfigError(f"ensemble '{name}': step {i} names the ensemble itself")
        if not s.input_map or not s.output_map:
            raise ConfigError(f"ensemble '{name}': step {i} (model '{s.model_name}') must have "
                              f"an input_map and an output_map")
        # an unset model_version reads 0: like -1, the latest ready version
        step = Step(i, s.model_name, s.model_version if s.model_version > 0 else -1,
                    dict(s.input_map), dict(s.output_map))
        for tensor in step.outputs.values():
            if tensor in p.producer:
                raise ConfigError(f"ensemble tensor '{tensor}' can appear in an output map only "
                                  f"once for ensemble '{name}' (steps {p.producer[tensor]} and "
                                  f"{i})")
            if tensor in inputs:
                raise ConfigError(f"ensemble '{name}': step {i} writes '{tensor}', which is an "
                                  f"input of the ensemble")
            p.producer[tensor] = i
        for tensor in step.inputs.values():
            p.consumers.setdefault(tensor, []).append(i)
        p.steps.append(step)
    for tensor in inputs:
        if tensor not in p.consumers:
            raise ConfigError(f"ensemble input '{tensor}' for ensemble '{name}' is not used by "
                              f"any step")
    for tensor in outputs:
        if tensor not in p.producer:
            raise ConfigError(f"output '{tensor}' for ensemble '{name}' is not written by any "
                              f"step")
    for tensor, users in p.consumers.items():
        if tensor not in p.producer and tensor not in inputs:
            raise ConfigError(f"ensemble '{name}': step {users[0]} (model "
                              f"'{p.steps[users[0]].model}') reads '{tensor}', which is neither "
                              f"an ensemble input nor written by a step")
    _check_acyclic(p)
    return p


def _check_acyclic(p: EnsemblePlan) -> None:
    """Every step must become runnable: with the ensemble inputs present, run what can run
    until nothing changes; a step left over is part of a cycle."""
    have = set(p.inputs)
    left = list(p.steps)
    while left:
        ready = [s for s in left if all(t in have for t in s.inputs.values())]
        if not ready:
            names = ", ".join(f"{s.index} ('{s.model}')" for s in left)
            raise ConfigError(f"ensemble '{p.name}' has a cycle: steps {names} wait for each "
                              f"other's outputs")
        for s in ready:
            have.update(s.outputs.values())
            left.remove(s)


def bind(p: EnsemblePlan, cfg: ModelConfig, configs: Callable[[str, int], ModelConfig | None]
         ) -> None:
    """Check the plan against its composing models' configs (``configs(model, version)``: the
    serving config, None if that model has no ready version) and fill what each step needs at
    run time; raises ConfigError."""
    name = p.name
    declared = {t.name: t for t in (*cfg.input, *cfg.output)}
    types: dict[str, tuple[int, str]] = {}      # tensor -> (data type, who says so)
    for tensor, t in declared.items():
        types[tensor] = (t.data_type, "the ensemble's config")
    mbs = cfg.max_batch_size
    for step in p.steps:
        sub = configs(step.model, step.version)
        if sub is None:
            version = "" if step.version < 0 else f" version {step.version}"
            raise ConfigError(f"ensemble '{name}' depends on '{step.model}'{version}, which has "
                              f"no ready version")
        if mbs > 0 and (sub.max_batch_size == 0 or sub.max_batch_size < mbs):
            raise ConfigError(f"ensemble '{name}' has max_batch_size {mbs}, but {step.label} "
                              f"has max_batch_size {sub.max_batch_size}: a composing model "
                              f"must take batches at least as large as the ensemble")
        sub_in = {t.name: t for t in sub.input}
        sub_out = {t.name: t for t in sub.output}
        for own, tensor in step.inputs.items():
            t = sub_in.get(own)
            if t is None:
                raise ConfigError(f"ensemble '{name}': {step.label} maps '{tensor}' to input "
                                  f"'{own}', which the model does not have (it has "
                                  f"{', '.join(sorted(sub_in)) or 'none'})")
            _agree(name, types, tensor, t.data_type, f"input '{own}' of {step.label}")
        for own, tensor in step.outputs.items():
            t = sub_out.get(own)
            if t is None:
                raise ConfigError(f"ensemble '{name}': {step.label} maps output '{own}', which "
                                  f"the model does not have (it has "
                                  f"{', '.join(sorted(sub_out)) or 'none'})")
            _agree(name, types, tensor, t.data_type, f"output '{own}' of {step.label}")
        missing = [t.name for t in sub.input if not t.optional and t.name not in step.inputs]
        if missing:
            raise ConfigError(f"ensemble '{name}': {step.label} does not map the model's "
                              f"required input(s) {', '.join(repr(m) for m in missing)}")
        step.max_batch_size = sub.max_batch_size
        step.decoupled = sub.model_transaction_policy.decoupled
        step.variable_inputs = frozenset(t.name for t in sub.input
                                         if -1 in t.dims and not t.allow_ragged_batch)
        step.optional_inputs = frozenset(t.name for t in sub.input if t.optional)
        step.input_dims = {t.name: list(t.dims) for t in sub.input}
        step.device_inputs = takes_device_inputs(sub)
        step.stateful = sub.HasField("sequence_batching")
    p.decoupled = any(s.decoupled for s in p.steps)
    streaming = [s.label for s in p.steps if s.decoupled]
    if cfg.response_cache.enable and streaming:
        raise ConfigError(f"Response Cache does not currently support model '{name}' with "
                          f"'decoupled' transaction policy: its {streaming[0]} is decoupled "
                          f"(the ensemble's answers would be a stream)")
    p.device_tensors = frozenset(
        tensor for tensor, users in p.consumers.items()
        if tensor in p.producer and all(p.steps[u].device_inputs for u in users))
    p.chain = chain(p, cfg)


def chain(p: EnsemblePlan, cfg: ModelConfig) -> list[Step]:
    """The steps in an order they can run in one after the other (of those ready together,
    the first in the config first); [] when they must not. Each worker hands the request to the
    next step's, and the last answers with the ensemble's outputs, whichever steps made them.
    Sets ``side_by_side`` when two steps could run at once. Left to the scheduler: streaming
    steps, tensors kept on a GPU, stateful steps (the sequence batcher orders their requests),
    and a request that leaves out an optional input (ipc/chain_route.py)."""
    p.side_by_side = False
    if p.decoupled or p.device_tensors or any(s.stateful for s in p.steps):
        return []
    have = set(p.inputs)
    left = list(p.steps)
    order: list[Step] = []
    while left:
        ready = [s for s in left if all(t in have for t in s.inputs.values())]
        if not ready:
            return []           # (plan() refused a cycle)
        p.side_by_side |= len(ready) > 1
        order.append(ready[0])
        have.update(ready[0].outputs.values())
        left.remove(ready[0])
    return order


def serial_cost_ns(p: EnsemblePlan, cost_ns: dict[int, float]) -> float:
    """What running the chain's steps one after the other adds to a request's time over
    running side by side those that can: the steps' costs (by step index) summed, less the
    longest path through them."""
    finish: dict[int, float] = {}
    for s in p.chain:
        before = [finish[p.producer[t]] for t in s.inputs.values() if t in p.producer]
        finish[s.index] = cost_ns[s.index] + max(before, default=0.0)
    return sum(cost_ns[s.index] for s in p.chain) - max(finish.values(), default=0.0)


def takes_device_inputs(sub: ModelConfig) -> bool:
    """Whether the model's workers read an input that is in GPU memory where it is, as the
    workers' backends say with ``device_inputs``: TensorRT; onnxruntime when every instance is
    on a GPU (I/O binding; string tensors turn it off); a python model that asks for GPU inputs
    (FORCE_CPU_ONLY_INPUT_TENSORS "no"). Any other model would copy such an input to the host
    itself, after starting CUDA for it: better the producer copies it out."""
    if sub.backend == "tensorrt" or sub.platform == "tensorrt_plan":
        return True
    if sub.backend == "onnxruntime" or sub.platform == "onnxruntime_onnx":
        return bool(sub.instance_group) and \
            all(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in sub.instance_group) and \
            not any(t.data_type == mc.TYPE_STRING for t in (*sub.input, *sub.output))
    if config_runs_python(sub):             # python-based backends' models too
        param = sub.parameters.get("FORCE_CPU_ONLY_INPUT_TENSORS")
        return param is not None and param.string_value.strip().lower() == "no"
    return False


def _agree(name: str, types: dict, tensor: str, data_type: int, who: str) -> None:
    seen = types.get(tensor)
    if seen is None:
        types[tensor] = (data_type, who)
    elif seen[0] != data_type:
        from tritonclient.grpc.model_config_pb2 import DataType
        raise ConfigError(f"ensemble '{name}': tensor '{tensor}' is {DataType.Name(seen[0])} "
                          f"for {seen[1]} but {DataType.Name(data_type)} for {who}")


def step_input_problem(step: Step, inputs: list[Tensor]) -> str:
    """A step's inputs must fit its model's config as a client's would (the frontend checked
    only the ensemble's own inputs); Triton's words, or "" when they fit."""
    return input_shape_problem(step.model, step.max_batch_size, step.input_dims, inputs)
