"""Instance supervision: spawning workers, noticing deaths, restarts with backoff, crash loops,
pings to idle workers and kills of stuck ones (a batch past the execution timeout, a load past
the load timeout, a process the kernel reports stopped).

Pure: it acts through the port and reads the injected clock. It owns every instance's process
state; what a death means for the model version and for the requests the worker held is decided
by the core, from the ``Death`` it gets back.
"""
from __future__ import annotations

import enum
import logging
import signal
from dataclasses import dataclass
from typing import Callable, Iterable

from shmserve.engine.models import (
    CRASH_LOOP_DEATHS,
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    STOP_CHECK_INTERVAL_S,
    STOPPED_KILL_S,
    Instance,
    ModelVersion,
    restart_delay,
)
from shmserve.engine.port import SchedulerPort
from shmserve.engine.processes.supervision import describe_exit
from shmserve.engine.states import InstanceState, KillReason, ModelState
from shmserve.ipc.backend_catalog import BackendCatalog, BackendNotFound
from shmserve.ipc.messages.to_scheduler import Pong
from shmserve.ipc.messages.to_worker import Ping, Shutdown
from shmserve.ipc.spawn_args import InstanceSpec

log = logging.getLogger("shmserve.scheduler")


class Outcome(enum.Enum):
    """What a worker's death leads to."""
    STOPPED = "stopped"             # it was told to stop (or the server is stopping)
    LOAD_FAILED = "load_failed"     # it died while its version was loading
    NOT_SERVING = "not_serving"     # its version drains or failed: no restart
    RESTARTING = "restarting"       # restarts after its backoff
    CRASH_LOOP = "crash_loop"       # died too often in a row: the version must go


@dataclass
class Death:
    version: ModelVersion
    instance: Instance
    outcome: Outcome
    how: str                        # e.g. "exited unexpectedly (killed by SIGSEGV)"
    kill_reason: KillReason         # why we killed it, NONE if nobody did
    batch: list | None              # the requests it was executing
    load_error: str = ""            # what a worker that failed to load wrote before it exited
    # the one request it was executing, when it ended by itself while running that alone:
    # (frontend, request id), the likely poison (``culprit_of``); None otherwise
    culprit: tuple[int, int] | None = None
    # it was told to stop and exited 0: it ran or handed back everything it was sent, and
    # refused what came later (workers/worker.py bounce_leased)
    clean: bool = False


# Signals that come from outside the worker (the OOM killer, an operator, a container runtime):
# a death by one says nothing about the request it was running
OUTSIDE_SIGNALS = (-signal.SIGKILL, -signal.SIGTERM)


def culprit_of(reason: KillReason, rc: int | None, count: int, frontend: int,
               req_id: int) -> tuple[int, int] | None:
    """The request a worker's death is blamed on: the only one it was running, when the
    worker ended by itself (an exit, a crash signal such as SIGSEGV or SIGABRT), not when
    the scheduler or something outside killed it. A batch of several names none (each is
    retried alone, which finds the poison among them)."""
    if reason != KillReason.NONE or rc is None or rc in OUTSIDE_SIGNALS or count != 1:
        return None
    return frontend, req_id


class SpawnFailed(Exception):
    """The worker process could not be started at all (e.g. no memory, no process slots)."""


class InstanceSupervisor:
    def __init__(self, port: SchedulerPort, clock: Callable[[], int],
                 load_timeout_s: float = 0.0, default_max_batch_size: int = 4):
        self.port = port
        self.default_max_batch_size = default_max_batch_size
        self.clock = clock                  # monotonic ns
        self.load_timeout_s = load_timeout_s    # 0 = none; a worker not ready by then is killed
        self.next_stop_check = 0.0
        self.by_spawn: dict[int, tuple[ModelVersion, Instance]] = {}
        self.spawn_counter = 0
        self.backoff: set[tuple[ModelVersion, Instance]] = set()    # waiting to restart
        self.ping_counter = 0
        self.next_ping = 0.0
        self.stopping = False
        self.backends = BackendCatalog()    # the scheduler sets the repository's

    def now(self) -> float:
        return self.clock() / 1e9

    # ---- processes -------------------------------------------------------------------------------
    def _backend_source(self, backend: str) -> str:
        """Where a backend that is not built in is loaded from (the worker imports it)."""
        try:
            return self.backends.find(backend).source
        except BackendNotFound:     # gone since the config was checked: the worker says so
            return ""

    def spawn(self, ver: ModelVersion, inst: Instance) -> None:
        self.spawn_counter += 1
        sid = self.spawn_counter
        spec = InstanceSpec(ver.name, ver.version, ver.path, ver.config_json, inst.name, inst.kind,
                            inst.device_id, ver.config.backend, ver.auto_complete,
                            self.default_max_batch_size, ver.instances.index(inst),
                            self._backend_source(ver.config.backend))
        inst.spawn_id = sid
        inst.state = InstanceState.STARTING
        inst.connected = False
        inst.kill_reason, inst.exit_detail = KillReason.NONE, ""
        inst.ping_seq = 0
        inst.spawned_at, inst.stopped_since = self.now(), 0.0
        self.by_spawn[sid] = (ver, inst)
        try:
            self.port.spawn(sid, spec)
        except Exception as e:
            del self.by_spawn[sid]
            inst.state = InstanceState.STOPPED
            raise SpawnFailed(f"could not start the worker process of instance '{inst.name}': "
                              f"{type(e).__name__}: {e}") from e

    def find(self, spawn_id: int) -> tuple[ModelVersion, Instance] | None:
        return self.by_spawn.get(spawn_id)

    def connected(self, spawn_id: int, address: str) -> tuple[ModelVersion, Instance] | None:
        """A worker said it is ready; None when it is unknown or already being killed (its
        ready message crossed our kill: it must not get work)."""
        found = self.by_spawn.get(spawn_id)
        if found is None or found[1].kill_reason != KillReason.NONE:
            return None
        found[1].connected = True
        self.port.connect_worker(spawn_id, address)
        return found

    def kill(self, ver: ModelVersion, inst: Instance, reason: KillReason, detail: str) -> None:
        inst.kill_reason, inst.exit_detail = reason, detail
        log.error("instance %s of model '%s' %s", inst.name, ver.name, detail)
        self.port.kill(inst.spawn_id)

    def stop(self, ver: ModelVersion, kill: bool) -> None:
        """Stop every instance of ``ver``: connected ones finish their batch and exit, the
        others (or all, with ``kill``) are killed."""
        for inst in ver.instances:
            if inst.state == InstanceState.STOPPED:
                continue
            if inst.spawn_id in self.by_spawn:
                if inst.connected and not kill:
                    self.port.send_worker(inst.spawn_id, Shutdown())
                else:
                    inst.kill_reason = KillReason.LOAD_ABORTED
                    self.port.kill(inst.spawn_id)
            inst.state = InstanceState.STOPPED
            self.backoff.discard((ver, inst))

    def stop_all(self) -> list[int]:
        """Server shutdown: every worker finishes its batch and exits (those still loading are
        killed). Returns the spawn ids to wait for."""
        self.stopping = True
        for sid, (_, inst) in self.by_spawn.items():
            if inst.connected:
                self.port.send_worker(sid, Shutdown())
            else:
                self.port.kill(sid)
        return list(self.by_spawn)

    # ---- deaths -------------------------------------------------------------------------------------
    def exited(self, spawn_id: int) -> Death | None:
        found = self.by_spawn.pop(spawn_id, None)
        if found is None:
            return None                     # a stale report
        ver, inst = found
        last_words = self.port.last_words(spawn_id)
        count, frontend, req_id = self.port.last_execution(spawn_id)
        rc = self.port.reap(spawn_id)
        self.port.unlink(spawn_id)
        inst.connected = False
        ver.queue.instance_gone(inst)
        reason, detail = inst.kill_reason, inst.exit_detail
        inst.kill_reason, inst.exit_detail = KillReason.NONE, ""
        how = detail or f"exited unexpectedly ({describe_exit(rc)})"
        batch, inst.batch = inst.batch, None
        death = Death(ver, inst, Outcome.STOPPED, how, reason, batch)
        death.clean = rc == 0 and reason == KillReason.NONE and \
            (inst.state == InstanceState.STOPPED or self.stopping)
        # a leased worker's requests are known only to it and their frontend: its record
        executing = bool(batch) or count > 0
        if batch is not None and len(batch) == 1:
            count, frontend, req_id = 1, batch[0].frontend, batch[0].req_id
        death.culprit = culprit_of(reason, rc, count, frontend, req_id)
        if inst.state == InstanceState.STOPPED or self.stopping:
            inst.state = InstanceState.STOPPED
            return death
        if inst.state == InstanceState.STARTING and ver.state == ModelState.LOADING:
            inst.state = InstanceState.STOPPED
            death.outcome = Outcome.LOAD_FAILED
            death.load_error = last_words
            return death
        if ver.state != ModelState.READY:
            inst.state = InstanceState.STOPPED
            death.outcome = Outcome.NOT_SERVING
            return death
        now = self.now()
        # a death while running requests is theirs (or an outside kill's), never a crash
        # loop: else a client that keeps sending a poison request would take the model down
        # for everyone (the poison fails alone, see the core's requests_of_dead_worker). Only
        # deaths while idle or loading count, and grow the restart backoff.
        if not executing:
            inst.deaths_in_a_row += 1
            if inst.deaths_in_a_row >= CRASH_LOOP_DEATHS:
                inst.state = InstanceState.STOPPED
                death.outcome = Outcome.CRASH_LOOP
                return death
        inst.state = InstanceState.BACKOFF
        inst.restart_at = now + restart_delay(inst.deaths_in_a_row)
        self.backoff.add((ver, inst))
        log.warning("instance %s of model '%s' %s; restarting in %.1fs", inst.name, ver.name,
                    how, inst.restart_at - now)
        death.outcome = Outcome.RESTARTING
        return death

    # ---- timers ---------------------------------------------------------------------------------------
    def restart_due(self) -> float:
        """Restart instances whose backoff expired; seconds until the next one is due."""
        now = self.now()
        wait = 1.0
        for ver, inst in list(self.backoff):
            if ver.state != ModelState.READY or inst.state != InstanceState.BACKOFF:
                self.backoff.discard((ver, inst))
            elif inst.restart_at <= now:
                self.backoff.discard((ver, inst))
                try:
                    self.spawn(ver, inst)
                except SpawnFailed as e:         # try again later, as after a death
                    log.error("%s", e)
                    inst.deaths_in_a_row += 1
                    inst.state = InstanceState.BACKOFF
                    inst.restart_at = now + max(restart_delay(inst.deaths_in_a_row), 1.0)
                    self.backoff.add((ver, inst))
            else:
                wait = min(wait, inst.restart_at - now)
        return wait

    def ping_due(self, versions: Iterable[ModelVersion]) -> float:
        """Ping idle workers; kill one whose answer is overdue (stopped, deadlocked, swapped
        out). Busy ones are covered by the execution timeout instead."""
        now = self.now()
        if now < self.next_ping:
            return self.next_ping - now
        self.next_ping = now + PING_INTERVAL_S
        for ver in versions:
            for inst in ver.instances:
                if inst.state != InstanceState.IDLE or not inst.connected \
                        or inst.kill_reason != KillReason.NONE:
                    continue
                if inst.ping_seq:
                    if now - inst.ping_sent > PING_TIMEOUT_S:
                        self.kill(ver, inst, KillReason.PING_TIMEOUT,
                                  f"stopped answering pings for {now - inst.ping_sent:.0f} s "
                                  f"and was killed")
                    continue
                self.ping_counter += 1
                inst.ping_seq, inst.ping_sent = self.ping_counter, now
                self.port.send_worker(inst.spawn_id, Ping(inst.ping_seq))
        return PING_INTERVAL_S

    def pong(self, msg: Pong) -> None:
        found = self.by_spawn.get(msg.spawn_id)
        if found is not None and found[1].ping_seq == msg.seq:
            found[1].ping_seq = 0

    def hang_due(self, versions: Iterable[ModelVersion]) -> float:
        """Kill stuck workers: a batch past the execution timeout, a load past the load
        timeout, a process stopped for STOPPED_KILL_S. Seconds to the next check."""
        now = self.now()
        wait = min(self.load_due(now), self.stopped_due(now))
        for ver in versions:
            limit = ver.execution_timeout_s
            if limit <= 0:
                continue
            for inst in ver.instances:
                if inst.state != InstanceState.BUSY or inst.kill_reason != KillReason.NONE:
                    continue
                overdue = inst.busy_since + limit - now
                if overdue > 0:
                    wait = min(wait, overdue)
                    continue
                self.kill(ver, inst, KillReason.EXECUTION_TIMEOUT,
                          f"exceeded the execution timeout of {limit:g} s and was killed")
        return wait

    def load_due(self, now: float) -> float:
        """Kill workers still loading (a hung initialize()) past the load timeout. The death
        that follows fails the load, or counts as a death in a row for a restart."""
        limit = self.load_timeout_s
        wait = 1.0
        if limit <= 0:
            return wait
        for ver, inst in self.by_spawn.values():
            if inst.state != InstanceState.STARTING or inst.kill_reason != KillReason.NONE:
                continue
            left = inst.spawned_at + limit - now
            if left > 0:
                wait = min(wait, left)
                continue
            self.kill(ver, inst, KillReason.LOAD_TIMEOUT,
                      f"did not become ready within {limit:g} s (initialize() hung?) and was "
                      f"killed")
        return wait

    def stopped_due(self, now: float) -> float:
        """Kill workers the port reports stopped for STOPPED_KILL_S, whatever they were doing;
        their requests get a retry like those of any other death."""
        if now < self.next_stop_check:
            return self.next_stop_check - now
        self.next_stop_check = now + STOP_CHECK_INTERVAL_S
        for sid, (ver, inst) in self.by_spawn.items():
            if inst.kill_reason != KillReason.NONE:
                continue
            if not self.port.stopped(sid):
                inst.stopped_since = 0.0
            elif not inst.stopped_since:
                inst.stopped_since = now
            elif now - inst.stopped_since >= STOPPED_KILL_S:
                self.kill(ver, inst, KillReason.STOPPED,
                          f"was stopped (SIGSTOP or a debugger) for "
                          f"{now - inst.stopped_since:.0f} s and was killed")
        return STOP_CHECK_INTERVAL_S
