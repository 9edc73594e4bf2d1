"""Ensemble tensors that stay on the GPU, in the scheduler (in-process, tests/engine/fakes.py):
which intermediate tensors may (every step reading them binds device memory, and the client does
not receive them), the producer told so per request (OutputSpec.device), the CudaRef passed to
the next step as it is, and the device slot's life: given back (ReleaseOutputs.device) when the
request ends, fails, is cancelled or answers late; not given back when its worker died, whose
arena handles every other worker is told to close (ForgetSegments), and a request that still
needed the dead slot fails with the reason. The worker side: tests/workers/test_device_arena.py;
through a real server: tests/e2e/test_ensemble_gpu_handoff.py."""
import pytest
from fakes import IO, ONE, Harness, tensor_payload, write_ensemble, write_model
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.ensemble import plan as ensemble_plan
from shmserve.ipc.messages import decode_payload
from shmserve.ipc.messages.common import ENSEMBLE_FRONTEND, CudaRef, ErrorCode, OutputSpec, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.messages.to_scheduler import BatchDone, CancelRequest, ForgetSegments
from shmserve.ipc.messages.to_worker import ReleaseOutputs

CLIENT_IN = ShmRef("client-in", 0, 16)
GPU_INPUTS = 'parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value { string_value: "no" } }'
HANDLE_A = b"A" * 64


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "a", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "g", f"max_batch_size: 8\n{IO}\n{ONE}\n{GPU_INPUTS}")      # reads GPU inputs
    write_model(r, "h", f"max_batch_size: 8\n{IO}\n{ONE}\n{GPU_INPUTS}")
    write_model(r, "c", f"max_batch_size: 8\n{IO}\n{ONE}")                   # host inputs only
    # D: IN -> a -> mid -> g -> OUT: mid may stay on a's GPU
    write_ensemble(r, "D", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("g", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})])
    # T: IN -> a -> mid, read by g and by h, both on the GPU
    write_ensemble(r, "T", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("g", {"INPUT0": "mid"}, {"OUTPUT0": "X"}),
                            ("h", {"INPUT0": "mid"}, {"OUTPUT0": "Y"})], outputs=("X", "Y"))
    # M: mid read on the GPU by g, on the host by c: it goes through host memory
    write_ensemble(r, "M", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("g", {"INPUT0": "mid"}, {"OUTPUT0": "X"}),
                            ("c", {"INPUT0": "mid"}, {"OUTPUT0": "Y"})], outputs=("X", "Y"))
    # O: mid is also an output of the ensemble: the client may receive it
    write_ensemble(r, "O", [("a", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
                            ("g", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"})], outputs=("OUT", "mid"))
    return r


def sid_of(h, model):
    (sid,) = [s for s in h.spawn_ids(model) if s not in h.port.reaped]
    return sid


def run(h, model="D", outputs=("OUT",)):
    return h.submit(model, payload=tensor_payload({"IN": CLIENT_IN}, outputs))


def answer(h, sid, error=""):
    """Worker ``sid`` answers its last batch as a worker with a device arena does: an output the
    request lets stay on the device comes as a CudaRef into its arena, the others in host
    slots."""
    _, batch, payloads = h.batches(sid)[-1]
    model = h.port.spawned[sid].model_name
    sent = []
    for route, frame in zip(batch.routes, payloads):
        if error:
            sent.append(InferResult(route.req_id, model, 1, error=error, code=ErrorCode.INTERNAL))
            continue
        outs = []
        for o in decode_payload(frame).outputs:
            h.slot += 1
            if o.device:
                outs.append(Tensor(o.name, "FP32", [1, 4], None, None,
                                   CudaRef(bytes([sid]) * 64, 0, h.slot * 256, 16)))
            else:
                outs.append(Tensor(o.name, "FP32", [1, 4], None, ShmRef(f"w{sid}", h.slot * 64, 16)))
        sent.append(InferResult(route.req_id, model, 1, outs, worker=h.address(sid)))
    h.core.handle(BatchDone(sid, batch.batch_id, [0] if error else [], 1, 2, 3, answers=sent))
    return sent


def device_released(h, sid=None):
    return [ref for s, m in h.to_worker(ReleaseOutputs) if sid is None or s == sid
            for ref in m.device]


def host_released(h, sid=None):
    return [ref for s, m in h.to_worker(ReleaseOutputs) if sid is None or s == sid
            for ref in m.refs]


def forgotten(h):
    return [(s, m) for s, m in h.to_worker(ForgetSegments)]


# ---- which tensors -------------------------------------------------------------------------------
def test_the_plan_says_which_intermediate_tensors_may_stay_on_the_gpu(repo):
    h = Harness(repo).start()
    plan = {name: h.core.versions[(name, 1)].ensemble for name in ("D", "T", "M", "O")}
    assert plan["D"].device_tensors == {"mid"}
    assert plan["T"].device_tensors == {"mid"}          # both readers bind device memory
    assert plan["M"].device_tensors == frozenset()      # c reads it on the host
    assert plan["O"].device_tensors == {"mid"}          # only when the client does not ask for it


@pytest.mark.parametrize("config, takes", [
    ('backend: "tensorrt"', True),
    ('platform: "tensorrt_plan"', True),
    ('backend: "onnxruntime"\ninstance_group [ { kind: KIND_GPU } ]', True),
    ('backend: "onnxruntime"\ninstance_group [ { kind: KIND_GPU }, { kind: KIND_CPU } ]', False),
    ('backend: "onnxruntime"\ninstance_group [ { kind: KIND_CPU } ]', False),
    ('backend: "onnxruntime"\ninstance_group [ { kind: KIND_GPU } ]\n'
     'input [ { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]', False),     # no I/O binding
    ('backend: "python"', False),                       # FORCE_CPU_ONLY_INPUT_TENSORS: yes
    (f'backend: "python"\n{GPU_INPUTS}', True),
    ('backend: "python"\nparameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value { string_value: "YES" } }', False),
    ('backend: "pytorch"', False),
])
def test_which_models_take_device_inputs(config, takes):
    cfg = text_format.Parse(f'name: "m"\n{config}', mc.ModelConfig())
    assert ensemble_plan.takes_device_inputs(cfg) is takes


# ---- a request -----------------------------------------------------------------------------------------
def test_an_intermediate_tensor_goes_to_the_next_step_as_a_cuda_ref_and_its_slot_comes_back(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    rid = run(h)
    ((_, p0),) = h.steps_of(a)
    assert p0.outputs == [OutputSpec("OUTPUT0", device=True)]       # a may leave mid on its GPU
    (res0,) = answer(h, a)
    mid = res0.outputs[0].cuda
    ((_, p1),) = h.steps_of(g)
    assert p1.inputs == [Tensor("INPUT0", "FP32", [1, 4], None, None, mid)]     # as it is
    assert p1.outputs == [OutputSpec("OUTPUT0")]        # OUT goes to the client: host memory
    assert device_released(h) == []                     # g still reads it
    (res1,) = answer(h, g)
    final = h.results()[rid]
    assert final.error == "" and final.outputs[0].shm == res1.outputs[0].shm
    assert device_released(h, a) == [mid] and host_released(h) == []
    assert h.core.ensembles.book.handed == {res1.outputs[0].shm: [h.address(g), 1]}
    h.core.handle(ReleaseOutputs([res1.outputs[0].shm]))    # the frontend is done
    assert host_released(h, g) == [res1.outputs[0].shm] and device_released(h) == [mid]


def test_every_slot_comes_back_after_many_requests(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    made = []
    for _ in range(20):
        run(h, "T", outputs=("X", "Y"))
        made.append(answer(h, a)[0].outputs[0].cuda)
        answer(h, g)
        answer(h, sid_of(h, "h"))
    assert sorted(device_released(h, a), key=lambda r: r.offset) == made
    assert h.core.ensembles.runs == {}


def test_a_tensor_the_client_receives_goes_through_host_memory(repo):
    h = Harness(repo).start()
    a = sid_of(h, "a")
    run(h, "O", outputs=("OUT", "mid"))
    ((_, p0),) = h.steps_of(a)
    assert p0.outputs == [OutputSpec("OUTPUT0")]
    run(h, "O", outputs=("OUT",))
    h.answer(a)         # (the harness's worker answers the first request's batch)
    ((_, p1),) = h.steps_of(a)
    assert p1.outputs == [OutputSpec("OUTPUT0", device=True)]


def test_a_failing_next_step_gives_the_device_slot_back(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    rid = run(h)
    mid = answer(h, a)[0].outputs[0].cuda
    answer(h, g, error="boom")
    assert h.results()[rid].error == "in ensemble 'D', step 1 (model 'g'): boom"
    assert device_released(h, a) == [mid]


def test_a_cancelled_request_gives_its_device_slot_back_and_late_answers_too(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    rid = run(h, "T", outputs=("X", "Y"))
    mid = answer(h, a)[0].outputs[0].cuda
    h.core.handle(CancelRequest(0, rid))
    assert h.results()[rid].code is ErrorCode.CANCELLED
    assert device_released(h, a) == [mid]
    # a step answers after the end, with a device slot (say a decoupled producer's): back at once
    late = Tensor("OUTPUT0", "FP32", [1, 4], None, None, CudaRef(HANDLE_A, 0, 4096, 16))
    _, batch, _ = h.batches(g)[-1]
    h.core.handle(BatchDone(g, batch.batch_id, [], 1, 2, 3, answers=[
        InferResult(batch.routes[0].req_id, "g", 1, [late], worker=h.address(g))]))
    assert device_released(h, g) == [late.cuda]


# ---- a producer that dies ------------------------------------------------------------------------
def test_a_dead_producers_slots_are_not_given_back_and_its_handles_are_closed(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    rid = run(h, "T", outputs=("X", "Y"))
    mid = answer(h, a)[0].outputs[0].cuda
    ((step_g, _),) = h.steps_of(g)
    h.die(a)
    # g and h were sent mid: they may have it open; every live worker closes a's handles
    assert sorted(s for s, _ in forgotten(h)) == sorted(h.port.connected)
    assert g in h.port.connected and a not in h.port.connected
    assert all(m == ForgetSegments([], [mid.handle]) for _, m in forgotten(h))
    # the steps reading it were running: the request fails with the reason, they are cancelled
    err = h.results()[rid]
    assert err.code is ErrorCode.INTERNAL
    assert err.error.startswith("in ensemble 'T', step ") and \
        err.error.endswith("the worker process that held tensor 'mid' in GPU memory ended "
                           "before this step read it")
    assert (g, CancelRequest(ENSEMBLE_FRONTEND, step_g)) in h.to_worker(CancelRequest)
    answer(h, g)
    assert device_released(h, a) == []                  # nothing goes to the dead worker
    assert [s for s, _ in h.to_worker(ReleaseOutputs)] == [g]   # g's late slot goes back
    # the restarted producer serves the next request
    h.tick(0)
    (a2,) = h.waiting()
    h.ready(a2)
    rid2 = run(h)
    answer(h, a2)
    answer(h, g)
    assert h.results()[rid2].error == ""


def test_a_producer_that_dies_after_its_tensors_were_read_fails_nothing(repo):
    h = Harness(repo).start()
    a, g = sid_of(h, "a"), sid_of(h, "g")
    rid = run(h)
    mid = answer(h, a)[0].outputs[0].cuda
    answer(h, g)
    assert h.results()[rid].error == "" and device_released(h, a) == [mid]
    h.die(a)
    assert all(m == ForgetSegments([], [mid.handle]) for _, m in forgotten(h))
    sent = len(forgotten(h))
    assert sent == len(h.port.connected)
    h.die(g)            # a consumer's death has no device slots to report
    assert len(forgotten(h)) == sent
