"""What once took the whole server down now costs one request or one load (issue 13): a config
override larger than a command-line argument may be, garbage in the scheduler's inbox, a config
that asks for unbounded resources."""
import json
import os

import msgspec
import numpy as np
import pytest
import tritonclient.http as httpclient
import zmq
from serverproc import Server, descendants, wait_for
from tritonclient.utils import InferenceServerException

from shmserve.ipc import messages
from shmserve.ipc.messages.to_frontend import ControlReply
from shmserve.ipc.messages.to_scheduler import BatchDone, SubmitRequest


@pytest.fixture(scope="module")
def server(example_repo):
    s = Server(example_repo, "--model-control-mode", "explicit", "--load-model", "identity_fp32")
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(server):
    c = httpclient.InferenceServerClient(server.url, network_timeout=120)
    yield c
    c.close()


def _serves(client) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)


def test_a_config_larger_than_an_argument_loads(client):
    """The worker's arguments once rode on its command line, where one argument may hold
    128 KiB: a larger override killed the scheduler (E2BIG) and with it the server."""
    cfg = client.get_model_config("identity_fp32")
    cfg["parameters"] = {"padding": {"string_value": "x" * 300_000}}
    client.load_model("identity_fp32", config=json.dumps(cfg))
    assert client.is_model_ready("identity_fp32")
    got = client.get_model_config("identity_fp32")
    assert len(got["parameters"]["padding"]["string_value"]) == 300_000
    _serves(client)


def test_unbounded_config_values_are_refused_with_the_limit(client):
    cfg = client.get_model_config("identity_fp32")
    for change, text in (({"instance_group": [{"count": 100_000, "kind": "KIND_CPU"}]},
                          "more than the limit of 128"),
                         ({"parameters": {"execution_timeout_ms": {"string_value": "nan"}}},
                          "must be a finite, non-negative number of milliseconds")):
        with pytest.raises(InferenceServerException) as e:
            client.load_model("identity_fp32", config=json.dumps({**cfg, **change}))
        assert e.value.status() == "400" and text in e.value.message()
        assert "failed to load" in e.value.message() or "load failed" in e.value.message()
    _serves(client)


def test_a_load_cannot_reach_files_outside_the_model(client, tmp_path):
    """An override once made a worker import (python) or open (onnxruntime) any file of the host
    through default_model_filename, and warm-up read any file through input_data_file."""
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    cfg = client.get_model_config("identity_fp32")
    for change in ({"default_model_filename": str(planted)},
                   {"default_model_filename": "../../../../../../" + str(planted)},
                   {"model_warmup": [{"name": "w", "batch_size": 1, "inputs": {"INPUT0": {
                       "data_type": "TYPE_FP32", "dims": [16],
                       "input_data_file": "../../../../../etc/passwd"}}}]}):
        with pytest.raises(InferenceServerException) as e:
            client.load_model("identity_fp32", config=json.dumps({**cfg, **change}))
        assert e.value.status() == "400"
        assert "must be a file name inside the model directory, not a path" in e.value.message()
    assert not (tmp_path / "ran").exists()
    _serves(client)


def _scheduler_run_dir(server) -> str:
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"shmserve.engine.scheduler" in argv:
            return msgspec.json.decode(argv[argv.index(b"shmserve.engine.scheduler") + 1])["run_dir"]
    raise AssertionError("no scheduler process")


def test_the_scheduler_survives_any_message(server, client):
    """Frames a scheduler can never expect: not msgpack, an unknown tag, a request without its
    payload frame, a reply meant for a frontend. Each is logged and dropped."""
    run_dir = _scheduler_run_dir(server)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{os.path.join(run_dir, 'scheduler')}")
    try:
        sock.send(b"\xc1 not msgpack")
        sock.send(msgspec.msgpack.encode([99, 1, 2]))
        sock.send(messages.encode(SubmitRequest(1, 0, "identity_fp32", 1, 1)))
        sock.send(messages.encode(ControlReply(5, "x")))
        sock.send(messages.encode(BatchDone(12345, 1)))
    finally:
        sock.close()
    for line in ("dropped an undecodable message",                  # not msgpack; an unknown tag
                 "error handling SubmitRequest; the scheduler carries on"):    # no payload
        wait_for(lambda: line in server.log_text(), 20, f"the scheduler to log '{line}'")
    _serves(client)
    assert server.ready()


def test_a_client_segment_that_shrinks_is_an_error_not_a_dead_worker(server, client):
    """Shrinking a registered segment made the worker fault (SIGBUS) on the next request that
    read past the new end; three such requests made the model UNAVAILABLE."""
    import tritonclient.utils.shared_memory as shm
    key = f"/shmtest_shrink_{os.getpid()}"
    handle = shm.create_shared_memory_region("shrink_in", key, 64 * 4)
    try:
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("shrink_in", key, 64 * 4)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_shared_memory("shrink_in", 64, offset=128)
        client.infer("identity_fp32", [inp])
        os.truncate(f"/dev/shm{key}", 16)
        for _ in range(4):
            with pytest.raises(InferenceServerException) as e:
                client.infer("identity_fp32", [inp])
            # a worker that had it mapped sees it shrink; one that maps it now sees it short
            assert "shrank to 16 bytes" in e.value.message() or \
                "is outside segment" in e.value.message() and "of 16 bytes" in e.value.message()
        assert client.is_model_ready("identity_fp32")
        _serves(client)
    finally:
        client.unregister_system_shared_memory("shrink_in")
        shm.destroy_shared_memory_region(handle)
