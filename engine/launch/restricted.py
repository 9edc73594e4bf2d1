"""Restricted API groups, as tritonserver's ``--http-restricted-api`` and
``--grpc-restricted-protocol`` define them: a group of endpoints answers only requests that
carry a given header with a given value (docs/triton-compat.md §1.1).

    --http-restricted-api=model-repository,shared-memory:admin-key=s3cret

HTTP answers others 403 ``This API is restricted, expecting header 'admin-key'``; gRPC answers
UNAVAILABLE ``This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'``
(the header gRPC clients send carries that prefix).
"""
from __future__ import annotations

GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
          "statistics", "trace", "logging")
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class RestrictionError(ValueError):
    pass


def parse(specs: list[str], word: str = "api") -> dict[str, tuple[str, str]]:
    """``["<group>[,<group>...]:<header>=<value>", ...]`` -> group -> (header, value). A group
    may be restricted once; header names are case-insensitive, as HTTP's are. ``word``: what
    the flag calls a group in its errors, "api" (HTTP) or "protocol" (gRPC), as Triton's do."""
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        groups, sep, kv = spec.partition(":")
        key, eq, value = kv.partition("=")
        if not sep or not eq or not key.strip() or not groups.strip():
            raise RestrictionError(f"'{spec}': expected <{word}>[,<{word}>...]:<header>=<value>")
        for group in (g.strip() for g in groups.split(",")):
            # Triton's words first (its L0_http test greps the log for them), then ours
            if group not in GROUPS:
                raise RestrictionError(f"unknown restricted {word} '{group}' in '{spec}' (one of "
                                       f"{', '.join(GROUPS)})")
            if group in out:
                raise RestrictionError(f"{word} '{group}' can not be specified in multiple "
                                       f"config groups ('{spec}')")
            out[group] = (key.strip().lower(), value)
    return out


def http_refusal(group: str, restrictions: dict[str, tuple[str, str]],
                 headers: dict[str, str]) -> str:
    """The error message when ``headers`` do not open ``group``; "" when they do."""
    rule = restrictions.get(group)
    if rule is None or headers.get(rule[0]) == rule[1]:
        return ""
    return f"This API is restricted, expecting header '{rule[0]}'"


def grpc_refusal(group: str, restrictions: dict[str, tuple[str, str]], metadata) -> str:
    rule = restrictions.get(group)
    if rule is None:
        return ""
    key = GRPC_HEADER_PREFIX + rule[0]
    for k, v in metadata or ():
        if k == key and v == rule[1]:
            return ""
    return f"This protocol is restricted, expecting header '{key}'"
