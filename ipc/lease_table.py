"""The lease taker's half of instance leases (engine/leases.py has the protocol): the instances
a frontend, or a worker's BLS client, holds; which of its requests went under which; which to
send the next one under. Both takers keep their leases here, so the rules are written once.

Pure: no sockets of its own; ``granted`` opens a worker's inbox through the callable it is
given, and the caller sends.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from shmserve.ipc.messages.common import ChainHop
from shmserve.ipc.messages.to_frontend import LeaseGranted
from shmserve.ipc.packets import PeerGone


@dataclass(eq=False)
class Lease:
    lease_id: int
    spawn_id: int
    box: Any                    # the worker's inbox (a PacketOutbox)
    depth: int = 1              # requests in flight at once; 0 = no limit
    inflight: int = 0
    # a sequence model's: the sequences its worker has (least recently used first; at most
    # ``slots``: one the worker holds no more has ended), None for any other model
    cids: OrderedDict | None = None
    slots: int = 0

    @property
    def full(self) -> bool:
        return bool(self.depth) and self.inflight >= self.depth

    def took(self, cid: int | str) -> None:
        """Its worker has sequence ``cid`` now."""
        if self.cids is not None:
            self.cids[cid] = None
            self.cids.move_to_end(cid)
            while len(self.cids) > max(1, self.slots):
                self.cids.popitem(last=False)


class LeaseTable:
    def __init__(self) -> None:
        # (model, version) -> its leases: one, or (no depth limit) one per idle instance
        self.held: dict[tuple[str, int], list[Lease]] = {}
        self.direct: dict[int, Lease] = {}      # request sent under a lease -> that lease
        # an ensemble's request sent worker to worker (workers/leases/chain.py) -> its steps' leases
        self.chained: dict[int, list[Lease]] = {}

    def __bool__(self) -> bool:
        return bool(self.held)

    # ---- choosing -------------------------------------------------------------------------------
    def pick(self, model: str, version: int) -> Lease | None:
        """The lease to send the next request for ``model`` under: the one with the fewest in
        flight (it may be full)."""
        held = self.held.get((model, version))
        if not held:
            return None
        return held[0] if len(held) == 1 else min(held, key=lambda h: h.inflight)

    def place(self, model: str, version: int, cid: int | str, start: bool) -> Lease | None:
        """The lease whose worker has sequence ``cid`` of a sequence model; for a new one
        (``start``), the lease with the fewest sequences, which takes it. None: the scheduler
        (a later request of a sequence none of our workers has: its instance came back to the
        scheduler, on its own term or before the others, or it never started; the scheduler
        judges it where its state is)."""
        held = self.held.get((model, version))
        if not held:
            return None
        for lease in held:
            if lease.cids is not None and cid in lease.cids:
                lease.cids.move_to_end(cid)
                return lease
        if not start:
            return None
        lease = min(held, key=lambda h: len(h.cids or ()))
        lease.took(cid)
        return lease

    def ended_sequence(self, model: str, version: int, cid: int | str) -> None:
        for lease in self.held.get((model, version), ()):
            if lease.cids is not None:
                lease.cids.pop(cid, None)

    def route(self, hops: list[ChainHop]) -> list[Lease] | None:
        """A lease with room for every step of an ensemble that may run worker to worker;
        None: the scheduler runs it."""
        chosen = []
        for hop in hops:
            lease = self.pick(hop.model, hop.version)
            if lease is None or lease.full:
                return None
            chosen.append(lease)
        return chosen

    def holds_all(self, hops: list[ChainHop]) -> bool:
        return all((h.model, h.version) in self.held for h in hops)

    # ---- requests -----------------------------------------------------------------------------
    def sent(self, lease: Lease, req_id: int) -> None:
        lease.inflight += 1
        self.direct[req_id] = lease

    def sent_route(self, leases: list[Lease], req_id: int) -> None:
        """An ensemble request counts as in flight under each of its steps' leases."""
        for lease in leases:
            lease.inflight += 1
        self.chained[req_id] = leases

    def busy(self) -> bool:
        return bool(self.direct or self.chained)

    def done(self, req_id: int) -> None:
        lease = self.direct.pop(req_id, None)
        if lease is not None:
            lease.inflight -= 1
        if self.chained:
            for lease in self.chained.pop(req_id, ()):
                lease.inflight -= 1

    def boxes_of(self, req_id: int) -> set:
        """The inboxes of the workers a request went to under leases (a cancel goes there)."""
        lease = self.direct.get(req_id)
        if lease is not None:
            return {lease.box}
        return {lease.box for lease in self.chained.get(req_id, ())}

    def lost(self, spawn_id: int, chained: bool = True) -> list[int]:
        """The requests that went under a lease on the worker ``spawn_id``, or (``chained``)
        through it worker to worker: no longer under any lease."""
        rids = [rid for rid, leases in self.chained.items()
                if any(lease.spawn_id == spawn_id for lease in leases)] if chained else []
        rids += [rid for rid, lease in self.direct.items() if lease.spawn_id == spawn_id]
        for rid in rids:
            self.done(rid)
        return rids

    # ---- what the scheduler says ----------------------------------------------------------------
    def granted(self, msg: LeaseGranted, box_for: Callable[[int], Any]) -> Lease | None:
        """A grant (or a grant again, with requests returned): the lease, None when its worker
        is gone already (``box_for`` raised; its LeaseLost follows)."""
        key = (msg.model, msg.version)
        held = self.held.setdefault(key, [])
        lease = next((h for h in held if h.lease_id == msg.lease_id), None)
        if lease is None:
            # a lease on the same worker ended already (its revoke came first, in order)
            held[:] = [h for h in held if h.spawn_id != msg.spawn_id]
            try:
                lease = Lease(msg.lease_id, msg.spawn_id, box_for(msg.spawn_id), msg.depth)
                if msg.sequences is not None:
                    lease.cids = OrderedDict.fromkeys(msg.sequences)
                    lease.slots = msg.slots
                held.append(lease)
            except PeerGone:
                lease = None
            if not held:
                del self.held[key]
        return lease

    def forget(self, match: Callable[[Lease], bool]) -> list[tuple[tuple[str, int], Lease]]:
        """Stop using the leases ``match`` picks (requests sent under them still finish);
        returns them, each with its (model, version)."""
        gone = []
        for key, held in list(self.held.items()):
            kept = [h for h in held if not match(h)]
            gone += [(key, h) for h in held if match(h)]
            if not kept:
                del self.held[key]
            elif len(kept) != len(held):
                self.held[key] = kept
        return gone

    def revoked(self, lease_id: int) -> None:
        self.forget(lambda h: h.lease_id == lease_id)

    def clear(self) -> Iterable[Lease]:
        self.direct.clear()
        self.chained.clear()
        leases = [h for held in self.held.values() for h in held]
        self.held.clear()
        return leases
