"""The protocol between the scheduler and its fork server (engine/processes/forkserver.py,
workers/zygote.py).

Not inbox messages: they travel on the socket pair between the two, each a msgpack array, with
``ForkReply`` carrying the worker's "go" pipe as SCM_RIGHTS."""
from __future__ import annotations

import msgspec


# Not inbox messages: they travel on the socket pair between the scheduler and its fork server,
# each a msgpack array, with ForkReply carrying the worker's "go" pipe as SCM_RIGHTS.
class ZygoteSettings(msgspec.Struct, array_like=True):
    """The fork server's command-line argument (after it comes a blank placeholder argument
    whose bytes a forked worker overwrites with its own command line)."""
    parent: int                 # the scheduler: workers are re-parented to it
    sock_fd: int                # its end of the socket pair


class ZygoteHello(msgspec.Struct, array_like=True, frozen=True):
    """Sent once the fork server has imported what workers need and can fork."""
    pid: int
    title_room: int             # bytes a worker's command line may take (arg_start..arg_end)
    threads: int                # threads of the fork server (forks only when 1)
    preloaded: list[str] = []   # modules imported for the workers (onnxruntime when fork-safe)
    notes: list[str] = []       # what it would have logged (the scheduler logs it, verbose)


class ForkRequest(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    label: str                  # the WorkerLabel JSON: argv[1] of `python -m shmserve.workers.main`
    args_path: str              # argv[2]: the WorkerArgs file
    parent: int                 # the scheduler's pid: the worker waits to be its child


class ForkReply(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    pid: int = 0                # the worker, already the scheduler's child; 0 when none
    error: str = ""             # why not (fork failed, or threads appeared: fork no more)
    refuse_for_good: bool = False
