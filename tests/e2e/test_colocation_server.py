"""--colocate: while requests come one at a time, the frontend's loop thread and the worker it
sends them to wait on one CPU; the model itself always runs, and starts threads, with every CPU
the server may use; from the first request that finds another in flight the frontend may run
anywhere again, and the worker waits on any CPU but the one the frontend sent it from. Read from the outside: /proc/<pid>/task/<tid>/status of the frontend's and
the worker's main threads, and the masks the model reports from inside execute()."""
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, frontend_pids, wait_for, worker_pid

from shmserve.frontend.colocation import ENTER

EVERYWHERE = os.sched_getaffinity(0)

pytestmark = pytest.mark.skipif(len(EVERYWHERE) < 2,
                                reason="one CPU: there is nothing to pair or spread")

# Reports the CPUs its own thread may use, and those of a thread it starts, during execute().
AFFINITY = '''
import os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        if pb_utils.get_input_tensor_by_name(requests[0], "INPUT0").as_numpy()[0] > 0:
            time.sleep(0.05)        # long enough for requests sent together to overlap
        seen = {}
        t = threading.Thread(target=lambda: seen.update(mask=os.sched_getaffinity(0)))
        t.start()
        t.join()
        mine = np.array(sorted(os.sched_getaffinity(0)), dtype=np.int32)
        child = np.array(sorted(seen["mask"]), dtype=np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("MINE", mine),
                                            pb_utils.Tensor("CHILD", child)])
                for _ in requests]
'''


def cpu_list(text: str) -> set[int]:
    """The CPUs of a list as /proc writes it ("0-1,4")."""
    cpus = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def allowed(pid: int) -> set[int]:
    """The CPUs the main thread of ``pid`` may run on."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return cpu_list(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("colocate"))
    write_model(root, "aff", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "MINE", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CHILD", data_type: TYPE_INT32, dims: [ -1 ] } ]
        instance_group [ { count: 1, kind: KIND_CPU } ]
    ''', AFFINITY)
    return root


def _input(mod, slow: bool = False):
    inp = mod.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.full(1, float(slow), dtype=np.float32))
    return [inp]


def _masks(res):
    return set(res.as_numpy("MINE").tolist()), set(res.as_numpy("CHILD").tolist())


def _one(client, mod):
    return _masks(client.infer("aff", _input(mod)))


def test_one_at_a_time_pairs_them_and_the_model_still_runs_everywhere(repo):
    # this test's client is slower than 1 ms a request on a busy machine: the pace rule is
    # tests/frontend/test_colocation.py's
    srv = Server(repo, "--colocate-max-gap-us", "1000000")
    try:
        (fe,) = frontend_pids(srv)
        wk = worker_pid(srv, "aff")
        assert wk, "no worker for aff"
        assert allowed(fe) == EVERYWHERE and allowed(wk) == EVERYWHERE
        client = httpclient.InferenceServerClient(srv.url, concurrency=4)
        for _ in range(ENTER - 1):
            assert _one(client, httpclient) == (EVERYWHERE, EVERYWHERE)
            assert allowed(fe) == EVERYWHERE

        def paired():
            # one more request alone each time (a pairing is chosen again every second)
            assert _one(client, httpclient) == (EVERYWHERE, EVERYWHERE)
            cpus = allowed(fe)
            return len(cpus) == 1 and allowed(wk) == cpus

        wait_for(paired, 20, "the frontend on one CPU and the worker waiting on it")
        # gRPC goes the same way, and the model keeps its full mask there too
        gclient = grpcclient.InferenceServerClient(srv.grpc_url)
        for _ in range(8):
            assert _one(gclient, grpcclient) == (EVERYWHERE, EVERYWHERE)

        wait_for(paired, 20, "paired again")
        # four at once (each runs 50 ms): the frontend may run anywhere again from the second
        sent = [client.async_infer("aff", _input(httpclient, slow=True)) for _ in range(4)]
        assert [_masks(p.get_result(timeout=60)) for p in sent] == [(EVERYWHERE, EVERYWHERE)] * 4
        assert allowed(fe) == EVERYWHERE
        # the worker was told with the requests themselves: the last three overlapped, so it
        # waits off the CPU the frontend sent the last from
        wait_for(lambda: len(allowed(wk)) == len(EVERYWHERE) - 1, 10,
                 "the worker waiting anywhere but on the frontend's CPU")
        # one alone again (the first of a new count): it waits anywhere
        assert _one(client, httpclient) == (EVERYWHERE, EVERYWHERE)
        wait_for(lambda: allowed(wk) == EVERYWHERE, 10, "the worker waiting anywhere")
    finally:
        srv.stop()


def test_off_pins_nothing(repo):
    srv = Server(repo, "--colocate", "off")
    try:
        (fe,) = frontend_pids(srv)
        wk = worker_pid(srv, "aff")
        assert wk, "no worker for aff"
        client = httpclient.InferenceServerClient(srv.url)
        for _ in range(ENTER + 8):
            assert _one(client, httpclient) == (EVERYWHERE, EVERYWHERE)
            assert allowed(fe) == EVERYWHERE and allowed(wk) == EVERYWHERE
    finally:
        srv.stop()


# A BLS caller and its callee, each reporting CPU masks: the callee its own, a thread's it
# starts, and the caller's main thread's as it is while the caller waits for this answer (the
# list as /proc writes it).
CALLEE = '''
import os, threading
import numpy as np
import triton_python_backend_utils as pb_utils
def mask(path):
    with open(path) as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    return np.array([line.split(":", 1)[1].strip().encode()], dtype=np.object_)
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            caller = int(pb_utils.get_input_tensor_by_name(r, "PID").as_numpy()[0])
            seen = {}
            t = threading.Thread(target=lambda: seen.update(mask=os.sched_getaffinity(0)))
            t.start()
            t.join()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("MINE", np.array(sorted(os.sched_getaffinity(0)), np.int32)),
                pb_utils.Tensor("CHILD", np.array(sorted(seen["mask"]), np.int32)),
                pb_utils.Tensor("CALLER", mask(f"/proc/{caller}/task/{caller}/status"))]))
        return out
'''

CALLER = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            if pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()[0] > 0:
                time.sleep(0.05)        # long enough for requests sent together to overlap
            res = pb_utils.InferenceRequest(
                model_name="callee", requested_output_names=["MINE", "CHILD", "CALLER"],
                inputs=[pb_utils.Tensor("PID", np.array([os.getpid()], np.int32))]).exec()
            if res.has_error():
                raise pb_utils.TritonModelException(res.error().message())
            got = [pb_utils.get_output_tensor_by_name(res, n).as_numpy()
                   for n in ("MINE", "CHILD", "CALLER")]
            mine = np.array(sorted(os.sched_getaffinity(0)), np.int32)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(n, a) for n, a in zip(("CALLEE", "CHILD", "CALLER"), got)]
                + [pb_utils.Tensor("MINE", mine)]))
        return out
'''


@pytest.fixture(scope="module")
def bls_repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("colocate_bls"))
    write_model(root, "callee", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "PID", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "MINE", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CHILD", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CALLER", data_type: TYPE_STRING, dims: [ 1 ] } ]
        instance_group [ { count: 1, kind: KIND_CPU } ]
    ''', CALLEE)
    write_model(root, "caller", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "MINE", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CALLEE", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CHILD", data_type: TYPE_INT32, dims: [ -1 ] },
                 { name: "CALLER", data_type: TYPE_STRING, dims: [ 1 ] } ]
        instance_group [ { count: 1, kind: KIND_CPU } ]
    ''', CALLER)
    return root


def test_a_bls_call_of_a_paired_request_waits_on_the_frontends_cpu(bls_repo):
    """Requests one at a time to a model that makes a BLS call: once paired, the call's hops
    are switches on the frontend's CPU too. The callee waits for its next call there, and the
    caller waits for the call's answer there (seen by the callee while it runs); both models
    still run, and start threads, with every CPU."""
    srv = Server(bls_repo, "--colocate-max-gap-us", "1000000")
    try:
        (fe,) = frontend_pids(srv)
        callee = worker_pid(srv, "callee")
        assert callee, "no worker for callee"
        client = httpclient.InferenceServerClient(srv.url)
        inp = _input(httpclient)

        def paired():
            res = client.infer("caller", inp)
            full = {n: set(res.as_numpy(n).tolist()) for n in ("MINE", "CALLEE", "CHILD")}
            assert full == dict.fromkeys(full, EVERYWHERE), full
            cpus = allowed(fe)
            return len(cpus) == 1 and cpu_list(res.as_numpy("CALLER")[0].decode()) == cpus \
                and allowed(callee) == cpus

        wait_for(paired, 30, "the caller waiting for its BLS answer on the frontend's CPU, "
                             "and the callee waiting for its next call there")
        # four at once (each 50 ms before its call): the callee is told with the calls
        client4 = httpclient.InferenceServerClient(srv.url, concurrency=4)
        sent = [client4.async_infer("caller", _input(httpclient, slow=True)) for _ in range(4)]
        for p in sent:
            p.get_result(timeout=60)
        assert allowed(fe) == EVERYWHERE
        wait_for(lambda: len(allowed(callee)) == len(EVERYWHERE) - 1, 10,
                 "the callee waiting anywhere but on the frontend's CPU")
        client.infer("caller", inp)             # one alone again: anywhere
        wait_for(lambda: allowed(callee) == EVERYWHERE, 10, "the callee waiting anywhere")
    finally:
        srv.stop()
