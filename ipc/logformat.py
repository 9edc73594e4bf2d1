"""Triton's log line formats, and which records the log settings let through.

Every line carries a severity letter (E, W, I; a verbose record is an I line, as in Triton),
a UTC timestamp, the pid and the caller's file:line (docs/triton-compat.md §1.14):

    default  I0520 20:03:25.829575 3355 lifecycle.py:441] "loading 'simple'"
    ISO8601  2024-05-20T20:03:26Z I 3355 lifecycle.py:441] "loading 'simple'"

The message is written as a JSON string, as Triton does by default: a client's text that ends
up in a message (a model or input name) cannot start a line of its own that reads like a log
record. ``TRITON_SERVER_ESCAPE_LOG_MESSAGES=0`` in the environment writes messages as they are.
A record's traceback is part of its message, so it is escaped with it.
"""
from __future__ import annotations

import json
import logging
import os
import time

from shmserve.ipc.messages.common import LogFormat, LogSettings

ESCAPE_ENV = "TRITON_SERVER_ESCAPE_LOG_MESSAGES"


def escape_messages() -> bool:
    return os.environ.get(ESCAPE_ENV, "1").strip() != "0"


def level_letter(levelno: int) -> str:
    if levelno >= logging.ERROR:
        return "E"
    if levelno >= logging.WARNING:
        return "W"
    return "I"


def allowed(settings: LogSettings, levelno: int) -> bool:
    """Whether a record of this level is written: each of info, warning and error is switched
    on and off by itself; below INFO (verbose) needs a verbose level of 1 or more, whatever
    log_info says (Triton's verbose lines do not depend on it either)."""
    if levelno >= logging.ERROR:
        return settings.error
    if levelno >= logging.WARNING:
        return settings.warning
    if levelno >= logging.INFO:
        return settings.info
    return settings.verbose > 0


def prefix(fmt: LogFormat, levelno: int, created: float, pid: int, filename: str,
           lineno: int) -> str:
    """Everything a line holds before its message."""
    secs = int(created)
    t = time.gmtime(secs)
    letter = level_letter(levelno)
    if fmt is LogFormat.ISO8601:
        return (f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:"
                f"{t.tm_sec:02d}Z {letter} {pid} {filename}:{lineno}] ")
    usec = min(999999, int((created - secs) * 1e6))
    return (f"{letter}{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:"
            f"{t.tm_sec:02d}.{usec:06d} {pid} {filename}:{lineno}] ")


class TritonFormatter(logging.Formatter):
    """Formats a record in the format that was in force when it was logged (SettingsFilter
    notes it), else in the one ``current()`` names."""

    def __init__(self, current, escape: bool | None = None):
        super().__init__()
        self.current = current          # () -> LogSettings
        self.escape = escape_messages() if escape is None else escape

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        if self.escape:
            text = json.dumps(text, ensure_ascii=False)
        fmt = getattr(record, "log_format", None) or self.current().format
        return prefix(fmt, record.levelno, record.created, record.process or 0, record.filename,
                      record.lineno) + text


class SettingsFilter(logging.Filter):
    """Lets through the records ``current()`` allows, and notes the format then in force on
    each; applied where a record is logged, so a silenced record costs no formatting and no
    room in the queue, and a line logged before a change of format is written in the old one
    even when the writer gets to it after the change."""

    def __init__(self, current):
        super().__init__()
        self.current = current

    def filter(self, record: logging.LogRecord) -> bool:
        settings = self.current()
        record.log_format = settings.format
        return allowed(settings, record.levelno)
