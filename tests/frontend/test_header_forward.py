"""engine/requests/header_forward.py: which headers become parameters, case, and the reserved names."""
import pytest

from shmserve.engine.requests.header_forward import HeaderForward
from shmserve.ipc.errors import InferError

HEADERS = [("X-Tenant", "acme"), ("x-trace", "abc"), ("Content-Type", "application/json"),
           ("PREFIX_a", "1"), ("prefix_b", "2"), ("my-x-thing", "3")]


def test_no_pattern_forwards_nothing():
    assert HeaderForward("").params(HEADERS) == {}


def test_a_search_that_ignores_case_keeping_the_names_as_sent():
    # x- matches anywhere in the name (my-x-thing too), in any case
    assert HeaderForward("x-").params(HEADERS) == {"X-Tenant": "acme", "x-trace": "abc",
                                                   "my-x-thing": "3"}
    assert HeaderForward("^x-").params(HEADERS) == {"X-Tenant": "acme", "x-trace": "abc"}


def test_a_pattern_starting_with_minus_i_matches_with_case():
    assert HeaderForward("(?-i)PREFIX_.*").params(HEADERS) == {"PREFIX_a": "1"}
    assert HeaderForward("PREFIX_.*").params(HEADERS) == {"PREFIX_a": "1", "prefix_b": "2"}


def test_binary_metadata_values_become_text():
    assert HeaderForward("^k").params([("key-bin", b"\x00\xff")]) == {"key-bin": "\x00\xff"}


@pytest.mark.parametrize("name", ["priority", "sequence_id", "timeout", "triton_anything",
                                  "binary_data_output"])
def test_a_header_that_would_set_a_reserved_parameter_is_refused(name):
    with pytest.raises(InferError) as e:
        HeaderForward(".*").params([(name, "5")])
    assert e.value.message == f"Header '{name}' is reserved for Triton usage and cannot be " \
                              f"forwarded."
