"""Errors a frontend answers with, and how Triton's error classes map to HTTP status codes."""
from __future__ import annotations

from shmserve.ipc.messages import ErrorCode

HTTP_STATUS = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
}


def http_status(code: str) -> int:
    # UNKNOWN, INVALID_ARG, ALREADY_EXISTS, CANCELLED and anything else are 400 (TRITON.md §1.1)
    return HTTP_STATUS.get(code, 400)


class InferError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> InferError:
    return InferError(ErrorCode.INVALID_ARG, message)
