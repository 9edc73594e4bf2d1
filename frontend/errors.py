"""The one error type of the frontend, and the one mapping from its code to each protocol's status.

Everything below the protocol layer (service, catalog, request preparation, shared-memory
registry) raises ``InferError``; HTTP and gRPC translate its code with ``http_status`` and
``grpc_status``, so an error reads the same over both.
"""
from __future__ import annotations

import grpc

from shmserve.ipc.messages import ErrorCode
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

GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def http_status(code: ErrorCode) -> int:
    # a missing code (None) is a bug of whoever built the error: report it as internal
    return HTTP_STATUS.get(code, 500)


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    return GRPC_STATUS.get(code, grpc.StatusCode.INTERNAL)


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
