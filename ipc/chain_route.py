"""Which requests of an ensemble may go worker to worker (workers/leases/chain.py).

Each step's worker writes the step's outputs once. An ensemble output that no later step reads
is written as the client asked for it (into its region, as classes) by the step that makes it;
one that a later step reads must be written plainly, for that step. So a request that wants such
an output in a region or as classes is the scheduler's to run (its runner writes a copy of the
tensor as asked once the ensemble is done).

Every step of the route runs, each with every input its input map names. A request that leaves
out an optional ensemble input is the scheduler's too: it skips the steps that cannot run
without it and leaves the input out of those that can.

The frontend asks this before it sends a request on a route; the worker reads which outputs
later steps read from the same route.
"""
from __future__ import annotations

from shmserve.ipc.messages.common import ChainHop, InferPayload, OutputSpec


def read_after(route: list[ChainHop], at: int) -> set[str]:
    """The ensemble tensors that the steps after step ``at`` of ``route`` read."""
    return {t for hop in route[at + 1:] for t in hop.inputs.values()}


def as_asked(o: OutputSpec) -> bool:
    """Whether the client asked for an output other than plainly (in a region, as classes)."""
    return o.shm is not None or o.cuda is not None or bool(o.classification)


class Route:
    """An ensemble version's steps in the order they run worker to worker, and what a request
    must bring to take them."""
    __slots__ = ("hops", "read", "needs")

    def __init__(self, hops: list[ChainHop]):
        self.hops = hops
        self.read = frozenset(read_after(hops, -1))
        # the ensemble inputs the steps read: tensors no step makes
        self.needs = self.read - {t for hop in hops for t in hop.outputs.values()}

    def serves(self, p: InferPayload) -> bool:
        """Whether request ``p`` may go worker to worker on this route."""
        if len(p.inputs) < len(self.needs):
            return False        # (each a distinct ensemble input: checked against the config)
        return not any(as_asked(o) and o.name in self.read for o in p.outputs)
