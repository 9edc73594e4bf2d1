"""Worker processes: spawning one per model instance and noticing at once when one exits.

Each worker is watched through a pidfd (engine/processes/exits.py), so a death is seen within one
poll wake-up, without a SIGCHLD handler that would reap children it does not own.

Each worker leads a process group of its own, and the group is SIGKILLed when the worker is
killed and again when it has exited, so what a model started (a subprocess, a pool) does not
outlive its worker. The group is signalled only while the worker is our unreaped child: its pid,
and with it the group id, cannot have been reused by then. A child that leaves the group
(setsid, setpgid) escapes this; the scheduler is a child subreaper (``become_subreaper``), so
such a process becomes the scheduler's child once its parent dies: it is reaped
(``reap_orphans``), and killed when the server stops (``kill_orphans``).

A worker is either spawned (``python -m shmserve.workers.main``, a fresh interpreter; for a python
model with an execution environment, engine/processes/env_worker.py, which execs it) or forked
by the fork server (engine/processes/forkserver.py), which hands it over as the scheduler's child with
the same command line; ``WorkerProcess`` treats both alike, reaping a forked one with
``os.waitpid`` instead of through ``subprocess.Popen``.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Collection

import msgspec

from shmserve.engine.lifecycle import execution_env
from shmserve.ipc.exec_record import read_record, record_path
from shmserve.ipc.messages.common import LogSettings
from shmserve.ipc.proc import failure_path
from shmserve.ipc.spawn_args import InstanceSpec, WorkerArgs, WorkerLabel

if TYPE_CHECKING:
    from shmserve.engine.processes.forkserver import ForkServer

log = logging.getLogger("shmserve.scheduler")


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


# A model config parameter: "false" (or no, off, 0) gives the model's workers fresh interpreters.
FORK_PARAMETER = "FORK_WORKER"


def fork_opt_out(spec: InstanceSpec) -> str:
    """Why this instance's worker must be a fresh interpreter rather than forked, or "": a
    python model with its own EXECUTION_ENV_PATH, or a config that says FORK_WORKER false."""
    if execution_env_of(spec):
        return execution_env.PARAMETER
    try:
        params = json.loads(spec.config_json).get("parameters") or {}
    except (ValueError, AttributeError):
        return ""
    p = params.get(FORK_PARAMETER) if isinstance(params, dict) else None
    flag = str(p.get("string_value", "")) if isinstance(p, dict) else (None if p is None else str(p))
    if flag is not None and flag.strip().lower() in ("false", "no", "off", "0"):
        return FORK_PARAMETER
    return ""


def execution_env_of(spec: InstanceSpec) -> str:
    """The EXECUTION_ENV_PATH of a python model or of a python-based backend's model, or ""."""
    return execution_env.requested(spec.backend, spec.config_json, spec.backend_source)


def worker_command(spec: InstanceSpec) -> str:
    """The module a spawned worker runs: a python model with an execution environment starts
    in engine/processes/env_worker.py, which makes the environment ready and execs the worker."""
    if execution_env_of(spec):
        return "shmserve.engine.processes.env_worker"
    return "shmserve.workers.main"


class WorkerProcess:
    def __init__(self, args: WorkerArgs, forkserver: ForkServer | None = None):
        """Forks the worker from ``engine/processes/forkserver.py`` when given and able, else spawns it."""
        self.args = args
        spec = args.spec
        label = msgspec.json.encode(
            WorkerLabel(spec.model_name, spec.version, spec.instance_name, args.spawn_id)).decode()
        # the arguments go through a file in the run directory: a config may be larger than
        # one command-line argument may be, and a pipe would block us until the child reads
        self.args_path = os.path.join(args.run_dir, f"w{args.spawn_id}.args.json")
        with open(self.args_path, "wb") as f:
            f.write(msgspec.json.encode(args))
        self.popen: subprocess.Popen | None = None
        self.returncode: int | None = None      # once reaped
        try:
            forked = None
            module = worker_command(spec)
            if forkserver is not None and module == "shmserve.workers.main":
                try:
                    forked = forkserver.fork(label, self.args_path)
                except Exception:           # a bug there must not cost the model its worker
                    log.exception("the fork server failed unexpectedly; spawning the worker")
            if forked is not None:
                self.pid, self.pidfd = forked
            else:
                self.popen = subprocess.Popen(
                    [sys.executable, "-m", module, label, self.args_path],
                    # a session (so a group) of its own: process_group=0 needs Python 3.11
                    stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)
                self.pid = self.popen.pid
                self.pidfd = os.pidfd_open(self.pid)
        except BaseException:
            self.forget_args()
            raise

    @property
    def forked(self) -> bool:
        return self.popen is None

    def forget_args(self) -> None:
        """The worker removes its arguments file once read; this covers one that died first.
        Its execution record (ipc/exec_record.py) goes too."""
        for path in (self.args_path, record_path(self.args.run_dir, self.args.spawn_id)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def last_execution(self) -> tuple[int, int, int]:
        """What it was executing when it ended (count, frontend, first request id)."""
        return read_record(record_path(self.args.run_dir, self.args.spawn_id))

    def last_words(self) -> str:
        """The load failure the worker wrote before it exited (workers/worker.py), or ""."""
        path = failure_path(self.args_path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(64 * 1024)
            os.unlink(path)
        except OSError:
            return ""
        return text

    def exited(self, timeout: float | None = 0.0) -> bool:
        """Whether the worker has exited, waiting up to ``timeout`` seconds (None: for ever).
        Reads its pidfd and never reaps it, so its group can still be signalled safely."""
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else int(timeout * 1000)))

    def reap(self) -> int | None:
        """Kill what is left of the worker's process group, then collect the exit status of
        this one child (never any other)."""
        self.kill_group()
        if self.popen is not None:
            try:
                self.returncode = self.popen.wait(timeout=1)
            except subprocess.TimeoutExpired:
                return None
            return self.returncode
        if self.returncode is None and self.exited(1.0):
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:       # not ours (cannot happen: it was re-parented)
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the worker and its process group."""
        self.kill_group()

    def kill_group(self) -> None:
        reaped = self.popen.returncode if self.popen is not None else self.returncode
        if reaped is None:                      # not reaped: the group id is still ours
            # the worker itself through its pidfd: a forked worker makes its group (setsid)
            # only once it runs, so a kill right after the fork finds no group yet, and a
            # killpg alone missed it (it then loaded and stayed, a worker of no model)
            if self.pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        self.forget_args()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn_worker(spawn_id: int, run_dir: str, scheduler_addr: str, segment_prefix: str,
                 spec: InstanceSpec, log: LogSettings, log_file: str = "",
                 forkserver: ForkServer | None = None,
                 cuda_memory_pool: dict[int, int] | None = None,
                 uploads: tuple[str, int] = ("", 0)) -> WorkerProcess:
    args = WorkerArgs(spawn_id=spawn_id, parent=os.getpid(), run_dir=run_dir,
                      scheduler=scheduler_addr, segment_prefix=segment_prefix, spec=spec,
                      log_verbose=log.verbose, log=log, log_file=log_file,
                      cuda_memory_pool=cuda_memory_pool or {},
                      model_upload_dir=uploads[0], model_upload_max_bytes=uploads[1])
    return WorkerProcess(args, forkserver)


def process_stopped(pid: int) -> bool:
    """Whether the kernel reports ``pid`` stopped: state T (SIGSTOP, SIGTSTP) or t (a tracer
    stopped it), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"T", b"t")


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Ask Linux to make this process the parent of its orphaned descendants (instead of
    init), so that what a worker's children leave behind can be reaped and killed here."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def children() -> list[int]:
    """Pids of this process's children (/proc/<pid>/task/<tid>/children)."""
    me = os.getpid()
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def reap_orphans(known: Collection[int]) -> int:
    """Collect the exit status of every child that exited and is not ``known`` (orphans that
    came to us as a subreaper). Never waits, never touches a known child."""
    n = 0
    for pid in children():
        if pid in known:
            continue
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        n += bool(done)
    return n


def kill_orphans(known: Collection[int], timeout_s: float = 2.0) -> int:
    """SIGKILL every child that is not ``known``, with its process group when it leads one,
    and reap it. What those leave behind comes to us in turn, so this repeats until no such
    child is left or ``timeout_s`` has passed. Returns how many there were (zombies that only
    needed reaping included)."""
    killed = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        orphans = [p for p in children() if p not in known]
        if not orphans:
            break
        for pid in orphans:
            try:
                if os.getpgid(pid) == pid:      # an unreaped child: the id cannot be reused
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        for pid in orphans:
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.01)
    return killed
