"""An ensemble's data flow checked from its own config (plan) and against its composing models'
configs (bind), and model_config.normalize for platform 'ensemble'. Pure: no core, no files
except the repository test's."""
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.ensemble.plan import bind, plan, serial_cost_ns
from shmserve.engine.lifecycle.repository import ModelRepository
from shmserve.ipc.model_config import ConfigError, normalize

FP32, INT32 = "TYPE_FP32", "TYPE_INT32"


def step(model, ins, outs, version=None):
    text = f'step {{ model_name: "{model}"'
    if version is not None:
        text += f" model_version: {version}"
    text += "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in ins.items())
    text += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outs.items())
    return text + " }\n"


def ensemble(steps, inputs=(("IN", FP32),), outputs=(("OUT", FP32),),
             extra="max_batch_size: 8") -> mc.ModelConfig:
    text = f'name: "E"\nplatform: "ensemble"\n{extra}\n'
    text += "".join(f'input {{ name: "{n}" data_type: {t} dims: [ 4 ] }}\n' for n, t in inputs)
    text += "".join(f'output {{ name: "{n}" data_type: {t} dims: [ 4 ] }}\n' for n, t in outputs)
    if steps is not None:
        text += "ensemble_scheduling {\n" + "".join(steps) + "}\n"
    return normalize(text_format.Parse(text, mc.ModelConfig()), "E")


def model(name, inputs=(("INPUT0", FP32),), outputs=(("OUTPUT0", FP32),), extra="max_batch_size: 8",
          dims="[ 4 ]") -> mc.ModelConfig:
    """A composing model's normalized config; an input may be (name, type, 'optional')."""
    text = f'name: "{name}"\nbackend: "python"\n{extra}\n'
    for i in inputs:
        opt = " optional: true" if len(i) > 2 and i[2] == "optional" else ""
        text += f'input {{ name: "{i[0]}" data_type: {i[1]} dims: {dims}{opt} }}\n'
    text += "".join(f'output {{ name: "{n}" data_type: {t} dims: {dims} }}\n' for n, t in outputs)
    return normalize(text_format.Parse(text, mc.ModelConfig()), name)


# a -> mid -> b
CHAIN = [step("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
         step("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})]


def configs(*models, versions=None):
    """configs(model, version) as bind wants it: the named configs, at any version (or only
    at ``versions[name]`` when given)."""
    by_name = {m.name: m for m in models}

    def get(name, version):
        if versions and name in versions and version not in (-1, versions[name]):
            return None
        return by_name.get(name)
    return get


def plan_error(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        plan(cfg)
    return str(e.value)


def bind_error(cfg, *models) -> str:
    p = plan(cfg)
    with pytest.raises(ConfigError) as e:
        bind(p, cfg, configs(*models))
    return str(e.value)


# ---- plan(): the ensemble's own config ----------------------------------------------------------
def test_plan_of_a_chain():
    p = plan(ensemble(CHAIN))
    assert p.name == "E" and p.inputs == ["IN"] and p.outputs == ["OUT"]
    assert [(s.index, s.model, s.version) for s in p.steps] == [(0, "a", -1), (1, "b", -1)]
    assert p.steps[1].inputs == {"INPUT0": "mid"} and p.steps[1].outputs == {"OUTPUT0": "OUT"}
    assert p.producer == {"mid": 0, "OUT": 1}
    assert p.consumers == {"IN": [0], "mid": [1]}
    assert p.composing() == ["a", "b"] and p.steps[0].label == "step 0 (model 'a')"
    assert not p.decoupled                          # known only after bind


def test_plan_model_versions_and_composing_once():
    p = plan(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "x"}, version=2),
                       step("a", {"INPUT0": "x"}, {"OUTPUT0": "OUT"}, version=-1)]))
    assert [s.version for s in p.steps] == [2, -1]
    assert p.composing() == ["a"]


@pytest.mark.parametrize("steps", [None, []])
def test_no_steps(steps):
    assert "ensemble 'E' must have at least one step in ensemble_scheduling" in \
        plan_error(ensemble(steps))


def test_instance_group_given():
    err = plan_error(ensemble(CHAIN, extra="max_batch_size: 8\ninstance_group [ { count: 2 } ]"))
    assert "ensemble 'E': instance_group cannot be specified for an ensemble" in err


@pytest.mark.parametrize("field", ["dynamic_batching", "sequence_batching"])
def test_batcher_given(field):
    """A batcher shares a oneof with ensemble_scheduling: the config then has no steps, and the
    error names the batcher, not the missing steps."""
    err = plan_error(ensemble(None, extra=f"max_batch_size: 8\n{field} {{ }}"))
    assert f"ensemble 'E': {field} cannot be specified for an ensemble" in err


def test_step_without_model_name():
    err = plan_error(ensemble([step("", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})]))
    assert "ensemble 'E': step 0 must name a model (model_name)" in err


def test_step_naming_the_ensemble_itself():
    err = plan_error(ensemble([step("E", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})]))
    assert "ensemble 'E': step 0 names the ensemble itself" in err


@pytest.mark.parametrize("ins, outs", [({}, {"OUTPUT0": "OUT"}), ({"INPUT0": "IN"}, {})])
def test_step_without_a_map(ins, outs):
    err = plan_error(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
                               step("b", ins, outs)]))
    assert "ensemble 'E': step 1 (model 'b') must have an input_map and an output_map" in err


def test_tensor_written_twice():
    err = plan_error(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
                               step("b", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})]))
    assert "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'E' " \
           "(steps 0 and 1)" in err


def test_writing_an_ensemble_input():
    err = plan_error(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT", "OUTPUT1": "IN"})]))
    assert "ensemble 'E': step 0 writes 'IN', which is an input of the ensemble" in err


def test_unused_input():
    err = plan_error(ensemble(CHAIN, inputs=(("IN", FP32), ("SPARE", FP32))))
    assert "ensemble input 'SPARE' for ensemble 'E' is not used by any step" in err


def test_unwritten_output():
    err = plan_error(ensemble(CHAIN, outputs=(("OUT", FP32), ("NEVER", FP32))))
    assert "output 'NEVER' for ensemble 'E' is not written by any step" in err


def test_unknown_tensor_read():
    err = plan_error(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                               step("b", {"INPUT0": "mid", "INPUT1": "ghost"},
                                    {"OUTPUT0": "OUT"})]))
    assert "ensemble 'E': step 1 (model 'b') reads 'ghost', which is neither an ensemble input " \
           "nor written by a step" in err


def test_cycle():
    err = plan_error(ensemble([step("a", {"INPUT0": "IN", "INPUT1": "y"}, {"OUTPUT0": "x"}),
                               step("b", {"INPUT0": "x"}, {"OUTPUT0": "y", "OUTPUT1": "OUT"})]))
    assert "ensemble 'E' has a cycle: steps 0 ('a'), 1 ('b') wait for each other's outputs" in err


def test_a_cycle_after_a_runnable_step_names_only_the_stuck_steps():
    err = plan_error(ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "x"}),
                               step("b", {"INPUT0": "x", "INPUT1": "z"}, {"OUTPUT0": "y"}),
                               step("c", {"INPUT0": "y"}, {"OUTPUT0": "z", "OUTPUT1": "OUT"})]))
    assert "has a cycle: steps 1 ('b'), 2 ('c') wait" in err


# ---- bind(): against the composing models' configs ----------------------------------------------
def test_bind_fills_what_each_step_needs():
    cfg = ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                    step("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    a = model("a", inputs=(("INPUT0", FP32), ("HINT", FP32, "optional")), extra="max_batch_size: 16",
              dims="[ -1 ]")
    b = model("b", extra="max_batch_size: 8\nmodel_transaction_policy { decoupled: true }")
    p = plan(cfg)
    bind(p, cfg, configs(a, b))
    sa, sb = p.steps
    assert (sa.max_batch_size, sa.decoupled) == (16, False)
    assert sa.variable_inputs == frozenset({"INPUT0", "HINT"})
    assert sa.optional_inputs == frozenset({"HINT"})     # not mapped: fine, it is optional
    assert (sb.max_batch_size, sb.decoupled) == (8, True)
    assert sb.variable_inputs == frozenset() and sb.optional_inputs == frozenset()
    assert p.decoupled                                  # a step streams: the ensemble does


def test_bind_ragged_inputs_are_not_variable_and_nothing_streams():
    cfg = ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})])
    text = ('name: "a"\nbackend: "python"\nmax_batch_size: 8\n'
            'input { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }\n'
            'output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }\n')
    a = normalize(text_format.Parse(text, mc.ModelConfig()), "a")
    p = plan(cfg)
    bind(p, cfg, configs(a))
    assert p.steps[0].variable_inputs == frozenset() and not p.decoupled


def test_composing_model_not_ready():
    assert "ensemble 'E' depends on 'b', which has no ready version" in \
        bind_error(ensemble(CHAIN), model("a"))


def test_composing_model_version_not_ready():
    cfg = ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}, version=3)])
    p = plan(cfg)
    with pytest.raises(ConfigError) as e:
        bind(p, cfg, configs(model("a"), versions={"a": 1}))
    assert "ensemble 'E' depends on 'a' version 3, which has no ready version" in str(e.value)


def test_a_nested_ensemble_binds_like_a_model():
    inner = ensemble([step("x", {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT0"})],
                     inputs=(("INPUT0", FP32),), outputs=(("OUTPUT0", FP32),))
    inner.name = "b"
    cfg = ensemble(CHAIN)
    p = plan(cfg)
    bind(p, cfg, configs(model("a"), inner))
    assert p.steps[1].max_batch_size == 8 and not p.steps[1].decoupled and not p.decoupled
    assert not p.steps[1].device_inputs         # an ensemble reads inputs in host memory
    # one that streams (its loader marks its config decoupled) makes the outer one stream
    inner.model_transaction_policy.decoupled = True
    p = plan(cfg)
    bind(p, cfg, configs(model("a"), inner))
    assert p.steps[1].decoupled and p.decoupled
    # and its tensors must still agree
    wrong = ensemble([step("x", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})])
    wrong.name = "b"
    assert "maps 'mid' to input 'INPUT0', which the model does not have (it has IN)" in \
        bind_error(ensemble(CHAIN), model("a"), wrong)


@pytest.mark.parametrize("sub_mbs", [4, 0])
def test_max_batch_size_larger_than_a_steps(sub_mbs):
    err = bind_error(ensemble(CHAIN), model("a"), model("b", extra=f"max_batch_size: {sub_mbs}"))
    assert f"ensemble 'E' has max_batch_size 8, but step 1 (model 'b') has max_batch_size " \
           f"{sub_mbs}: a composing model must take batches at least as large" in err


def test_an_unbatched_ensemble_may_use_batching_models():
    cfg = ensemble(CHAIN, extra="max_batch_size: 0")
    p = plan(cfg)
    bind(p, cfg, configs(model("a", extra="max_batch_size: 0"), model("b")))
    assert [s.max_batch_size for s in p.steps] == [0, 8]


def test_unknown_input_name():
    err = bind_error(ensemble(CHAIN), model("a", inputs=(("X", FP32), ("Y", FP32))), model("b"))
    assert "ensemble 'E': step 0 (model 'a') maps 'IN' to input 'INPUT0', which the model does " \
           "not have (it has X, Y)" in err


def test_unknown_output_name():
    err = bind_error(ensemble(CHAIN), model("a", outputs=(("RESULT", FP32),)), model("b"))
    assert "ensemble 'E': step 0 (model 'a') maps output 'OUTPUT0', which the model does not " \
           "have (it has RESULT)" in err


def test_datatype_mismatch_with_the_ensembles_config():
    err = bind_error(ensemble(CHAIN), model("a", inputs=(("INPUT0", INT32),)), model("b"))
    assert "ensemble 'E': tensor 'IN' is TYPE_FP32 for the ensemble's config but TYPE_INT32 for " \
           "input 'INPUT0' of step 0 (model 'a')" in err


def test_datatype_mismatch_between_steps():
    err = bind_error(ensemble(CHAIN), model("a", outputs=(("OUTPUT0", INT32),)), model("b"))
    assert "ensemble 'E': tensor 'mid' is TYPE_INT32 for output 'OUTPUT0' of step 0 (model 'a') " \
           "but TYPE_FP32 for input 'INPUT0' of step 1 (model 'b')" in err


def test_unmapped_required_input():
    err = bind_error(ensemble(CHAIN), model("a"),
                     model("b", inputs=(("INPUT0", FP32), ("SCALE", FP32), ("BIAS", FP32))))
    assert "ensemble 'E': step 1 (model 'b') does not map the model's required input(s) " \
           "'SCALE', 'BIAS'" in err


# ---- model_config.normalize and the repository for platform 'ensemble' ---------------------------
def test_normalize_ensemble_adds_no_instances_nor_backend():
    cfg = ensemble(CHAIN)
    assert cfg.platform == "ensemble" and cfg.backend == ""
    assert len(cfg.instance_group) == 0 and cfg.default_model_filename == ""
    assert cfg.version_policy.latest.num_versions == 1
    assert not cfg.model_transaction_policy.decoupled


def test_normalize_ensemble_with_a_backend_is_an_error():
    with pytest.raises(ConfigError) as e:
        ensemble(CHAIN, extra='max_batch_size: 8\nbackend: "python"')
    assert "ensemble 'E' must not set a backend" in str(e.value)


def test_normalize_ensemble_checks_its_tensors_and_batch_size():
    with pytest.raises(ConfigError, match="max_batch_size must be >= 0"):
        ensemble(CHAIN, extra="max_batch_size: -1")
    with pytest.raises(ConfigError, match="must specify a valid data_type"):
        ensemble(CHAIN, inputs=(("IN", "TYPE_INVALID"),))


def test_repository_reads_an_ensemble_without_model_files(tmp_path):
    from fakes import write_ensemble
    repo = str(tmp_path)
    write_ensemble(repo, "E", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})], versions=(1, 2))
    entry = ModelRepository([repo]).read_model("E", [str(tmp_path / "E")])
    assert entry.error == "" and [v.version for v in entry.versions] == [2]
    assert [v.error for v in entry.versions] == [""] and not entry.auto_complete
    assert entry.config.platform == "ensemble" and len(entry.config.instance_group) == 0


def test_a_cached_ensemble_with_a_decoupled_step_does_not_load():
    cached = ensemble(CHAIN, extra="max_batch_size: 8\nresponse_cache { enable: true }")
    streaming = model("b", extra="max_batch_size: 8\nmodel_transaction_policy { decoupled: true }")
    assert bind_error(cached, model("a"), streaming) == (
        "Response Cache does not currently support model 'E' with 'decoupled' transaction "
        "policy: its step 1 (model 'b') is decoupled (the ensemble's answers would be a stream)")
    bind(plan(cached), cached, configs(model("a"), model("b")))      # plain steps: it loads
    plain = ensemble(CHAIN)
    bind(plan(plain), plain, configs(model("a"), streaming))        # no cache: it loads


def test_absent_tensors_follow_the_steps_that_can_never_run():
    """Triton's optional-input ensembles: a left-out ensemble input is absent; a step whose
    required input is absent never runs, so its outputs are absent too; an optional input
    that is absent does not hold its step back."""
    from shmserve.engine.ensemble.plan import EnsemblePlan, Step
    from shmserve.engine.ensemble.runner import absent
    a = Step(0, "m", -1, {"IN0": "X", "IN1": "Y"}, {"OUT": "t"}, optional_inputs=frozenset({"IN1"}))
    b = Step(1, "m", -1, {"IN0": "Y"}, {"OUT": "u"})                 # Y required here
    c = Step(2, "m", -1, {"IN0": "u", "IN1": "t"}, {"OUT": "v"},
             optional_inputs=frozenset({"IN0"}))
    plan = EnsemblePlan("E", [a, b, c], ["X", "Y"], ["t", "v"])
    assert absent(plan, {"X", "Y"}) == frozenset()
    assert absent(plan, {"X"}) == frozenset({"Y", "u"})    # b never runs; a and c still do
    # a's X is required: a never runs, and c's t (required) never comes either
    assert absent(plan, {"Y"}) == frozenset({"X", "t", "v"})
    assert absent(plan, set()) == frozenset({"X", "Y", "t", "u", "v"})


# ---- chain: the ensembles whose steps may run worker to worker (workers/leases/chain.py) ---------------
def chained(steps, *models, **kw) -> list[int]:
    cfg = ensemble(steps, **kw)
    p = plan(cfg)
    bind(p, cfg, configs(*models))
    return [s.index for s in p.chain]


def test_steps_that_can_only_run_one_after_the_other_form_a_chain_in_that_order():
    # written out of order: the chain is the order they can run in
    assert chained(list(reversed(CHAIN)), model("a"), model("b")) == [1, 0]
    assert chained(CHAIN[:1] + [step("b", {"INPUT0": "mid"}, {"OUTPUT0": "mid2"}),
                                step("c", {"INPUT0": "mid2"}, {"OUTPUT0": "OUT"})],
                   model("a"), model("b"), model("c")) == [0, 1, 2]


DIAMOND = [step("c", {"X": "p", "Y": "q"}, {"OUTPUT0": "OUT"}),     # written first: runs last
           step("a", {"INPUT0": "IN"}, {"OUTPUT0": "p"}),
           step("b", {"INPUT0": "IN"}, {"OUTPUT0": "q"})]


def diamond_plan():
    cfg = ensemble(DIAMOND)
    p = plan(cfg)
    bind(p, cfg, configs(model("a"), model("b"), model("c", inputs=(("X", FP32), ("Y", FP32)))))
    return p


def test_steps_that_could_run_side_by_side_chain_only_while_that_costs_less_than_it_saves():
    # a and b both read IN (the scheduler runs them side by side); c joins them
    p = diamond_plan()
    assert [s.index for s in p.chain] == [1, 2, 0] and p.side_by_side
    assert p.chained() == []                    # until their costs say otherwise
    p.serial_ok = True
    assert [s.index for s in p.chained()] == [1, 2, 0]
    # one after the other, a and b cost the shorter of the two more than side by side
    assert serial_cost_ns(p, {0: 10.0, 1: 30.0, 2: 50.0}) == 30.0
    assert serial_cost_ns(p, {0: 10.0, 1: 0.0, 2: 50.0}) == 0.0


def test_a_chain_loses_nothing_when_its_steps_run_one_after_the_other():
    cfg = ensemble(CHAIN)
    p = plan(cfg)
    bind(p, cfg, configs(model("a"), model("b")))
    assert not p.side_by_side and p.chained() == p.chain and len(p.chain) == 2
    assert serial_cost_ns(p, {0: 40.0, 1: 70.0}) == 0.0


def test_outputs_made_before_the_last_step_chain_too():
    # an output a later step also reads (the last worker answers with it)
    steps = [step("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
             step("b", {"INPUT0": "mid"}, {"OUTPUT0": "OUT2"})]
    assert chained(steps, model("a"), model("b"),
                   outputs=(("mid", FP32), ("OUT2", FP32))) == [0, 1]
    # fan out: two steps read IN, each makes an output, nothing joins them
    cfg = ensemble([step("a", {"INPUT0": "IN"}, {"OUTPUT0": "OUT_A"}),
                    step("b", {"INPUT0": "IN"}, {"OUTPUT0": "OUT_B"})],
                   outputs=(("OUT_A", FP32), ("OUT_B", FP32)))
    p = plan(cfg)
    bind(p, cfg, configs(model("a"), model("b")))
    assert [s.index for s in p.chain] == [0, 1] and p.side_by_side
    assert p.chained() == []                    # side by side: only once light (step_costs)


def test_steps_with_optional_inputs_chain_streaming_steps_are_left_to_the_scheduler():
    # (a request that leaves an optional input out goes to the scheduler: ipc/chain_route.py)
    optional = model("b", inputs=(("INPUT0", FP32), ("EXTRA", FP32, "optional")))
    assert chained(CHAIN, model("a"), optional) == [0, 1]
    streaming = model("b", extra="max_batch_size: 8\nmodel_transaction_policy { decoupled: true }")
    assert chained(CHAIN, model("a"), streaming) == []
