"""``SlotBook``: the output slots of ensemble steps that the scheduler passes on by reference, and
when each goes back to the worker that owns it (``ReleaseOutputs``).

A step's output lives in a slot of the worker that ran the step: host shared memory (``ShmRef``)
or, for an intermediate tensor the next step reads on its GPU, the worker's device arena
(``CudaRef``, ipc/gpu/device_arena.py). A request's run holds its slots until it ends
(``Run.slots`` in engine/ensemble/runner.py); host slots answered to a client are handed to its frontend
and counted here until the frontend and any run that may answer with them again let go.

Device slots die with their worker, and so do the IPC handles of its arena that other workers
opened: ``worker_gone`` returns those handles so that every worker closes them.
"""
from __future__ import annotations

from typing import Callable, TypeAlias

from shmserve.ipc.messages.common import CudaRef, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult

Ref: TypeAlias = ShmRef | CudaRef


class SlotBook:
    def __init__(self, release: Callable[[str, list[Ref]], None]):
        self.release = release              # ReleaseOutputs to the worker at an address
        # slots answered to frontends -> [owning worker, references]: a frontend's release
        # drops one, the run that holds it (Run.held) one when it ends; the last gives it back
        self.handed: dict[ShmRef, list] = {}
        # worker address -> IPC handles of its device arena that steps' answers named
        self.device_handles: dict[str, set[bytes]] = {}

    def note(self, slots: dict[Ref, str], t: Tensor, worker: str) -> None:
        """Step output ``t`` is in a slot of ``worker``; the run's ``slots`` hold it."""
        if t.shm is not None:
            slots[t.shm] = worker
        elif t.cuda is not None:
            slots[t.cuda] = worker
            self.device_handles.setdefault(worker, set()).add(t.cuda.handle)

    def hand(self, ref: ShmRef, worker: str, holders: int) -> None:
        """A run answers a client with the slot: the frontend holds it, and the run too when
        ``holders`` is 2 (a later response may name it again)."""
        self.handed[ref] = [worker, holders]

    def hold(self, ref: ShmRef) -> None:
        entry = self.handed.get(ref)
        if entry is not None:
            entry[1] += 1

    def give_back(self, slots: dict[Ref, str]) -> None:
        by_worker: dict[str, list[Ref]] = {}
        for ref, worker in slots.items():
            by_worker.setdefault(worker, []).append(ref)
        for worker, refs in by_worker.items():
            self.release(worker, refs)

    def give_back_late(self, res: InferResult) -> None:
        """An answer for a request that has ended: its slots go straight back. (A CudaRef of a
        client's region is not a slot: the worker's arena ignores it.)"""
        refs: list[Ref] = []
        for t in res.outputs:
            if t.shm is not None:
                refs.append(t.shm)
            elif t.cuda is not None:
                refs.append(t.cuda)
        if refs and res.worker:
            self.release(res.worker, refs)

    def released(self, refs: list[ShmRef]) -> dict[str, list[Ref]]:
        """A frontend is done with slots of an ensemble's answer: which worker owns each."""
        by_worker: dict[str, list[Ref]] = {}
        for ref, worker in self.drop(refs).items():
            by_worker.setdefault(worker, []).append(ref)
        return by_worker

    def drop(self, refs: list[ShmRef]) -> dict[Ref, str]:
        """One reference less on each handed slot: those nobody holds any more, with their
        workers."""
        free: dict[Ref, str] = {}
        for ref in refs:
            entry = self.handed.get(ref)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self.handed[ref]
                free[ref] = entry[0]
        return free

    def worker_gone(self, address: str) -> list[bytes]:
        """A worker died: its slots died with it, nobody returns them. The IPC handles of its
        device arena that other workers may have open."""
        for ref in [r for r, (w, _) in self.handed.items() if w == address]:
            del self.handed[ref]
        return sorted(self.device_handles.pop(address, ()))
