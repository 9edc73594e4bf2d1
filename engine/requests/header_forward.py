"""Forwarding HTTP headers and gRPC metadata to models as request parameters
(``--http-header-forward-pattern``, ``--grpc-header-forward-pattern``), as Triton does.

A header whose name the pattern matches anywhere (a search, not a full match) reaches the model
as a string parameter named after it (``request.parameters()`` in a python model). The match
ignores case, as HTTP header names do; a pattern that starts with ``(?-i)`` is matched with
case. A matching header that names a parameter the server reserves is refused with Triton's
words, rather than silently steering the request.
"""
from __future__ import annotations

import re
from typing import Iterable

from shmserve.engine.requests.prepare import RESERVED_PARAMS
from shmserve.ipc.errors import invalid

CASE_SENSITIVE = "(?-i)"


def compile_pattern(pattern: str) -> re.Pattern | None:
    """The pattern's regex (None: forward nothing); raises re.error for a bad one."""
    if not pattern:
        return None
    if pattern.startswith(CASE_SENSITIVE):
        return re.compile(pattern[len(CASE_SENSITIVE):])
    return re.compile(pattern, re.IGNORECASE)


class HeaderForward:
    def __init__(self, pattern: str):
        self.regex = compile_pattern(pattern)

    def params(self, headers: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
        """The parameters the headers that match become; raises InferError (400) for one that
        would set a reserved parameter."""
        regex = self.regex
        if regex is None:
            return {}
        out: dict[str, str] = {}
        for name, value in headers:
            if not regex.search(name):
                continue
            if name in RESERVED_PARAMS or name.startswith("triton_"):
                raise invalid(f"Header '{name}' is reserved for Triton usage and cannot be "
                              f"forwarded.")
            out[name] = value if isinstance(value, str) else value.decode("latin-1")
        return out
