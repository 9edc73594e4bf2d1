"""A worker's part in an ensemble run worker to worker (workers/leases/chain.py): it runs its step as
a leased request of its own model, hands the request on with the step's outputs, answers the
frontend after the last step, and gives back every intermediate slot however the request ends.
The worker's execute() is recorded, not run; the next worker and the owner of a slot are real
packet inboxes."""
from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest
from bare_worker import BareWorker

from shmserve.ipc import channel
from shmserve.ipc.messages import decode_payload, encode
from shmserve.ipc.messages.common import ChainHop, ErrorCode, InferPayload, LeasedRecord, OutputSpec, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, LeaseBounced
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import ChainExecute, ReleaseOutputs
from shmserve.workers.leases.chain import STOPPING, Chains

SPAWN, NEXT, OTHER = 7, 8, 9
FRONTEND = 2


class Arena:
    def __init__(self):
        self.freed = []

    def free(self, ref):
        self.freed.append(ref)


@pytest.fixture
def worker(tmp_path):
    run_dir = str(tmp_path)
    w = BareWorker()      # only the chain logic; execute() is recorded, not run
    w.args = SimpleNamespace(spawn_id=SPAWN, run_dir=run_dir)
    w.inbox = channel.inbox_for(channel.worker_address(run_dir, SPAWN))
    w.backlog, w.revoked_upto = deque(), 0
    w.main_thread = threading.get_ident()
    w.out_lock = threading.Lock()
    w.arena = Arena()
    w.executed, w.sent = [], []
    w.execute = lambda batch, frames, leased=None: w.executed.append((batch, frames, leased))
    w.answer = lambda fid, msg: w.sent.append((fid, msg))
    w.chains = Chains(w)
    peers = {sid: channel.inbox_for(channel.worker_address(run_dir, sid)) for sid in (NEXT, OTHER)}
    for box in peers.values():
        box.set_timeout(5000)
    yield w, peers
    w.chains.close()
    for box in peers.values():
        box.close()
    w.inbox.close()


# the ensemble "ens": IN -> a (X -> Y) -> t1 -> b (X -> Y) -> OUT
HOPS = [ChainHop(0, "a", 1, {"X": "IN"}, {"Y": "t1"}, 8, {"X": [4]}),
        ChainHop(1, "b", 3, {"X": "t1"}, {"Y": "OUT"}, 8, {"X": [4]})]
HEAD = SubmitRequest(40, FRONTEND, "ens", 1, 2, received_ns=1000)


def slot(segment: str, offset: int = 0) -> ShmRef:
    return ShmRef(segment, offset, 32)


def chain(at: int, workers=(SPAWN, NEXT), held=(), records=(), leases=(5, 6)) -> ChainExecute:
    return ChainExecute(HEAD, HOPS, list(leases), list(workers), at, list(held), list(records))


def frame(*tensors: Tensor, outputs=("OUT",)) -> bytes:
    return encode(InferPayload("rid", list(tensors), [OutputSpec(o) for o in outputs]))


def record(model: str, infer_ns: int, failed: bool = False) -> LeasedRecord:
    return LeasedRecord(SPAWN, model, 1, 2, 1000, 2000, 10, infer_ns, 30, failed)


def test_a_step_runs_as_a_leased_request_of_its_own_model(worker):
    w, _ = worker
    w.chains.run(chain(0), [frame(Tensor("IN", "FP32", [2, 4], shm=slot("client")))])
    [(batch, [step], [head])] = w.executed
    assert [(r.req_id, r.frontend) for r in batch.routes] == [(40, FRONTEND)]
    # the step's inputs and outputs by the model's own names; every output of a middle step
    assert [(t.name, t.shm) for t in step.inputs] == [("X", slot("client"))]
    assert [o.name for o in step.outputs] == ["Y"] and step.chain == ["ens"]
    # its record counts for model "a": batch 2, from when the frontend got the request
    assert (head.model, head.version, head.batch_size, head.received_ns) == ("a", 1, 2, 1000)


def test_the_next_step_on_another_worker_gets_the_tensors_and_the_slots_to_give_back(worker):
    w, peers = worker
    w.chains.run(chain(0), [frame(Tensor("IN", "FP32", [2, 4], shm=slot("client")))])
    made = Tensor("Y", "FP32", [2, 4], shm=slot("mine"))
    assert w.chains.answered((FRONTEND, 40), InferResult(40, "a", 1, [made],
                                                         worker=w.inbox.address,
                                                         done=record("a", 100)))
    msg, frames = peers[NEXT].recv()
    assert type(msg) is ChainExecute and msg.at == 1
    assert msg.held == [(w.inbox.address, slot("mine"))] and msg.records == [record("a", 100)]
    p = decode_payload(frames[0])
    assert {t.name: t.shm for t in p.inputs} == {"IN": slot("client"), "t1": slot("mine")}
    assert [o.name for o in p.outputs] == ["OUT"]     # the client's, kept for the last step
    assert w.sent == [] and w.arena.freed == []    # the slot lives on with the request


def test_a_next_step_on_this_worker_runs_next_without_a_socket(worker):
    w, _ = worker
    w.chains.run(chain(0, workers=(SPAWN, SPAWN)), [frame(Tensor("IN", "FP32", [2, 4]))])
    w.chains.answered((FRONTEND, 40), InferResult(40, "a", 1, [Tensor("Y", "FP32", [2, 4])]))
    [(msg, [_])] = w.backlog
    assert msg.at == 1 and msg.workers == [SPAWN, SPAWN]


def test_the_last_step_answers_the_frontend_with_the_ensembles_names_and_records(worker):
    w, peers = worker
    held = [(peers[OTHER].address, slot("other")), (w.inbox.address, slot("mine", 64))]
    w.chains.run(chain(1, workers=(OTHER, SPAWN), held=held, records=[record("a", 100)]),
                 [frame(Tensor("IN", "FP32", [2, 4]), Tensor("t1", "FP32", [2, 4],
                                                            shm=slot("other")))])
    [(_, [step], [head])] = w.executed
    assert [(t.name, t.shm) for t in step.inputs] == [("X", slot("other"))]
    assert [o.name for o in step.outputs] == ["Y"]      # the client's OUT by its own name
    assert head.model == "b" and head.version == 3 and head.received_ns > 1000
    out = Tensor("Y", "FP32", [2, 4], shm=slot("mine", 128))
    w.chains.answered((FRONTEND, 40), InferResult(40, "b", 3, [out], worker=w.inbox.address,
                                                  done=record("b", 200)))
    [(fid, res)] = w.sent
    assert fid == FRONTEND and (res.req_id, res.model, res.version) == (40, "ens", 1)
    assert [(t.name, t.shm) for t in res.outputs] == [("OUT", slot("mine", 128))]
    assert res.worker == w.inbox.address            # the frontend gives the output back here
    assert res.steps == [record("a", 100), record("b", 200)]
    # the ensemble's own record: its steps' compute times summed, no worker of its own
    ens = res.done
    assert (ens.spawn_id, ens.model, ens.batch_size, ens.received_ns) == (0, "ens", 2, 1000)
    assert (ens.compute_infer_ns, ens.failed) == (300, False)
    # the intermediate slots went back to their owners
    assert w.arena.freed == [slot("mine", 64)]
    msg, _ = peers[OTHER].recv()
    assert msg == ReleaseOutputs([slot("other")])


def test_a_failed_step_fails_the_request_by_its_step_and_gives_the_slots_back(worker):
    w, _ = worker
    held = [(w.inbox.address, slot("mine"))]
    w.chains.run(chain(1, workers=(SPAWN, SPAWN), held=held),
                 [frame(Tensor("t1", "FP32", [2, 4]))])
    w.chains.answered((FRONTEND, 40), InferResult(40, "b", 3, error="boom",
                                                  code=ErrorCode.INVALID_ARG,
                                                  done=record("b", 5, failed=True)))
    [(_, res)] = w.sent
    assert res.error == "in ensemble 'ens', step 1 (model 'b'): boom"
    assert res.code == ErrorCode.INVALID_ARG and res.done.failed
    assert res.steps == [record("b", 5, failed=True)]
    assert w.arena.freed == [slot("mine")]


def test_an_input_that_does_not_fit_the_steps_model_fails_before_it_runs(worker):
    w, _ = worker
    w.chains.run(chain(1, workers=(SPAWN, SPAWN)), [frame(Tensor("t1", "FP32", [2, 5]))])
    assert w.executed == []
    [(_, res)] = w.sent
    assert res.code == ErrorCode.INVALID_ARG
    assert res.error == ("in ensemble 'ens', step 1 (model 'b'): unexpected shape for input "
                         "'X' for model 'b'. Expected [-1, 4], got [2, 5]")


def test_a_first_step_whose_lease_ended_goes_back_to_the_frontend_unrun(worker):
    w, _ = worker
    w.revoked_upto = 6
    w.chains.run(chain(0), [frame(Tensor("IN", "FP32", [2, 4]))])
    assert w.executed == []
    assert w.sent == [(FRONTEND, LeaseBounced(SPAWN, 40))]


def test_a_later_step_whose_lease_ended_runs_unless_the_worker_stops(worker):
    """An earlier step has run the request: a lease revoked since (its ensemble unloaded with
    a step) lets it finish, as a draining model does; a stopping worker sends it back."""
    w, peers = worker
    w.revoked_upto = 6
    tensors = frame(Tensor("IN", "FP32", [2, 4]), Tensor("t1", "FP32", [2, 4], shm=slot("other")))
    w.chains.run(chain(1, workers=(OTHER, SPAWN)), [tensors])
    assert len(w.executed) == 1 and w.sent == []
    w.executed.clear()
    w.revoked_upto = STOPPING
    held = [(peers[OTHER].address, slot("other"))]
    w.chains.run(chain(1, workers=(OTHER, SPAWN), held=held), [frame()])
    assert w.executed == []
    assert w.sent == [(FRONTEND, LeaseBounced(SPAWN, 40))]
    msg, _ = peers[OTHER].recv()
    assert msg == ReleaseOutputs([slot("other")])


def test_a_next_worker_that_is_gone_sends_the_request_back_to_the_frontend(worker):
    w, peers = worker
    peers[NEXT].close()
    w.chains.run(chain(0), [frame(Tensor("IN", "FP32", [2, 4]))])
    w.chains.answered((FRONTEND, 40), InferResult(40, "a", 1, [Tensor("Y", "FP32", [2, 4],
                                                                      shm=slot("mine"))],
                                                  worker=w.inbox.address))
    assert w.sent == [(FRONTEND, LeaseBounced(SPAWN, 40))]
    assert w.arena.freed == [slot("mine")]


def test_a_cancel_that_came_first_ends_the_request_when_it_arrives(worker):
    w, _ = worker
    held = [(w.inbox.address, slot("mine"))]
    w.chains.cancel((FRONTEND, 40))
    w.chains.run(chain(1, workers=(SPAWN, SPAWN), held=held), [frame()])
    assert w.executed == []
    [(_, res)] = w.sent
    assert res.code == ErrorCode.CANCELLED and w.arena.freed == [slot("mine")]
    assert not w.chains.cancelled           # forgotten once used


def test_cancels_for_requests_never_seen_stay_bounded(worker):
    from shmserve.workers.leases import chain as chain_module
    w, _ = worker
    for i in range(chain_module.CANCELS_KEPT + 50):
        w.chains.cancel((FRONTEND, i))
    assert len(w.chains.cancelled) == chain_module.CANCELS_KEPT
    assert (FRONTEND, 0) not in w.chains.cancelled      # the oldest went first
