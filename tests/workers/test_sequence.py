"""workers/sequence.py: the control tensors and the implicit state a sequence model's request gets
besides the client's inputs, checked without a backend (a response is made by hand)."""
from __future__ import annotations

import numpy as np
import pytest

from shmserve.ipc import dtypes
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers import sequence
from shmserve.workers.backends.base import WorkRequest, WorkResponse
from shmserve.workers.sequence import SequenceConfigError, SequenceRequestError
from shmserve.workers.tensors import OutputChecks

START, END = sequence.SEQUENCE_START, sequence.SEQUENCE_END


def control(name, kind, **values):
    return {"name": name, "control": [{"kind": kind, **values}]}


def config(mbs=8, controls=(), states=(), outputs=("OUTPUT",), **seq):
    return {"name": "m", "max_batch_size": mbs,
            "sequence_batching": {"control_input": list(controls), "state": list(states), **seq},
            "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [1]} for n in outputs]}


def state(inp="STATE_IN", out="STATE_OUT", data_type="TYPE_INT32", dims=(1,), initial=None):
    st = {"input_name": inp, "output_name": out, "data_type": data_type, "dims": list(dims)}
    if initial is not None:
        st["initial_state"] = [initial]
    return st


def make(cfg, model_dir="/nonexistent"):
    seqs = sequence.from_config(cfg, model_dir)
    assert seqs is not None
    return seqs


def prepare(seqs, cid, flags=0, requested=("OUTPUT",)):
    inputs, types = {}, {}
    wanted = seqs.prepare(cid, flags, inputs, types, list(requested))
    return inputs, types, wanted


def run(seqs, requests, outputs_of):
    """One batch: ``requests`` = [(cid, flags)]; ``outputs_of(cid, inputs)`` -> the response's
    outputs [(name, datatype, array)]. Returns {cid: (inputs, response)}."""
    work, got = [], {}
    for cid, flags in requests:
        inputs, types, wanted = prepare(seqs, cid, flags)
        work.append(WorkRequest(inputs, types, wanted, "", {}, cid, flags))
    responses = [WorkResponse(outputs=outputs_of(r.correlation_id, r.inputs)) for r in work]
    seqs.finish(work, responses)
    for r, resp in zip(work, responses):
        got[r.correlation_id] = (r.inputs, resp)
    return got


def test_a_model_without_sequence_batching_has_none():
    assert sequence.from_config({"name": "m", "max_batch_size": 8}, "/x") is None


# ---- control tensors ------------------------------------------------------------------------
BOOLEAN_KINDS = [("int32_false_true", [0, 1], np.int32, "INT32"),
                 ("int32_false_true", [-7, 9], np.int32, "INT32"),
                 ("fp32_false_true", [0.5, 2.5], np.float32, "FP32"),
                 ("bool_false_true", [False, True], np.bool_, "BOOL"),
                 ("bool_false_true", [True, False], np.bool_, "BOOL")]


@pytest.mark.parametrize("key,values,np_type,wire", BOOLEAN_KINDS)
@pytest.mark.parametrize("mbs,shape", [(8, (1, 1)), (0, (1,))])
def test_start_end_ready_take_the_configured_values(key, values, np_type, wire, mbs, shape):
    cfg = config(mbs, [control("S", "CONTROL_SEQUENCE_START", **{key: values}),
                       control("E", "CONTROL_SEQUENCE_END", **{key: values}),
                       control("R", "CONTROL_SEQUENCE_READY", **{key: values})])
    seqs = make(cfg)
    false, true = values
    for flags, s, e in [(0, false, false), (START, true, false), (END, false, true),
                        (START | END, true, true)]:
        inputs, types, wanted = prepare(seqs, 5, flags)
        assert wanted == ["OUTPUT"]
        assert types == {"S": wire, "E": wire, "R": wire}
        for name, want in (("S", s), ("E", e), ("R", true)):    # READY: every request is real
            arr = inputs[name]
            assert arr.dtype == np_type and arr.shape == shape and arr.tolist() == np.full(shape, want, np_type).tolist()
            assert not arr.flags.writeable          # shared by every request


def test_control_tensors_batch_like_inputs():
    seqs = make(config(8, [control("START", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1])]))
    batch = np.concatenate([prepare(seqs, c, f)[0]["START"] for c, f in [(1, START), (2, 0)]])
    assert batch.tolist() == [[1], [0]]


@pytest.mark.parametrize("kind", [0, None])
def test_kind_start_may_be_its_number_or_left_out(kind):
    """The enum's default (CONTROL_SEQUENCE_START = 0) is what a JSON form leaves out."""
    c = {"int32_false_true": [0, 1]} if kind is None else {"kind": kind, "int32_false_true": [0, 1]}
    seqs = make(config(8, [{"name": "S", "control": [c]}]))
    assert prepare(seqs, 1, START)[0]["S"].tolist() == [[1]]
    assert prepare(seqs, 1, 0)[0]["S"].tolist() == [[0]]


def test_the_json_form_with_every_field_printed():
    """The engine hands workers configs with every field printed: empty lists for the
    false/true pairs not used, TYPE_INVALID for data_type."""
    c = {"kind": "CONTROL_SEQUENCE_END", "int32_false_true": [], "fp32_false_true": [2.0, 3.0],
         "bool_false_true": [], "data_type": "TYPE_INVALID"}
    seqs = make(config(0, [{"name": "E", "control": [c]}]))
    assert prepare(seqs, 1, END)[0]["E"].tolist() == [3.0]


# ---- CORRID ---------------------------------------------------------------------------------
CORRIDS = [
    ("TYPE_UINT64", 2 ** 64 - 1, np.uint64, 2 ** 64 - 1),
    ("TYPE_UINT64", 7, np.uint64, 7),
    ("TYPE_INT64", 2 ** 63, np.int64, -2 ** 63),            # the same 64 bits, read signed
    ("TYPE_INT64", 12345, np.int64, 12345),
    ("TYPE_UINT32", 2 ** 32 + 5, np.uint32, 5),             # Triton copies the low bytes
    ("TYPE_INT32", 2 ** 31, np.int32, -2 ** 31),
    ("TYPE_INT32", 2 ** 32 + 2 ** 31 + 1, np.int32, -2 ** 31 + 1),
    ("TYPE_INT32", 99, np.int32, 99),
]


@pytest.mark.parametrize("data_type,cid,np_type,want", CORRIDS)
@pytest.mark.parametrize("mbs,shape", [(4, (1, 1)), (0, (1,))])
def test_corrid_in_each_integer_type(data_type, cid, np_type, want, mbs, shape):
    seqs = make(config(mbs, [control("CORRID", "CONTROL_SEQUENCE_CORRID", data_type=data_type)]))
    inputs, types, _ = prepare(seqs, cid, START)
    arr = inputs["CORRID"]
    assert arr.dtype == np_type and arr.shape == shape and int(arr.ravel()[0]) == want
    assert types["CORRID"] == data_type[5:]


@pytest.mark.parametrize("cid,want", [("abc", b"abc"), ("séquence", "séquence".encode()),
                                      (42, b"42"), (2 ** 64 - 1, b"18446744073709551615")])
@pytest.mark.parametrize("mbs,shape", [(4, (1, 1)), (0, (1,))])
def test_string_corrid_is_bytes_and_an_integer_id_its_decimal_text(cid, want, mbs, shape):
    seqs = make(config(mbs, [control("CORRID", "CONTROL_SEQUENCE_CORRID", data_type="TYPE_STRING")]))
    inputs, types, _ = prepare(seqs, cid, START)
    assert types["CORRID"] == "BYTES"
    assert inputs["CORRID"].dtype == object and inputs["CORRID"].shape == shape
    assert inputs["CORRID"].ravel().tolist() == [want]


@pytest.mark.parametrize("data_type", ["TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32"])
def test_a_string_id_for_an_integer_corrid_fails_that_request_and_changes_nothing(data_type):
    seqs = make(config(8, [control("START", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1]),
                           control("CORRID", "CONTROL_SEQUENCE_CORRID", data_type=data_type)],
                       [state()]))
    inputs, types = {}, {}
    with pytest.raises(SequenceRequestError) as e:
        seqs.prepare("abc", START, inputs, types, ["OUTPUT"])
    assert str(e.value) == (f"sequence 'abc': model 'm' takes the correlation id as {data_type} in "
                            f"control input 'CORRID', so the sequence_id must be an unsigned "
                            f"integer, not a string")
    assert inputs == {} and types == {} and not seqs.held and not seqs.hidden


# ---- config errors --------------------------------------------------------------------------
BAD_CONTROLS = [
    ([control("S", "CONTROL_SEQUENCE_START")],
     "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for CONTROL_SEQUENCE_START for m"),
    ([control("S", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1], fp32_false_true=[0, 1])],
     "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and 'bool_false_true' for CONTROL_SEQUENCE_START for m"),
    ([control("S", "CONTROL_SEQUENCE_READY", bool_false_true=[False, True, True])],
     "sequence batching control 'bool_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_READY for m"),
    ([control("S", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1]),
      control("T", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1])],
     "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for m"),
    ([control("S", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1]),
      control("S", "CONTROL_SEQUENCE_READY", int32_false_true=[0, 1])],
     "sequence batching control tensor 'S' is specified for multiple control kinds for m"),
    ([control("", "CONTROL_SEQUENCE_START", int32_false_true=[0, 1])],
     "sequence batching control tensor must have a name for m"),
    ([control("C", "CONTROL_SEQUENCE_CORRID", data_type="TYPE_FP32")],
     "unexpected control data type, expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32, or TYPE_STRING for CONTROL_SEQUENCE_CORRID for m"),
    ([{"name": "S", "control": []}],
     "sequence batching control tensor 'S' must have exactly one control for m, it has 0"),
]


@pytest.mark.parametrize("controls,message", BAD_CONTROLS)
def test_control_config_errors(controls, message):
    with pytest.raises(SequenceConfigError) as e:
        sequence.from_config(config(8, controls), "/x")
    assert str(e.value) == message


# ---- implicit state -------------------------------------------------------------------------
def accumulate(cid, inputs):
    """A model whose state output is its state input plus 10."""
    total = inputs["STATE_IN"] + 10
    return [("OUTPUT", "INT32", total.copy()), ("STATE_OUT", "INT32", total)]


def test_state_is_carried_across_requests_and_hidden_from_the_client():
    seqs = make(config(8, states=[state(initial={"name": "z", "data_type": "TYPE_INT32", "dims": [1], "zero_data": True})]))
    got = run(seqs, [(1, START)], accumulate)
    inputs, resp = got[1]
    assert inputs["STATE_IN"].tolist() == [[0]]
    assert [o[0] for o in resp.outputs] == ["OUTPUT"]          # STATE_OUT kept, not returned
    for step in (20, 30):
        (inputs, resp), = run(seqs, [(1, 0)], accumulate).values()
        assert inputs["STATE_IN"].tolist() == [[step - 10]]
        assert resp.outputs[0][2].tolist() == [[step]]


def test_the_backend_is_asked_for_the_state_outputs():
    seqs = make(config(8, states=[state(), state("H_IN", "H_OUT")]))
    assert prepare(seqs, 1, START)[2] == ["OUTPUT", "STATE_OUT", "H_OUT"]
    assert prepare(seqs, 2, START, ["OUTPUT", "H_OUT"])[2] == ["OUTPUT", "H_OUT", "STATE_OUT"]


def test_a_state_output_the_client_asked_for_comes_back():
    """Triton: the client may ask for it when the config lists it among the outputs."""
    seqs = make(config(8, states=[state()], outputs=("OUTPUT", "STATE_OUT")))
    inputs, types, wanted = prepare(seqs, 1, START, ["OUTPUT", "STATE_OUT"])
    assert wanted == ["OUTPUT", "STATE_OUT"]
    resp = WorkResponse(outputs=accumulate(1, inputs))
    seqs.finish([WorkRequest(inputs, types, wanted, "", {}, 1, START)], [resp])
    assert [o[0] for o in resp.outputs] == ["OUTPUT", "STATE_OUT"]
    assert seqs.held[1]["STATE_IN"].tolist() == [[10]]


def test_asking_for_every_output_means_the_configs():
    seqs = make(config(8, states=[state()]))
    inputs, types, wanted = prepare(seqs, 1, START, [])
    assert wanted == []                     # the backend returns all, the state among them
    resp = WorkResponse(outputs=accumulate(1, inputs))
    seqs.finish([WorkRequest(inputs, types, wanted, "", {}, 1, START)], [resp])
    assert [o[0] for o in resp.outputs] == ["OUTPUT"]


def test_output_checks_let_an_output_outside_the_config_pass():
    """Worker.result checks outputs against the config's list; a state output named there is
    checked like any output, one that is not (only when a client asked for every output and
    the backend gave it) passes untouched."""
    checks = OutputChecks(config(8))
    assert checks.problem("STATE_OUT", "FP64", (3, 7)) == ""
    assert checks.fit("STATE_OUT", "INT64", np.ones(2, np.int64))[0] == "INT64"


def test_start_resets_the_state():
    seqs = make(config(8, states=[state()]))
    run(seqs, [(1, START)], accumulate)
    run(seqs, [(1, 0)], accumulate)
    inputs, _ = run(seqs, [(1, START)], accumulate)[1]     # a new START for the same id
    assert inputs["STATE_IN"].tolist() == [[0]]


def test_end_drops_the_state():
    seqs = make(config(8, states=[state()]))
    run(seqs, [(1, START), (2, START)], accumulate)
    _, resp = run(seqs, [(1, END)], accumulate)[1]
    assert [o[0] for o in resp.outputs] == ["OUTPUT"]
    assert list(seqs.held) == [2] and not seqs.hidden


def test_start_and_end_in_one_request_leaves_nothing():
    seqs = make(config(8, states=[state()]))
    (inputs, resp), = run(seqs, [(1, START | END)], accumulate).values()
    assert inputs["STATE_IN"].tolist() == [[0]] and resp.outputs[0][2].tolist() == [[10]]
    assert not seqs.held


def test_an_unseen_sequence_without_start_gets_the_initial_state():
    """Triton's empty slot: a sequence this worker never saw (its state evicted, or the worker
    restarted) starts from the initial state rather than failing."""
    seqs = make(config(8, states=[state()]))
    assert run(seqs, [(9, 0)], accumulate)[9][0]["STATE_IN"].tolist() == [[0]]


@pytest.mark.parametrize("seq_cfg,capacity", [({}, 3), ({"direct": {}}, 3),
                                              ({"oldest": {"max_candidate_sequences": 2}}, 2),
                                              ({"oldest": {"max_candidate_sequences": 0}}, 3)])
def test_at_most_capacity_states_the_least_recently_used_goes(seq_cfg, capacity):
    seqs = make(config(3, states=[state()], **seq_cfg))
    assert seqs.capacity == capacity
    for cid in range(1, capacity + 1):
        run(seqs, [(cid, START)], accumulate)
    run(seqs, [(1, 0)], accumulate)                 # 1 is the most recent now; 2 the least
    run(seqs, [(100, START)], accumulate)
    assert len(seqs.held) == capacity and 2 not in seqs.held and {1, 100} <= set(seqs.held)


def test_capacity_without_batching_is_one():
    seqs = make(config(0, states=[state()]))
    run(seqs, [(1, START)], accumulate)
    run(seqs, [(2, START)], accumulate)
    assert list(seqs.held) == [2] and seqs.held[2]["STATE_IN"].shape == (1,)


def test_eviction_waits_for_the_end_of_the_batch():
    """A new sequence's START may come first in a batch that also continues the least recently
    used sequence: that one ran in this batch, so it is not the one to go."""
    seqs = make(config(2, states=[state()]))
    run(seqs, [(1, START)], accumulate)
    run(seqs, [(2, START)], accumulate)
    run(seqs, [(1, 0)], accumulate)                 # 2 is the least recently used
    got = run(seqs, [(3, START), (2, 0)], accumulate)
    assert got[2][0]["STATE_IN"].tolist() == [[10]]
    assert set(seqs.held) == {2, 3}                 # 1 went: it did not run in that batch
    assert seqs.held[2]["STATE_IN"].tolist() == [[20]]


def test_the_kept_state_is_a_read_only_copy():
    seqs = make(config(8, states=[state()]))
    produced = {}

    def model(cid, inputs):
        out = inputs["STATE_IN"] + 1
        produced[cid] = out
        return [("OUTPUT", "INT32", out), ("STATE_OUT", "INT32", out)]
    run(seqs, [(1, START)], model)
    kept = seqs.held[1]["STATE_IN"]
    assert kept is not produced[1] and not np.shares_memory(kept, produced[1])
    assert not kept.flags.writeable
    produced[1][0, 0] = 99                          # the model writes its array again
    assert kept.tolist() == [[1]]


def test_a_slice_of_a_batched_output_is_copied_out():
    seqs = make(config(8, states=[state()]))
    whole = np.arange(8, dtype=np.int32).reshape(8, 1)
    run(seqs, [(1, START)], lambda cid, inputs: [("OUTPUT", "INT32", whole[3:4]), ("STATE_OUT", "INT32", whole[3:4])])
    assert seqs.held[1]["STATE_IN"].base is None and seqs.held[1]["STATE_IN"].tolist() == [[3]]


@pytest.mark.parametrize("outputs,message", [
    ([("OUTPUT", "INT32", np.zeros((1, 1), np.int32))],
     "model 'm' did not produce state output 'STATE_OUT'"),
    ([("OUTPUT", "INT32", np.zeros((1, 1), np.int32)), ("STATE_OUT", "FP32", np.zeros((1, 1), np.float32))],
     "unexpected datatype FP32 for inference output 'STATE_OUT' of model 'm', expecting INT32"),
    ([("OUTPUT", "INT32", np.zeros((1, 1), np.int32)), ("STATE_OUT", "INT32", np.zeros((1, 2), np.int32))],
     "unexpected shape [1, 2] for inference output 'STATE_OUT' of model 'm', expecting [-1, 1]"),
    ([("OUTPUT", "INT32", np.zeros((1, 1), np.int32)), ("STATE_OUT", "INT32", np.zeros((2, 1), np.int32))],
     "state output 'STATE_OUT' of model 'm' has batch size 2, expecting 1 (shape [2, 1])"),
])
def test_a_bad_state_output_fails_the_request_and_keeps_the_old_state(outputs, message):
    seqs = make(config(8, states=[state()]))
    run(seqs, [(1, START)], accumulate)
    _, resp = run(seqs, [(1, 0)], lambda cid, inputs: outputs)[1]
    assert resp.error == message and resp.code == ErrorCode.INTERNAL and resp.outputs == []
    assert seqs.held[1]["STATE_IN"].tolist() == [[10]]


def test_python_integers_that_fit_become_the_state_type():
    seqs = make(config(8, states=[state()]))
    run(seqs, [(1, START)], lambda cid, inputs: [("OUTPUT", "INT64", np.array([[5]])), ("STATE_OUT", "INT64", np.array([[5]]))])
    assert seqs.held[1]["STATE_IN"].dtype == np.int32


def test_a_failed_request_keeps_the_state_and_an_end_still_drops_it():
    seqs = make(config(8, states=[state()]))
    run(seqs, [(1, START), (2, START)], accumulate)
    work = []
    for cid, flags in [(1, 0), (2, END)]:
        inputs, types, wanted = prepare(seqs, cid, flags)
        work.append(WorkRequest(inputs, types, wanted, "", {}, cid, flags))
    seqs.finish(work, [WorkResponse(error="boom", code=ErrorCode.INTERNAL), None])
    assert list(seqs.held) == [1] and seqs.held[1]["STATE_IN"].tolist() == [[10]]
    inputs, types, wanted = prepare(seqs, 1, END)
    seqs.finish([WorkRequest(inputs, types, wanted, "", {}, 1, END)], None)   # the batch failed
    assert not seqs.held and not seqs.hidden


def test_variable_dims_start_as_one_and_follow_the_model():
    seqs = make(config(8, states=[state(dims=(-1, 2))]))
    inputs, _ = run(seqs, [(1, START)], lambda cid, inputs: [
        ("OUTPUT", "INT32", np.zeros((1, 1), np.int32)), ("STATE_OUT", "INT32", np.ones((1, 3, 2), np.int32))])[1]
    assert inputs["STATE_IN"].shape == (1, 1, 2) and inputs["STATE_IN"].tolist() == [[[0, 0]]]
    assert seqs.held[1]["STATE_IN"].shape == (1, 3, 2)


def test_string_state_starts_empty():
    seqs = make(config(0, states=[state(data_type="TYPE_STRING", dims=(2,))]))
    inputs, types, _ = prepare(seqs, 1, START)
    assert types["STATE_IN"] == "BYTES" and inputs["STATE_IN"].tolist() == [b"", b""]


# ---- initial_state --------------------------------------------------------------------------
def initial(**kw):
    return {"name": "init", "data_type": "TYPE_INT32", "dims": [3], **kw}


def test_initial_state_zero_data():
    seqs = make(config(8, states=[state(dims=(3,), initial=initial(zero_data=True))]))
    assert prepare(seqs, 1, START)[0]["STATE_IN"].tolist() == [[0, 0, 0]]


@pytest.mark.parametrize("mbs,shape", [(8, (1, 3)), (0, (3,))])
def test_initial_state_from_a_data_file(tmp_path, mbs, shape):
    (tmp_path / "initial_state").mkdir()
    # Triton reads as many bytes as the state needs; more are ignored
    (tmp_path / "initial_state" / "init.bin").write_bytes(np.array([7, -1, 3, 55], "<i4").tobytes())
    seqs = make(config(mbs, states=[state(dims=(-1,), initial=initial(data_file="init.bin"))]), str(tmp_path))
    inputs = prepare(seqs, 1, START)[0]
    assert inputs["STATE_IN"].shape == shape and inputs["STATE_IN"].ravel().tolist() == [7, -1, 3]
    run(seqs, [(1, 0)], lambda cid, inputs: [("OUTPUT", "INT32", np.zeros((1, 1), np.int32)),
                                             ("STATE_OUT", "INT32", np.zeros((1, 3), np.int32))])
    assert prepare(seqs, 2, START)[0]["STATE_IN"].ravel().tolist() == [7, -1, 3]   # shared, unchanged


def test_string_initial_state_from_a_data_file(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "words").write_bytes(dtypes.serialize_bytes(np.array([b"a", b"bc"], object)).tobytes())
    st = state(data_type="TYPE_STRING", dims=(2,), initial={"name": "w", "data_type": "TYPE_STRING", "dims": [2], "data_file": "words"})
    seqs = make(config(0, states=[st]), str(tmp_path))
    assert prepare(seqs, 1, START)[0]["STATE_IN"].tolist() == [b"a", b"bc"]


def test_initial_state_dims_in_json_as_strings():
    """int64 fields (dims) come as strings from protobuf's JSON form."""
    st = state(dims=("2",), initial={"name": "z", "data_type": "TYPE_INT32", "dims": ["2"], "zero_data": True})
    assert prepare(make(config(8, states=[st])), 1, START)[0]["STATE_IN"].tolist() == [[0, 0]]


BAD_INITIAL = [
    (state(dims=(3,), initial=initial(data_type="TYPE_FP32", zero_data=True)),
     "The data type used for 'initial_state' field of state 'STATE_IN' does not match the state data type."),
    (state(dims=(3,), initial=initial(name="", zero_data=True)),
     "Field 'name' must be set when using initial_state for state input 'STATE_IN'."),
    (state(dims=(3, 1), initial=initial(zero_data=True)),
     "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state input 'STATE_IN'. 1 != 2"),
    (state(dims=(-1,), initial=initial(dims=[-1], zero_data=True)),
     "'initial_state' field for state input name 'STATE_IN' contains variable dimensions."),
    (state(dims=(4,), initial=initial(zero_data=True)),
     "'initial_state' dim for input name 'STATE_IN' doesn't match 'state' dim description. 3 != 4"),
    (state(dims=(3,), initial=initial()),
     "initial_state setting expects state 'STATE_IN' to have state_data set"),
    (state(dims=(3,), initial=initial(data_file="short.bin")),
     "initial_state setting expects 12 bytes, but the data provided from short.bin only has 8 bytes."),
    (state(dims=(3,), initial=initial(data_file="../secret")),
     "initial_state data_file '../secret' of state input 'STATE_IN' must be a file name inside initial_state/, not a path"),
    (dict(state(), initial_state=[initial(dims=[1], zero_data=True)] * 2),
     "initial_state field for state input 'STATE_IN' must contain exactly one or zero element. Found '2' elements."),
    (state(data_type="TYPE_NOPE"), "state input 'STATE_IN' of model 'm' has an invalid data_type 'TYPE_NOPE'"),
    (state(out=""), "a state of model 'm' needs both an input_name and an output_name"),
]


@pytest.mark.parametrize("st,message", BAD_INITIAL)
def test_state_config_errors(tmp_path, st, message):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "short.bin").write_bytes(bytes(8))
    with pytest.raises(SequenceConfigError) as e:
        sequence.from_config(config(8, states=[st]), str(tmp_path))
    assert str(e.value) == message


def test_a_missing_data_file_fails_the_load(tmp_path):
    with pytest.raises(SequenceConfigError) as e:
        sequence.from_config(config(8, states=[state(dims=(3,), initial=initial(data_file="gone"))]), str(tmp_path))
    assert str(e.value).startswith("initial_state of state input 'STATE_IN': cannot read ") and \
        str(e.value).endswith("initial_state/gone: No such file or directory")


def test_a_repeated_state_name_is_ignored_as_triton_does():
    seqs = make(config(8, states=[state(), state(out="OTHER_OUT")]))
    assert [s.output_name for s in seqs.states] == ["STATE_OUT"]


def test_declared_names_the_tensors_a_backend_must_have():
    cfg = config(8, [control("S", "CONTROL_SEQUENCE_START", fp32_false_true=[0, 1]),
                     control("C", "CONTROL_SEQUENCE_CORRID", data_type="TYPE_STRING")],
                 [state(data_type="TYPE_INT64")])
    assert sequence.declared(cfg) == ({"S": "FP32", "C": "BYTES", "STATE_IN": "INT64"},
                                      {"STATE_OUT": "INT64"})
    assert sequence.declared({"name": "m"}) == ({}, {})
