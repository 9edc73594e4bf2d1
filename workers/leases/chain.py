"""Ensembles run worker to worker: a step's worker hands the request to the next step's.

An ensemble needs no scheduler between its steps once they run one after the other
(engine/ensemble/plan.py ``chain``: in an order they can run in; steps that could run side by
side only while that costs less than the hops save). A frontend
that holds leases on the instances of all its steps (engine/leases.py) sends the request to the
first step's worker (ChainExecute, with the ensemble tensors in its payload frame); each worker
runs its step as a leased request of its own model, adds the step's outputs to the tensors and
sends the request on to the next step's worker, or, for itself, to the front of its own queue.
The last one answers the frontend with the ensemble's outputs. An output that no later step
reads is made as the client asked for it (into its region, as classes) by the step that makes
it; one that a later step reads is made plainly (ipc/chain_route.py: a request that wants it
otherwise is the scheduler's). An output of an
earlier step stays in that step's worker's slot until the frontend has written it, and the
frontend gives each slot back to the worker whose arena holds it (it knows by the segment's
name), so no slot waits on the last worker living on. So an ensemble of N steps
crosses N + 1 sockets (one when every step is on one worker) instead of 2N + 2 through the
scheduler, and the scheduler runs no code for it; it hears of it from the completion records
(one per step and one for the ensemble) that ride with the answer, as for any leased request.

The rules of leased requests hold on every hop: a hop whose lease was revoked, or whose next
worker is gone or cannot take it, goes back to the frontend unrun (LeaseBounced), which submits
the ensemble request to the scheduler; a worker of a step that dies makes its frontend submit it
again as lost (LeaseLost), which the scheduler runs again or fails as for a dead batch. The slots
of intermediate tensors are listed in the request as it travels and given back to their workers
however it ends: answered, failed, bounced or cancelled. A cancel reaches every worker of the
route; one that has not run its step yet ends the request there.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import zmq

from shmserve.ipc import channel, packets
from shmserve.ipc.chain_route import as_asked, read_after
from shmserve.ipc.input_shapes import input_shape_problem
from shmserve.ipc.messages import decode_payload, encode
from shmserve.ipc.messages.common import ErrorCode, InferPayload, LeasedRecord, OutputSpec, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, LeaseBounced
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import ChainExecute, ExecuteBatch, ReleaseOutputs, RequestRoute

log = logging.getLogger("shmserve.worker")
STOPPING = 1 << 62      # the worker's revoked_upto once it stops (workers/worker.py bounce_leased)

# Cancels for requests of a chain this worker has not seen yet (the cancel reached every worker
# of the route at once); the oldest are forgotten first.
CANCELS_KEPT = 1024


class Chains:
    def __init__(self, worker) -> None:
        self.worker = worker
        # hops executing now: (frontend, req_id) -> (the message, its decoded payload, the
        # ensemble outputs its step writes into the client's regions)
        self.live: dict[tuple[int, int], tuple[ChainExecute, InferPayload, frozenset]] = {}
        self.cancelled: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.peers: dict[str, packets.PacketOutbox] = {}    # other workers, by address
        self.lock = threading.Lock()    # peers: a response sender answers from any thread

    # ---- a hop arrives ------------------------------------------------------------------------
    def run(self, msg: ChainExecute, frames: list) -> None:
        w = self.worker
        head, k = msg.head, msg.at
        key = (head.frontend, head.req_id)
        # A hop after the first belongs to a request an earlier step has run: a lease revoked
        # since (its ensemble was unloaded with a step, say) no longer takes new requests but
        # lets this one finish, as a draining model finishes what it holds. Only a worker that
        # is stopping sends it back.
        revoked = msg.leases[k] <= w.revoked_upto and (k == 0 or w.revoked_upto >= STOPPING)
        if revoked or msg.workers[k] != w.args.spawn_id:
            self.bounce(msg)
            return
        if self.cancelled and key in self.cancelled:
            del self.cancelled[key]
            self.end(msg, ErrorCode.CANCELLED, "the request was cancelled by the client")
            return
        hop = msg.hops[k]
        try:
            # from this worker's own queue the payload comes as it was made, not encoded
            p = frames[0] if type(frames[0]) is InferPayload else decode_payload(frames[0])
        except Exception as e:
            self.end(msg, ErrorCode.INVALID_ARG, f"invalid request tensors: {e}")
            return
        known = {t.name: t for t in p.inputs}
        inputs = []
        for own, tensor in hop.inputs.items():
            t = known.get(tensor)
            if t is None:
                self.fail(msg, ErrorCode.INTERNAL, f"ensemble tensor '{tensor}' was not made by "
                                                   f"the steps before it")
                return
            inputs.append(Tensor(own, t.datatype, t.shape, t.data, t.shm, t.cuda))
        problem = input_shape_problem(hop.model, hop.max_batch_size, hop.input_dims, inputs)
        if problem:
            self.fail(msg, ErrorCode.INVALID_ARG, problem)
            return
        # the client's outputs as it asked for them, unless a later step reads one
        # (ipc/chain_route.py); before the last step, every output plainly
        last = k == len(msg.hops) - 1
        wanted = {o.name: o for o in p.outputs}
        outputs = []
        regions = []
        for own, tensor in hop.outputs.items():
            o = wanted.get(tensor)
            if o is not None and (not as_asked(o) or tensor not in read_after(msg.hops, k)):
                outputs.append(OutputSpec(own, o.shm, o.classification, o.cuda, labels=o.labels))
                if o.shm is not None:
                    regions.append(tensor)
            elif not last or o is not None:
                outputs.append(OutputSpec(own))
        if not outputs:         # (none asked means all: those come back, and are let go)
            outputs = [OutputSpec(own) for own in hop.outputs]
        batch = inputs[0].shape[0] if hop.max_batch_size > 0 and inputs and inputs[0].shape \
            else 1
        step = InferPayload(p.request_id, inputs, outputs, p.parameters, p.correlation_id,
                            p.flags, [head.model])
        # the step's record counts from when it reached this worker (the first: the frontend)
        step_head = SubmitRequest(head.req_id, head.frontend, hop.model, hop.version, batch,
                                  head.received_ns if k == 0 else time.monotonic_ns())
        # its answer continues it (answered): from execute(), or later from a model's thread
        # through the request's response sender
        self.live[key] = (msg, p, frozenset(regions))
        w.execute(ExecuteBatch(0, [RequestRoute(head.req_id, head.frontend)]), [step],
                  [step_head])

    # ---- its step answered ----------------------------------------------------------------------
    def answered(self, key: tuple[int, int], res: InferResult) -> bool:
        """``res`` answers the step of a chained request: the request goes on (or ends); False
        when ``key`` is not one."""
        found = self.live.pop(key, None)
        if found is None:
            return False
        msg, p, regions = found
        w = self.worker
        head, k = msg.head, msg.at
        hop = msg.hops[k]
        records = [*msg.records, *res.steps]       # (a step's BLS calls under leases)
        if res.done is not None:
            records.append(res.done)
        msg.records = records
        if res.error:
            self.fail(msg, res.code or ErrorCode.INTERNAL, res.error)
            return True
        renamed = [Tensor(hop.outputs.get(t.name, t.name), t.datatype, t.shape, t.data, t.shm,
                          t.cuda) for t in res.outputs]
        known = {t.name: t for t in p.inputs}
        held = list(msg.held)
        for t in renamed:
            known[t.name] = t
            # (one written into the client's region is the client's)
            if t.shm is not None and res.worker and t.name not in regions:
                held.append((res.worker, t.shm))
        if k == len(msg.hops) - 1:
            final = [known[o.name] for o in p.outputs if o.name in known]
            w.answer(head.frontend, InferResult(
                head.req_id, head.model, head.version, final,
                worker=self.keep_answered(held, final),
                parameters=res.parameters, done=self.record(msg, False), steps=records))
            return True
        nxt = ChainExecute(head, msg.hops, msg.leases, msg.workers, k + 1, held, records,
                           msg.cpu)
        self.forward(nxt, InferPayload(p.request_id, list(known.values()), p.outputs,
                                       p.parameters, p.correlation_id, p.flags, p.chain))
        return True

    def forward(self, msg: ChainExecute, payload: InferPayload) -> None:
        w = self.worker
        sid = msg.workers[msg.at]
        if sid == w.args.spawn_id and threading.get_ident() == w.main_thread:
            w.backlog.append((msg, [payload]))  # ours too: next, without a socket
            return
        if not self.send(channel.worker_address(w.args.run_dir, sid), msg, (encode(payload),)):
            self.bounce(msg)

    # ---- how it ends, other than answered -----------------------------------------------------------
    def bounce(self, msg: ChainExecute) -> None:
        """Not run here (the lease ended, or the next worker is gone): the frontend submits it
        to the scheduler."""
        self.release_held(msg.held)
        self.worker.answer(msg.head.frontend, LeaseBounced(self.worker.args.spawn_id,
                                                           msg.head.req_id))

    def fail(self, msg: ChainExecute, code: ErrorCode, error: str) -> None:
        hop = msg.hops[msg.at]
        self.end(msg, code, f"in ensemble '{msg.head.model}', step {hop.step} (model "
                            f"'{hop.model}'): {error}")

    def end(self, msg: ChainExecute, code: ErrorCode, error: str) -> None:
        head = msg.head
        self.release_held(msg.held)
        self.worker.answer(head.frontend, InferResult(
            head.req_id, head.model, head.version, error=error, code=code,
            done=self.record(msg, True), steps=msg.records))

    def cancel(self, key: tuple[int, int]) -> None:
        """The client left: a hop that has not run here yet ends the request (the one running
        sees request.is_cancelled() through the worker)."""
        if key in self.live:
            return
        self.cancelled[key] = None
        while len(self.cancelled) > CANCELS_KEPT:
            self.cancelled.popitem(last=False)

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def record(msg: ChainExecute, failed: bool) -> LeasedRecord:
        """The ensemble's own completion record (spawn id 0: no worker of its own): its steps'
        compute times summed, as the scheduler sums them for an ensemble it runs."""
        head = msg.head
        ci = sum(r.compute_input_ns for r in msg.records)
        cinf = sum(r.compute_infer_ns for r in msg.records)
        co = sum(r.compute_output_ns for r in msg.records)
        return LeasedRecord(0, head.model, head.version, head.batch_size, head.received_ns,
                            time.monotonic_ns(), ci, cinf, co, failed)

    def keep_answered(self, held: list[tuple[str, ShmRef]], final: list[Tensor]) -> str:
        """The request is answered with ``final``: the slots it holds that are not answered
        with go back now; those that are stay with their workers until the frontend gives them
        back, each to its own (frontend/engine_client.py ``release``). Returns this worker's
        address, where the frontend sends a slot it cannot place ("" when none is answered)."""
        answered = {(t.shm.segment, t.shm.offset) for t in final if t.shm is not None}
        rest = [(owner, ref) for owner, ref in held
                if (ref.segment, ref.offset) not in answered]
        self.release_held(rest)
        return self.worker.inbox.address if len(rest) < len(held) else ""

    def release_held(self, held: list[tuple[str, ShmRef]]) -> None:
        """Give the slots of intermediate tensors back to the workers that own them."""
        if not held:
            return
        w = self.worker
        own = w.inbox.address
        by_owner: dict[str, list[ShmRef]] = {}
        for owner, ref in held:
            by_owner.setdefault(owner, []).append(ref)
        mine = by_owner.pop(own, None)
        if mine:
            with w.out_lock:
                for ref in mine:
                    w.arena.free(ref)
        for owner, refs in by_owner.items():
            # one gone took its slots with it; one that is full keeps them until it restarts
            self.send(owner, ReleaseOutputs(refs))

    def send(self, address: str, msg, payloads=()) -> bool:
        """To another worker, without waiting; False when it is gone or cannot take it."""
        try:
            with self.lock:
                box = self.peers.get(address)
                if box is None:
                    box = self.peers[address] = packets.PacketOutbox(address)
                box.send(msg, payloads, flags=channel.NOBLOCK)
            return True
        except (packets.PeerGone, packets.PeerStalled, zmq.Again) as e:
            log.debug("could not send %s to %s: %s", type(msg).__name__, address,
                      type(e).__name__)
            with self.lock:
                gone = self.peers.pop(address, None)
            if gone is not None:
                gone.close()
            return False

    def close(self) -> None:
        with self.lock:
            for box in self.peers.values():
                box.close()
            self.peers.clear()
