"""Processes a model starts do not outlive its worker or the server (issue 13): each worker
leads a process group of its own, killed when the worker exits; the scheduler is a child
subreaper, so what escapes the group (a child that calls setsid) comes back to it, is reaped,
and is killed when the server stops."""
import os
import signal

import numpy as np
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, alive, wait_for

FORKER = '''
import os, subprocess
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.plain = subprocess.Popen(["sleep", "1000"])
        # leaves the worker's process group: only the subreaper can catch it
        self.detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)

    def execute(self, requests):
        pids = np.array([self.plain.pid, self.detached.pid, os.getpid()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PIDS", pids)]) for _ in requests]
'''

CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "PIDS", data_type: TYPE_INT64, dims: [ 3 ] } ]
'''


def _pids(server) -> tuple[int, int, int]:
    c = httpclient.InferenceServerClient(server.url, network_timeout=30)
    inp = httpclient.InferInput("INPUT0", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    plain, detached, worker = (int(p) for p in c.infer("forker", [inp]).as_numpy("PIDS"))
    c.close()
    return plain, detached, worker


def _gone(pid: int) -> bool:
    """Not running and reaped: no zombie left behind either."""
    return not os.path.exists(f"/proc/{pid}")


def test_children_of_a_model_die_with_the_server(tmp_path):
    write_model(str(tmp_path), "forker", CONFIG, FORKER)
    srv = Server(str(tmp_path))
    try:
        plain, detached, _ = _pids(srv)
        assert alive(plain) and alive(detached)
    finally:
        assert srv.stop() == 0          # SIGTERM to the launcher
    wait_for(lambda: not alive(plain), 10, "the model's child to be killed")
    wait_for(lambda: not alive(detached), 10, "the model's setsid child to be killed")


def test_the_children_of_a_killed_worker_die_with_it(tmp_path):
    write_model(str(tmp_path), "forker", CONFIG, FORKER)
    srv = Server(str(tmp_path))
    try:
        plain, detached, worker = _pids(srv)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: _gone(plain), 10, "the killed worker's child to be killed and reaped")
        # a child that left the worker's process group survives its worker (best effort): it
        # is the scheduler's now, and goes when the server stops
        assert alive(detached)
        new_plain, _, new_worker = wait_for(
            lambda: _restarted(srv, worker), 30, "the worker to be restarted")
        assert alive(new_plain)
    finally:
        assert srv.stop() == 0
    for pid in (detached, new_plain):
        wait_for(lambda: not alive(pid), 10, "every child to be killed at shutdown")


def _restarted(server, old_worker: int):
    try:
        pids = _pids(server)
    except Exception:           # noqa: BLE001 - restarting: try again
        return None
    return pids if pids[2] != old_worker else None
