"""The worker: one model instance. Loads the backend, then executes batches until told to stop
or until its parent (the scheduler) dies. workers/main.py is the process around it (arguments,
signals, exit); this module is compiled (ipc/compiled.py), main.py is not, so that
``python -m shmserve.workers.main`` can run it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import zmq

from shmserve.ipc import channel, logs, model_files, packets
from shmserve.ipc.compiled import mypyc_attr
from shmserve.ipc.exec_record import ExecutionRecord, record_path
from shmserve.ipc.gpu import cuda_ipc
from shmserve.ipc.gpu.device import CudaError
from shmserve.ipc.gpu.device_arena import DeviceArena
from shmserve.ipc.messages import decode_payload
from shmserve.ipc.messages.common import (
    ENSEMBLE_FRONTEND,
    CustomMetrics,
    ErrorCode,
    InferPayload,
    LeasedRecord,
)
from shmserve.ipc.messages.to_frontend import InferResult, InferResults, LeaseBounced
from shmserve.ipc.messages.to_scheduler import (
    BatchDone,
    CancelRequest,
    ForgetSegments,
    LeaseEnded,
    Pong,
    ReadinessReport,
    ResponseReport,
    SetLogSettings,
    Wake,
    WorkerLoadFailed,
    WorkerReady,
)
from shmserve.ipc.messages.to_worker import (
    ChainExecute,
    CheckReadiness,
    ExecuteBatch,
    LeasedExecute,
    LendSequences,
    Ping,
    ReleaseOutputs,
    RequestRoute,
    RevokeLease,
    Shutdown,
)
from shmserve.ipc.proc import (
    PacketWaker,
    StopFlag,
    failure_path,
    freeze_startup_heap,
)
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache
from shmserve.ipc.spawn_args import WorkerArgs
from shmserve.workers import sequence, tensors, warmup
from shmserve.workers.answers import Answers
from shmserve.workers.backends import autocomplete
from shmserve.workers.backends.base import Backend, WorkRequest, load_backend
from shmserve.workers.leases.batch import LeasedBatcher
from shmserve.workers.leases.chain import STOPPING, Chains
from shmserve.workers.leases.sequences import SequenceLease
from shmserve.workers.python_backend import metrics as pb_metrics
from shmserve.workers.python_backend import pb_utils
from shmserve.workers.readiness import ReadinessCalls
from shmserve.workers.waiting_cpu import WaitingCpu

if TYPE_CHECKING:  # imported at a model's first BLS call
    from shmserve.workers.python_backend.bls import BlsClient

log = logging.getLogger("shmserve.worker")

# Custom metrics (pb_utils.MetricFamily) go to the scheduler at most this often under load, so a
# model that updates them on every request costs one small message per interval, not per batch.
METRICS_INTERVAL_S = 0.1
_METRICS_WAIT_MS = 100
# How long the loop blocks when nothing is due. Signals and messages end the wait at once; the
# timeout only lets metrics changed by a model's own threads reach /metrics within a second.
IDLE_TIMEOUT_MS = 1000
_NONE: frozenset = frozenset()           # no output stays on the GPU


def _ignore(msg) -> None:
    pass


@mypyc_attr(allow_interpreted_subclasses=True)    # tests give a bare one what they need
class Worker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        self.args_path = ""         # set by main(): where our arguments came from
        self.inbox = packets.PacketInbox(channel.worker_address(args.run_dir, args.spawn_id))
        self.scheduler = channel.outbox_for(args.scheduler)
        self.frontends: dict[int, packets.PacketOutbox] = {}
        self.arena = ShmArena(args.segment_prefix)
        self.maps = ShmMapCache()
        # what it executes, for the scheduler to read should it die (ipc/exec_record.py)
        self.record = ExecutionRecord(record_path(args.run_dir, args.spawn_id))
        # outputs an ensemble's next step reads on the GPU; nothing touches CUDA before one
        self.device_arena = DeviceArena(args.cuda_memory_pool)
        # clients' CUDA regions and other workers' device arenas, opened on use
        self.cuda_handles = cuda_ipc.CudaHandles(self.device_arena.local)
        # what the backend returned, made into answers (the config's reshapes and checks)
        self.answers = Answers(args.spec.model_name, args.spec.version, self.inbox.address,
                               self.arena, self.maps, self.device_arena, self.cuda_handles)
        self.device_inputs = False      # the backend binds inputs in device memory (DeviceTensor)
        self.spec = args.spec
        self.use_config(args.spec.config_json)
        self.sequence: sequence.Sequences | None = None    # sequence_batching: set by load()
        self.backend: Backend = None  # type: ignore[assignment]  # set by load()
        # messages that request.is_cancelled() read while execute() ran; handled first, in order
        self.backlog: deque = deque()
        self.running: list[RequestRoute] | None = None  # routes of the batch inside execute()
        self.cancelled: set[tuple[int, int]] = set()   # of those, the ones whose client left
        self.metrics_due = 0.0                  # the first custom-metrics message goes at once
        self.revoked_upto = 0                   # leases up to this id have ended (RevokeLease)
        self.main_thread = threading.get_ident()
        self.waiting = WaitingCpu()             # the CPU to wait on (workers/waiting_cpu.py)
        # Requests a python model answers through request.get_response_sender() (a decoupled
        # model's, until their FINAL flag): (frontend, req_id) -> (route, regions, top K, outputs
        # that may stay on the GPU).
        # Model threads send from outside the loop, so whatever touches the output arena or the
        # frontends' sockets holds ``out_lock`` (uncontended when no thread sends).
        self.streams: dict[tuple[int, int], tuple[RequestRoute, dict, dict, frozenset]] = {}
        self.stream_cancelled: set[tuple[int, int]] = set()
        self.responses_reported: dict[tuple[int, int], int] = {}    # per stream (index next)
        self.out_lock = threading.Lock()
        self.tell_lock = threading.Lock()       # model threads send BLS requests too
        self.running_chain: list[str] = []      # BLS chains of the batch inside execute()
        self.bls: BlsClient | None = None       # made at a model's first BLS request
        self.bls_lock = threading.Lock()
        pb_utils._bls = self.bls_client
        pb_utils._control = self.model_control     # load_model / unload_model / is_model_ready
        self.senders = False    # the backend answers through WorkRequest.emit: set by load()
        self.chains = Chains(self)              # ensembles run worker to worker (chain.py)
        # everything but ExecuteBatch (the hot path, tested first) and Shutdown (ends the loop);
        # a Wake (a signal: the loop condition decides) or a CancelRequest for a request no
        # longer running needs nothing
        self.handlers: dict[type, Callable[[Any], Any]] = {
                         ReleaseOutputs: self.release_outputs, ForgetSegments: self.forget,
                         Ping: self.pong, Wake: _ignore, CancelRequest: self.cancel,
                         RevokeLease: self.revoke_lease, SetLogSettings: self.log_settings,
                         LendSequences: self.lend_sequences,
                         CheckReadiness: self.check_readiness}
        self.readiness = ReadinessCalls(args.spawn_id, self.tell)

    def use_config(self, config_json: str) -> None:
        """What the config decides about every answer: reshapes and the output checks."""
        config = json.loads(config_json)
        self.answers.use_config(config)
        self.lease_batcher = LeasedBatcher(config)
        # a sequence model's leased requests meet in its own sequence batcher
        sb = config.get("sequence_batching")
        self.sequence_lease = SequenceLease(self, config) \
            if sb is not None and not sb.get("iterative_sequence") else None
        # read again after load: auto_complete_config may have made the model decoupled
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))

    def answer(self, fid: int, msg) -> None:
        """Send answers to a frontend. One that has gone, or has not read for
        packets.SEND_TIMEOUT_S, loses them: its clients are gone or get its deadline error."""
        if fid == ENSEMBLE_FRONTEND:    # an ensemble's step: the scheduler runs the ensemble
            self.tell(msg)
            return
        with self.out_lock:
            try:
                box = self.frontends.get(fid)
                if box is not None:
                    try:
                        box.send(msg)
                        return
                    except packets.PeerGone:
                        # that frontend process died; the launcher may have started another
                        # in its place, listening at the same address
                        del self.frontends[fid]
                        box.close()
                box = self.frontends[fid] = channel.outbox_for(
                    channel.frontend_address(self.args.run_dir, fid), wait_connected_s=2.0)
                box.send(msg)
            except (packets.PeerGone, packets.PeerStalled) as e:
                log.warning("answers for frontend %d dropped: %s", fid, e)
                gone = self.frontends.pop(fid, None)
                if gone is not None:
                    gone.close()
                # nobody will release their output slots (a frontend that died, or its
                # restart, which never heard of these requests): give them back now
                for res in msg.results if type(msg) is InferResults else (msg,):
                    for t in getattr(res, "outputs", ()):
                        if t.shm is not None:
                            self.arena.free(t.shm)
                        elif t.cuda is not None:
                            self.device_arena.free(t.cuda)

    def tell(self, msg, payloads=()) -> None:
        """To the scheduler. If it has gone, we are about to die with it (parent-death signal);
        if it has not read for packets.SEND_TIMEOUT_S, it is stuck: nothing to do but say so."""
        try:
            with self.tell_lock:
                self.scheduler.send(msg, payloads)
        except (packets.PeerGone, packets.PeerStalled) as e:
            log.warning("could not send the scheduler a %s: %s", type(msg).__name__, e)

    def bls_client(self):
        bls = self.bls
        if bls is not None:         # every BLS call asks: no import statement on the way
            return bls
        # imported on first use: BLS reuses the frontend's request checks, which a worker
        # that never makes a BLS request should not pay for in memory
        from shmserve.workers.python_backend.bls import BlsClient
        with self.bls_lock:
            if self.bls is None:
                self.bls = BlsClient(self)
            return self.bls

    def model_control(self):
        from shmserve.workers.python_backend.model_control import ModelControl
        return ModelControl(self.bls_client, self.args.model_upload_dir,
                            self.args.model_upload_max_bytes)

    def chain(self) -> list[str]:
        """A BLS request's chain: the running batch's (from execute()), then this model."""
        own = self.running_chain if threading.get_ident() == self.main_thread else []
        return [m for m in own if m != self.spec.model_name] + [self.spec.model_name]

    def load(self) -> bool:
        try:
            if self.spec.auto_complete and self.spec.backend == "onnxruntime":
                self.spec.config_json = autocomplete.complete(
                    self.spec.config_json, self.spec.backend, self.spec.model_dir,
                    self.spec.version, self.spec.default_max_batch_size)
            self.backend = load_backend(self.spec, self.poll_cancelled, self.report_response)
            self.device_inputs = bool(getattr(self.backend, "device_inputs", False))
            self.senders = bool(getattr(self.backend, "emits", False))
            self.use_config(self.spec.config_json)
            config = json.loads(self.spec.config_json)
            self.answers.labels = model_files.read_labels(config, self.spec.model_dir)
            self.sequence = sequence.from_config(config, self.spec.model_dir)
            warmup.run_warmup(self.backend, self.spec.config_json, self.spec.model_dir)
        except Exception as e:
            reason = str(e) or type(e).__name__
            log.error("loading %s failed: %s", self.spec.instance_name, reason)
            if logs.current().verbose:
                traceback.print_exc()
            self.write_last_words(reason)
            self.tell(WorkerLoadFailed(self.args.spawn_id, reason))
            return False
        completed = self.spec.config_json if self.spec.auto_complete else ""
        # before WorkerReady, on the same socket: a client that sees the model ready finds the
        # families initialize() created on /metrics
        self.send_metrics()
        freeze_startup_heap()       # the model's objects too
        asks_model = getattr(self.backend, "ready_check", None) is not None
        self.tell(WorkerReady(self.args.spawn_id, os.getpid(), self.inbox.address,
                                        completed, asks_model))
        return True

    def write_last_words(self, reason: str) -> None:
        """The reason also goes to a file the scheduler reads when it sees us exit: our exit
        can reach it before the message does (they travel different ways)."""
        if not self.args_path:
            return
        try:
            with open(failure_path(self.args_path), "w", encoding="utf-8") as f:
                f.write(reason)
        except OSError:
            pass

    def run(self, stop: StopFlag) -> None:
        # One socket: a blocking receive wakes straight into the message, which is cheaper than
        # a poll followed by a non-blocking receive (bench/zmq_options.py). A stop signal ends
        # the receive with a Wake (InboxWaker).
        inbox, backlog, registry = self.inbox, self.backlog, pb_metrics.REGISTRY
        waiting = self.waiting
        armed = None
        while not stop.set:
            if backlog:
                msg, frames = backlog.popleft()
            else:
                # metrics waiting for the rate limit need a wake-up; otherwise nothing is due
                ms = _METRICS_WAIT_MS if registry.dirty else IDLE_TIMEOUT_MS
                seqs = self.sequence_lease
                if seqs is not None and seqs.seqs.waiting():   # a batch delay, a backlog
                    ms = min(ms, seqs.seqs.wait_ms())
                if ms != armed:
                    inbox.set_timeout(ms)
                    armed = ms
                waiting.before_wait()
                try:
                    msg, frames = inbox.recv()
                except zmq.Again:
                    waiting.after_wait()
                    if seqs is not None and seqs.seqs.waiting():
                        seqs.run()
                    self.send_metrics()
                    # idle: give back arena chunks nothing has used for a while, and mappings
                    # of segments their owner unlinked (they pin its pages in /dev/shm)
                    with self.out_lock:
                        self.arena.trim()
                    self.maps.sweep()
                    continue
                waiting.after_wait()
            kind = type(msg)
            if kind is LeasedExecute:
                waiting.hint(msg.cpu)
                self.leased(msg, frames)
            elif kind is ExecuteBatch:
                waiting.hint(-1)        # from the scheduler: requests are queueing
                self.execute(msg, frames)
            elif kind is ChainExecute:
                waiting.hint(msg.cpu)
                self.chains.run(msg, frames)
            elif kind is Shutdown:
                break
            else:
                handler = self.handlers.get(kind)
                if handler is None:
                    log.warning("ignoring an unexpected %s", kind.__name__)
                else:
                    handler(msg)
            if registry.dirty:
                self.send_metrics()
        # told to stop, or a stop signal: what the inbox holds goes back, nothing comes after
        self.bounce_leased()

    def leased(self, msg: LeasedExecute, frames) -> None:
        """A request its frontend sent straight to us under a lease; after the lease was
        revoked it goes back to the frontend unrun, which submits it to the scheduler."""
        head = msg.head
        if msg.lease_id <= self.revoked_upto:
            self.answer(head.frontend, LeaseBounced(self.args.spawn_id, head.req_id))
            return
        if self.sequence_lease is not None:
            self.sequence_lease.leased(msg, frames)
            return
        batch = [(msg, frames)]
        if self.lease_batcher.limit:    # requests behind it in the inbox may join it
            batch = self.lease_batcher.gather(msg, frames, self.inbox, self.backlog,
                                              self.revoked_upto)
        heads = [m.head for m, _ in batch]
        self.execute(ExecuteBatch(0, [RequestRoute(h.req_id, h.frontend, h.trace) for h in heads]),
                     [f for _, fs in batch for f in fs], heads)

    def revoke_lease(self, msg: RevokeLease) -> None:
        self.end_lease(msg.lease_id)

    def end_lease(self, lease_id: int) -> None:
        """Revoked, or given up (workers/leases/sequences.py): everything accepted under the
        lease ran before this (one loop), but a sequence model's requests still queued, which
        go back to their frontend."""
        self.revoked_upto = max(self.revoked_upto, lease_id)
        seqs = self.sequence_lease
        # (the sequences of a later lease stay: a revoke of one this worker gave up already)
        live = seqs.end() if seqs is not None and seqs.seqs.lease_id <= lease_id else None
        self.tell(LeaseEnded(self.args.spawn_id, lease_id, live))

    def lend_sequences(self, msg: LendSequences) -> None:
        if self.sequence_lease is not None:
            self.sequence_lease.lend(msg)

    def bounce_leased(self) -> None:
        """Stopping: leased requests already in the inbox go back to their frontends, and those
        that come later fail at their sender (the inbox refuses them), which sends them to the
        scheduler: each request this worker was sent was run, or handed back, or never taken,
        so a frontend need not guess after it exits (LeaseLost.clean)."""
        self.inbox.refuse_new()
        self.revoked_upto = STOPPING
        if self.sequence_lease is not None:
            self.sequence_lease.end()
        inbox = self.inbox
        while self.backlog or inbox.has_message():
            try:
                msg, frames = self.backlog.popleft() if self.backlog else inbox.recv(channel.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, LeasedExecute):
                self.leased(msg, frames)
            elif isinstance(msg, ChainExecute):
                self.chains.bounce(msg)

    def release_outputs(self, msg: ReleaseOutputs) -> None:
        with self.out_lock:
            for ref in msg.refs:
                self.arena.free(ref)
            for dref in msg.device:
                self.device_arena.free(dref)

    def cancel(self, msg: CancelRequest) -> None:
        if self.sequence_lease is not None:
            self.sequence_lease.cancel(msg.frontend, msg.req_id)
        self.cancel_stream(msg)
        self.chains.cancel((msg.frontend, msg.req_id))

    def cancel_stream(self, msg: CancelRequest) -> None:
        """The client of a request still being answered through its response sender left:
        sender.is_cancelled() and request.is_cancelled() turn true (late ones are dropped)."""
        key = (msg.frontend, msg.req_id)
        if key in self.streams:
            self.stream_cancelled.add(key)

    def emit(self, key: tuple[int, int], resp, final: bool) -> None:
        """A response sent through a request's response sender, from execute() or a thread the
        model started: on its way to the client at once. ``resp`` None: FINAL alone."""
        with self.out_lock:
            record = self.streams.get(key)
            if record is None:
                return                  # already answered (an error ended it)
            route, targets, top, device = record
            if resp is None:
                res = InferResult(route.req_id, self.spec.model_name, self.spec.version,
                                  no_response=True)
            else:
                res = self.answers.result(route.req_id, resp, targets, top, device)
                if not self.decoupled:
                    # a model that is not decoupled answers once: its first response is the
                    # answer, and any later one finds the stream closed (as Triton keeps the
                    # first and drops the rest)
                    final = True
            res.final = final
            if self.decoupled:
                # the frontend ends the stream if this worker dies, and sends cancels here
                res.spawn_id, res.worker = self.args.spawn_id, self.inbox.address
            if final:
                del self.streams[key]
                self.stream_cancelled.discard(key)
                self.responses_reported.pop(key, None)
        if self.chains.live and self.chains.answered(key, res):
            return
        self.answer(route.frontend, res)

    def report_response(self, key: tuple[int, int], kind: str, start_ns: int,
                        output_start_ns: int, end_ns: int) -> None:
        """A backend's account of a response of a stream (Triton's response statistics),
        after it was sent; counted by the scheduler at the stream's next index."""
        with self.out_lock:
            if key not in self.streams:
                return
            index = self.responses_reported.get(key, 0)
            self.responses_reported[key] = index + 1
        self.tell(ResponseReport(self.args.spawn_id, index, kind, start_ns, output_start_ns,
                                 end_ns))

    def log_settings(self, msg: SetLogSettings) -> None:
        """The logging extension changed them (pb_utils.Logger obeys them too)."""
        logs.apply(msg.settings)

    def forget(self, msg: ForgetSegments) -> None:
        for name in msg.segments:
            self.maps.forget(name)
        self.cuda_handles.forget(msg.cuda_handles)

    def check_readiness(self, msg: CheckReadiness) -> None:
        model_ready = getattr(self.backend, "ready_check", None)
        if model_ready is None:     # a model that does not decide it is ready once loaded
            self.tell(ReadinessReport(self.args.spawn_id, msg.check, True))
        else:
            self.readiness.check(msg.check, model_ready)

    def pong(self, msg: Ping) -> None:
        self.tell(Pong(self.args.spawn_id, msg.seq))

    def send_metrics(self) -> None:
        """Ship the custom metrics if they changed, at most once per METRICS_INTERVAL_S."""
        now = time.monotonic()
        if now < self.metrics_due:
            return
        families = pb_metrics.snapshot_if_dirty()
        if families is not None:
            self.tell(CustomMetrics(self.args.spawn_id, families))
            self.metrics_due = now + METRICS_INTERVAL_S

    def poll_cancelled(self, key: tuple[int, int]) -> bool:
        """request.is_cancelled(): read what has arrived without blocking, note CancelRequests
        for the running batch, keep everything else for the loop. No thread is needed, and the
        cost falls only on models that ask.

        The scheduler sends a worker one batch at a time, so a CancelRequest for anything but
        the running batch is late (its request has finished) and is dropped; ``cancelled``
        holds keys of the running batch only and is cleared after it.

        Only the main thread touches the inbox (it keeps no locks, and after
        execute() returns the loop owns it again); a model's own threads see what it recorded."""
        if key in self.stream_cancelled:
            return True
        if self.running is None:
            return False
        if threading.get_ident() != self.main_thread:
            return key in self.cancelled
        inbox = self.inbox
        while inbox.has_message():
            try:
                msg, frames = inbox.recv(channel.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, CancelRequest):
                routes = self.running
                if routes and any(r.req_id == msg.req_id and r.frontend == msg.frontend
                                  for r in routes):
                    self.cancelled.add((msg.frontend, msg.req_id))
                self.cancel(msg)    # a request that goes on streaming past execute(), or a chain
            else:
                self.backlog.append((msg, frames))
        return key in self.cancelled

    def execute(self, batch: ExecuteBatch, frames, leased: list | None = None) -> None:
        routes = batch.routes
        if routes:
            self.record.running(len(routes), routes[0].frontend, routes[0].req_id)
        try:
            self.execute_batch(batch, frames, leased)
        finally:
            self.record.idle()

    def execute_batch(self, batch: ExecuteBatch, frames, leased: list | None) -> None:
        clock = time.monotonic_ns
        t0 = clock()
        work, ready, targets, classes, devices = [], [], [], [], []
        chains: list[str] = []
        traced: list[int] = []
        results: list[InferResult | None] = [None] * len(batch.routes)
        for i, frame in enumerate(frames):
            try:
                p = frame if type(frame) is InferPayload else decode_payload(frame)
                inputs, types = {}, {}
                for t in p.inputs:
                    arr = tensors.to_numpy(t, self.maps) if t.cuda is None else \
                        cuda_ipc.input_tensor(t, self.cuda_handles, self.device_inputs)
                    inputs[t.name] = self.answers.reshapes.model_input(t.name, arr)
                    types[t.name] = t.datatype
                route = batch.routes[i]
                key = (route.frontend, route.req_id)
                if route.trace:
                    traced.append(i)
                if p.chain:
                    chains.extend(m for m in p.chain if m not in chains)
                # (one pass over the outputs: most requests have one, wanted as it is)
                target, top, wanted = {}, {}, []
                device: frozenset = _NONE
                for o in p.outputs:
                    wanted.append(o.name)
                    if o.shm is not None or o.cuda is not None:
                        target[o.name] = o.shm or o.cuda
                    if o.classification:
                        top[o.name] = (o.classification, o.labels)
                    if o.device:
                        device = device | {o.name}
                if self.sequence is not None:   # control inputs, implicit state
                    wanted = self.sequence.prepare(p.correlation_id, p.flags, inputs, types, wanted)
                emit = None
                if self.senders:
                    self.streams[key] = (route, target, top, device)
                    emit = partial(self.emit, key)
                work.append(WorkRequest(inputs, types, wanted, p.request_id,
                                        p.parameters, p.correlation_id, p.flags, key, emit,
                                        device))
                ready.append(i)
                targets.append(target)
                classes.append(top)
                devices.append(device)
            except sequence.SequenceRequestError as e:
                results[i] = self.answers.error(batch.routes[i].req_id, str(e), ErrorCode.INVALID_ARG)
            except (ShmError, CudaError, ValueError, msgspec.DecodeError) as e:
                results[i] = self.answers.error(batch.routes[i].req_id, f"invalid request tensors: {e}",
                                        ErrorCode.INVALID_ARG)
        t1 = t2 = clock()
        if work:
            self.running = batch.routes
            self.running_chain = chains
            try:
                responses = self.backend.execute(work)
                t2 = clock()
            except Exception as e:  # a backend bug must fail the batch, not the worker
                log.exception("execute failed")
                responses = None
                for i in ready:
                    results[i] = self.answers.error(batch.routes[i].req_id, f"execute failed: {e}",
                                            ErrorCode.INTERNAL)
            finally:
                self.running = None
                self.running_chain = []
                if self.cancelled:
                    self.cancelled.clear()
            if self.sequence is not None:   # new states kept, ended ones dropped
                self.sequence.finish(work, responses)
            if responses is None:
                t2 = clock()
                for i in ready:
                    self.end_stream(batch.routes[i])
            else:
                with self.out_lock:
                    for i, resp, target, top, device in zip(ready, responses, targets, classes,
                                                            devices):
                        if resp is None:
                            continue        # answered through its response sender
                        self.end_stream(batch.routes[i])
                        results[i] = self.answers.result(batch.routes[i].req_id, resp, target, top,
                                                 device)
        t3 = clock()
        for i in traced:
            traced_result = results[i]
            if traced_result is not None:
                traced_result.compute_ns = [t0, t1, t2, t3]
        if leased is not None:
            # their statistics ride with the answers; the frontend passes them on in bulk. The
            # first record counts the execution (the inferences of the requests that did not
            # fail, or of all if all failed), the others only their requests. (A request a
            # response sender answered has no result here: its answer has gone already.)
            executed = sum(h.batch_size for h, r in zip(leased, results)
                           if r is not None and not r.error) or \
                sum(h.batch_size for h in leased)
            calls: list = self.bls.take_done() if self.bls is not None and self.bls.done else []
            for head, res in zip(leased, results):
                if res is not None:
                    res.done = LeasedRecord(self.args.spawn_id, head.model, head.version,
                                            head.batch_size, head.received_ns, t3, t1 - t0,
                                            t2 - t1, t3 - t2, bool(res.error), executed)
                    executed = 0
                    if calls:       # the BLS calls the execution made under leases
                        res.steps, calls = calls, []
            if calls and self.bls is not None:
                self.bls.flush_done()
            self.answer_all(batch.routes, results)
            return
        failed = [i for i, res in enumerate(results) if res is not None and res.error]
        by_frontend, steps = self.group_answers(batch.routes, results)
        # the scheduler hears of the execution before any frontend has its answer: it reads
        # workers' messages first, so a statistics query sent after an answer counts it
        self.tell(BatchDone(self.args.spawn_id, batch.batch_id, failed,
                            t1 - t0, t2 - t1, t3 - t2, answers=steps))
        self.send_answers(by_frontend)

    def answer_all(self, routes: list[RequestRoute],
                   results: list[InferResult | None]) -> list[InferResult]:
        """The answers of one execution, sent; an ensemble's steps are returned instead."""
        by_frontend, steps = self.group_answers(routes, results)
        self.send_answers(by_frontend)
        return steps

    def group_answers(self, routes: list[RequestRoute], results: list[InferResult | None]
                      ) -> tuple[dict[int, list[InferResult]], list[InferResult]]:
        """The answers of one execution by frontend, to go one message per frontend (one
        wake-up of it for the whole batch), and an ensemble's steps, which ride in the BatchDone
        (one message, one wake-up of the scheduler, which runs the ensemble)."""
        by_frontend: dict[int, list[InferResult]] = {}
        chains = self.chains
        for route, res in zip(routes, results):
            if res is not None:
                if chains.live and chains.answered((route.frontend, route.req_id), res):
                    continue        # a step of an ensemble run worker to worker
                by_frontend.setdefault(route.frontend, []).append(res)
        return by_frontend, by_frontend.pop(ENSEMBLE_FRONTEND, [])

    def send_answers(self, by_frontend: dict[int, list[InferResult]]) -> None:
        for fid, answers in by_frontend.items():
            self.answer(fid, answers[0] if len(answers) == 1 else InferResults(answers))

    def end_stream(self, route: RequestRoute) -> None:
        """The request's answer comes from execute()'s return: its sender can send no more."""
        if self.streams:
            key = (route.frontend, route.req_id)
            self.streams.pop(key, None)
            self.stream_cancelled.discard(key)
            self.responses_reported.pop(key, None)

    def close(self, waker: PacketWaker | None = None) -> None:
        if self.backend is not None:
            try:
                self.backend.finalize()
            except Exception:
                log.exception("finalize failed")
        if self.bls is not None:
            self.bls.close()
        self.chains.close()
        self.arena.close()
        self.maps.close()
        self.record.close()
        self.cuda_handles.close()
        self.device_arena.close()
        # give queued messages (a load failure, the last BatchDone) a moment to leave
        self.inbox.close()
        if waker is not None:
            waker.close()           # every socket must be closed before the context ends
        self.scheduler.close()      # packets: what was sent is in the scheduler's socket
        for box in self.frontends.values():
            box.close()             # packets: what was sent is in the frontend's socket already
        channel.term_context()
