"""Triton's rate limiter (``--rate-limit execution_count``): an instance executes only while it
holds the resources its instance group names (``rate_limiter { resources [...] priority }``).

Resources are counted per device (the instance's GPU; 0 for a CPU instance), or in one pool
for a ``global`` one. What a resource has is ``--rate-limit-resource <name>:<count>[:<device>]``
where given, else the most any loaded instance asks for, as in Triton, so that every instance
can run (just not all at once). An instance that asks for more than an override gives can
never run: its model fails to load.

Pure (no sockets, no clock): the core asks ``gate`` which of a version's idle instances may
take a batch now, and ``settle`` records the batches it sent. While nothing waits for resources,
an idle instance whose resources are free may be lent to a frontend (``lendable``, ``lend``:
engine/leases.py); it holds its resources for as long as the lease lasts, busy or not, and
the first version that must wait for them makes the core take the lease back
(``lent_versions``). What is held is worked out from the instances that are still busy with
the batch they were given or still lent, so an instance whose worker died or whose model
unloaded holds nothing, with no event to miss. Versions that had requests
but no resources wait in ``blocked`` and are dispatched again, lowest ``priority`` first (0
counts as 1), whenever an execution ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from shmserve.engine.models import Instance, ModelVersion
from shmserve.engine.states import InstanceState

Key = tuple[str, int | None]        # (resource, device; None for a global one)


class RateLimitError(ValueError):
    pass


@dataclass(frozen=True)
class Needs:
    resources: dict[Key, int]
    priority: int


def parse_override(text: str) -> tuple[Key | tuple[str, str], int]:
    """``<name>:<count>[:<device>]`` -> ((name, device or "*"), count); raises ValueError."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError("expected <name>:<count>[:<device>]")
    count = int(parts[1])
    if count < 0:
        raise ValueError("the count must be >= 0")
    device: int | str = "*"
    if len(parts) == 3:
        device = int(parts[2])
        if device < 0:
            raise ValueError("the device must be >= 0")
    return (parts[0], device), count       # type: ignore[return-value]


def needs_of(ver: ModelVersion, inst: Instance) -> Needs | None:
    """What ``inst`` of ``ver`` needs to execute; None when its group names no resource."""
    groups = ver.config.instance_group
    if not 0 <= inst.group < len(groups):
        return None
    limiter = groups[inst.group].rate_limiter
    if not limiter.resources:
        return None
    res: dict[Key, int] = {}
    for r in limiter.resources:
        key = (r.name, None if getattr(r, "global") else inst.device_id)
        res[key] = res.get(key, 0) + r.count
    return Needs(res, limiter.priority or 1)


class RateLimiter:
    def __init__(self, overrides: Iterable[str] = ()):
        self.overrides: dict[tuple[str, int | str], int] = {}
        for text in overrides:
            key, count = parse_override(text)
            self.overrides[key] = count       # type: ignore[index]
        self.versions: set[ModelVersion] = set()    # loaded versions whose instances need some
        self.running: dict[Instance, tuple[int, Needs]] = {}    # instance -> (batch id, needs)
        self.blocked: dict[ModelVersion, int] = {}      # version -> its best priority
        # instances lent under a lease: they hold their resources while it lasts (LEASED)
        self.lent: dict[Instance, tuple[ModelVersion, Needs]] = {}
        self._tentative: dict[Instance, Needs] = {}     # let through by gate, until settle

    # ---- what there is ------------------------------------------------------------------------
    def capacity(self, key: Key) -> int:
        name, device = key
        for k in ((name, device if device is not None else "*"), (name, "*")):
            if k in self.overrides:
                return self.overrides[k]
        return max((n.resources.get(key, 0) for v in self.versions
                    for n in (needs_of(v, i) for i in v.instances) if n is not None), default=0)

    def check(self, ver: ModelVersion) -> None:
        """Before ``ver`` loads: every instance must be able to run some time (raises
        RateLimitError naming the resource); then it counts in the capacities."""
        for inst in ver.instances:
            n = needs_of(ver, inst)
            if n is None:
                continue
            for key, count in n.resources.items():
                name, device = key
                given = self.overrides.get((name, device if device is not None else "*"),
                                           self.overrides.get((name, "*")))
                if given is not None and count > given:
                    where = "global" if device is None else f"device {device}"
                    raise RateLimitError(
                        f"Resource count for '{name}' is limited to {given} which will prevent "
                        f"scheduling of one or more model instances: instance '{inst.name}' of "
                        f"model '{ver.name}' needs {count} ({where}; --rate-limit-resource)")
        if any(needs_of(ver, i) is not None for i in ver.instances):
            self.versions.add(ver)

    def forget(self, ver: ModelVersion) -> None:
        self.versions.discard(ver)
        self.blocked.pop(ver, None)

    def constrained(self, ver: ModelVersion) -> bool:
        return ver in self.versions

    # ---- what is held --------------------------------------------------------------------------
    def held(self) -> dict[Key, int]:
        out: dict[Key, int] = {}
        for inst, (batch_id, needs) in list(self.running.items()):
            if inst.state != InstanceState.BUSY or inst.batch_id != batch_id:
                del self.running[inst]          # finished, died or unloaded: gives them back
                continue
            _add(out, needs)
        for inst, (_, needs) in list(self.lent.items()):
            if inst.state != InstanceState.LEASED:
                del self.lent[inst]                     # the lease ended, or the worker died
                continue
            _add(out, needs)
        return out

    def lendable(self, ver: ModelVersion, idle: list) -> Instance | None:
        """An idle instance of ``ver`` that may be lent now: no version waits for resources,
        and what it needs is free beside what is held (the most recently idle first)."""
        if self.blocked:
            return None
        held = self.held()
        for inst in reversed(idle):
            n = needs_of(ver, inst)
            if n is None or all(held.get(k, 0) + c <= self.capacity(k)
                                for k, c in n.resources.items()):
                return inst
        return None

    def lend(self, ver: ModelVersion, inst: Instance) -> None:
        """``inst`` was lent: it holds its resources until its lease ends."""
        n = needs_of(ver, inst)
        if n is not None:
            self.lent[inst] = (ver, n)

    def lent_versions(self) -> set[ModelVersion]:
        """The versions whose lent instances hold resources now."""
        return {ver for inst, (ver, _) in self.lent.items()
                if inst.state == InstanceState.LEASED}

    # ---- the core's calls ---------------------------------------------------------------------
    def gate(self, ver: ModelVersion, idle: list) -> list:
        """The idle instances of ``ver`` that may not take a batch now (they are taken out of
        ``idle``, which the queue hands batches to from its end; ``settle`` puts them back).
        Each one let through is counted as holding its resources until ``settle``."""
        held = self.held()
        parked: list = []
        tentative: dict[Instance, Needs] = {}
        for inst in reversed(list(idle)):
            n = needs_of(ver, inst)
            if n is None:
                continue
            if all(held.get(k, 0) + c <= self.capacity(k) for k, c in n.resources.items()):
                for k, c in n.resources.items():
                    held[k] = held.get(k, 0) + c
                tentative[inst] = n
            else:
                parked.append(inst)
                idle.remove(inst)
        self._tentative = tentative
        return parked

    def settle(self, ver: ModelVersion, idle: list, parked: list, given: list,
               waiting: bool) -> None:
        """After the queue formed its batches: the instances ``given`` one hold their resources
        (``started``); the parked ones are idle again; ``waiting``: requests are still queued,
        so ``ver`` waits for resources."""
        for inst in given:
            n = self._tentative.get(inst)
            if n is not None:
                self.running[inst] = (inst.batch_id, n)
        for inst in reversed(parked):
            idle.insert(0, inst)
        if parked and waiting:
            self.blocked[ver] = min(n.priority for n in (needs_of(ver, i) for i in parked)
                                    if n is not None)
        else:
            self.blocked.pop(ver, None)
        self._tentative = {}

    def waiting(self) -> list[ModelVersion]:
        """Versions that wait for resources, the lowest priority first (then the longest
        waiting: dicts keep their order)."""
        return sorted(self.blocked, key=self.blocked.__getitem__)


def _add(held: dict[Key, int], needs: Needs) -> None:
    for key, count in needs.resources.items():
        held[key] = held.get(key, 0) + count
