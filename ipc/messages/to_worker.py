"""Messages a worker receives: batches and leases from the scheduler, leased requests and
pipeline steps from frontends and other workers, and the scheduler's control messages."""
from __future__ import annotations

import msgspec

from shmserve.ipc.messages.common import ChainHop, CudaRef, LeasedRecord, SequenceSlot, ShmRef
from shmserve.ipc.messages.to_scheduler import SubmitRequest

# Where a worker waits for its next request: the ``cpu`` of LeasedExecute and ChainExecute,
# named by the frontend (frontend/colocation.py) and obeyed by the worker
# (workers/waiting_cpu.py). One int, so that a request carries no extra field: a CPU (0 or
# more) to wait on, ANYWHERE, or any CPU but one (apart_from).
ANYWHERE = -1


def apart_from(cpu: int) -> int:
    """The hint "wait on any CPU but ``cpu``" (-2 for CPU 0, -3 for CPU 1, ...); ANYWHERE when
    ``cpu`` is not a CPU (sched_getcpu's -1)."""
    return -2 - cpu if cpu >= 0 else ANYWHERE


def waiting_cpus(hint: int, everywhere: set[int]) -> set[int] | None:
    """The CPUs a worker allowed ``everywhere`` waits on for ``hint``; None: no pin at all
    (ANYWHERE, or "all but a CPU" that leaves every CPU it has, or none)."""
    if hint >= 0:
        return {hint}
    if hint == ANYWHERE:
        return None
    rest = everywhere - {-2 - hint}
    return rest if rest and rest != everywhere else None


class RequestRoute(msgspec.Struct, array_like=True):
    req_id: int
    frontend: int
    trace: bool = False         # answer with the execution's times (InferResult.compute_ns)


class ExecuteBatch(msgspec.Struct, array_like=True, tag=20):
    """One execution; one payload frame per route follows."""
    batch_id: int
    routes: list[RequestRoute]


class LendSequences(msgspec.Struct, array_like=True, tag=28):
    """Sent to a sequence model's worker before its lease is granted: the live sequences the
    scheduler had pinned to it, which its own sequence batcher takes over for the lease
    (workers/lease_sequences.py). LeaseEnded gives them back."""
    lease_id: int
    sequences: list[SequenceSlot]


class RevokeLease(msgspec.Struct, array_like=True, tag=25):
    """Leases up to ``lease_id`` end: a LeasedExecute of one of them that the worker reads
    after this goes back to its frontend (LeaseBounced). Answered by LeaseEnded."""
    lease_id: int


class Shutdown(msgspec.Struct, array_like=True, tag=21):
    pass


class CheckReadiness(msgspec.Struct, array_like=True, tag=29):
    """Call the model's is_ready() and answer with ReadinessReport."""
    check: int


class Ping(msgspec.Struct, array_like=True, tag=24):
    """Sent to idle workers; one that does not answer in time is killed and restarted."""
    seq: int


class ReleaseOutputs(msgspec.Struct, array_like=True, tag=22):
    refs: list[ShmRef]
    # slots of the worker's device arena (only the scheduler sends these: an ensemble's
    # intermediate tensors never reach a frontend)
    device: list[CudaRef] = []


class ChainExecute(msgspec.Struct, array_like=True, tag=27):
    """An ensemble request run worker to worker under leases (workers/chain.py); its payload
    frame follows: the ensemble tensors known so far, named as in the ensemble, and the
    client's outputs. ``head`` is the client's request (model: the ensemble); ``leases`` and
    ``workers`` the lease id and spawn id for each hop; ``held``: the slots of earlier hops'
    outputs (owner's address, slot), given back when the request ends; ``records``: the
    completion records of the hops run so far (statistics)."""
    head: SubmitRequest
    hops: list[ChainHop]
    leases: list[int]
    workers: list[int]
    at: int = 0
    held: list[tuple[str, ShmRef]] = []
    records: list["LeasedRecord"] = []
    cpu: int = ANYWHERE                 # where each hop's worker waits next (above)


class LeasedExecute(msgspec.Struct, array_like=True, tag=26):
    """A request sent straight to a leased worker (no scheduler hop); its payload frame
    follows. The head is what the scheduler would have got, for its statistics. ``cpu``: where
    the worker waits for its next request (above): on the frontend's own CPU while requests
    come one at a time, on any other while they overlap (frontend/colocation.py)."""
    lease_id: int
    head: SubmitRequest
    cpu: int = ANYWHERE
