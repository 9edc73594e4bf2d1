"""The logging extension (docs/triton-compat.md §1.14): ``GET|POST /v2/logging`` and the gRPC
``LogSettings`` RPC, read and checked once for both protocols.

A change is checked whole before any of it applies (Triton applies the keys before a bad one).
It applies in this frontend at once, then travels to the scheduler, which applies it and passes
it on to every worker and every other frontend (``SetLogSettings``); the client is answered
once the scheduler has done that. So a request the client sends after the answer runs under
the new settings in the frontends and the scheduler; a worker takes them with its next control
message, and a request that reaches a leased worker straight from the frontend may come first
(it then runs at the old level, as one already running would).

What clients see, as Triton words it:
- a ``log_file`` that is not null: UNSUPPORTED (HTTP 501, gRPC UNIMPLEMENTED) "log file
  location can not be updated through network protocol";
- a value of the wrong type: "expect boolean for 'log_info'", "expect int32 for
  'log_verbose_level'", "expect string for 'log_format'" (400 / INVALID_ARGUMENT);
- a format other than ``default`` and ``ISO8601``: "invalid argument for log_format, got: X".
Beyond Triton, which ignores them, an unknown key is refused (400), so a misspelt setting is
not silently left as it was; and a verbose level below 0 or past int32 is refused.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from tritonclient.grpc import service_pb2 as pb

from shmserve.ipc import logs
from shmserve.ipc.errors import InferError, invalid
from shmserve.ipc.messages.common import ErrorCode, LogFormat, LogSettings

KEYS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
_LEVELS = {"log_info": "info", "log_warning": "warning", "log_error": "error"}
MAX_VERBOSE = 2 ** 31 - 1       # Triton keeps the level in an int32
NOT_SET = object()              # a gRPC SettingValue that holds no value


def render(settings: LogSettings, log_file: str) -> dict[str, Any]:
    """Every setting, as ``GET /v2/logging`` answers (the keys in Triton's order)."""
    return {"log_file": log_file, "log_info": settings.info, "log_warning": settings.warning,
            "log_error": settings.error, "log_verbose_level": settings.verbose,
            "log_format": settings.format.value}


def updated(current: LogSettings, changes: dict[str, Any]) -> LogSettings:
    """``current`` with ``changes`` (setting name -> value; None leaves a setting as it is, as
    JSON null does in Triton) applied. Raises InferError naming the first bad key."""
    if changes.get("log_file") is not None:
        raise InferError(ErrorCode.UNSUPPORTED,
                         "log file location can not be updated through network protocol")
    fields: dict[str, Any] = {}
    for key, value in changes.items():
        if key not in KEYS:
            raise invalid(f"unknown log setting '{key}' (the settings are {', '.join(KEYS)})")
        if value is None or key == "log_file":
            continue
        if key in _LEVELS:
            if not isinstance(value, bool):
                raise invalid(f"expect boolean for '{key}'")
            fields[_LEVELS[key]] = value
        elif key == "log_verbose_level":
            if isinstance(value, bool) or not isinstance(value, int):
                raise invalid(f"expect int32 for '{key}'")
            if not 0 <= value <= MAX_VERBOSE:
                raise invalid(f"invalid argument for log_verbose_level, got: {value} (expect an "
                              f"integer from 0 to {MAX_VERBOSE})")
            fields["verbose"] = value
        else:
            if not isinstance(value, str):
                raise invalid(f"expect string for '{key}'")
            try:
                fields["format"] = LogFormat(value)
            except ValueError:
                raise invalid(f"invalid argument for log_format, got: {value}") from None
    return msgspec.structs.replace(current, **fields)


def from_json(doc: Any) -> dict[str, Any]:
    """The changes a ``POST /v2/logging`` body (decoded) asks for."""
    if not isinstance(doc, dict):
        raise invalid("the log settings request must be a JSON object")
    return doc


def from_grpc(request: pb.LogSettingsRequest) -> dict[str, Any]:
    """The changes a ``LogSettingsRequest`` asks for; an empty value is NOT_SET, which no
    setting accepts (Triton: "expect boolean for ...")."""
    out: dict[str, Any] = {}
    for key, value in request.settings.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = NOT_SET if which is None else getattr(value, which)
    return out


def to_grpc(settings: LogSettings, log_file: str) -> pb.LogSettingsResponse:
    resp = pb.LogSettingsResponse()
    for key, value in render(settings, log_file).items():
        target = resp.settings[key]
        if isinstance(value, bool):
            target.bool_param = value
        elif isinstance(value, int):
            target.uint32_param = value
        else:
            target.string_param = value
    return resp


class LogControl:
    """This frontend's side of the extension; the settings themselves live in ``ipc.logs``."""

    def __init__(self, client):
        self.client = client            # EngineClient: the way to the scheduler

    def get(self) -> tuple[LogSettings, str]:
        return logs.current(), logs.log_file()

    async def update(self, changes: dict[str, Any]) -> tuple[LogSettings, str]:
        """Apply ``changes`` in every process; the settings now in force."""
        new = updated(logs.current(), changes)
        logs.apply(new)
        try:
            await self.client.log_settings(new)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE, "the scheduler did not confirm the new log "
                             "settings in time; they apply in this frontend, and elsewhere once "
                             "it reads them") from None
        return self.get()
