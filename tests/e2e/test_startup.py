"""What a user sees while the server starts: a port already taken (one line, before any model
loads), `--help` with defaults, a line for a slow load, the status table, hints for a
repository laid out wrongly, and 503 "loading" for a model that is not ready yet."""
import os
import socket
import subprocess
import sys
import textwrap

import requests
from repo_builder import write_model
from serverproc import Server, descendants, wait_for

IO = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
'''
ECHO = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
''')
# initialize() waits for the file GATE to exist: the test decides when the load ends, with
# no sleeping on its side
GATED = textwrap.dedent('''
    import os, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            deadline = time.monotonic() + 60
            while not os.path.exists(GATE) and time.monotonic() < deadline:
                time.sleep(0.02)

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
''')


def test_a_port_in_use_stops_the_start_with_one_line_before_any_model_loads(tmp_path):
    write_model(str(tmp_path), "echo", IO, ECHO)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", str(tmp_path),
             "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0",
             "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another port " \
           f"with --http-port" in out, out
    assert "Traceback" not in out and "echo" not in out, out     # no model started loading


def test_help_shows_the_defaults():
    out = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    helps: dict[str, str] = {}          # the first line of each flag's entry -> its whole text
    flag = ""
    for line in out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            helps[flag] = line
        elif flag:
            helps[flag] += " " + line.strip()
    for flag, default in (("--http-port", "8000"), ("--grpc-port", "8001"),
                          ("--model-control-mode", "none"), ("--log-verbose", "0"),
                          ("--exit-timeout-secs", "30.0")):
        assert f"(default: {default})" in helps[flag] or \
            helps[flag].endswith(f"default: {default}"), helps[flag]


def test_a_loading_model_answers_503_then_serves_and_the_start_is_reported(tmp_path):
    repo = tmp_path / "repo"
    gate = tmp_path / "gate"
    write_model(str(repo), "slow", IO, f"GATE = {str(gate)!r}\n" + GATED)
    write_model(str(repo), "echo", IO, ECHO)
    (repo / "model.onnx").write_bytes(b"")          # at the top: a hint, nothing else
    (repo / "loose").mkdir()
    (repo / "loose" / "model.py").write_text(ECHO)  # no version directory
    s = Server(str(repo), wait_ready=False)
    try:
        # the server is not ready while a model of its start-up loads; echo serves already
        wait_for(lambda: s.model_ready("echo"), 60, "echo to be ready")
        body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [3]}]}
        r = requests.post(f"{s.base}/v2/models/slow/infer", json=body, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == ("Request for unknown model: 'slow' version 1 is not at "
                                     "ready state: the model is loading")
        wait_for(lambda: "model 'slow' is still loading (5 s so far)" in s.log_text(), 30,
                 "a line about the slow load")
        assert "model status:" not in s.log_text()         # start-up has not finished
        gate.touch()
        wait_for(lambda: s.model_ready("slow"), 60, "slow to be ready")
        r = requests.post(f"{s.base}/v2/models/slow/infer", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3], r.text
        wait_for(lambda: "model status:" in s.log_text(), 10, "the status table")
        log = s.log_text()
        table = log.split("model status:", 1)[1]
        # each line of the table is a log record of its own: '... lifecycle.py:N] "| a | b |"'
        cells = [line.split('] "', 1)[1].rstrip('"') for line in table.splitlines()
                 if '] "| ' in line]
        rows = [[c.strip() for c in line.split("|")[1:4]] for line in cells]
        assert rows[0] == ["Model", "Version", "Status"]
        assert ["echo", "1", "READY"] in rows and ["slow", "1", "READY"] in rows
        assert ["loose", "-", f"UNAVAILABLE: model 'loose' has no version directory: "
                f"{repo}/loose/model.py is not in a version directory: a model's files live "
                f"in numbered version directories, e.g. {repo}/loose/1/model.py"] in rows
        assert f"{repo}/model.onnx is a file at the top of the model repository" in log
        pids = descendants(s.proc.pid)
    finally:
        s.stop()
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10,
             "the server's processes to end")
