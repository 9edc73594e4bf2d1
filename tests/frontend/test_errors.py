"""The one mapping from an error code to an HTTP status and to a gRPC status code."""
import grpc
import pytest

from shmserve.frontend.grpc.status import GRPC_STATUS, grpc_status
from shmserve.ipc.errors import HTTP_STATUS, http_status
from shmserve.ipc.messages.common import ErrorCode

# Triton's classes (docs/triton-compat.md §1.1): what each protocol answers for each
EXPECTED = {
    ErrorCode.INTERNAL: (500, grpc.StatusCode.INTERNAL),
    ErrorCode.NOT_FOUND: (404, grpc.StatusCode.NOT_FOUND),
    ErrorCode.INVALID_ARG: (400, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorCode.UNAVAILABLE: (503, grpc.StatusCode.UNAVAILABLE),
    ErrorCode.UNSUPPORTED: (501, grpc.StatusCode.UNIMPLEMENTED),
    ErrorCode.UNKNOWN: (400, grpc.StatusCode.UNKNOWN),
    ErrorCode.ALREADY_EXISTS: (400, grpc.StatusCode.ALREADY_EXISTS),
    ErrorCode.CANCELLED: (400, grpc.StatusCode.CANCELLED),
    ErrorCode.RESOURCE_EXHAUSTED: (507, grpc.StatusCode.RESOURCE_EXHAUSTED),   # /dev/shm full
}


def test_expectations_cover_every_code():
    assert set(EXPECTED) == set(ErrorCode)


def test_both_maps_are_total():
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert set(GRPC_STATUS) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode), ids=[c.value for c in ErrorCode])
def test_each_code_maps_for_both_protocols(code):
    status, grpc_code = EXPECTED[code]
    assert http_status(code) == status
    assert grpc_status(code) == grpc_code


@pytest.mark.parametrize("code", list(ErrorCode), ids=[c.value for c in ErrorCode])
def test_the_wire_string_maps_like_the_enum(code):
    # a code decoded from a message is the enum; one compared as its str value maps the same
    assert http_status(ErrorCode(code.value)) == EXPECTED[code][0]
    assert grpc_status(ErrorCode(code.value)) == EXPECTED[code][1]


def test_a_missing_code_is_internal():
    assert http_status(None) == 500
    assert grpc_status(None) == grpc.StatusCode.INTERNAL
