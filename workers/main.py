"""Worker process shell: one model instance. Loads the backend, then executes batches until told
to stop or until its parent (the scheduler) dies.

    python -m shmserve.workers.main '<json WorkerArgs>'
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from shmserve.ipc import channel
from shmserve.ipc.messages import (BatchDone, ErrorCode, ExecuteBatch, ForgetSegments, InferResult,
                                   InferResults,
                                   Ping, Pong, ReleaseOutputs,
                                   Shutdown, WorkerArgs, WorkerLoadFailed, WorkerReady,
                                   decode_payload)
from shmserve.ipc.proc import StopFlag, die_with_parent
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache

from . import autocomplete, tensors, warmup
from .backend import WorkRequest, load_backend

log = logging.getLogger("shmserve.worker")


class Worker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        self.inbox = channel.Inbox(channel.address(args.run_dir, f"w{args.instance}"))
        self.scheduler = channel.Outbox(args.scheduler)
        self.frontends: dict[int, channel.Outbox] = {}
        self.arena = ShmArena(args.segment_prefix)
        self.maps = ShmMapCache()
        self.spec = args.spec
        self.reshapes = tensors.Reshapes(json.loads(args.spec.config_json))
        self.backend = None

    def frontend(self, fid: int) -> channel.Outbox:
        box = self.frontends.get(fid)
        if box is None:
            box = self.frontends[fid] = channel.Outbox(
                channel.address(self.args.run_dir, f"frontend-{fid}"))
        return box

    def load(self) -> bool:
        try:
            if self.spec.auto_complete and self.spec.backend == "onnxruntime":
                self.spec.config_json = autocomplete.complete(
                    self.spec.config_json, self.spec.backend, self.spec.model_dir,
                    self.spec.version)
            self.backend = load_backend(self.spec)
            self.reshapes = tensors.Reshapes(json.loads(self.spec.config_json))
            warmup.run_warmup(self.backend, self.spec.config_json, self.spec.model_dir)
        except Exception as e:
            reason = str(e) or type(e).__name__
            log.error("loading %s failed: %s", self.spec.instance_name, reason)
            if self.args.log_verbose:
                traceback.print_exc()
            self.scheduler.send(WorkerLoadFailed(self.args.instance, reason))
            return False
        completed = self.spec.config_json if self.spec.auto_complete else ""
        self.scheduler.send(WorkerReady(self.args.instance, os.getpid(), self.inbox.address,
                                        completed))
        return True

    def run(self, stop: StopFlag) -> None:
        # One socket: a blocking receive wakes straight into the message, which is cheaper than
        # a poll followed by a non-blocking receive (bench/zmq_options.py).
        self.inbox.set_timeout(1000)
        while not stop.set:
            try:
                msg, frames = self.inbox.recv()
            except zmq.Again:
                continue
            if isinstance(msg, ExecuteBatch):
                self.execute(msg, frames)
            elif isinstance(msg, ReleaseOutputs):
                for ref in msg.refs:
                    self.arena.free(ref)
            elif isinstance(msg, ForgetSegments):
                for name in msg.segments:
                    self.maps.forget(name)
            elif isinstance(msg, Ping):
                self.scheduler.send(Pong(self.args.instance, msg.seq))
            elif isinstance(msg, Shutdown):
                return

    def execute(self, batch: ExecuteBatch, frames) -> None:
        clock = time.monotonic_ns
        t0 = clock()
        work, ready, targets = [], [], []
        results: list[InferResult | None] = [None] * len(batch.routes)
        for i, frame in enumerate(frames):
            try:
                p = decode_payload(frame)
                inputs, types = {}, {}
                for t in p.inputs:
                    inputs[t.name] = self.reshapes.model_input(t.name, tensors.to_numpy(t, self.maps))
                    types[t.name] = t.datatype
                work.append(WorkRequest(inputs, types, [o.name for o in p.outputs], p.request_id,
                                        p.parameters, p.correlation_id, p.flags))
                ready.append(i)
                targets.append({o.name: o.shm for o in p.outputs if o.shm is not None})
            except (ShmError, ValueError, msgspec.DecodeError) as e:
                results[i] = self.error(batch.routes[i].req_id, f"invalid request tensors: {e}",
                                        ErrorCode.INVALID_ARG)
        t1 = t2 = clock()
        if work:
            try:
                responses = self.backend.execute(work)
                t2 = clock()
            except Exception as e:  # a backend bug must fail the batch, not the worker
                log.exception("execute failed")
                responses = None
                for i in ready:
                    results[i] = self.error(batch.routes[i].req_id, f"execute failed: {e}",
                                            ErrorCode.INTERNAL)
            if responses is None:
                t2 = clock()
            else:
                for i, resp, target in zip(ready, responses, targets):
                    results[i] = self.result(batch.routes[i].req_id, resp, target)
        t3 = clock()
        failed = []
        by_frontend: dict[int, list[InferResult]] = {}
        for i, (route, res) in enumerate(zip(batch.routes, results)):
            if res.error:
                failed.append(i)
            by_frontend.setdefault(route.frontend, []).append(res)
        for fid, answers in by_frontend.items():
            self.frontend(fid).send(answers[0] if len(answers) == 1 else InferResults(answers))
        self.scheduler.send(BatchDone(self.args.instance, batch.batch_id, failed,
                                      t1 - t0, t2 - t1, t3 - t2))

    def error(self, req_id: int, message: str, code: str) -> InferResult:
        return InferResult(req_id, self.spec.model_name, self.spec.version, error=message, code=code)

    def result(self, req_id: int, resp, targets: dict) -> InferResult:
        if resp.error:
            return self.error(req_id, resp.error, resp.code or ErrorCode.INTERNAL)
        outs, uses_shm = [], False
        try:
            for name, datatype, arr in resp.outputs:
                arr = self.reshapes.client_output(name, arr)
                target = targets.get(name)
                if target is not None:
                    outs.append(tensors.into_region(name, datatype, arr, target, self.maps))
                    continue
                t = tensors.from_numpy(name, datatype, arr, self.arena)
                uses_shm |= t.shm is not None
                outs.append(t)
        except tensors.OutputTooLarge as e:
            self.free_outputs(outs, targets)
            return self.error(req_id, str(e), ErrorCode.INVALID_ARG)
        except (ShmError, ValueError, TypeError) as e:
            self.free_outputs(outs, targets)
            return self.error(req_id, f"failed to return outputs: {e}", ErrorCode.INTERNAL)
        return InferResult(req_id, self.spec.model_name, self.spec.version, outs,
                           worker=self.inbox.address if uses_shm else "",
                           parameters=resp.parameters)

    def free_outputs(self, outs, targets: dict) -> None:
        for t in outs:
            if t.shm is not None and t.name not in targets:
                self.arena.free(t.shm)

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.finalize()
            except Exception:
                log.exception("finalize failed")
        self.arena.close()
        self.maps.close()
        # give queued messages (a load failure, the last BatchDone) a moment to leave
        self.inbox.close()
        for box in [self.scheduler, *self.frontends.values()]:
            box.socket.close(linger=2000)
        channel.context().term()


def main() -> None:
    args = msgspec.json.decode(sys.argv[1].encode(), type=WorkerArgs)
    die_with_parent(args.parent)
    logging.basicConfig(level=logging.DEBUG if args.log_verbose else logging.INFO,
                        format=f"%(asctime)s worker {args.spec.instance_name} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C; we obey Shutdown
    stop = StopFlag(signals=(signal.SIGTERM,))
    worker = Worker(args)
    try:
        if worker.load():
            worker.run(stop)
    finally:
        worker.close()
    os._exit(0)


if __name__ == "__main__":
    main()
