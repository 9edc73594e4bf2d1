"""Worker processes: spawning one per model instance and noticing at once when one exits.

Each worker is watched through a pidfd (engine/exits.py), so a death is seen within one
poll wake-up, without a SIGCHLD handler that would reap children it does not own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec

from shmserve.ipc.messages import InstanceSpec, WorkerArgs


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"


class WorkerProcess:
    def __init__(self, args: WorkerArgs):
        self.args = args
        blob = msgspec.json.encode(args).decode()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "shmserve.workers.main", blob],
            stdin=subprocess.DEVNULL, close_fds=True)
        self.pid = self.popen.pid
        self.pidfd = os.pidfd_open(self.pid)

    def reap(self) -> int | None:
        """Collect the exit status of this one child (never any other)."""
        try:
            return self.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.kill()
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn_worker(instance: int, run_dir: str, scheduler_addr: str, segment_prefix: str,
                 spec: InstanceSpec, log_verbose: int) -> WorkerProcess:
    args = WorkerArgs(spawn_id=instance, parent=os.getpid(), run_dir=run_dir,
                      scheduler=scheduler_addr, segment_prefix=segment_prefix, spec=spec,
                      log_verbose=log_verbose)
    return WorkerProcess(args)
