"""``EnsembleRunner``: runs ensemble requests inside the scheduler, step by step.

A request for an ensemble never reaches a worker of its own. The runner decodes its payload (tensor
metadata only: shared-memory references and small inline tensors), submits each step to the
composing model as the scheduler's own request (``ENSEMBLE_FRONTEND``) as soon as the step's
inputs exist, and collects the steps' answers, which workers send to the scheduler. Steps whose
inputs are ready together run in parallel; every tensor stays where the worker that produced it
wrote it and is passed on by reference. The answer goes to the client's frontend with
``worker`` set to the scheduler, which forwards the frontend's ReleaseOutputs to the workers
that own the slots; slots of intermediate tensors are given back when the request ends
(engine/ensemble/slots.py). An intermediate tensor that only steps reading GPU memory take
(``EnsemblePlan.device_tensors``) may stay on the producer's GPU: its slot is then in that
worker's device arena, named by a CUDA IPC handle.

A decoupled step answers any number of times: each answer starts a branch of the data flow that
holds the tensors known so far plus that answer's, and the steps downstream of it run once per
branch. Every branch that holds all requested outputs is one response of the (then decoupled)
ensemble; the request ends when no step is running.

Pure: it acts through the callables it is given; tests drive it through the core
(tests/engine/test_ensemble_core.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from shmserve.engine.batching.queues import shape_key
from shmserve.engine.ensemble.plan import EnsemblePlan, Step, step_input_problem
from shmserve.engine.ensemble.slots import SlotBook
from shmserve.engine.models import ModelVersion
from shmserve.ipc.messages import decode_payload, encode
from shmserve.ipc.messages.common import (
    ENSEMBLE_FRONTEND,
    CudaRef,
    ErrorCode,
    InferPayload,
    OutputSpec,
    ShmRef,
    Tensor,
)
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.messages.to_scheduler import SubmitRequest

log = logging.getLogger("shmserve.scheduler")


@dataclass(eq=False)
class Branch:
    tensors: dict[str, Tensor]          # ensemble tensor name -> tensor (named as in the step)
    launched: set[int]                  # steps started in this branch or an ancestor
    children: list["Branch"] = field(default_factory=list)
    responded: bool = False
    parent: "Branch | None" = None


@dataclass(eq=False)
class Run:
    version: ModelVersion
    plan: EnsemblePlan
    head: SubmitRequest
    payload: InferPayload
    wanted: list[OutputSpec]            # the client's outputs, in response order
    root: Branch
    inflight: dict[int, tuple[Branch, Step]] = field(default_factory=dict)
    # worker address of every step output slot (host, or device: a CudaRef into the worker's
    # device arena): given back when the request ends, unless handed to the frontend with an
    # answer (host slots only: the client never gets a device slot)
    slots: dict[ShmRef | CudaRef, str] = field(default_factory=dict)
    timings: list[int] = field(default_factory=lambda: [0, 0, 0, 0])   # queue, in, infer, out
    streaming: dict[int, int] = field(default_factory=dict)   # decoupled step id -> spawn id
    # handed slots a later response of this (decoupled) run may name too: the run holds a
    # reference on each in ``handed`` until it ends
    held: list[ShmRef] = field(default_factory=list)
    responses: int = 0
    done: bool = False
    # tensors that will never exist: ensemble inputs the client left out, and what only
    # steps that can never run would make (absent())
    absent: frozenset = frozenset()


def absent(plan: EnsemblePlan, given: set[str]) -> frozenset:
    """The tensors a request without some ensemble inputs will never have: those inputs, and,
    step by step, the outputs of a step one of whose required (non-optional) inputs is absent.
    A step reads an absent tensor for an optional input as left out, as Triton does."""
    gone = {t for t in plan.inputs if t not in given}
    changed = bool(gone)
    while changed:
        changed = False
        for step in plan.steps:
            if any(tensor in gone and own not in step.optional_inputs
                   for own, tensor in step.inputs.items()):
                new = set(step.outputs.values()) - gone
                if new:
                    gone |= new
                    changed = True
    return frozenset(gone)


class EnsembleRunner:
    def __init__(self, submit: Callable[[SubmitRequest, bytes], None],
                 cancel: Callable[[int, int], None],
                 answer: Callable[[int, InferResult], None],
                 release: Callable[[str, list[ShmRef | CudaRef]], None],
                 resolve: Callable[[str, int], int | None],
                 clock: Callable[[], int], release_address: str,
                 ended: Callable[[ModelVersion, int], None] = lambda ver, frontend: None):
        self.submit_step = submit           # the core's submit, for a step's request
        self.cancel_step = cancel           # cancel a step's request (id, spawn id if it streams)
        self.to_frontend = answer           # to a client's frontend
        self.release_worker = release       # ReleaseOutputs to a worker
        self.book = SlotBook(self.release)  # who owns each slot, and when it goes back
        self.resolve = resolve              # (model, version or -1) -> a ready version
        self.clock = clock
        self.release_address = release_address  # where frontends return handed slots
        # (ensemble version, frontend): a run of an ensemble that may run worker to worker
        # ended (the scheduler may lend its steps' instances now)
        self.ended = ended
        self.runs: dict[tuple[int, int], Run] = {}     # (frontend, req_id) -> run
        self.steps: dict[int, Run] = {}     # step request id -> its run (until its final answer)
        self.counter = 0

    # ---- nested ensembles ---------------------------------------------------------------------
    def answer(self, frontend: int, res: InferResult) -> None:
        """An answer goes to its client's frontend, or, when the request is a step of another
        ensemble (a nested one), to that ensemble's run here."""
        if frontend == ENSEMBLE_FRONTEND:
            self.result(res)
        else:
            self.to_frontend(frontend, res)

    def release(self, address: str, refs: list[ShmRef | CudaRef]) -> None:
        """Slots go back to their worker. Those a nested ensemble answered a step with were
        handed to this runner (their answer names it as the worker): one reference less on
        each, and those nobody holds go back to the workers that own them."""
        if address != self.release_address:
            self.release_worker(address, refs)
            return
        for owner, owned in self.book.released([r for r in refs if type(r) is ShmRef]).items():
            self.release(owner, owned)

    # ---- start --------------------------------------------------------------------------------
    def start(self, ver: ModelVersion, plan: EnsemblePlan, head: SubmitRequest,
              frame: bytes) -> None:
        payload = decode_payload(frame)
        for o in payload.outputs:
            if o.classification and plan.consumers.get(o.name):
                self.fail_new(ver, head, ErrorCode.INVALID_ARG,
                              f"in ensemble '{ver.name}', output '{o.name}' feeds another step, "
                              f"so it cannot be returned as a classification")
                return
        root = Branch({t.name: t for t in payload.inputs}, set())
        run = Run(ver, plan, head, payload, list(payload.outputs), root,
                  absent=absent(plan, set(root.tensors)))
        self.runs[(head.frontend, head.req_id)] = run
        self.advance(run, root)

    def fail_new(self, ver: ModelVersion, head: SubmitRequest, code: ErrorCode,
                 message: str) -> None:
        ver.stats.failed("OTHER", self.clock() - head.received_ns)
        self.answer(head.frontend, InferResult(head.req_id, ver.name, ver.version, error=message,
                                               code=code))

    # ---- the data flow ----------------------------------------------------------------------------
    def advance(self, run: Run, branch: Branch, finish: bool = True) -> None:
        """Start every step whose inputs ``branch`` now holds; answer what is complete;
        ``finish``: end the request if no step runs then."""
        for step in run.plan.steps:
            if run.done:
                return
            if step.index in branch.launched or not self.ready(run, branch, step):
                continue
            self.mark_launched(branch, step.index)
            self.launch(run, branch, step)
        if run.done:
            return
        if run.plan.decoupled and not branch.responded and \
                all(o.name in branch.tensors for o in run.wanted):
            branch.responded = True
            self.respond(run, branch, final=False)
        if finish and not run.inflight:
            self.finish(run)

    @staticmethod
    def ready(run: Run, branch: Branch, step: Step) -> bool:
        """Every input of ``step`` is there, or optional and absent for good; and not all of
        them absent (a step that would read nothing is not run)."""
        if not run.absent:
            return all(t in branch.tensors for t in step.inputs.values())
        present = 0
        for own, tensor in step.inputs.items():
            if tensor in branch.tensors:
                present += 1
            elif tensor not in run.absent or own not in step.optional_inputs:
                return False
        return present > 0 or not step.inputs

    @staticmethod
    def mark_launched(branch: Branch, index: int) -> None:
        branch.launched.add(index)
        for child in branch.children:
            EnsembleRunner.mark_launched(child, index)

    def launch(self, run: Run, branch: Branch, step: Step) -> None:
        version = self.resolve(step.model, step.version)
        if version is None:
            self.fail(run, step, ErrorCode.UNAVAILABLE,
                      f"model '{step.model}' has no ready version"
                      + ("" if step.version < 0 else f" {step.version}"))
            return
        inputs = []
        for own, tensor in step.inputs.items():
            t = branch.tensors.get(tensor)
            if t is None:           # an optional input absent for good: left out (ready())
                continue
            inputs.append(Tensor(own, t.datatype, t.shape, t.data, t.shm, t.cuda))
        problem = step_input_problem(step, inputs)
        if problem:
            self.fail(run, step, ErrorCode.INVALID_ARG, problem)
            return
        outputs = []
        for own, tensor in step.outputs.items():
            spec = next((o for o in run.wanted if o.name == tensor), None)
            if spec is None and not run.plan.consumers.get(tensor):
                continue            # nobody reads it: the model need not return it
            outputs.append(OutputSpec(own, spec.shm if spec else None,
                                      spec.classification if spec else 0,
                                      spec.cuda if spec else None,
                                      # only later steps read it, on their GPUs
                                      spec is None and tensor in run.plan.device_tensors,
                                      spec.labels if spec else None))
        if not outputs:             # a step whose outputs nobody wants still runs (for its effects)
            outputs = [OutputSpec(own) for own in step.outputs]
        p, head = run.payload, run.head
        now = self.clock()
        timeout_us = head.timeout_us
        if timeout_us:      # the request's timeout covers all its steps: a step gets what is left
            timeout_us -= (now - head.received_ns) // 1000
            if timeout_us <= 0:
                self.fail(run, step, ErrorCode.UNAVAILABLE, "Request timeout expired")
                return
        chain = [*head.chain, run.version.name]
        payload = InferPayload(p.request_id, inputs, outputs, p.parameters, p.correlation_id,
                               p.flags, chain)
        self.counter += 1
        rid = self.counter
        run.inflight[rid] = (branch, step)
        self.steps[rid] = run
        batch = inputs[0].shape[0] if step.max_batch_size > 0 and inputs and inputs[0].shape \
            else 1
        self.submit_step(SubmitRequest(rid, ENSEMBLE_FRONTEND, step.model, version, batch,
                                       now, head.priority, timeout_us,
                                       shape_key(inputs, step.variable_inputs,
                                                 bool(step.optional_inputs),
                                                 step.max_batch_size > 0),
                                       chain=chain, sequence_id=p.correlation_id,
                                       sequence_flags=p.flags), encode(payload))

    def result(self, res: InferResult) -> None:
        """A step's answer (a worker's, or the scheduler's error for it)."""
        run = self.steps.get(res.req_id)
        if run is None:
            self.book.give_back_late(res)
            return
        if res.final:
            del self.steps[res.req_id]
        where = run.inflight.get(res.req_id)
        if run.done or where is None:
            self.book.give_back_late(res)
            return
        branch, step = where
        if res.final:
            del run.inflight[res.req_id]
            run.streaming.pop(res.req_id, None)
        elif res.spawn_id:
            run.streaming[res.req_id] = res.spawn_id
        if res.error:
            # as in Triton, a failed step counts against the ensemble too (the composing
            # request reports to the ensemble's statistics as well as its model's), besides the
            # ensemble request's own failure: two failures, reason OTHER, per failed step
            run.version.stats.failed("OTHER", self.clock() - run.head.received_ns)
            self.fail(run, step, res.code or ErrorCode.INTERNAL, res.error)
            return
        if res.no_response:
            if not run.inflight:
                self.finish(run)
            return
        made: dict[str, Tensor] = {}
        regions = {o.name for o in run.wanted if o.shm is not None or o.cuda is not None}
        for t in res.outputs:
            tensor = step.outputs.get(t.name)
            if tensor is None:
                continue
            made[tensor] = t
            # an output written into the client's region is not the worker's slot
            if res.worker and tensor not in regions:
                self.book.note(run.slots, t, res.worker)
        if step.decoupled:
            child = Branch({**branch.tensors, **made}, set(branch.launched),
                           responded=branch.responded, parent=branch)
            branch.children.append(child)
            self.advance(run, child)
        else:
            self.add(run, branch, made)

    def add(self, run: Run, branch: Branch, made: dict[str, Tensor]) -> None:
        """Tensors a step of ``branch`` made: its descendants see them too. The request may end
        only once each of them had its chance to start steps or respond."""
        order = [branch]
        for b in order:             # the subtree, parents first
            order.extend(b.children)
        for b in order:
            b.tensors.update(made)
        for b in order:
            if run.done:
                return
            self.advance(run, b, finish=False)
        if not run.done and not run.inflight:
            self.finish(run)

    def timings(self, req_id: int, queue_ns: int, input_ns: int, infer_ns: int,
                output_ns: int) -> None:
        """A step's statistics, summed into the ensemble's."""
        run = self.steps.get(req_id)
        if run is not None:
            t = run.timings
            t[0] += queue_ns
            t[1] += input_ns
            t[2] += infer_ns
            t[3] += output_ns

    # ---- the end -------------------------------------------------------------------------------
    def respond(self, run: Run, branch: Branch, final: bool) -> None:
        ver, head = run.version, run.head
        outs = []
        for spec in run.wanted:
            t = branch.tensors.get(spec.name)
            if t is None:       # cannot happen: checked at load (every output is written)
                continue
            outs.append(Tensor(spec.name, t.datatype, t.shape, t.data, t.shm, t.cuda))
            ref = t.shm
            if ref is None:
                continue
            if ref in run.slots:
                shared = self.shared(run, branch, spec.name, ref)
                owner = run.slots.pop(ref)
                if owner != self.release_address:
                    self.book.hand(ref, owner, 2 if shared else 1)
                elif shared:        # a nested ensemble handed it to us: it is handed already,
                    self.book.hold(ref)     # and our reference passes to the client
                if shared:
                    run.held.append(ref)
            elif ref in run.held:
                self.book.hold(ref)
        run.responses += 1
        # ``worker`` is the scheduler even when no slot is handed: a frontend sends the cancel
        # of a request that is streaming to the worker of its answers, here this runner
        self.answer(head.frontend, InferResult(
            head.req_id, ver.name, ver.version, outs,
            worker=self.release_address, final=final))

    @staticmethod
    def shared(run: Run, branch: Branch, tensor: str, ref: ShmRef) -> bool:
        """Whether a later response of ``run`` may hold the tensor that ``branch`` answers with,
        or a step still reads it: then its slot must outlive this response. Tensors flow down
        the branches only, and a branch's children made after it responded never respond."""
        if not run.plan.decoupled:
            return False            # one response, when no step runs
        parent = branch.parent
        if parent is not None and (t := parent.tensors.get(tensor)) is not None and t.shm == ref:
            return True             # its parent's other descendants hold it too
        if branch.children:         # made before it responded: they may respond with it
            return True
        # a step of this branch that reads it runs, or may run once an earlier step answers
        return any(b is branch and tensor in step.inputs.values()
                   for b, step in run.inflight.values()) or \
            any(s.index not in branch.launched and tensor in s.inputs.values()
                for s in run.plan.steps)

    def finish(self, run: Run) -> None:
        """No step runs any more: the answer (or the final flag) goes out."""
        if run.done:
            return
        ver, head = run.version, run.head
        now = self.clock()
        if head.frontend == ENSEMBLE_FRONTEND:      # a nested ensemble: its steps' times are
            self.timings(head.req_id, *run.timings)     # the outer one's too (before it hears)
        if run.plan.decoupled:
            self.close(run)
            self.answer(head.frontend, InferResult(head.req_id, ver.name, ver.version,
                                                   final=True, no_response=True))
        else:
            root = run.root
            if not all(o.name in root.tensors for o in run.wanted):
                self.fail(run, None, ErrorCode.INTERNAL,
                          "unexpected deadlock, at least one output is not set while no more "
                          "ensemble steps can be made")
                return
            self.respond(run, root, final=True)
            self.close(run)
        q, i, c, o = run.timings
        ver.stats.executions([head.batch_size], [i], [c], [o])
        ver.stats.successes([head.batch_size], [now - head.received_ns], [q], [i], [c], [o])

    def fail(self, run: Run, step: Step | None, code: ErrorCode, error: str) -> None:
        """The request fails with the failing step's name; the steps still running are
        cancelled (their late answers give their slots back)."""
        ver, head = run.version, run.head
        where = f"step {step.index} (model '{step.model}')" if step is not None else ""
        message = f"in ensemble '{ver.name}', " + (f"{where}: " if where else "") + error
        ver.stats.failed("OTHER", self.clock() - head.received_ns)
        self.close(run)
        for rid in list(run.inflight):
            self.cancel_step(rid, run.streaming.get(rid, 0))
        run.inflight.clear()
        self.answer(head.frontend, InferResult(head.req_id, ver.name, ver.version,
                                               error=message, code=code))

    def close(self, run: Run) -> None:
        run.done = True
        self.runs.pop((run.head.frontend, run.head.req_id), None)
        self.book.give_back(run.slots)
        run.slots = {}
        held, run.held = run.held, []
        self.book.give_back(self.book.drop(held))
        if run.plan.chained():
            self.ended(run.version, run.head.frontend)

    # ---- the client --------------------------------------------------------------------------
    def cancel(self, frontend: int, req_id: int) -> bool:
        """The client went away: cancel the running steps, answer CANCELLED."""
        run = self.runs.get((frontend, req_id))
        if run is None:
            return False
        ver, head = run.version, run.head
        ver.stats.failed("CANCELED", self.clock() - head.received_ns)
        self.close(run)
        for rid in list(run.inflight):
            self.cancel_step(rid, run.streaming.get(rid, 0))
        run.inflight.clear()
        self.answer(frontend, InferResult(req_id, ver.name, ver.version,
                                          error="the request was cancelled by the client",
                                          code=ErrorCode.CANCELLED))
        return True

    def streams_ended(self, spawn_id: int, reason: str, answered=()) -> None:
        """The worker of a decoupled model died: a step it was still answering fails: one that
        streamed, or one whose execution it had finished (``answered``: it may have meant to
        answer from a thread) and that has not had its final answer."""
        lost = set(answered)
        for run in list(self.runs.values()):
            for rid, (_, step) in list(run.inflight.items()):
                if not run.done and (run.streaming.get(rid) == spawn_id or rid in lost):
                    self.fail(run, step, ErrorCode.INTERNAL, reason)

    def worker_gone(self, address: str) -> list[bytes]:
        """A worker died: its slots died with it, nobody returns them. A request that still
        needs one of its device slots (a step that runs or has yet to run reads it) fails. The
        IPC handles of its device arena are returned: every worker must close them."""
        handles = self.book.worker_gone(address)
        if handles:
            for run in list(self.runs.values()):
                self.lose_device_slots(run, address)
        return handles

    def lose_device_slots(self, run: Run, address: str) -> None:
        dead = {ref for ref, w in run.slots.items() if w == address and type(ref) is CudaRef}
        if not dead:
            return
        for ref in dead:
            del run.slots[ref]
        branches = [run.root]
        for b in branches:
            branches.extend(b.children)
        for b in branches:
            for tensor, t in b.tensors.items():
                if t.cuda not in dead:
                    continue
                step = next((s for s in run.plan.steps if tensor in s.inputs.values() and
                             s.index not in b.launched), None) or \
                    next((s for _, s in run.inflight.values() if tensor in s.inputs.values()),
                         None)
                if step is not None:
                    self.fail(run, step, ErrorCode.INTERNAL,
                              f"the worker process that held tensor '{tensor}' in GPU memory "
                              f"ended before this step read it")
                    return
