"""Instance leases: the scheduler lends an idle instance to a frontend, which then sends its
requests straight to that worker (LeasedExecute): two hops on the critical path instead of
three, and no scheduler work before the model runs.

The scheduler still owns allocation. It grants a lease only when a version's queue is empty and
an instance is idle, to the frontend that sent that version's last request. A version whose
requests its workers can run in arrival order (a single instance, or a plain dynamic batcher:
see below) is leased with no limit on requests in flight (depth 0), each idle instance as its
own lease to the same frontend, which spreads its requests over them (the one with the fewest
in flight). Any other version lends at most one instance, one request at a time: a second
concurrent request goes to the scheduler, which spreads it over the other instances. The
scheduler also hands instances over when one turns idle with only one frontend's requests
queued: it returns them to that frontend, which sends them first under the lease. So one
frontend's steady load on such a version costs the scheduler nothing per request.

The scheduler takes the lease back (RevokeLease to the worker, LeaseRevoked to the frontend) as
soon as a request has to queue for want of an idle instance; the worker answers LeaseEnded
once everything it accepted under the lease has run, and from then on the instance takes
batches from the scheduler again. A leased request the worker reads after the revoke is not run
but handed back to its frontend (LeaseBounced), which submits it to the scheduler: nothing is
lost and nothing runs twice. Statistics still count every request (the completion records of
leased requests reach the scheduler through the frontend, LeasedDone).

When a worker that was ever leased to a frontend ends, that frontend is told (LeaseLost): what
it sent the worker and got no answer for is submitted to the scheduler again, which retries it
alone or fails it with the reason, as for any request of a dead worker.

The scheduler cannot time a leased worker's executions one by one; it sees its progress in
the completion records frontends pass on (LeasedDone, every 50 ms). A lease with no progress
for TERM_NS (plus its dynamic batcher's max_queue_delay, which a request may rightly wait in
the worker) is revoked and granted again (an idle worker answers the revoke at once: it acts
as a ping). After a revoke, the worker must finish a request within the version's execution
timeout plus PING_TIMEOUT_S, or it is killed as for a batch past the timeout. So a leased
execution that hangs is killed at most TERM_NS + PING_TIMEOUT_S later than a dispatched one
would be.

A version with a plain dynamic batcher is leased too: its requests meet in each leased worker's
inbox instead of the scheduler's queue, and the worker batches them by the same rules
(workers/leases/batch.py); each completion record counts its request, and the first of a batch
counts the execution. With several instances, each batches what the frontend spread to it, as
the scheduler's batcher would have handed each idle instance what had queued by then.

A sequence model is leased too, all its instances at once, and taken back at once (its term
too): the live sequences the scheduler pinned to each go to its worker (LendSequences, before
the grant, which names them to the frontend), whose own sequence batcher applies the same
rules to the leased requests (workers/leases/sequences.py), and come back with LeaseEnded.
Requests that reach the scheduler meanwhile wait for them (their sequence's state is judged
where it is): they revoke the leases like any request that queues; one from the lease holder
is forwarded to the worker that has its sequence instead. The frontend keeps each sequence's
requests on one path at a time (frontend/sequence_paths.py), so none overtakes another, and
sends a later request of a sequence none of its leased workers has to the scheduler.

A dynamic batcher with priority levels or queue policies (timeouts, a size bound) and no
max_queue_delay is leased one instance at a time, one request in flight (depth 1): a request
under the lease never queues, so those rules have nothing to act on; the first that would
queue goes to the scheduler, whose queue applies them, and takes the lease back. With a delay
it is not leased: a request waiting out the delay is queued, and a later one must find it
there (a queue bound of one refuses the second, as Triton's does).

A rate-limited version is lent one idle instance at a time whose resources are free while no
version waits for any; the instance holds them until its lease ends, and the first version
that must wait for them takes the lease back (engine/core.py ``lend_limited``).

Not leased: iterative sequences, decoupled models, and any version while the server stops.

Pure: no sockets; it acts through the port and reads the injected clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shmserve.engine.batching.dynamic import DynamicBatcher, QueuePolicy
from shmserve.engine.batching.queues import QueuedRequest
from shmserve.engine.batching.sequences import SequenceBatcher
from shmserve.engine.models import PING_TIMEOUT_S, Instance, ModelVersion
from shmserve.engine.port import SchedulerPort
from shmserve.engine.states import InstanceState, ModelState
from shmserve.ipc.messages.common import BLS_FRONTEND_BASE, SequenceSlot
from shmserve.ipc.messages.to_frontend import LeaseGranted, LeaseLost, LeaseRevoked
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute, LendSequences, RevokeLease

# After a revoke, a version gets no new lease for this long: under load (requests queueing) the
# scheduler path serves, and a lease granted and revoked on every lull would cost two messages
# each time for nothing.
COOLDOWN_NS = 200_000_000
# How long a lease lasts before it is revoked and granted again (see above).
TERM_NS = 2_000_000_000


def queue_rules(ver: ModelVersion) -> bool:
    """Whether ``ver``'s dynamic batcher has rules only a queue applies: priority levels, queue
    timeouts, a queue size bound. A worker's inbox cannot stand in for that queue."""
    q = ver.queue
    return isinstance(q, DynamicBatcher) and (
        q.cfg.priority_levels > 1 or q.cfg.default_policy != QueuePolicy()
        or bool(q.cfg.level_policies))


def worker_batches(ver: ModelVersion) -> bool:
    """Whether a dynamic-batching version's requests can batch in its workers' inboxes under
    leases (workers/leases/batch.py): its batcher has nothing an inbox cannot do."""
    return isinstance(ver.queue, DynamicBatcher) and not queue_rules(ver)


def unlimited(ver: ModelVersion) -> bool:
    """Whether ``ver``'s workers may take any number of leased requests in flight, run in
    arrival order: a single instance (with no queue rules: requests would wait in its inbox
    unordered by priority and untimed), requests that batch in the worker anyway, or a
    sequence model's (each sequence lives on one worker, whose batcher orders them)."""
    return (len(ver.instances) == 1 and not queue_rules(ver)) or worker_batches(ver) \
        or isinstance(ver.queue, SequenceBatcher)


def submitted(ver: ModelVersion, r: QueuedRequest) -> SubmitRequest:
    """The head a queued request came with (what a leased worker reads)."""
    return SubmitRequest(r.req_id, r.frontend, ver.name, ver.version, r.batch_size,
                         r.received_ns, r.priority, r.timeout_us, r.shape_key,
                         sequence_id=r.sequence_id, sequence_flags=r.flags, trace=r.trace)


def place(held: list, cid) -> "Lease":
    """The lease of ``held`` whose worker has sequence ``cid``, or (a new one) the one with
    the fewest sequences, which takes it."""
    for lease in held:
        if cid in lease.cids:
            return lease
    lease = min(held, key=lambda h: len(h.cids))
    lease.cids[cid] = None
    return lease


@dataclass(eq=False)
class Lease:
    lease_id: int
    version: ModelVersion
    instance: Instance
    frontend: int
    granted_ns: int
    depth: int = 1              # requests in flight at once; 0 = no limit
    revoked_ns: int = 0         # 0 = in force
    progress_ns: int = 0        # when its worker last finished a leased request
    # a sequence model's: the sequences lent with it or forwarded to it (engine/core.py
    # forward), to forward a sequence's later requests to the same worker
    cids: dict | None = None


class LeaseBook:
    def __init__(self, port: SchedulerPort, clock: Callable[[], int], enabled: bool = True):
        self.port = port
        self.clock = clock
        self.enabled = enabled
        self.counter = 0
        self.by_version: dict[ModelVersion, list[Lease]] = {}     # all to one frontend
        self.by_spawn: dict[int, Lease] = {}
        # by (name, version): a reload's new ModelVersion inherits them, and they stay bounded
        self.last_frontend: dict[tuple[str, int], int] = {}
        self.cooldown_until: dict[tuple[str, int], int] = {}
        # frontends that ever held a lease on a worker (spawn id): told when it ends
        self.holders: dict[int, set[int]] = {}
        self.stopping = False

    def leasable(self, ver: ModelVersion) -> bool:
        # a decoupled model answers past its execution (the lease's completion records ride
        # with one answer): never lent. A sequence model is: each instance's live sequences go
        # with its lease (below). An iterative sequence (one request, rescheduled in its
        # worker: no SequenceBatcher) is not; nor is a batcher with queue rules and a delay
        # (see above)
        q = ver.queue
        return (self.enabled and not self.stopping and ver.state == ModelState.READY
                and not ver.config.model_transaction_policy.decoupled
                and (not ver.config.HasField("sequence_batching")
                     or isinstance(q, SequenceBatcher))
                and (not ver.config.HasField("dynamic_batching")
                     or (isinstance(q, DynamicBatcher)
                         and (not q.delay_ns or not queue_rules(ver)))))

    def note_request(self, ver: ModelVersion, frontend: int | None) -> None:
        """The frontend the version's latest request came from; None: not a lease taker."""
        if frontend is None:
            self.last_frontend.pop((ver.name, ver.version), None)
        else:
            self.last_frontend[(ver.name, ver.version)] = frontend

    def offer(self, ver: ModelVersion, idle: list, frontend: int | None = None,
              returned: list[int] | None = None) -> bool:
        """The queue of ``ver`` is empty and ``idle`` (its idle instances, most recently idle
        last) is not: lease them to ``frontend`` (default: the version's last one), if nothing
        stands against it: all of them when their leases have no depth limit, else one;
        ``returned`` are its requests the scheduler held (see above)."""
        if not self.leasable(ver):
            return False
        key = (ver.name, ver.version)
        if frontend is None:
            frontend = self.last_frontend.get(key)
        if frontend is None or self.clock() < self.cooldown_until.get(key, 0):
            return False
        sequences = ver.queue if isinstance(ver.queue, SequenceBatcher) else None
        if sequences is not None and frontend >= BLS_FRONTEND_BASE:
            return False    # a BLS client does not keep a sequence's requests in order
        held = self.by_version.get(ver)
        if sequences is not None and (held or len(idle) != len(ver.instances)):
            # all its instances at once: a sequence on an instance not lent would be out of
            # the frontend's reach, and a new one must find every slot
            return False
        depth = 0 if unlimited(ver) else 1
        # one frontend holds a version's leases, all in force; a limited lease comes alone
        if held and (depth or held[0].frontend != frontend or any(h.revoked_ns for h in held)):
            return False
        held = self.by_version.setdefault(ver, [])
        while idle:
            inst = idle.pop()
            self.counter += 1
            lease = Lease(self.counter, ver, inst, frontend, self.clock(), depth)
            inst.state = InstanceState.LEASED
            held.append(lease)
            self.by_spawn[inst.spawn_id] = lease
            self.holders.setdefault(inst.spawn_id, set()).add(frontend)
            grant = LeaseGranted(lease.lease_id, ver.name, ver.version, inst.spawn_id, depth,
                                 returned or [])
            if sequences is not None:   # the worker takes over its live sequences first
                live = [SequenceSlot(cid, t) for cid, t in sequences.lend(inst)]
                self.port.send_worker(inst.spawn_id, LendSequences(lease.lease_id, live))
                lease.cids = {s.cid: None for s in live}
                grant.sequences, grant.slots = list(lease.cids), sequences.cfg.capacity
            self.port.send_frontend(frontend, grant)
            returned = None
            if depth:
                break
        return True

    def can_hand_over(self, ver: ModelVersion, frontend: int) -> bool:
        """Whether idle instances of ``ver``, with only ``frontend``'s requests queued, may be
        leased to it with them."""
        held = self.by_version.get(ver, ())
        return (unlimited(ver) and self.leasable(ver)
                and all(h.frontend == frontend and not h.revoked_ns for h in held)
                and self.clock() >= self.cooldown_until.get((ver.name, ver.version), 0))

    def give_back(self, ver: ModelVersion, msg: SubmitRequest, payload) -> bool:
        """A request from the frontend that holds unlimited leases on ``ver`` (sent before it
        heard of a grant): returned to it, to go under one of them; a sequence model's is
        forwarded to the worker instead (``forward``)."""
        if isinstance(ver.queue, SequenceBatcher):
            return self.forward(ver, msg.frontend, [(msg, payload)])
        for lease in self.by_version.get(ver, ()):
            if lease.frontend == msg.frontend and not lease.depth and not lease.revoked_ns:
                self.port.send_frontend(msg.frontend, LeaseGranted(
                    lease.lease_id, ver.name, ver.version, lease.instance.spawn_id, 0,
                    [msg.req_id]))
                return True
        return False

    def forward(self, ver: ModelVersion, frontend: int,
                requests: list[tuple[SubmitRequest, Any]]) -> bool:
        """Requests of the frontend that holds the lease on a sequence model: sent to the
        leased worker by the scheduler itself, behind the live sequences it lent (on one
        channel, so in order; the frontend may have later ones of the same sequences on their
        way here, which come the same way: frontend/sequence_paths.py), and the frontend told
        they went under the lease (LeaseGranted.forwarded)."""
        held = [h for h in self.by_version.get(ver, ()) if h.frontend == frontend]
        if not held or any(h.revoked_ns for h in held):
            return False
        by_lease: dict[Lease, list[int]] = {}
        for head, payload in requests:
            lease = place(held, head.sequence_id)
            self.port.send_worker(lease.instance.spawn_id, LeasedExecute(lease.lease_id, head),
                                  [payload])
            by_lease.setdefault(lease, []).append(head.req_id)
        for lease, rids in by_lease.items():
            self.port.send_frontend(frontend, LeaseGranted(
                lease.lease_id, ver.name, ver.version, lease.instance.spawn_id, lease.depth,
                forwarded=rids))
        return True

    def progress(self, spawn_id: int, finished_ns: int) -> None:
        lease = self.by_spawn.get(spawn_id)
        if lease is not None and finished_ns > lease.progress_ns:
            lease.progress_ns = finished_ns

    def revoke(self, ver: ModelVersion) -> None:
        """Take back the leases of ``ver`` (requests are queueing, or it drains); each instance
        stays LEASED until its worker's LeaseEnded."""
        held = self.by_version.get(ver, ())
        if any(not h.revoked_ns for h in held):
            self.cooldown_until[(ver.name, ver.version)] = self.clock() + COOLDOWN_NS
        for lease in held:
            self._revoke(lease)

    def frontend_gone(self, frontend: int) -> None:
        """A frontend process died (a new one takes its id): its leases are taken back, and
        the workers it held leases on no longer tell it of their end."""
        for held in list(self.by_version.values()):
            for lease in held:
                if lease.frontend == frontend:
                    self._revoke(lease)
        for holders in self.holders.values():
            holders.discard(frontend)
        for key in [k for k, f in self.last_frontend.items() if f == frontend]:
            del self.last_frontend[key]

    def _revoke(self, lease: Lease) -> None:
        if lease.revoked_ns:
            return
        lease.revoked_ns = self.clock()
        self.port.send_worker(lease.instance.spawn_id, RevokeLease(lease.lease_id))
        self.port.send_frontend(lease.frontend, LeaseRevoked(lease.lease_id))

    def ended(self, spawn_id: int, lease_id: int) -> Lease | None:
        """The worker finished with the lease: the instance is the scheduler's again."""
        lease = self.by_spawn.get(spawn_id)
        if lease is None or lease.lease_id != lease_id:
            return None
        if not lease.revoked_ns:
            # the worker gave it up (a new sequence found no slot): the version's leases all
            # end (the waiting is the scheduler's to do), this one without a revoke
            lease.revoked_ns = self.clock()
            self.port.send_frontend(lease.frontend, LeaseRevoked(lease.lease_id))
            self.revoke(lease.version)
            ver = lease.version
            self.cooldown_until[(ver.name, ver.version)] = self.clock() + COOLDOWN_NS
        self._forget(lease)
        return lease

    def worker_exited(self, spawn_id: int, reason: str, retry: bool, clean: bool = False) -> None:
        """The worker ``spawn_id`` ended (crash, kill, stop): the frontends that held a lease on
        it resubmit what they sent it and got no answer for."""
        lease = self.by_spawn.get(spawn_id)
        if lease is not None:
            self._forget(lease)
            if lease.cids is not None:
                # its sequences are lost: the scheduler says so to their next requests, with
                # the model's other sequences back in its hands
                self.revoke(lease.version)
        for frontend in self.holders.pop(spawn_id, ()):
            self.port.send_frontend(frontend, LeaseLost(spawn_id, reason, retry, clean))

    def due(self) -> tuple[float, list[Lease]]:
        """Renew leases past their term; returns the seconds until the next check and the
        leases whose worker has not ended them in time (hung: the caller kills it)."""
        now = self.clock()
        wait_ns = TERM_NS
        hung = []
        for lease in [h for held in self.by_version.values() for h in held]:
            if not lease.revoked_ns:
                # a request may rightly wait the batcher's delay in the worker before it runs:
                # no progress for that long is not a hang (revoking would cut the wait short)
                term = TERM_NS + getattr(lease.version.queue, "delay_ns", 0)
                left = max(lease.granted_ns, lease.progress_ns) + term - now
                if left > 0:
                    wait_ns = min(wait_ns, left)
                    continue
                if lease.cids is not None:
                    # a sequence model's instances are lent together and come back together
                    # (a sequence on one taken back alone would be out of its frontend's reach)
                    for h in self.by_version.get(lease.version, ()):
                        self._revoke(h)
                else:
                    self._revoke(lease)         # renewed once its worker ended it
            limit = lease.version.execution_timeout_s
            if limit <= 0:
                continue
            since = max(lease.revoked_ns, lease.progress_ns)
            left = since + int((limit + PING_TIMEOUT_S) * 1e9) - now
            if left > 0:
                wait_ns = min(wait_ns, left)
            else:
                hung.append(lease)
        return wait_ns / 1e9, hung

    def _forget(self, lease: Lease) -> None:
        self.by_spawn.pop(lease.instance.spawn_id, None)
        held = self.by_version.get(lease.version)
        if held and lease in held:
            held.remove(lease)
            if not held:
                del self.by_version[lease.version]
