"""The scheduler core's only way to act on the world.

``SchedulerCore`` decides; whatever it decides to do to a socket or a process goes through this
small interface. The process shell (engine/scheduler.py) implements it with ZeroMQ outboxes,
subprocesses and pidfds; the core's tests implement it with lists (tests/engine/fakes.py).
Workers are named by spawn id: one id per worker process, never reused in a server's life.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from shmserve.ipc.messages.common import LogSettings
from shmserve.ipc.spawn_args import InstanceSpec


class SchedulerPort(Protocol):
    def connect_frontend(self, frontend: int, address: str) -> None:
        """A frontend said hello: messages for it go to ``address`` from now on. A second
        hello under the same id is a new process in the place of one that died: the
        connection is made again."""

    def send_frontend(self, frontend: int, msg) -> None:
        """Best effort: a frontend that never said hello is skipped."""

    def connect_worker(self, spawn_id: int, address: str) -> None:
        """A worker is up and listening on ``address``."""

    def send_worker(self, spawn_id: int, msg, payloads: Sequence[bytes] = ()) -> None:
        """To a connected worker; ``payloads`` are opaque frames forwarded as they are."""

    def spawn(self, spawn_id: int, spec: InstanceSpec) -> None:
        """Start a worker process; its exit comes back as ``SchedulerCore.process_exited``."""

    def kill(self, spawn_id: int) -> None:
        """SIGKILL a worker and its process group (no-op if it has exited); its exit is
        reported as usual."""

    def stopped(self, spawn_id: int) -> bool:
        """Whether the worker's process is stopped (SIGSTOP, SIGTSTP or a tracer): it runs
        nothing, answers nothing and would hold its batch until the execution timeout."""

    def last_words(self, spawn_id: int) -> str:
        """Why a worker that failed to load said it failed (it writes that to a file before it
        exits), or "". Its WorkerLoadFailed message says the same, but may come after the
        report of its exit: the two travel different ways."""

    def last_execution(self, spawn_id: int) -> tuple[int, int, int]:
        """What the worker was executing when it ended (ipc/exec_record.py): (requests,
        frontend and request id of the first); (0, 0, 0) when nothing. Read before ``reap``."""

    def reap(self, spawn_id: int) -> int | None:
        """The worker has exited: kill what is left of its process group (what the model
        started), collect its status, close what pointed at it (socket, descriptors). Returns
        the exit status as ``Popen.returncode`` gives it."""

    def unlink(self, spawn_id: int) -> None:
        """Remove the shared-memory segments a worker created."""

    def memory(self, spawn_id: int) -> int | None:
        """The worker's proportional set size in bytes (its share of the pages it maps), or
        None when it cannot be read (the process is gone)."""

    def apply_log_settings(self, settings: LogSettings) -> None:
        """This process logs by ``settings`` from now on, and workers spawned later start
        with them."""
