"""bench/floor_server.py, the floors docs/performance.md compares shmserve with: each floor
answers a real tritonclient infer with the input echoed back, through every hop count and
transport it offers, and stops on SIGTERM."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.http as httpclient
from serverproc import REPO_ROOT, wait_for

FLOOR = os.path.join(REPO_ROOT, "bench", "floor_server.py")


@pytest.mark.parametrize("hops, transport", [(0, "zmq"), (2, "unix"), (3, "unix"), (4, "unix"),
                                             (3, "zmq")])
def test_a_floor_echoes_the_input_through_its_hops(tmp_path, hops, transport):
    port_file = str(tmp_path / "floor.json")
    proc = subprocess.Popen([sys.executable, FLOOR, "--port", "0", "--port-file", port_file,
                             "--hops", str(hops), "--transport", transport])
    try:
        wait_for(lambda: os.path.exists(port_file), 30, "the floor server to listen")
        with open(port_file) as f:
            port = json.load(f)["http"]
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        for _ in range(3):
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
            got = client.infer("identity_fp32", [inp], outputs=[out]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(got, x)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
