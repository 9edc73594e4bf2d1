"""Lifecycles as explicit enums."""
from __future__ import annotations

import enum


class ModelState(str, enum.Enum):
    """State of one model version, as the repository index reports it."""
    UNKNOWN = "UNKNOWN"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class InstanceState(enum.Enum):
    """State of one worker process (one model instance)."""
    STARTING = "STARTING"       # spawned, loading the model
    IDLE = "IDLE"               # ready for a batch
    BUSY = "BUSY"               # executing a batch
    BACKOFF = "BACKOFF"         # died; waiting to be restarted
    STOPPED = "STOPPED"         # told to stop, or failed to load
