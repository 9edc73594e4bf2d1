"""Operating-system situations the fault tests create for real: a small /dev/shm of our own and a
pipe nobody reads."""
from __future__ import annotations

import os
import subprocess


def small_shm_possible() -> bool:
    """Whether a child may mount a tmpfs of its own on /dev/shm (a private mount namespace:
    root, or a user namespace that allows mounts), so a full tmpfs is real and the host's is
    untouched."""
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is already full: the next write to it blocks until someone reads.
    The write end is left blocking, as a server finds its stdout."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for chunk in (4096, 1):
        try:
            while True:
                os.write(w, b"x" * chunk)
        except BlockingIOError:
            pass
    os.set_blocking(w, True)
    return r, w
