"""Instance health (a mixin of the scheduler shell): worker deaths, restarts with backoff, hung
executions, and crash loops."""
from __future__ import annotations

import logging
import time

from shmserve.ipc import shm
from shmserve.ipc.messages import ErrorCode, Ping, Pong, ProcessExited

from .models import (BACKOFF_CAP_S, CRASH_LOOP_DEATHS, HEALTHY_AFTER_S, PING_INTERVAL_S,
                     PING_TIMEOUT_S, Instance, ModelVersion)
from .states import InstanceState, ModelState
from .supervision import describe_exit

log = logging.getLogger("shmserve.scheduler")


class InstanceHealth:
    def process_exited(self, msg: ProcessExited) -> None:
        found = self.by_spawn.get(msg.instance)
        if found is None:
            return                              # already handled (a stale report)
        proc = found[1].process
        if proc.popen.poll() is None:           # a reused pidfd number; see ExitWatcher.rearm
            self.exits.rearm(proc.pidfd)
            return
        self.worker_exited(msg.instance)

    def worker_exited(self, sid: int) -> None:
        ver, inst = self.by_spawn.pop(sid)
        proc = inst.process
        self.exits.unwatch(proc.pidfd)
        rc = proc.reap()
        proc.close()
        if inst.outbox is not None:
            inst.outbox.close()
            inst.outbox = None
        shm.unlink_prefixed(self.segment_prefix(sid))
        ver.scheduler.instance_gone(inst)
        how = inst.kill_reason or f"exited unexpectedly ({describe_exit(rc)})"
        inst.kill_reason = ""
        if inst.batch:
            self.requests_of_dead_worker(ver, inst, how)
        if inst.state == InstanceState.STOPPED or self.stopping:
            inst.state = InstanceState.STOPPED
            return
        if inst.state == InstanceState.STARTING and ver.state == ModelState.LOADING:
            inst.state = InstanceState.STOPPED
            self.version_failed(ver, f"worker process of instance '{inst.name}' {how} while "
                                     f"loading the model")
            return
        if ver.state != ModelState.READY:
            inst.state = InstanceState.STOPPED      # draining or failed: no restart
            self.drain_progress(ver)
            return
        now = time.monotonic()
        inst.deaths_in_a_row += 1
        if inst.deaths_in_a_row >= CRASH_LOOP_DEATHS:
            return self.crash_loop(ver, inst, how)
        if now - inst.started_at > HEALTHY_AFTER_S:
            inst.backoff_s = 0.0
        inst.deaths += 1
        inst.state = InstanceState.BACKOFF
        inst.restart_at = now + inst.backoff_s
        self.backoff.add((ver, inst))
        log.warning("instance %s of model '%s' %s; restarting in %.1fs", inst.name, ver.name,
                    how, inst.backoff_s)
        inst.backoff_s = min(BACKOFF_CAP_S, max(inst.backoff_s * 2, 0.2))

    def requests_of_dead_worker(self, ver: ModelVersion, inst: Instance, how: str) -> None:
        """Stateless models get one retry on another (or the restarted) instance; a request
        that already had its retry, or a model that turned retries off, gets the error."""
        reason = (f"the worker process of instance '{inst.name}' of model '{ver.name}' "
                  f"{how} while executing this request")
        now = time.monotonic_ns()
        retry = ver.retry_on_death and ver.state == ModelState.READY and not inst.kill_reason \
            and not self.stopping and not how.startswith("exceeded")
        for r in reversed(inst.batch):          # requeued at the head, in their order
            if retry and not r.retried:
                r.retried = True
                ver.scheduler.requeue(r)
                self.queued_in[(r.frontend, r.req_id)] = ver
                continue
            ver.stats.failed("BACKEND", now - r.received_ns)
            self.reply_error(r.frontend, r.req_id, ver.name, ver.version, ErrorCode.INTERNAL,
                             reason)
        inst.batch = None
        self.dispatch(ver)

    def crash_loop(self, ver: ModelVersion, inst: Instance, how: str) -> None:
        """Stop restarting: the version is UNAVAILABLE with the reason until it is reloaded."""
        inst.state = InstanceState.STOPPED
        reason = (f"crash loop: instance '{inst.name}' {how}; it died {inst.deaths_in_a_row} "
                  f"times in a row without finishing an execution")
        log.error("model '%s' version %d is UNAVAILABLE: %s", ver.name, ver.version, reason)
        ver.state, ver.reason = ModelState.UNAVAILABLE, reason
        now = time.monotonic_ns()
        for r in ver.scheduler.drain():
            ver.stats.failed("OTHER", now - r.received_ns)
            self.reply_error(r.frontend, r.req_id, ver.name, ver.version, ErrorCode.UNAVAILABLE,
                             f"model '{ver.name}' version {ver.version} is unavailable: {reason}")
        self.stop_instances(ver, kill=False)
        self.publish()

    def restart_due(self) -> float:
        """Restart instances whose backoff expired; returns seconds until the next one is due."""
        now = time.monotonic()
        wait = 1.0
        for ver, inst in list(self.backoff):
            if ver.state != ModelState.READY or inst.state != InstanceState.BACKOFF:
                self.backoff.discard((ver, inst))
            elif inst.restart_at <= now:
                self.backoff.discard((ver, inst))
                self.spawn(ver, inst)
            else:
                wait = min(wait, inst.restart_at - now)
        return wait

    def ping_due(self) -> float:
        """Ping idle workers; kill one whose answer is overdue (stopped, deadlocked, swapped
        out). Busy ones are covered by the execution timeout instead."""
        now = time.monotonic()
        if now < self.next_ping:
            return self.next_ping - now
        self.next_ping = now + PING_INTERVAL_S
        for ver in self.versions.values():
            for inst in ver.instances:
                if inst.state != InstanceState.IDLE or inst.outbox is None or inst.kill_reason:
                    continue
                if inst.ping_seq:
                    if now - inst.ping_sent > PING_TIMEOUT_S:
                        inst.kill_reason = (f"stopped answering pings for "
                                            f"{now - inst.ping_sent:.0f} s and was killed")
                        log.error("instance %s of model '%s' %s", inst.name, ver.name,
                                  inst.kill_reason)
                        inst.process.kill()
                    continue
                self.ping_counter += 1
                inst.ping_seq, inst.ping_sent = self.ping_counter, now
                inst.outbox.send(Ping(inst.ping_seq))
        return PING_INTERVAL_S

    def pong(self, msg: Pong) -> None:
        found = self.by_spawn.get(msg.instance)
        if found is not None and found[1].ping_seq == msg.seq:
            found[1].ping_seq = 0

    def hang_due(self) -> float:
        """Kill workers whose batch has run past the execution timeout; seconds to next check."""
        now = time.monotonic()
        wait = 1.0
        for ver in [*self.versions.values(), *self.draining]:
            limit = ver.execution_timeout_s
            if limit <= 0:
                continue
            for inst in ver.instances:
                if inst.state != InstanceState.BUSY or inst.kill_reason:
                    continue
                overdue = inst.busy_since + limit - now
                if overdue > 0:
                    wait = min(wait, overdue)
                    continue
                inst.kill_reason = (f"exceeded the execution timeout of {limit:g} s and was "
                                    f"killed")
                log.error("instance %s of model '%s' %s", inst.name, ver.name, inst.kill_reason)
                inst.process.kill()
        return wait
