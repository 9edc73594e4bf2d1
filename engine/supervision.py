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

from shmserve.ipc.messages import InstanceSpec, WorkerArgs, WorkerLabel


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
        spec = args.spec
        label = WorkerLabel(spec.model_name, spec.version, spec.instance_name, args.spawn_id)
        # the arguments go through a file in the run directory: a config may be larger than
        # one command-line argument may be, and a pipe would block us until the child reads
        self.args_path = os.path.join(args.run_dir, f"w{args.spawn_id}.args.json")
        with open(self.args_path, "wb") as f:
            f.write(msgspec.json.encode(args))
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "shmserve.workers.main",
                 msgspec.json.encode(label).decode(), self.args_path],
                stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            self.forget_args()
            raise
        self.pid = self.popen.pid
        self.pidfd = os.pidfd_open(self.pid)

    def forget_args(self) -> None:
        """The worker removes its arguments file once read; this covers one that died first."""
        try:
            os.unlink(self.args_path)
        except FileNotFoundError:
            pass

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
        self.forget_args()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn_worker(spawn_id: int, run_dir: str, scheduler_addr: str, segment_prefix: str,
                 spec: InstanceSpec, log_verbose: int) -> WorkerProcess:
    args = WorkerArgs(spawn_id=spawn_id, parent=os.getpid(), run_dir=run_dir,
                      scheduler=scheduler_addr, segment_prefix=segment_prefix, spec=spec,
                      log_verbose=log_verbose)
    return WorkerProcess(args)
