"""Lifecycles as explicit enums. ModelState travels on the wire, so it lives in ipc/messages/common.py."""
from __future__ import annotations

import enum

from shmserve.ipc.messages.common import ModelState

__all__ = ["InstanceState", "ModelState", "KillReason"]


class InstanceState(enum.Enum):
    """State of one worker process (one model instance)."""
    STARTING = "STARTING"       # spawned, loading the model
    IDLE = "IDLE"               # ready for a batch
    BUSY = "BUSY"               # executing a batch
    LEASED = "LEASED"           # lent to a frontend, which sends it requests directly
    BACKOFF = "BACKOFF"         # died; waiting to be restarted
    STOPPED = "STOPPED"         # told to stop, or failed to load


class KillReason(enum.Enum):
    """Why the scheduler killed a worker; decides what happens to the requests it held."""
    NONE = "none"
    EXECUTION_TIMEOUT = "execution_timeout"     # a hung batch: its requests fail, no retry
    PING_TIMEOUT = "ping_timeout"               # idle and unresponsive: nothing to retry
    LOAD_ABORTED = "load_aborted"               # its load failed or was cancelled
    LOAD_TIMEOUT = "load_timeout"               # not ready within --model-load-timeout-secs
    STOPPED = "stopped"                         # the kernel reported it stopped (SIGSTOP)

    @property
    def retries(self) -> bool:
        """Whether the requests of a worker that died this way get their one retry: not when
        their own execution ran too long (a poison request would kill again), only when the
        worker died of something else, or sat stopped, which says nothing about them."""
        return self in (KillReason.NONE, KillReason.STOPPED)
