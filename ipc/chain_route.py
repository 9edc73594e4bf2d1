"""Which requests of an ensemble may go worker to worker (workers/leases/chain.py).

Each step's worker writes the step's outputs once. An ensemble output that no later step reads
is written as the client asked for it (into its region, as classes) by the step that makes it;
one that a later step reads must be written plainly, for that step. So a request that wants such
an output in a region or as classes is the scheduler's to run (its runner writes a copy of the
tensor as asked once the ensemble is done). The frontend asks this before it sends a request on
a route; the worker reads which outputs later steps read from the same route.
"""
from __future__ import annotations

from shmserve.ipc.messages.common import ChainHop, OutputSpec


def read_after(route: list[ChainHop], at: int) -> set[str]:
    """The ensemble tensors that the steps after step ``at`` of ``route`` read."""
    return {t for hop in route[at + 1:] for t in hop.inputs.values()}


def as_asked(o: OutputSpec) -> bool:
    """Whether the client asked for an output other than plainly (in a region, as classes)."""
    return o.shm is not None or o.cuda is not None or bool(o.classification)


def route_serves(route: list[ChainHop], outputs: list[OutputSpec]) -> bool:
    """Whether a request that wants ``outputs`` may go worker to worker on ``route``."""
    if not any(as_asked(o) for o in outputs):
        return True             # (the usual request: nothing to look up)
    read = read_after(route, -1)
    return not any(o.name in read and as_asked(o) for o in outputs)
