"""The gRPC status of each error code: the gRPC half of the one mapping (``ipc/errors.py`` has
the HTTP half and the error type). Every member is listed so a new code cannot fall through
unnoticed (tests/frontend/test_errors.py checks the map is total)."""
from __future__ import annotations

import grpc

from shmserve.ipc.messages.common import ErrorCode

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


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    # a missing code (None) is a bug of whoever built the error: report it as internal
    return GRPC_STATUS.get(code, grpc.StatusCode.INTERNAL)
