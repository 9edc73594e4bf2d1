"""Chaos: mlp_onnx (2 instances) under 16 concurrent clients while a worker is killed every 2 s;
and the same through ensemble_mlp (mlp_preprocess -> mlp_onnx -> mlp_postprocess), killing a
worker of any of its steps: each step is retried like any request, so the ensemble's clients see
no more than a model's do."""
import collections
import os
import signal
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from serverproc import Server, alive, descendants, segments_of, wait_for
from tritonclient.utils import InferenceServerException

KILL_EVERY_S = 2.0
# model, its input (name, datatype, maker), the models whose workers are killed, duration (s)
CASES = {
    "mlp_onnx": ("mlp_onnx", ("INPUT0", lambda rng: rng.standard_normal((1, 256)).astype(np.float32)),
                 ("mlp_onnx",), 20.0),
    "ensemble_mlp": ("ensemble_mlp", ("IMAGE", lambda rng: rng.integers(0, 255, (1, 256),
                                                                          dtype=np.uint8)),
                     ("mlp_preprocess", "mlp_onnx", "mlp_postprocess"), 10.0),
}


def _workers(srv, models):
    out = []
    for pid in descendants(srv.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()
            if any(f'"model_name":"{m}"' in cmdline for m in models):
                out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_chaos_every_request_answered(example_repo, case):
    model, (input_name, make_input), victims, duration_s = CASES[case]
    srv = Server(example_repo)
    counts = collections.Counter()
    slowest = [0.0]
    stop = threading.Event()
    lock = threading.Lock()

    def client():
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        x = make_input(np.random.default_rng(0))
        inp = httpclient.InferInput(input_name, list(x.shape),
                                    "FP32" if x.dtype == np.float32 else "UINT8")
        inp.set_data_from_numpy(x)
        while not stop.is_set():
            t = time.monotonic()
            try:
                c.infer(model, [inp])
                kind = "ok"
            except InferenceServerException as e:
                kind = f"{e.status()} {'worker died' if 'exited unexpectedly' in e.message() else e.message()[:60]}"
            with lock:
                counts[kind] += 1
                slowest[0] = max(slowest[0], time.monotonic() - t)
        c.close()

    try:
        processes_before = len(descendants(srv.proc.pid))
        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        kills = 0
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(KILL_EVERY_S)        # the chaos schedule itself, not synchronisation
            workers = [p for p in _workers(srv, victims) if alive(p)]
            if workers:
                os.kill(workers[kills % len(workers)], signal.SIGKILL)
                kills += 1
        stop.set()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a client hung"
        total = sum(counts.values())
        print(f"chaos: {total} requests, {kills} workers killed, outcomes {dict(counts)}, "
              f"slowest {slowest[0] * 1000:.0f} ms")
        # every failure is the documented case: a request whose retry also lost its worker
        assert set(counts) <= {"ok", "500 worker died"}, counts
        assert counts["ok"] > 0.99 * total
        wait_for(lambda: srv.model_ready(model) and srv.ready(), 60, "the killed instances to run again")
        # every killed worker was restarted, and nothing extra is left
        wait_for(lambda: len(descendants(srv.proc.pid)) == processes_before, 30,
                 "the process count to return to where it started")
    finally:
        stop.set()
        assert srv.stop() == 0
    assert segments_of(srv.proc.pid) == []
