"""An ensemble's intermediate tensor that stays on the GPU, through a real server on a machine
without one: every server process has the fake cuda-python (tests/e2e/fake_cuda_python, whose
"device memory" is POSIX shared memory that processes reach through CUDA IPC handles).

gpu_make (python) leaves MID on the GPU (``Tensor.from_dlpack`` of a device tensor); gpu_take
(python, FORCE_CPU_ONLY_INPUT_TENSORS "no") reads it as a GPU tensor and says so (ON_GPU). MID
goes from one worker to the other as a CUDA IPC handle into gpu_make's device arena: gpu_take
maps gpu_make's allocation, and its input is not in host memory. The server runs with a device
arena of one slot (--cuda-memory-pool-byte-size 0:4096), so that every request that finds its
tensor on the GPU shows the slot of the one before was given back: after many requests, after a
failing second step, after requests that ran at once (some of which fell back to host memory).
A tensor too large for the arena goes through host memory and the answer is the same. A killed
gpu_make: the server keeps serving, and gpu_take closes the dead worker's handles.

In-process: tests/workers/test_device_arena.py, tests/engine/test_ensemble_device.py."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import tritonclient.http as httpclient
from handoff_models import write_handoff_models
from serverproc import Server, alive, descendants, wait_for, worker_pid
from tritonclient.utils import InferenceServerException

HERE = os.path.dirname(os.path.abspath(__file__))
SLOT_FLOATS = 1024          # one slot of the arena (4096 bytes)

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("gpu_handoff"))
    write_handoff_models(repo)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, "fake_cuda_python"),
                                                           env_path) if p)
    try:
        srv = Server(repo, "--cuda-memory-pool-byte-size", f"0:{SLOT_FLOATS * 4}")
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    yield srv
    pids = descendants(srv.proc.pid)
    assert srv.stop() == 0
    # what the fake leaves behind: "device memory" of workers that were killed, or that a
    # model still held when its worker exited (a real driver frees it with the process)
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the workers to exit")
    for name in os.listdir("/dev/shm"):
        if name.startswith("fakecuda_") and not alive(int(name.split("_")[1])):
            os.unlink(f"/dev/shm/{name}")


def infer(server, x: np.ndarray):
    c = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        inp = httpclient.InferInput("IN", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer("gpu_pipe", [inp])
        return res.as_numpy("OUT"), bool(res.as_numpy("ON_GPU")[0])
    finally:
        c.close()


def maps_device_memory_of(pid: int, owner: int) -> bool:
    """Whether process ``pid`` maps an allocation the fake driver made in process ``owner``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f"/fakecuda_{owner}_" in f.read()
    except OSError:
        return False


def test_the_intermediate_tensor_travels_as_a_cuda_ipc_handle(server):
    for i in range(20):         # one slot: each request finds it given back by the one before
        x = np.arange(SLOT_FLOATS, dtype=np.float32) + i
        out, on_gpu = infer(server, x)
        np.testing.assert_array_equal(out, x * 2 + 1)
        assert on_gpu, f"request {i} found the arena's slot still taken"
    make, take = worker_pid(server, "gpu_make"), worker_pid(server, "gpu_take")
    assert make and take
    assert maps_device_memory_of(take, make)     # gpu_take opened gpu_make's arena


def test_a_tensor_too_large_for_the_arena_goes_through_host_memory(server):
    x = np.arange(2 * SLOT_FLOATS, dtype=np.float32)
    out, on_gpu = infer(server, x)
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert not on_gpu
    out, on_gpu = infer(server, x[:SLOT_FLOATS])
    assert on_gpu and out.shape == (SLOT_FLOATS,)


def test_a_failing_second_step_gives_the_slot_back(server):
    bad = -np.ones(SLOT_FLOATS, np.float32)
    with pytest.raises(InferenceServerException, match="negative values are refused"):
        infer(server, bad)
    out, on_gpu = infer(server, np.ones(SLOT_FLOATS, np.float32))
    assert on_gpu and (out == 3).all()


def test_requests_at_once_share_the_slot_or_use_the_host_and_give_it_back(server):
    results, errors = [], []

    def client(k: int) -> None:
        try:
            for i in range(5):
                x = np.full(SLOT_FLOATS, 10 * k + i, np.float32)
                out, on_gpu = infer(server, x)
                results.append((bool((out == x * 2 + 1).all()), on_gpu))
        except Exception as e:      # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 30 and all(ok for ok, _ in results)
    out, on_gpu = infer(server, np.zeros(SLOT_FLOATS, np.float32))
    assert on_gpu and (out == 1).all()


def test_a_killed_producer_the_server_keeps_serving(server):
    make, take = worker_pid(server, "gpu_make"), worker_pid(server, "gpu_take")
    infer(server, np.ones(SLOT_FLOATS, np.float32))
    assert maps_device_memory_of(take, make)
    os.kill(make, signal.SIGKILL)
    # the scheduler tells gpu_take to close the dead worker's handles
    wait_for(lambda: not maps_device_memory_of(take, make), 30,
             "gpu_take to close the handles of the dead gpu_make's arena")

    def serves() -> bool:
        try:
            out, on_gpu = infer(server, np.full(SLOT_FLOATS, 2, np.float32))
        except InferenceServerException:
            return False        # the restart is under way
        return on_gpu and bool((out == 5).all())
    wait_for(serves, 60, "the ensemble to serve from the restarted gpu_make")
    again = worker_pid(server, "gpu_make")
    assert again not in (0, make) and maps_device_memory_of(take, again)
    assert worker_pid(server, "gpu_take") == take
