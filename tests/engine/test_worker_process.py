"""WorkerProcess (engine/processes/supervision.py) against real processes: a kill reaches the worker even
before it leads a process group of its own, and what it leaves in the run directory goes."""
import os
import subprocess
import sys

from shmserve.engine.processes.supervision import spawn_worker
from shmserve.ipc.exec_record import ExecutionRecord, record_path
from shmserve.ipc.messages.common import LogSettings
from shmserve.ipc.spawn_args import InstanceSpec


class NotYetALeader:
    """Hands over a worker as the fork server does, at the moment a kill can find it: forked,
    running, but not yet through its first line (workers/zygote.py ``os.setsid()``), so still
    in another process group. A real process, which only sleeps."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def fork(self, label: str, args_path: str) -> tuple[int, int]:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.procs.append(p)
        return p.pid, os.pidfd_open(p.pid)


def _spec() -> InstanceSpec:
    return InstanceSpec("m", 1, "/nonexistent", "{}", "m_0", "CPU", 0, "python")


def test_a_worker_killed_before_it_made_its_process_group_dies(tmp_path):
    """Before, the kill was only a killpg() of the worker's own group, which a just-forked
    worker does not have yet: it survived, loaded, and stayed, a worker of no model (load and
    unload racing left such workers behind)."""
    fork = NotYetALeader()
    proc = spawn_worker(1, str(tmp_path), "unix:///nonexistent", "shmserve_test_", _spec(),
                        LogSettings(), forkserver=fork)
    try:
        assert proc.forked and proc.pid == fork.procs[0].pid
        assert os.getpgid(proc.pid) != proc.pid         # not a group leader
        proc.kill()
        assert proc.exited(timeout=10)
        assert proc.reap() == -9
    finally:
        for p in fork.procs:
            p.kill()
            p.wait()
        proc.close()


def test_the_execution_record_reads_back_and_goes_with_the_worker(tmp_path):
    fork = NotYetALeader()
    proc = spawn_worker(2, str(tmp_path), "unix:///nonexistent", "shmserve_test_", _spec(),
                        LogSettings(), forkserver=fork)
    try:
        assert proc.last_execution() == (0, 0, 0)        # no record: nothing running
        record = ExecutionRecord(record_path(str(tmp_path), 2))
        record.running(3, 1, 12345678901)
        assert proc.last_execution() == (3, 1, 12345678901)
        record.idle()
        assert proc.last_execution() == (0, 0, 0)
        record.close()
        proc.kill()
        assert proc.exited(timeout=10)
        proc.reap()
    finally:
        for p in fork.procs:
            p.kill()
            p.wait()
        proc.close()
    assert os.listdir(tmp_path) == []                   # arguments and record removed
