"""A fake port and a fake clock for driving ``SchedulerCore`` in-process: no sockets, no
processes, no sleeping. Everything the core does to the world lands in lists the tests read."""
from __future__ import annotations

import os

from shmserve.engine.core import SchedulerCore
from shmserve.ipc.messages import decode_payload, encode
from shmserve.ipc.messages.common import (
    ENSEMBLE_FRONTEND,
    ErrorCode,
    InferPayload,
    OutputSpec,
    ShmRef,
    Tensor,
)
from shmserve.ipc.messages.to_frontend import ControlReply, InferResult, InferResults, ModelTable
from shmserve.ipc.messages.to_scheduler import (
    BatchDone,
    FrontendHello,
    Pong,
    SubmitRequest,
    WorkerLoadFailed,
    WorkerReady,
)
from shmserve.ipc.messages.to_worker import ExecuteBatch, Ping
from shmserve.ipc.spawn_args import ServerSettings

FRONTEND = 0


class FakeClock:
    """Monotonic nanoseconds that move only when a test says so."""

    def __init__(self, start_s: float = 1000.0):
        self.ns = int(start_s * 1e9)

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


class FakePort:
    def __init__(self):
        self.frontend_addresses: dict[int, str] = {}
        self.to_frontend: list[tuple[int, object]] = []
        self.to_worker: list[tuple[int, object, list]] = []
        self.spawned: dict[int, object] = {}        # spawn id -> InstanceSpec
        self.connected: dict[int, str] = {}
        self.killed: list[int] = []
        self.reaped: list[int] = []
        self.unlinked: list[int] = []
        self.exit_codes: dict[int, int] = {}        # what reap() reports, per spawn id
        self.stopped_workers: set[int] = set()      # spawn ids whose process is stopped
        self.failures: dict[int, str] = {}          # last words of workers that failed to load
        self.log_settings = None                    # what apply_log_settings was given last
        self.memory_bytes: dict[int, int] = {}      # what memory() reports, per spawn id
        # what last_execution() reports (a leased worker's record), per spawn id
        self.executions: dict[int, tuple[int, int, int]] = {}

    def connect_frontend(self, frontend, address):
        self.frontend_addresses[frontend] = address

    def send_frontend(self, frontend, msg):
        if frontend in self.frontend_addresses:
            self.to_frontend.append((frontend, msg))

    def connect_worker(self, spawn_id, address):
        self.connected[spawn_id] = address

    def send_worker(self, spawn_id, msg, payloads=()):
        assert spawn_id in self.connected, f"sent {msg!r} to worker {spawn_id} before it connected"
        self.to_worker.append((spawn_id, msg, list(payloads)))

    def spawn(self, spawn_id, spec):
        assert spawn_id not in self.spawned, "spawn ids are never reused"
        self.spawned[spawn_id] = spec

    def kill(self, spawn_id):
        self.killed.append(spawn_id)

    def stopped(self, spawn_id):
        return spawn_id in self.stopped_workers

    def last_words(self, spawn_id):
        return self.failures.pop(spawn_id, "")

    def last_execution(self, spawn_id):
        return self.executions.pop(spawn_id, (0, 0, 0))

    def reap(self, spawn_id):
        self.reaped.append(spawn_id)
        self.connected.pop(spawn_id, None)
        return self.exit_codes.get(spawn_id, -9 if spawn_id in self.killed else 0)

    def unlink(self, spawn_id):
        self.unlinked.append(spawn_id)

    def memory(self, spawn_id):
        if spawn_id in self.reaped:
            return None
        return self.memory_bytes.get(spawn_id)

    def apply_log_settings(self, settings):
        self.log_settings = settings


def write_model(repo: str, name: str, config: str, versions=(1,)) -> None:
    os.makedirs(os.path.join(repo, name), exist_ok=True)
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\nbackend: "python"\n{config}\n')
    for v in versions:
        os.makedirs(os.path.join(repo, name, str(v)), exist_ok=True)
        with open(os.path.join(repo, name, str(v), "model.py"), "w") as f:
            f.write("class TritonPythonModel:\n    pass\n")


def write_ensemble(repo: str, name: str, steps, inputs=("IN",), outputs=("OUT",),
                   extra: str = "max_batch_size: 8", versions=(1,)) -> None:
    """An ensemble of FP32 [4] tensors; ``steps``: (model, {its input: tensor},
    {its output: tensor}) each."""
    io = "".join(f'input {{ name: "{t}" data_type: TYPE_FP32 dims: [ 4 ] }}\n' for t in inputs)
    io += "".join(f'output {{ name: "{t}" data_type: TYPE_FP32 dims: [ 4 ] }}\n' for t in outputs)
    body = ""
    for model, ins, outs in steps:
        body += f'  step {{ model_name: "{model}" model_version: -1\n'
        body += "".join(f'    input_map {{ key: "{k}" value: "{v}" }}\n' for k, v in ins.items())
        body += "".join(f'    output_map {{ key: "{k}" value: "{v}" }}\n' for k, v in outs.items())
        body += "  }\n"
    os.makedirs(os.path.join(repo, name), exist_ok=True)
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\nplatform: "ensemble"\n{extra}\n{io}'
                f'ensemble_scheduling {{\n{body}}}\n')
    for v in versions:
        os.makedirs(os.path.join(repo, name, str(v)), exist_ok=True)


def tensor_payload(inputs: dict, outputs=("OUT",), **kw) -> bytes:
    """An encoded InferPayload: ``inputs`` name -> ShmRef (in shared memory) or bytes (inline),
    FP32 [1, 4] each; ``outputs``: names, or OutputSpecs."""
    ins = [Tensor(n, "FP32", [1, 4], None, v) if isinstance(v, ShmRef) else
           Tensor(n, "FP32", [1, 4], v) for n, v in inputs.items()]
    outs = [o if isinstance(o, OutputSpec) else OutputSpec(o) for o in outputs]
    return encode(InferPayload(kw.pop("request_id", ""), ins, outs, **kw))


IO = '''input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]'''
ONE = 'instance_group [ { count: 1 kind: KIND_CPU } ]'
TWO = 'instance_group [ { count: 2 kind: KIND_CPU } ]'


class Harness:
    """A core on a fake port and clock, with the moves a test makes in one line each."""

    def __init__(self, repo: str, **settings):
        self.clock = FakeClock()
        self.port = FakePort()
        # the scheduler path unless a test asks for leases (tests/engine/test_lease_book.py)
        settings.setdefault("instance_leases", False)
        self.settings = ServerSettings(model_repositories=[repo], run_dir="", segment_prefix="",
                                       launcher_pid=0, **settings)
        self.core = SchedulerCore(self.settings, self.port, clock=self.clock)
        self.next_req = 0
        self.mute: set[int] = set()     # workers that do not answer pings
        self.pinged = 0                 # how many of port.to_worker were looked at for pings
        self.slot = 0                   # output slots handed out by answer() and respond()

    # ---- moves -----------------------------------------------------------------------------------
    def start(self, ready: bool = True) -> "Harness":
        self.core.start()
        self.core.handle(FrontendHello(FRONTEND, "inproc://frontend"))
        if ready:
            self.ready_all()
        return self

    def ready(self, sid: int, config_json: str = "") -> None:
        self.core.handle(WorkerReady(sid, 1000 + sid, self.address(sid), config_json))

    def ready_all(self) -> None:
        for sid in self.waiting():
            self.ready(sid)

    def load_failed(self, sid: int, reason: str) -> None:
        self.core.handle(WorkerLoadFailed(sid, reason))

    def submit(self, model: str, version: int = 1, **kw) -> int:
        """``payload``: the encoded InferPayload (an ensemble decodes it; tensor_payload)."""
        self.next_req += 1
        payload = kw.pop("payload", None) or f"payload-{self.next_req}".encode()
        self.core.handle(SubmitRequest(self.next_req, FRONTEND, model, version,
                                       kw.pop("batch_size", 1), self.clock(), **kw),
                         [payload])
        return self.next_req

    def submit_seq(self, model: str, cid: int | str, flags: int = 0, **kw) -> int:
        """A request of sequence ``cid``; ``flags``: SEQUENCE_START 1 | SEQUENCE_END 2."""
        return self.submit(model, sequence_id=cid, sequence_flags=flags, **kw)

    # ---- a worker answering the scheduler's own requests (an ensemble's steps) --------------
    @staticmethod
    def address(sid: int) -> str:
        """The inbox address ``ready`` gives worker ``sid``."""
        return f"inproc://w{sid}"

    def outputs_for(self, sid: int, frame: bytes) -> list[Tensor]:
        """What worker ``sid`` returns for a request: each asked output, FP32 [1, 4], in a slot
        of its own (or in the region the request names)."""
        out = []
        for o in decode_payload(frame).outputs:
            self.slot += 1
            out.append(Tensor(o.name, "FP32", [1, 4], None,
                              o.shm or ShmRef(f"w{sid}-out", self.slot * 64, 16)))
        return out

    def steps_of(self, sid: int) -> list[tuple[int, object]]:
        """(step request id, decoded payload) of the last batch worker ``sid`` got."""
        _, batch, payloads = self.batches(sid)[-1]
        return [(r.req_id, decode_payload(p)) for r, p in zip(batch.routes, payloads)
                if r.frontend == ENSEMBLE_FRONTEND]

    def answer(self, sid: int, error: str = "", times=(10, 20, 30)) -> list[InferResult]:
        """Worker ``sid`` finishes its batch as a worker does: one BatchDone with its times,
        which carries the answers of the scheduler's requests in it (an ensemble's steps)."""
        _, batch, payloads = self.batches(sid)[-1]
        model = self.port.spawned[sid].model_name
        sent, failed = [], []
        for i, (route, frame) in enumerate(zip(batch.routes, payloads)):
            if route.frontend != ENSEMBLE_FRONTEND:
                continue
            if error:
                res = InferResult(route.req_id, model, 1, error=error, code=ErrorCode.INTERNAL)
                failed.append(i)
            else:
                res = InferResult(route.req_id, model, 1, self.outputs_for(sid, frame),
                                  worker=self.address(sid))
            sent.append(res)
        self.core.handle(BatchDone(sid, batch.batch_id, failed, *times, answers=sent))
        return sent

    def respond(self, sid: int, req_id: int, final: bool = False,
                no_response: bool = False) -> InferResult:
        """A decoupled worker ``sid`` sends one response of the step ``req_id`` it runs (through
        its response sender: no ``done``; ``no_response``: the final flag alone)."""
        frame = next(p for _, b, ps in self.batches(sid) for r, p in zip(b.routes, ps)
                     if r.req_id == req_id and r.frontend == ENSEMBLE_FRONTEND)
        model = self.port.spawned[sid].model_name
        outs = [] if no_response else self.outputs_for(sid, frame)
        res = InferResult(req_id, model, 1, outs, worker=self.address(sid) if outs else "",
                          final=final, no_response=no_response, spawn_id=sid)
        self.core.handle(res)
        return res

    def finish(self, sid: int, failed=()) -> None:
        """The worker ``sid`` answers the batch it holds."""
        batch = self.last_batch(sid)
        self.core.handle(BatchDone(sid, batch.batch_id, list(failed), 10, 20, 30))

    def die(self, sid: int, rc: int = -11) -> None:
        self.port.exit_codes.setdefault(sid, rc)
        self.core.process_exited(sid)

    def kill_reported(self) -> None:
        """Every worker the core killed has exited."""
        for sid in list(self.port.killed):
            if sid not in self.port.reaped:
                self.core.process_exited(sid)

    def tick(self, seconds: float = 0.0) -> None:
        """Let time pass, then do what the shell's loop does after every wake-up."""
        self.clock.advance(seconds)
        self.core.batching_due()
        if self.clock() / 1e9 >= self.core.housekeeping_at:
            self.core.housekeeping()
        sent, self.pinged = self.port.to_worker[self.pinged:], len(self.port.to_worker)
        for sid, msg, _ in sent:
            if isinstance(msg, Ping) and sid not in self.mute and sid in self.port.connected:
                self.core.handle(Pong(sid, msg.seq))

    # ---- what the core did -------------------------------------------------------------------------
    def waiting(self) -> list[int]:
        """Spawned workers that have not said they are ready, nor exited."""
        return [sid for sid in self.port.spawned
                if sid not in self.port.connected and sid not in self.port.reaped]

    def batches(self, sid: int | None = None) -> list[tuple[int, ExecuteBatch, list]]:
        return [(s, m, p) for s, m, p in self.port.to_worker
                if isinstance(m, ExecuteBatch) and (sid is None or s == sid)]

    def last_batch(self, sid: int) -> ExecuteBatch:
        return self.batches(sid)[-1][1]

    def sent_to(self, sid: int) -> list[list[int]]:
        """The request ids of each batch worker ``sid`` got, in order."""
        return [[r.req_id for r in m.routes] for _, m, _ in self.batches(sid)]

    def to_worker(self, kind) -> list[tuple[int, object]]:
        return [(s, m) for s, m, _ in self.port.to_worker if isinstance(m, kind)]

    def results(self) -> dict[int, InferResult]:
        out = {}
        for _, m in self.port.to_frontend:
            for r in (m.results if isinstance(m, InferResults) else [m]):
                if isinstance(r, InferResult):
                    out[r.req_id] = r
        return out

    def answers(self, req_id: int) -> list[InferResult]:
        """Every answer the client's frontend got for ``req_id``, in order (a stream's too)."""
        out = []
        for _, m in self.port.to_frontend:
            for r in (m.results if isinstance(m, InferResults) else [m]):
                if isinstance(r, InferResult) and r.req_id == req_id:
                    out.append(r)
        return out

    def replies(self) -> list[ControlReply]:
        return [m for _, m in self.port.to_frontend if isinstance(m, ControlReply)]

    def table(self) -> ModelTable:
        return [m for _, m in self.port.to_frontend if isinstance(m, ModelTable)][-1]

    def states(self, model: str) -> dict[int, tuple]:
        for info in self.table().models:
            if info.name == model:
                return {v.version: (v.state, v.reason, v.cause) for v in info.versions}
        return {}

    def spawn_ids(self, model: str) -> list[int]:
        return [sid for sid, spec in self.port.spawned.items() if spec.model_name == model]
