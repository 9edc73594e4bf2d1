"""The error types every process shares, and the one mapping from an error's code to each
protocol's status.

Everything below the protocol layer (service, catalog, request preparation, shared-memory
registry, a python model's BLS client) raises ``InferError``; HTTP and gRPC translate its code
with ``http_status`` (here) and ``grpc_status`` (frontend/grpc/status.py), so an error reads
the same over both. A backend that
cannot load (its files, its GPU) raises ``BackendLoadError``, and the worker reports it.
"""
from __future__ import annotations

import zmq

from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.shm import ShmError, ShmFull

# Triton's HTTP frontend answers UNKNOWN, INVALID_ARG, ALREADY_EXISTS and CANCELLED with 400
# (docs/triton-compat.md §1.1). Every member is listed so a new code cannot fall through unnoticed
# (tests/frontend/test_errors.py checks both maps are total).
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.UNKNOWN: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    # 507 Insufficient Storage, not 503: the server is up and serves what fits, and a tensor
    # larger than /dev/shm never will, so this must not read as "retry" or "not ready"
    ErrorCode.RESOURCE_EXHAUSTED: 507,
}


def http_status(code: ErrorCode) -> int:
    # a missing code (None) is a bug of whoever built the error: report it as internal
    return HTTP_STATUS.get(code, 500)


class InferError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> InferError:
    return InferError(ErrorCode.INVALID_ARG, message)


def shm_error(e: ShmError) -> InferError:
    """An arena allocation that failed: a full /dev/shm is the host's limit, not a bug."""
    return InferError(ErrorCode.RESOURCE_EXHAUSTED if isinstance(e, ShmFull)
                      else ErrorCode.INTERNAL, str(e))


class BackendLoadError(Exception):
    """A model instance cannot load: the text says why, and reaches the load's caller."""


class PeerGone(ConnectionError):
    """The receiving process has closed its inbox or exited (ipc/packets.py)."""


class PeerStalled(zmq.Again):
    """The receiver has not read for ``packets.SEND_TIMEOUT_S`` while its buffer was full."""

    def __init__(self, msg: str):
        super().__init__(zmq.EAGAIN)
        self.strerror = msg

    def __str__(self) -> str:
        return self.strerror
