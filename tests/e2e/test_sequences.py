"""The sequence batcher end to end: the real server as a subprocess, driven by tritonclient (HTTP,
gRPC and the gRPC stream) and the real perf_analyzer.

One server serves every test: copies of the example repository's sequence models
(configs/models: sequence_accumulator, onnx_accumulator, simple_dyna_sequence) and the python
sequence models written here (idle timeout, one slot, a worker that exits, control inputs,
implicit state from a data file). Every test uses sequence ids of its own.
"""
from __future__ import annotations

import itertools
import os
import queue
import shutil
import subprocess
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for
from tritonclient.utils import InferenceServerException

EXAMPLES = ("sequence_accumulator", "onnx_accumulator", "simple_dyna_sequence")
_ids = itertools.count(10_000)     # perf_analyzer gets 500000 and up


def new_id() -> int:
    return next(_ids)


# OUTPUT = the running sum of the sequence's INPUTs (kept per request.correlation_id()), PID = the
# worker's pid, CALL = the worker's execution count (so a test sees the order executions ran
# in). INPUT -1 makes the worker exit.
ACCUMULATE = textwrap.dedent('''
    import itertools, os
    import numpy as np
    import triton_python_backend_utils as pb_utils

    _calls = itertools.count(1)

    class TritonPythonModel:
        def initialize(self, args):
            self.sums = {}

        def execute(self, requests):
            call = next(_calls)
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
                if (x == -1).any():
                    os._exit(3)
                cid = r.correlation_id()
                if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                    self.sums[cid] = 0
                total = (self.sums.get(cid, 0) + x).astype(np.int32)
                if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                    self.sums.pop(cid, None)
                else:
                    self.sums[cid] = total
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT", total),
                    pb_utils.Tensor("PID", np.full(x.shape, os.getpid(), np.int64)),
                    pb_utils.Tensor("CALL", np.full(x.shape, call, np.int64))]))
            return out
''')


def accumulate_config(mbs: int, count: int, idle_us: int) -> str:
    return f'''
        backend: "python"
        max_batch_size: {mbs}
        sequence_batching {{ max_sequence_idle_microseconds: {idle_us} }}
        input [ {{ name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
        output [ {{ name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] }},
                 {{ name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }},
                 {{ name: "CALL", data_type: TYPE_INT64, dims: [ 1 ] }} ]
        instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
    '''


# Returns the control inputs it gets as outputs
CONTROLS = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT_" + n, pb_utils.get_input_tensor_by_name(r, n).as_numpy())
                    for n in ("INPUT", "START", "END", "READY", "CORRID")]))
            return out
''')


def controls_config(corrid_type: str) -> str:
    return f'''
        backend: "python"
        max_batch_size: 8
        sequence_batching {{
          control_input [
            {{ name: "START", control [ {{ kind: CONTROL_SEQUENCE_START, int32_false_true: [ 5, 7 ] }} ] }},
            {{ name: "END", control [ {{ kind: CONTROL_SEQUENCE_END, fp32_false_true: [ 0.5, 1.5 ] }} ] }},
            {{ name: "READY", control [ {{ kind: CONTROL_SEQUENCE_READY, bool_false_true: [ false, true ] }} ] }},
            {{ name: "CORRID", control [ {{ kind: CONTROL_SEQUENCE_CORRID, data_type: {corrid_type} }} ] }}
          ]
        }}
        input [ {{ name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
        output [ {{ name: "OUT_INPUT", data_type: TYPE_INT32, dims: [ 1 ] }},
                 {{ name: "OUT_START", data_type: TYPE_INT32, dims: [ 1 ] }},
                 {{ name: "OUT_END", data_type: TYPE_FP32, dims: [ 1 ] }},
                 {{ name: "OUT_READY", data_type: TYPE_BOOL, dims: [ 1 ] }},
                 {{ name: "OUT_CORRID", data_type: {corrid_type}, dims: [ 1 ] }} ]
    '''


# OUTPUT = STATE_IN + INPUT, which becomes the next STATE_IN (implicit state)
STATEFUL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
                s = pb_utils.get_input_tensor_by_name(r, "STATE_IN").as_numpy()
                total = (s + x).astype(np.int32)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total),
                                                       pb_utils.Tensor("STATE_OUT", total)]))
            return out
''')
STATEFUL_CONFIG = '''
    backend: "python"
    max_batch_size: 8
    sequence_batching {
      state [ {
        input_name: "STATE_IN"
        output_name: "STATE_OUT"
        data_type: TYPE_INT32
        dims: [ 2 ]
        initial_state [ { name: "from_file", data_type: TYPE_INT32, dims: [ 2 ], data_file: "init.bin" } ]
      } ]
    }
    input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 2 ] } ]
    output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 2 ] } ]
'''
INITIAL_STATE = np.array([100, 200], dtype=np.int32)

IDLE_S = 0.2


@pytest.fixture(scope="module")
def repo(tmp_path_factory, example_repo):
    root = str(tmp_path_factory.mktemp("sequences"))
    for name in EXAMPLES:
        shutil.copytree(os.path.join(example_repo, name), os.path.join(root, name))
    write_model(root, "seq_idle", accumulate_config(4, 1, int(IDLE_S * 1e6)), ACCUMULATE)
    # one instance, max_batch_size 0: one sequence at a time
    write_model(root, "seq_one_slot", accumulate_config(0, 1, 5_000_000), ACCUMULATE)
    # two instances of one slot each: two sequences on different workers
    write_model(root, "seq_crash", accumulate_config(0, 2, 5_000_000), ACCUMULATE)
    write_model(root, "seq_controls", controls_config("TYPE_UINT64"), CONTROLS)
    write_model(root, "seq_controls_str", controls_config("TYPE_STRING"), CONTROLS)
    write_model(root, "seq_state_file", STATEFUL_CONFIG, STATEFUL)
    os.makedirs(os.path.join(root, "seq_state_file", "initial_state"))
    INITIAL_STATE.tofile(os.path.join(root, "seq_state_file", "initial_state", "init.bin"))
    return root


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, "--id", "shmserve-sequences")
    yield s
    assert s.stop() == 0
    log = s.log_text()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def http(srv):
    c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


def client_for(srv, proto: str):
    if proto == "http":
        return httpclient.InferenceServerClient(srv.url, network_timeout=60)
    return grpcclient.InferenceServerClient(srv.grpc_url)


def module_of(client):
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def inputs(mod, value, shape=(1, 1), name="INPUT"):
    arr = np.full(shape, value, dtype=np.int32) if np.isscalar(value) else \
        np.asarray(value, dtype=np.int32).reshape(shape)
    inp = mod.InferInput(name, list(arr.shape), "INT32")
    inp.set_data_from_numpy(arr)
    return [inp]


def step(client, model, cid, value, start=False, end=False, shape=(1, 1), **kw):
    """One request of a sequence; returns the result."""
    mod = module_of(client)
    if mod is grpcclient:
        kw.setdefault("client_timeout", 60)
    return client.infer(model, inputs(mod, value, shape), sequence_id=cid, sequence_start=start,
                        sequence_end=end, **kw)


def out(result, name="OUTPUT"):
    return int(result.as_numpy(name).reshape(-1)[0])


def refused(call):
    """Run ``call``; it must fail. Returns (status, message)."""
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value.status(), e.value.message()


BAD_REQUEST = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
START_MSG = ("inference request for sequence {cid} to model '{model}' must specify the START "
             "flag on the first request of the sequence")


def run_sums(client, model, cid, values, shape=(1, 1)):
    """A whole sequence: the running sums the server answers."""
    return [out(step(client, model, cid, v, start=i == 0, end=i == len(values) - 1, shape=shape))
            for i, v in enumerate(values)]


def success_count(client, model) -> int:
    stats = client.get_inference_statistics(model)
    if isinstance(stats, dict):
        return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])
    return int(stats.model_stats[0].inference_stats.success.count)


def pending(srv, model) -> int:
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count{") and f'model="{model}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


# ---- 1. tritonclient's sequence calls ------------------------------------------------------
@pytest.mark.parametrize("model", ["sequence_accumulator", "onnx_accumulator"])
@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("kind", ["int", "str"])
def test_sequence_running_sums(srv, http, grpc, model, proto, kind):
    client = http if proto == "http" else grpc
    a, b = new_id(), new_id()
    if kind == "str":
        a, b = f"seq-{a}", f"seq-{b}"
    # two sequences interleaved on one connection: each keeps its own sum
    got_a, got_b = [], []
    for i, (va, vb) in enumerate(zip([3, 4, 5, 6], [100, -1, 7, 10])):
        first, last = i == 0, i == 3
        got_a.append(out(step(client, model, a, va, start=first, end=last)))
        got_b.append(out(step(client, model, b, vb, start=first, end=last)))
    assert got_a == [3, 7, 12, 18]
    assert got_b == [100, 99, 106, 116]
    # a START after the END begins from zero again
    assert run_sums(client, model, a, [9, 1]) == [9, 10]
    # a START for a live sequence ends it and starts it again
    assert out(step(client, model, b, 50, start=True)) == 50
    assert out(step(client, model, b, 1)) == 51
    assert run_sums(client, model, b, [2, 3]) == [2, 5]


@pytest.mark.parametrize("model", ["sequence_accumulator", "onnx_accumulator"])
def test_sequence_on_grpc_stream(srv, model):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        ids = {"int": new_id(), "str": f"stream-{new_id()}"}
        values = {"int": [1, 2, 3, 4, 5], "str": [10, 20, 30, 40, 50]}
        sent = {}
        for i in range(5):
            for kind, cid in ids.items():
                rid = f"{kind}-{i}"
                sent[rid] = (kind, i)
                client.async_stream_infer(model, inputs(grpcclient, values[kind][i]),
                                          request_id=rid, sequence_id=cid,
                                          sequence_start=i == 0, sequence_end=i == 4)
                # one request per sequence in flight, as a client that awaits each answer
                result, error = answers.get(timeout=30)
                assert error is None, error
                assert result.get_response().id == rid
                kind_i, step_i = sent[rid]
                assert out(result) == sum(values[kind_i][:step_i + 1])
        # a refused request on the stream answers with the error and the stream goes on
        client.async_stream_infer(model, inputs(grpcclient, 1), request_id="late",
                                  sequence_id=ids["int"])
        result, error = answers.get(timeout=30)
        assert result is None and error is not None
        assert START_MSG.format(cid=ids["int"], model=model) in error.message()
        pipelined = new_id()
        for i in range(3):      # a sequence's requests sent without waiting: they run in order
            client.async_stream_infer(model, inputs(grpcclient, i + 1), request_id=f"p{i}",
                                      sequence_id=pipelined, sequence_start=i == 0,
                                      sequence_end=i == 2)
        got = {}
        for _ in range(3):
            result, error = answers.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = out(result)
        assert got == {"p0": 1, "p1": 3, "p2": 6}
    finally:
        client.stop_stream()
        client.close()


# ---- 2. many interleaved sequences from many clients -----------------------------------------
def _interleaved(srv, model, expect, n_seqs=32, n_steps=10):
    base = new_id()
    for _ in range(n_seqs):
        new_id()
    barrier = threading.Barrier(n_seqs, timeout=60)

    def one(k):
        client = client_for(srv, "http" if k % 2 else "grpc")
        try:
            cid = base + k
            values = [k * 100 + s for s in range(n_steps)]
            barrier.wait()
            got = [out(step(client, model, cid, v, start=s == 0, end=s == n_steps - 1))
                   for s, v in enumerate(values)]
            return cid, values, got
        finally:
            client.close()

    with ThreadPoolExecutor(n_seqs) as pool:
        for cid, values, got in pool.map(one, range(n_seqs), timeout=120):
            assert got == expect(cid, values), f"sequence {cid}"


def _running(cid, values):
    return list(itertools.accumulate(values))


@pytest.mark.parametrize("model", ["sequence_accumulator", "onnx_accumulator"])
def test_many_interleaved_sequences_accumulate(srv, model):
    _interleaved(srv, model, _running)


def test_many_interleaved_sequences_oldest_strategy(srv):
    # simple_dyna_sequence: OUTPUT = READY * (INPUT + START + END * CORRID)
    def expect(cid, values):
        n = len(values)
        return [v + (s == 0) + (s == n - 1) * cid for s, v in enumerate(values)]
    _interleaved(srv, "simple_dyna_sequence", expect)


# ---- 3. errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_sequence_errors(srv, http, grpc, proto):
    client = http if proto == "http" else grpc
    mod = module_of(client)
    model = "sequence_accumulator"
    kw = {"client_timeout": 60} if mod is grpcclient else {}

    status, msg = refused(lambda: client.infer(model, inputs(mod, 1), **kw))
    assert status == BAD_REQUEST[proto]
    assert msg == (f"inference request to model '{model}' must specify a non-zero or non-empty "
                   f"correlation ID")

    unknown = new_id()
    status, msg = refused(lambda: step(client, model, unknown, 1))
    assert status == BAD_REQUEST[proto]
    assert msg == START_MSG.format(cid=unknown, model=model)

    ended = new_id()
    assert run_sums(client, model, ended, [1, 2]) == [1, 3]
    status, msg = refused(lambda: step(client, model, ended, 1))
    assert status == BAD_REQUEST[proto]
    assert msg == START_MSG.format(cid=ended, model=model)
    status, msg = refused(lambda: step(client, model, ended, 1, end=True))
    assert status == BAD_REQUEST[proto] and msg == START_MSG.format(cid=ended, model=model)

    batch2 = new_id()
    status, msg = refused(lambda: step(client, model, batch2, [1, 2], start=True, shape=(2, 1)))
    assert status == BAD_REQUEST[proto]
    assert msg == (f"inference request to model '{model}' must specify batch-size 1 due to "
                   f"requirements of sequence batcher")
    # the refused START did not start it
    status, msg = refused(lambda: step(client, model, batch2, 1))
    assert msg == START_MSG.format(cid=batch2, model=model)

    # a string id on a model whose CORRID is an integer
    sid = f"s-{new_id()}"
    status, msg = refused(lambda: step(client, "seq_controls", sid, 1, start=True))
    assert status == BAD_REQUEST[proto], msg
    assert "unsigned integer" in msg
    assert "has the string correlation ID" in msg     # the frontend's: it took no slot

    # the server goes on serving sequences
    assert srv.ready()
    assert run_sums(client, model, new_id(), [4, 5, 6]) == [4, 9, 15]


# ---- 4. idle timeout -------------------------------------------------------------------------
def test_idle_sequence_is_released(http):
    model, cid = "seq_idle", new_id()
    assert out(step(http, model, cid, 1, start=True)) == 1
    expected, last = 1, time.monotonic()
    deadline = last + 30
    while True:
        # the idle time has to pass (no request in between, which would keep it alive)
        time.sleep(max(0.0, last + IDLE_S * 1.5 - time.monotonic()))
        try:
            result = step(http, model, cid, 1)
        except InferenceServerException as e:
            assert e.status() == "400"
            assert e.message() == START_MSG.format(cid=cid, model=model)
            break
        # the server had not yet seen it idle: it still runs in order, and idles again
        expected += 1
        assert out(result) == expected
        last = time.monotonic()
        assert last < deadline, "the sequence never idled out"
    # a new START works, and the sequence goes on from it
    assert run_sums(http, model, cid, [5, 6, 7]) == [5, 11, 18]


# ---- 5. backlog ----------------------------------------------------------------------------
def test_backlogged_sequences_wait_for_the_slot_in_order(srv, http):
    model = "seq_one_slot"
    a, b, c = new_id(), new_id(), new_id()
    r = step(http, model, a, 1, start=True, shape=(1,))
    assert out(r) == 1
    with ThreadPoolExecutor(2) as pool:
        def start(cid, value):
            client = client_for(srv, "grpc")
            try:
                return step(client, model, cid, value, start=True, shape=(1,))
            finally:
                client.close()
        fb = pool.submit(start, b, 10)
        wait_for(lambda: pending(srv, model) == 1, 20, "B's START to wait in the backlog")
        fc = pool.submit(start, c, 20)
        wait_for(lambda: pending(srv, model) == 2, 20, "C's START to wait in the backlog")
        # A owns the slot: it runs while B and C wait
        assert out(step(http, model, a, 2, shape=(1,))) == 3
        assert not fb.done() and not fc.done()
        a_end = step(http, model, a, 3, end=True, shape=(1,))
        assert out(a_end) == 6
        rb = fb.result(timeout=30)
        assert out(rb) == 10
        assert out(rb, "CALL") > out(a_end, "CALL")
        # C still waits: B holds the slot
        assert pending(srv, model) == 1 and not fc.done()
        b_end = step(http, model, b, 1, end=True, shape=(1,))
        assert out(b_end) == 11
        rc = fc.result(timeout=30)
        assert out(rc) == 20 and out(rc, "CALL") > out(b_end, "CALL")
        assert out(step(http, model, c, 2, end=True, shape=(1,))) == 22


def test_backlogged_sequence_times_out(srv, http, grpc):
    model = "seq_one_slot"
    a, b = new_id(), new_id()
    assert out(step(http, model, a, 1, start=True, shape=(1,))) == 1
    t0 = time.monotonic()
    status, msg = refused(lambda: step(grpc, model, b, 5, start=True, shape=(1,), timeout=300_000))
    assert time.monotonic() - t0 >= 0.3
    assert status == "StatusCode.UNAVAILABLE" and "timeout" in msg.lower(), msg
    # the HTTP status of the same
    status, msg = refused(lambda: step(http, model, b, 5, start=True, shape=(1,), timeout=200_000))
    assert status == "503" and "timeout" in msg.lower(), msg
    # the rejected sequence never started; the one in the slot is untouched
    status, msg = refused(lambda: step(http, model, b, 1, shape=(1,)))
    assert msg == START_MSG.format(cid=b, model=model)
    assert out(step(http, model, a, 2, end=True, shape=(1,))) == 3
    assert run_sums(http, model, b, [4, 4], shape=(1,)) == [4, 8]


def test_cancelled_backlogged_start_gives_up_its_place(srv, http, grpc):
    """A START the client gave up on (its gRPC deadline passed) while it waited in the backlog:
    nothing of its sequence ran, so the sequence is gone, not left to take the slot."""
    model = "seq_one_slot"
    a, b, c = new_id(), new_id(), new_id()
    assert out(step(http, model, a, 1, start=True, shape=(1,))) == 1
    status, _ = refused(lambda: step(grpc, model, b, 10, start=True, shape=(1,),
                                     client_timeout=0.3))
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    wait_for(lambda: pending(srv, model) == 0, 20, "the cancelled START to leave the queue")
    # (the request timeout only bounds the wait if B were still waiting for the slot)
    status, msg = refused(lambda: step(http, model, b, 10, shape=(1,), timeout=2_000_000))
    assert (status, msg) == ("400", START_MSG.format(cid=b, model=model))
    other = client_for(srv, "http")
    with ThreadPoolExecutor(1) as pool:
        fc = pool.submit(step, other, model, c, 20, start=True, shape=(1,))
        wait_for(lambda: pending(srv, model) == 1, 20, "C's START to wait in the backlog")
        assert out(step(http, model, a, 2, end=True, shape=(1,))) == 3
        assert out(fc.result(timeout=30)) == 20
    other.close()
    assert out(step(http, model, c, 1, end=True, shape=(1,))) == 21


# ---- 6. worker death -----------------------------------------------------------------------
def lost_state(cid, model):
    return (f"sequence {cid} of model '{model}' lost its state: the worker process that held it "
            f"ended; start the sequence again")


def test_worker_death_loses_only_its_sequences(srv, http, grpc):
    model = "seq_crash"
    x, y = new_id(), new_id()
    rx = step(http, model, x, 1, start=True, shape=(1,))
    ry = step(grpc, model, y, 10, start=True, shape=(1,))
    pid_x, pid_y = out(rx, "PID"), out(ry, "PID")
    assert pid_x != pid_y           # one slot per instance
    assert out(step(http, model, x, 2, shape=(1,))) == 3

    # on the stream, the request that kills the worker and one queued behind it
    stream = grpcclient.InferenceServerClient(srv.grpc_url)
    answers: queue.Queue = queue.Queue()
    stream.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for value in (-1, 5):
            stream.async_stream_infer(model, inputs(grpcclient, value, (1,)), sequence_id=x)
        (r1, e1), (r2, e2) = answers.get(timeout=60), answers.get(timeout=60)
    finally:
        stream.stop_stream()
        stream.close()
    # (a stream's error carries its message only)
    assert r1 is None and "exit code 3" in e1.message(), e1.message()
    # queued when the worker died (500), or sent after it (400): either way it says why
    assert r2 is None and lost_state(x, model) in e2.message(), e2.message()

    status, msg = refused(lambda: step(http, model, x, 5, shape=(1,)))
    assert status == "400"
    assert msg.startswith(START_MSG.format(cid=x, model=model)), msg
    assert lost_state(x, model) in msg

    # the other sequence, on the other worker, goes on with its sum
    ry = step(grpc, model, y, 5, shape=(1,))
    assert out(ry) == 15 and out(ry, "PID") == pid_y

    # a new START runs on the restarted worker (it waits for it in the backlog)
    rx = step(http, model, x, 7, start=True, shape=(1,))
    assert out(rx) == 7 and out(rx, "PID") not in (pid_x, pid_y)
    assert out(step(http, model, x, 1, end=True, shape=(1,))) == 8
    ry = step(grpc, model, y, 1, end=True, shape=(1,))
    assert out(ry) == 16 and out(ry, "PID") == pid_y


# ---- 7. control inputs and implicit state ----------------------------------------------------
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_control_inputs_reach_a_python_model(http, grpc, proto):
    client = http if proto == "http" else grpc
    # over HTTP past int64 (a uint64 CORRID holds it); tritonclient.grpc sends an int64_param
    cid = (1 << 63 if proto == "http" else 1 << 40) + new_id()
    rows = []
    for i, (start, end) in enumerate([(True, False), (False, False), (False, True),
                                      (True, True)]):
        r = step(client, "seq_controls", cid, i, start=start, end=end)
        rows.append((out(r, "OUT_INPUT"), out(r, "OUT_START"),
                     float(r.as_numpy("OUT_END").reshape(-1)[0]),
                     bool(r.as_numpy("OUT_READY").reshape(-1)[0]),
                     int(r.as_numpy("OUT_CORRID").reshape(-1)[0])))
        assert r.as_numpy("OUT_START").shape == (1, 1)
        assert r.as_numpy("OUT_START").dtype == np.int32
        assert r.as_numpy("OUT_END").dtype == np.float32
        assert r.as_numpy("OUT_READY").dtype == np.bool_
        assert r.as_numpy("OUT_CORRID").dtype == np.uint64
    assert rows == [(0, 7, 0.5, True, cid), (1, 5, 0.5, True, cid), (2, 5, 1.5, True, cid),
                    (3, 7, 1.5, True, cid)]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_string_corrid_control(http, grpc, proto):
    client = http if proto == "http" else grpc
    sid, nid = f"corr-{new_id()}", new_id()
    for cid, want in ((sid, sid.encode()), (nid, str(nid).encode())):
        got = []
        for i in range(3):
            r = step(client, "seq_controls_str", cid, i, start=i == 0, end=i == 2)
            corrid = r.as_numpy("OUT_CORRID").reshape(-1)[0]
            got.append((out(r, "OUT_START"), float(r.as_numpy("OUT_END").reshape(-1)[0]),
                        corrid))
        assert got == [(7, 0.5, want), (5, 0.5, want), (5, 1.5, want)]


def test_implicit_state_from_a_data_file(http, grpc):
    model = "seq_state_file"
    a, b = new_id(), f"state-{new_id()}"
    ra = step(http, model, a, [1, 2], start=True, shape=(1, 2))
    rb = step(grpc, model, b, [10, 10], start=True, shape=(1, 2))
    np.testing.assert_array_equal(ra.as_numpy("OUTPUT"), [[101, 202]])
    np.testing.assert_array_equal(rb.as_numpy("OUTPUT"), [[110, 210]])
    # the state is the server's: the client sees only OUTPUT
    assert ra.as_numpy("STATE_OUT") is None
    assert [o["name"] for o in ra.get_response()["outputs"]] == ["OUTPUT"]
    ra = step(http, model, a, [5, 5], shape=(1, 2))
    np.testing.assert_array_equal(ra.as_numpy("OUTPUT"), [[106, 207]])
    ra = step(http, model, a, [1, 1], end=True, shape=(1, 2))
    np.testing.assert_array_equal(ra.as_numpy("OUTPUT"), [[107, 208]])
    rb = step(grpc, model, b, [1, 1], end=True, shape=(1, 2))
    np.testing.assert_array_equal(rb.as_numpy("OUTPUT"), [[111, 211]])
    # a new START begins from the file's state again
    ra = step(http, model, a, [0, 0], start=True, end=True, shape=(1, 2))
    np.testing.assert_array_equal(ra.as_numpy("OUTPUT"), [INITIAL_STATE])


# ---- 8. perf_analyzer ----------------------------------------------------------------------
PERF_CASES = {"http": ["-i", "http"], "grpc-streaming": ["-i", "grpc", "--streaming"]}


@pytest.mark.parametrize("case", list(PERF_CASES))
def test_perf_analyzer_sequence_mode(srv, http, perf_analyzer, case):
    model = "sequence_accumulator"
    port = srv.grpc_port if case.startswith("grpc") else srv.http_port
    before = success_count(http, model)
    cmd = [perf_analyzer, "-m", model, "-u", f"127.0.0.1:{port}", *PERF_CASES[case],
           "--sequence-length", "5", "--num-of-sequences", "4",
           "--sequence-id-range", "500000:900000", "--concurrency-range", "4",
           "--measurement-interval", "500", "--max-trials", "8", "--stability-percentage", "999"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "error" not in done.stdout.lower(), done.stdout
    assert "Sequence count:" in done.stdout, done.stdout      # it ran in sequence mode
    lines = done.stdout.splitlines()
    throughput = [float(line.split("Throughput:")[1].split()[0]) for line in lines
                  if "Throughput:" in line]
    assert throughput and all(t > 0 for t in throughput), done.stdout
    sent = [int(line.split("Request count:")[1].split()[0]) for line in lines
            if "Request count:" in line]
    assert sent and sent[-1] >= 5 * 4, done.stdout
    # every request it counted (in its last measurement window) succeeded on the server
    assert success_count(http, model) - before >= sent[-1]


# ---- 9. statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_statistics_count_sequence_requests(http, grpc, proto):
    client = http if proto == "http" else grpc
    model = "onnx_accumulator"
    before = success_count(client, model)
    for _ in range(2):
        assert run_sums(client, model, new_id(), [1, 2, 3]) == [1, 3, 6]
    # refused requests are not successes
    refused(lambda: step(client, model, new_id(), 1))
    wait_for(lambda: success_count(client, model) >= before + 6, 10, "the statistics")
    assert success_count(client, model) == before + 6
