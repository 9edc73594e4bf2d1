"""BLS: a python model's own inference requests (``pb_utils.InferenceRequest(...).exec()``).

The worker acts as a frontend of its own: it says hello to the scheduler under an id no real
frontend uses (``BLS_FRONTEND_BASE + spawn id``), listens on that frontend's address, and sends
``SubmitRequest``s over its packet channel. So a BLS request is scheduled like any other
(queues, batching, priorities, statistics), and the model that answers writes to this inbox
as it would to a frontend. The input tensors travel in this worker's output arena by
reference; the answer's outputs are copied out of the other worker's slots (which go back at
once), so the model owns what it gets.

Each request carries its chain: the models whose executions wait for it. The scheduler refuses
one whose chain already runs in the model it asks for while no instance of that model is idle
(it could only wait for itself).

Like a frontend, the client takes leases (engine/leases.py; ipc/lease_table.py keeps them): once
the scheduler has lent it an idle instance of the model it calls, its requests go straight to
that worker (LeasedExecute), one hop instead of two and no scheduler code before the callee
runs. The completion records that ride with the answers leave with the worker's own answer
(``take_done``: its frontend passes them on with its own), or, for a call made outside a
request's execution, in bulk after RECORDS_WAIT_MS (LeasedDone). A model in the request's own
chain is never called under a lease: its instance may be the one waiting for the answer, and
only the scheduler can refuse that.

Requests may come from execute() or from any thread of the model. Each answer goes to the queue
of the request it belongs to, read by the thread waiting for an answer or, while none waits, by a
background thread (bls_inbox.py: one wake-up per answer, not two).
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import queue
import threading
import time

import numpy as np
import zmq

from shmserve.engine.requests import prepare as requests_
from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.ipc import channel, packets
from shmserve.ipc.errors import InferError
from shmserve.ipc.lease_table import LeaseTable
from shmserve.ipc.messages import encode as encode_message
from shmserve.ipc.messages.common import BLS_FRONTEND_BASE, ErrorCode, LeasedRecord, Tensor
from shmserve.ipc.messages.to_frontend import (
    ControlReply,
    InferResult,
    InferResults,
    LeaseBounced,
    LeaseGranted,
    LeaseLost,
    LeaseRevoked,
    ModelTable,
    WorkerGone,
)
from shmserve.ipc.messages.to_scheduler import (
    CancelRequest,
    ControlRequest,
    FrontendHello,
    LeasedDone,
    SubmitRequest,
)
from shmserve.ipc.messages.to_worker import ANYWHERE, LeasedExecute, ReleaseOutputs
from shmserve.ipc.shm import ShmError, ShmMapCache
from shmserve.workers import tensors
from shmserve.workers.python_backend import pb_utils
from shmserve.workers.python_backend.bls_inbox import SharedInbox
from shmserve.workers.python_backend.errors import FROM_ERROR_CODE

log = logging.getLogger("shmserve.worker")

FIRST_TABLE_WAIT_S = 30.0
# How long the completion records of leased calls wait for the worker's own answer to take
# them before they go to the scheduler on their own.
RECORDS_WAIT_MS = 5


class BlsClient:
    def __init__(self, worker):
        self.worker = worker
        self.fid = BLS_FRONTEND_BASE + worker.args.spawn_id
        self.inbox = packets.PacketInbox(channel.frontend_address(worker.args.run_dir, self.fid))
        self.catalog = ModelCatalog()
        self.table_seen = threading.Event()
        self.lock = threading.Lock()        # pending, maps and the outboxes to other workers
        self.pending: dict[int, queue.SimpleQueue] = {}
        self.streams: dict[int, int] = {}   # req_id -> spawn id of the worker still answering
        # requests given up on (timeout): their input slots wait for the last answer, since the
        # model answering may still read them
        self.abandoned: dict[int, list] = {}
        self.ids = itertools.count(1)
        self.queries: dict[int, queue.SimpleQueue] = {}     # model control (model_control.py)
        self.maps = ShmMapCache()
        self.boxes: dict[str, packets.PacketOutbox] = {}
        self.leases = LeaseTable()          # instances lent to this client (under ``lock``)
        # what each pending request was sent as: a bounced or lost one goes to the scheduler
        self.sent: dict[int, tuple[SubmitRequest, bytes]] = {}
        self.done: list[LeasedRecord] = []  # completion records of leased requests, not sent
        self.lost: list[LeaseLost] = []     # handled once the inbox is drained
        self.shared = SharedInbox(self.inbox, self.handle, self.drained,
                                  lambda: bool(self.done), self.flush_done)
        self.shared.start()
        worker.tell(FrontendHello(self.fid, self.inbox.address))

    # ---- what the inbox brings (read by whoever holds its token: bls_inbox.py) ------------
    def handle(self, msg) -> None:
        if isinstance(msg, InferResult):
            self.deliver(msg)
        elif isinstance(msg, InferResults):
            for r in msg.results:
                self.deliver(r)
        elif isinstance(msg, ModelTable):
            self.catalog.update(msg)
            self.table_seen.set()
        elif isinstance(msg, ControlReply):
            with self.lock:
                waiting = self.queries.pop(msg.query_id, None)
            if waiting is not None:
                waiting.put(msg)
        elif isinstance(msg, WorkerGone) and msg.reason:
            with self.lock:
                ended = [rid for rid, sid in self.streams.items() if sid == msg.spawn_id]
            for rid in ended:
                self.deliver(InferResult(rid, "", 0, error=msg.reason,
                                         code=ErrorCode.INTERNAL))
        elif isinstance(msg, (LeaseGranted, LeaseRevoked, LeaseBounced, LeaseLost)):
            self.lease_news(msg)

    def drained(self) -> None:
        if self.lost:
            self.settle()

    # ---- leases (whoever reads the inbox) -------------------------------------------------------
    def lease_news(self, msg) -> None:
        with self.lock:
            if isinstance(msg, LeaseGranted):
                lease = self.leases.granted(msg, self.worker_box)
                for rid in msg.returned:        # ours, held by the scheduler: they go first
                    if rid in self.pending and rid in self.sent:
                        head = self.sent[rid][0]
                        head.no_lease = lease is None or head.model != msg.model
                        self.send(rid, None if head.no_lease else lease)
            elif isinstance(msg, LeaseRevoked):
                self.leases.revoked(msg.lease_id)
            elif isinstance(msg, LeaseBounced):     # read after its lease ended: not run
                self.leases.done(msg.req_id)
                if msg.req_id in self.pending and msg.req_id in self.sent:
                    self.send(msg.req_id, None)
            else:
                self.leases.forget(lambda held: held.spawn_id == msg.spawn_id)
                # its answers may still be unread in the inbox: decided once all is read
                self.lost.append(msg)

    def settle(self) -> None:
        """The inbox is drained: the requests of leased workers that ended go to the
        scheduler, to run again or fail."""
        with self.lock:
            lost, self.lost = self.lost, []
            for msg in lost:
                for rid in self.leases.lost(msg.spawn_id):
                    sent = self.sent.get(rid)
                    if sent is not None and rid in self.pending:
                        sent[0].lost, sent[0].lost_retry = msg.reason, msg.retry
                        self.send(rid, None)

    def take_done(self) -> list[LeasedRecord]:
        """The completion records of leased calls not yet sent (they ride with an answer)."""
        with self.lock:
            done, self.done = self.done, []
        return done

    def flush_done(self) -> None:
        done = self.take_done()
        if done:
            self.worker.tell(LeasedDone(done))

    def worker_box(self, spawn_id: int) -> packets.PacketOutbox:
        address = channel.worker_address(self.worker.args.run_dir, spawn_id)
        box = self.boxes.get(address)
        if box is None or box.gone:
            box = self.boxes[address] = packets.PacketOutbox(address)
        return box

    def send(self, req_id: int, lease, cpu: int = ANYWHERE) -> None:
        """Send a request (held under ``lock``): under ``lease``, or to the scheduler when it
        is None or its worker cannot take it. ``cpu``: where the callee waits next (see
        ``waiting_hint``)."""
        head, payload = self.sent[req_id]
        if lease is not None and not lease.full:
            self.leases.sent(lease, req_id)
            try:
                lease.box.send(LeasedExecute(lease.lease_id, head, cpu), (payload,),
                               flags=channel.NOBLOCK)
                return
            except (packets.PeerGone, packets.PeerStalled, zmq.Again):
                self.leases.done(req_id)
                if lease.box.gone:
                    self.leases.forget(lambda held: held.box is lease.box)
        self.worker.tell(head, (payload,))

    def deliver(self, result: InferResult) -> None:
        with self.lock:
            if result.final:
                if self.leases.busy():
                    self.leases.done(result.req_id)
                if self.sent.pop(result.req_id, None) is not None and result.done is not None:
                    self.done.append(result.done)
            q = self.pending.get(result.req_id)
            if q is not None and not result.final:
                self.streams[result.req_id] = result.spawn_id
            slots = self.abandoned.pop(result.req_id, None) if result.final and q is None \
                else None
        if q is None:
            self.release(result)        # nobody waits for it (timed out)
            self.free(slots or [])
        else:
            q.put(result)

    def control(self, request: ControlRequest, timeout_s: float) -> ControlReply:
        """Send a model control request (its ``frontend`` and ``query_id`` are filled in here)
        and wait for the scheduler's answer, which comes once the load or unload is done."""
        request.frontend, request.query_id = self.fid, next(self.ids)
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            self.queries[request.query_id] = answer
        self.worker.tell(request)
        try:
            return answer.get(timeout=timeout_s)
        except queue.Empty:
            raise pb_utils.TritonModelException(
                f"{request.action.value} of '{request.name}' did not finish in "
                f"{timeout_s:g} s") from None
        finally:
            with self.lock:
                self.queries.pop(request.query_id, None)

    # ---- a model's request ------------------------------------------------------------------
    def submit(self, req) -> tuple[int, queue.SimpleQueue, list]:
        """Send ``req`` (a pb_utils.InferenceRequest); returns its id, the queue its answers
        arrive in, and this worker's slots holding its inputs (freed after the last answer)."""
        if not self.table_seen.wait(FIRST_TABLE_WAIT_S):
            raise pb_utils.TritonModelException("BLS: the scheduler sent no model table")
        version = "" if req.model_version() < 0 else str(req.model_version())
        view, v = self.catalog.resolve(req.model_name(), version)
        worker = self.worker
        slots: list = []
        ins = []
        try:
            with worker.out_lock:           # the arena is the worker's output arena
                for t in req.inputs():
                    arr = t._host()     # a GPU tensor is copied to the host
                    if not isinstance(arr, np.ndarray):
                        arr = np.asarray(arr)
                    placed = tensors.from_numpy(t.name(), t.datatype(), arr, worker.arena)
                    if placed.shm is not None:
                        slots.append(placed.shm)
                    ins.append(placed)
            wanted = [requests_.OutputWanted(n) for n in req.requested_output_names()] or None
            text = req.parameters()
            params = dict(json.loads(text)) if text != "{}" else {}
            if req.timeout():
                params["timeout"] = req.timeout()
            prepared = requests_.prepare(view, ins, wanted, params, req.request_id(), [], [],
                                         json_outputs=False)
        except BaseException:
            self.free(slots)
            raise
        prepared.payload.correlation_id = req.correlation_id()
        prepared.payload.flags = req.flags()
        chain = worker.chain()
        prepared.payload.chain = chain
        req_id = next(self.ids)
        answers: queue.SimpleQueue = queue.SimpleQueue()
        head = SubmitRequest(req_id, self.fid, view.name, v, prepared.batch_size,
                             time.monotonic_ns(), prepared.priority, prepared.timeout_us,
                             prepared.shape_key, chain=chain,
                             sequence_id=prepared.payload.correlation_id,
                             sequence_flags=prepared.payload.flags)
        with self.lock:
            self.pending[req_id] = answers
            self.sent[req_id] = (head, encode_message(prepared.payload))
            # never under a lease on a model whose execution waits for this answer
            self.send(req_id, self.leases.pick(view.name, v)
                      if self.leases and view.name not in chain else None, self.waiting_hint())
        return req_id, answers, slots

    def waiting_hint(self) -> int:
        """For a call made by execute(), the running request's hint of where to wait
        (ipc/messages/to_worker.py); ANYWHERE otherwise. The callee waits for its next call as
        the request's worker does: on the frontend's CPU while requests come one at a time,
        where this thread also waits for the answer, so that each hop of the call is a switch
        on one CPU, as each hop of a chain is, not a wake-up of another; off the frontend's
        CPU while they overlap."""
        w = self.worker
        return w.waiting.cpu if threading.get_ident() == w.main_thread else ANYWHERE

    def answers(self, req, decoupled: bool):
        """Send ``req`` now; its answers as pb_utils.InferenceResponse objects (the last one of
        a decoupled model's that ends with the FINAL flag alone is an empty response), and a
        callable that cancels it (None when it was refused before it left)."""
        try:
            req_id, answers, slots = self.submit(req)
        except InferError as e:
            return iter([pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message))]), None
        return self._answers(req, decoupled, req_id, answers, slots), \
            functools.partial(self.cancel, req_id)

    def cancel(self, req_id: int) -> None:
        """ResponseIterator.cancel(): the model that answers hears it (its is_cancelled() turns
        true); the answers still come, the last one ends the iteration."""
        with self.lock:
            if req_id not in self.pending:
                return
        self.tell_cancel(req_id)

    def tell_cancel(self, req_id: int) -> None:
        """To the leased worker the request went to, or to the scheduler."""
        msg = CancelRequest(self.fid, req_id)
        with self.lock:
            for box in self.leases.boxes_of(req_id):
                try:
                    box.send(msg, flags=channel.NOBLOCK)
                except (packets.PeerGone, packets.PeerStalled, zmq.Again):
                    pass
                return
        self.worker.tell(msg)

    def _answers(self, req, decoupled: bool, req_id: int, answers, slots):
        timeout_s = req.timeout() / 1e6 if req.timeout() > 0 else None
        deadline = time.monotonic() + timeout_s if timeout_s else 0.0
        try:
            final = False
            while not final:
                try:
                    result = self.wait(answers, deadline if timeout_s else None)
                except queue.Empty:
                    self.give_up(req_id, slots)
                    slots = []
                    yield pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"Request timeout expired: no answer from model '{req.model_name()}' "
                        f"within the request's timeout of {req.timeout()} us",
                        pb_utils.TritonError.UNAVAILABLE))
                    return
                final = result.final
                if final:
                    self.free(slots)
                    slots = []
                if not decoupled and not final:
                    self.release(result)
                    continue            # (a decoupled model's answers, asked for as one)
                yield self.response(result)
        finally:
            with self.lock:
                self.pending.pop(req_id, None)
                self.streams.pop(req_id, None)
            self.free(slots)

    def wait(self, answers, deadline: float | None) -> InferResult:
        if self.waiting_hint() < 0:         # paired only: one CPU named
            return self.shared.wait(answers, deadline)
        waiting = self.worker.waiting
        waiting.before_wait()
        try:
            return self.shared.wait(answers, deadline)
        finally:
            waiting.after_wait()

    def response(self, result: InferResult):
        if result.error:
            code = FROM_ERROR_CODE.get(result.code or ErrorCode.INTERNAL,
                                       pb_utils.TritonError.INTERNAL)
            self.release(result)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(result.error, code))
        try:
            out = []
            with self.lock:
                for t in result.outputs:
                    out.append(pb_utils.Tensor(t.name, self.copy_out(t)))
        except (ShmError, ValueError) as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"BLS: cannot read the outputs of model '{result.model}': {e}"))
        finally:
            self.release(result)
        return pb_utils.InferenceResponse(out, parameters=result.parameters or None)

    def copy_out(self, t: Tensor) -> np.ndarray:
        arr = tensors.to_numpy(t, self.maps)
        return arr.copy() if t.datatype != "BYTES" else arr

    def give_up(self, req_id: int, slots: list) -> None:
        """The request's timeout passed: cancel it; its inputs are freed with its last answer."""
        with self.lock:
            self.pending.pop(req_id, None)
            if slots:
                self.abandoned[req_id] = slots
        self.tell_cancel(req_id)

    # ---- memory -----------------------------------------------------------------------------
    def free(self, slots: list) -> None:
        if slots:
            with self.worker.out_lock:
                for ref in slots:
                    self.worker.arena.free(ref)

    def release(self, result: InferResult) -> None:
        """Give the answering worker its output slots back."""
        refs = [t.shm for t in result.outputs if t.shm is not None]
        if not refs or not result.worker:
            return
        with self.lock:
            try:
                box = self.boxes.get(result.worker)
                if box is None:
                    box = self.boxes[result.worker] = channel.outbox_for(result.worker)
                box.send(ReleaseOutputs(refs), flags=channel.NOBLOCK)
            except Exception as e:      # that worker is gone: its slots went with it
                log.debug("could not return BLS output slots to %s: %s", result.worker, e)
                self.boxes.pop(result.worker, None)

    def close(self) -> None:
        self.shared.close()
        self.inbox.close()
        with self.lock:
            for box in self.boxes.values():
                box.close()
            self.maps.close()

