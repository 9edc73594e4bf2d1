"""HTTP routing from one table of (methods, path pattern, handler), compiled once.

A pattern is a path whose segments are literals or ``{name}`` captures. A capture matches one
non-empty segment (``{version}`` only digits, as Triton's routes: another path is not found)
and reaches the handler URL-unquoted, as a positional argument in the order of the pattern:
``handler(conn, req, *captures)``. Positional, not keyword, because a keyword call costs twice
as much and the infer path pays it on every request. The router answers what a path
means before any handler runs: no pattern matches (404), or patterns match but none takes the
method (405, with the methods that would have worked).

Resolution stays cheap on the infer hot path: a dict lookup for paths without captures, then
only the patterns with the same number of segments and the same last segment, compared literal
by literal (``python -m shmserve.frontend.http.routes`` times it).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence
from urllib.parse import unquote

Handler = Callable[..., None]
RouteSpec = tuple[str | Sequence[str], str, Handler]


def _is_capture(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


class _Pattern:
    __slots__ = ("pattern", "literals", "captures", "digits", "handlers")

    def __init__(self, pattern: str):
        self.pattern = pattern
        parts = pattern.split("/")
        # the first segment is "" for every pattern, and the bucket already matched the last one
        # when it is a literal: compare only what lies between
        self.literals: tuple[tuple[int, str], ...] = tuple(
            (i, p) for i, p in enumerate(parts[:-1]) if i and not _is_capture(p))
        self.captures: tuple[int, ...] = tuple(i for i, p in enumerate(parts) if _is_capture(p))
        self.digits: frozenset[int] = frozenset(i for i, p in enumerate(parts) if p == "{version}")
        self.handlers: dict[str, Handler] = {}


class Router:
    def __init__(self, routes: Iterable[RouteSpec]):
        self.exact: dict[str, dict[str, Handler]] = {}
        # segment count -> last segment (None where the pattern captures it) -> patterns, in
        # table order. The infer path ends in "infer", so it is compared with one pattern only.
        self.buckets: dict[int, dict[str | None, list[_Pattern]]] = {}
        patterns: dict[str, _Pattern] = {}
        for methods, pattern, handler in routes:
            if not pattern.startswith("/"):
                raise ValueError(f"route pattern '{pattern}' must start with '/'")
            if isinstance(methods, str):
                methods = (methods,)
            if "{" not in pattern:
                table = self.exact.setdefault(pattern, {})
            else:
                p = patterns.get(pattern)
                if p is None:
                    p = patterns[pattern] = _Pattern(pattern)
                    last = pattern.rsplit("/", 1)[1]
                    by_last = self.buckets.setdefault(pattern.count("/") + 1, {})
                    by_last.setdefault(None if _is_capture(last) else last, []).append(p)
                table = p.handlers
            for m in methods:
                if m in table:
                    raise ValueError(f"route {m} {pattern} is defined twice")
                table[m] = handler

    def match(self, method: str, path: str) -> tuple[Handler | None, list[str] | str]:
        """``(handler, captures)``; ``(None, "GET, POST")`` when only the method is wrong;
        ``(None, "")`` when nothing matches the path."""
        handlers = self.exact.get(path)
        if handlers is not None:
            handler = handlers.get(method)
            if handler is not None:
                return handler, []
            return None, ", ".join(sorted(handlers))
        parts = path.split("/")
        by_last = self.buckets.get(len(parts))
        if by_last is None or parts[0]:
            return None, ""
        allowed: list[str] = []
        for key in (parts[-1], None):
            for p in by_last.get(key, ()):
                for i, literal in p.literals:
                    if parts[i] != literal:
                        break
                else:
                    captures = []
                    for i in p.captures:
                        value = parts[i]
                        if not value or (i in p.digits and not (value.isascii() and value.isdigit())):
                            break
                        captures.append(unquote(value) if "%" in value else value)
                    else:
                        handler = p.handlers.get(method)
                        if handler is not None:
                            return handler, captures
                        allowed.extend(p.handlers)
        return None, ", ".join(sorted(set(allowed)))
