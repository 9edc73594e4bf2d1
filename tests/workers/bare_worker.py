"""A Worker with nothing set: a test gives it only what the code under test uses.

The real constructor opens the worker's inbox, arena and model; the worker's module is compiled,
so ``Worker.__new__`` would run that constructor, and only an interpreted subclass may skip it.
"""
from __future__ import annotations

from shmserve.workers.worker import Worker


class BareWorker(Worker):
    def __init__(self) -> None:     # (deliberately not calling Worker.__init__)
        pass
