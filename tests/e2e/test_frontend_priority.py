"""--frontend-priority: the frontend's event-loop thread answers at real-time priority while it
holds many requests (auto: raised for each drain of answers, so the thread is normal between
them), always (realtime), or never (normal). Read from the outside with sched_getscheduler on
the frontend's main thread and from the log line auto writes the first time it raises."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, descendants, frontend_pids, wait_for

# Each request waits in execute until the test creates the file named by the config parameter
# (one instance, no batching: the first request waits inside, the rest queue behind it).
GATED = '''
import json, os, time
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.gate = cfg["parameters"]["GATE"]["string_value"]
    def execute(self, requests):
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

HELD = 12       # above the 8 held requests from which answers are written raised


def _rt_allowed() -> bool:
    code = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    not _rt_allowed(), reason="this machine does not let a process use real-time scheduling "
                              "(no CAP_SYS_NICE, RLIMIT_RTPRIO 0)")


def frontend_pid(server) -> int:
    (pid,) = frontend_pids(server)
    return pid


def policy(pid: int) -> int:
    return os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK


@pytest.fixture
def repo(tmp_path):
    gate = tmp_path / "open"
    write_model(str(tmp_path / "repo"), "gated", f'''
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        instance_group [ {{ count: 1, kind: KIND_CPU }} ]
        parameters {{ key: "GATE" value: {{ string_value: "{gate}" }} }}
    ''', GATED)
    return str(tmp_path / "repo"), gate


def test_auto_answers_raised_while_many_requests_are_held_and_is_normal_between(repo):
    root, gate = repo
    srv = Server(root)
    try:
        fe = frontend_pid(srv)
        assert policy(fe) == os.SCHED_OTHER
        client = httpclient.InferenceServerClient(srv.url, concurrency=HELD)
        x = np.arange(4, dtype=np.float32)
        pending = []
        for i in range(HELD):
            inp = httpclient.InferInput("INPUT0", [4], "FP32")
            inp.set_data_from_numpy(x + i)
            pending.append(client.async_infer("gated", [inp]))
        gate.touch()
        for i, p in enumerate(pending):
            assert (p.get_result(timeout=60).as_numpy("OUTPUT0") == x + i).all()
        # the first answers came back while 8 or more were held
        wait_for(lambda: "answers at real-time priority while 8 or more requests are held"
                 in srv.log_text(), 20, "the frontend's note that it raised its priority")
        assert "stays at normal priority" not in srv.log_text()
        # raised for each drain only: normal again, and nothing else was ever raised
        wait_for(lambda: policy(fe) == os.SCHED_OTHER, 20, "the frontend at normal priority")
        for pid in descendants(srv.proc.pid):
            assert policy(pid) == os.SCHED_OTHER, pid
        client.close()
    finally:
        gate.touch()
        srv.stop()


def test_realtime_is_set_at_start_and_normal_never(repo):
    root, gate = repo
    gate.touch()
    srv = Server(root, "--frontend-priority", "realtime")
    try:
        fe = frontend_pid(srv)
        wait_for(lambda: policy(fe) == os.SCHED_FIFO, 20, "the frontend at real-time priority")
        # only the event loop's thread: the frontend's other threads stay normal
        others = [int(t) for t in os.listdir(f"/proc/{fe}/task") if int(t) != fe]
        assert others and all(policy(t) == os.SCHED_OTHER for t in others)
    finally:
        srv.stop()
    srv = Server(root, "--frontend-priority", "normal")
    try:
        client = httpclient.InferenceServerClient(srv.url, concurrency=HELD)
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_data_from_numpy(np.zeros(4, dtype=np.float32))
        pending = [client.async_infer("gated", [inp]) for _ in range(HELD)]
        for p in pending:
            p.get_result(timeout=60)
        assert policy(frontend_pid(srv)) == os.SCHED_OTHER
        assert "real-time priority" not in srv.log_text()
        client.close()
    finally:
        srv.stop()


def test_an_unknown_priority_is_refused_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository",
                          str(tmp_path), "--frontend-priority", "highest"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--frontend-priority" in out.stderr and "highest" in out.stderr
