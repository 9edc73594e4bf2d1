"""Process plumbing shared by every shmserve process: parent-death signal and flag-only handlers."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL us when our parent exits, and exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != expected_parent:
        os._exit(1)


class StopFlag:
    """SIGTERM/SIGINT only set a flag; the process loop notices it and shuts down in order."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.set = False
        self.signum = 0
        for s in signals:
            signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        self.set = True
        self.signum = signum
