"""Ensembles (``platform: "ensemble"``) against the real server, over HTTP and gRPC: values through
chains and parallel steps, with and without batching; tensors above the inline limit (shared
memory) without leaking output slots; client system shared memory in and out; output subsets;
a failing step's error; statistics; and bad inputs refused as for any model."""
import os
import uuid
from unittest import mock

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from repo_builder import write_model
from serverproc import Server, segments_of, wait_for
from tritonclient.utils import InferenceServerException

from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.shm import IDLE_RELEASE_ENV

PROTOCOLS = ["http", "grpc"]

# x * mul + add, in the input's data type; mul and add come from the config's parameters
AFFINE = '''
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.mul = float(params.get("mul", {}).get("string_value", "1"))
        self.add = float(params.get("add", {}).get("string_value", "0"))

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            y = (x * self.mul + self.add).astype(x.dtype)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return out
'''

SUM2 = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "B").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("S", a + b)]))
        return out
'''

# raises on a 1 anywhere in its input, answers an error on a 2, else echoes
FAULTY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if (x == 1).any():
                raise ValueError("faulty raised on purpose")
            if (x == 2).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "faulty refuses the value 2", pb_utils.TritonError.INVALID_ARG)))
                continue
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
'''


def affine(dtype: str, mbs: int, dims: str, mul: float, add: float) -> str:
    return f'''
        backend: "python"
        max_batch_size: {mbs}
        input [ {{ name: "INPUT0", data_type: {dtype}, dims: {dims} }} ]
        output [ {{ name: "OUTPUT0", data_type: {dtype}, dims: {dims} }} ]
        parameters {{ key: "mul" value: {{ string_value: "{mul}" }} }}
        parameters {{ key: "add" value: {{ string_value: "{add}" }} }}
    '''


def step(model: str, inputs: dict, outputs: dict) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {ins} {outs} }}'


def ensemble(mbs: int, inputs: list, outputs: list, steps: list) -> str:
    def tensors(ts):
        return ", ".join(f'{{ name: "{n}", data_type: {t}, dims: {d} }}' for n, t, d in ts)
    return (f'platform: "ensemble"\nmax_batch_size: {mbs}\n'
            f'input [ {tensors(inputs)} ]\noutput [ {tensors(outputs)} ]\n'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n')


# The main ensemble: a chain (add1 -> times2) and, in parallel with its first step, a second
# step that reads the same ensemble input (times2).
#   PLUS = IN + 1, CHAIN = (IN + 1) * 2, DOUBLE = IN * 2
MAIN_STEPS = [
    step("add1", {"INPUT0": "IN"}, {"OUTPUT0": "PLUS"}),
    step("times2", {"INPUT0": "PLUS"}, {"OUTPUT0": "CHAIN"}),
    step("times2", {"INPUT0": "IN"}, {"OUTPUT0": "DOUBLE"}),
]
MAIN_OUTPUTS = ["PLUS", "CHAIN", "DOUBLE"]


def expected(x: np.ndarray) -> dict:
    return {"PLUS": x + 1, "CHAIN": (x + 1) * 2, "DOUBLE": x * 2}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ensemble_data"))
    f32 = "TYPE_FP32"
    write_model(root, "add1", affine(f32, 8, "[ -1 ]", 1, 1), AFFINE)
    write_model(root, "times2", affine(f32, 8, "[ -1 ]", 2, 0), AFFINE)
    write_model(root, "ens", ensemble(4, [("IN", f32, "[ -1 ]")],
                                      [(n, f32, "[ -1 ]") for n in MAIN_OUTPUTS], MAIN_STEPS), None)
    # no batching anywhere: the same flow over composing models with max_batch_size 0
    write_model(root, "add1_nb", affine(f32, 0, "[ 2, -1 ]", 1, 1), AFFINE)
    write_model(root, "times2_nb", affine(f32, 0, "[ 2, -1 ]", 2, 0), AFFINE)
    nb_steps = [s.replace('"add1"', '"add1_nb"').replace('"times2"', '"times2_nb"')
                for s in MAIN_STEPS]
    write_model(root, "ens_nb", ensemble(0, [("IN", f32, "[ 2, -1 ]")],
                                         [(n, f32, "[ 2, -1 ]") for n in MAIN_OUTPUTS], nb_steps),
                None)
    # two inputs
    write_model(root, "sum2", '''
        backend: "python"
        max_batch_size: 8
        input [ { name: "A", data_type: TYPE_INT32, dims: [ 3 ] },
                { name: "B", data_type: TYPE_INT32, dims: [ 3 ] } ]
        output [ { name: "S", data_type: TYPE_INT32, dims: [ 3 ] } ]
    ''', SUM2)
    write_model(root, "neg_i32", affine("TYPE_INT32", 8, "[ 3 ]", -1, 0), AFFINE)
    write_model(root, "pair", ensemble(
        4, [("A", "TYPE_INT32", "[ 3 ]"), ("B", "TYPE_INT32", "[ 3 ]")],
        [("SUM", "TYPE_INT32", "[ 3 ]"), ("NEG", "TYPE_INT32", "[ 3 ]")],
        [step("sum2", {"A": "A", "B": "B"}, {"S": "SUM"}),
         step("neg_i32", {"INPUT0": "SUM"}, {"OUTPUT0": "NEG"})]), None)
    # a failing step: step 1 (faulty) sees IN + 1
    write_model(root, "inc_i32", affine("TYPE_INT32", 0, "[ -1 ]", 1, 1), AFFINE)
    write_model(root, "faulty", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ -1 ] } ]
    ''', FAULTY)
    # (step 2 runs beside them: its output, done before or after the failure, must be given back)
    write_model(root, "guarded", ensemble(
        0, [("IN", "TYPE_INT32", "[ -1 ]")],
        [("OUT", "TYPE_INT32", "[ -1 ]"), ("SIDE", "TYPE_INT32", "[ -1 ]")],
        [step("inc_i32", {"INPUT0": "IN"}, {"OUTPUT0": "T"}),
         step("faulty", {"INPUT0": "T"}, {"OUTPUT0": "OUT"}),
         step("inc_i32", {"INPUT0": "IN"}, {"OUTPUT0": "SIDE"})]), None)
    # statistics: composing models nothing else uses
    write_model(root, "s_add", affine(f32, 8, "[ -1 ]", 1, 1), AFFINE)
    write_model(root, "s_mul", affine(f32, 8, "[ -1 ]", 3, 0), AFFINE)
    write_model(root, "stats_ens", ensemble(
        4, [("IN", f32, "[ -1 ]")], [("OUT", f32, "[ -1 ]")],
        [step("s_add", {"INPUT0": "IN"}, {"OUTPUT0": "T"}),
         step("s_mul", {"INPUT0": "T"}, {"OUTPUT0": "OUT"})]), None)
    return root


@pytest.fixture(scope="module")
def srv(repo):
    # arena chunks nothing uses go back after 0.3 s, so a leaked slot (which keeps its chunk in
    # use forever) shows as a segment that never goes away
    with mock.patch.dict(os.environ, {IDLE_RELEASE_ENV: "0.3"}):
        s = Server(repo)
    yield s
    assert s.stop() == 0, s.log_text()


def client(srv, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(srv.url, network_timeout=60)
    return grpcclient, grpcclient.InferenceServerClient(srv.grpc_url)


@pytest.fixture(params=PROTOCOLS)
def proto(request, srv):
    mod, c = client(srv, request.param)
    yield request.param, mod, c
    c.close()


def infer(mod, c, model, arrays: dict, outputs=None, dtype="FP32"):
    inputs = []
    for name, x in arrays.items():
        i = mod.InferInput(name, list(x.shape), dtype)
        i.set_data_from_numpy(x)
        inputs.append(i)
    outs = None if outputs is None else [mod.InferRequestedOutput(n) for n in outputs]
    return c.infer(model, inputs, outputs=outs)


def output_names(res) -> list[str]:
    r = res.get_response()
    if isinstance(r, dict):
        return [o["name"] for o in r["outputs"]]
    return [o.name for o in r.outputs]


def error_of(fn) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn()
    return e.value


BAD_REQUEST = ("400", "StatusCode.INVALID_ARGUMENT")


# ---- 1. values: chain and parallel steps, with and without batching ---------------------------
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_chain_and_parallel_steps_batched(proto, batch):
    _, mod, c = proto
    x = np.arange(batch * 5, dtype=np.float32).reshape(batch, 5) - 7
    res = infer(mod, c, "ens", {"IN": x})
    assert sorted(output_names(res)) == sorted(MAIN_OUTPUTS)
    for name, want in expected(x).items():
        got = res.as_numpy(name)
        assert got.shape == (batch, 5), (name, got.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_chain_and_parallel_steps_without_batching(proto):
    _, mod, c = proto
    for width in (1, 7):
        x = np.arange(2 * width, dtype=np.float32).reshape(2, width) * 0.5
        res = infer(mod, c, "ens_nb", {"IN": x})
        for name, want in expected(x).items():
            np.testing.assert_array_equal(res.as_numpy(name), want, err_msg=name)


def test_two_inputs_and_int32(proto):
    _, mod, c = proto
    a = np.array([[1, 2, 3], [10, 20, 30]], dtype=np.int32)
    b = np.array([[5, 5, 5], [-1, -2, -3]], dtype=np.int32)
    res = infer(mod, c, "pair", {"A": a, "B": b}, dtype="INT32")
    np.testing.assert_array_equal(res.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(res.as_numpy("NEG"), -(a + b))
    assert res.as_numpy("NEG").dtype == np.int32


def test_concurrent_requests_keep_their_answers_apart(srv):
    """Many requests at once (steps of different requests interleave in the scheduler): each
    gets the values of its own input."""
    c = httpclient.InferenceServerClient(srv.url, concurrency=8, network_timeout=60)
    try:
        xs, pending = [], []
        for i in range(32):
            x = np.full((2, 6), float(i), dtype=np.float32)
            inp = httpclient.InferInput("IN", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            xs.append(x)
            pending.append(c.async_infer("ens", [inp]))
        for x, p in zip(xs, pending):
            res = p.get_result(timeout=60)
            for name, want in expected(x).items():
                np.testing.assert_array_equal(res.as_numpy(name), want, err_msg=name)
    finally:
        c.close()


# ---- 2. tensors above the inline limit, and no leaked slots -----------------------------------
def big_input(batch: int, seed: int) -> np.ndarray:
    width = 3 * INLINE_LIMIT // 4 // batch + 13      # 3x the inline limit in all, odd size
    return np.random.default_rng(seed).standard_normal((batch, width)).astype(np.float32)


def test_tensors_above_the_inline_limit(proto):
    _, mod, c = proto
    for batch in (1, 4):
        x = big_input(batch, batch)
        assert x.nbytes > INLINE_LIMIT
        res = infer(mod, c, "ens", {"IN": x})
        for name, want in expected(x).items():
            np.testing.assert_array_equal(res.as_numpy(name), want, err_msg=name)
    x = big_input(2, 9)[:, :INLINE_LIMIT // 4].copy()       # [2, 16384]: the limit exactly x 2
    res = infer(mod, c, "ens_nb", {"IN": x})
    for name, want in expected(x).items():
        np.testing.assert_array_equal(res.as_numpy(name), want, err_msg=name)


def shm_usage(srv) -> tuple[int, int]:
    """The server's segments in /dev/shm: how many, and the bytes they hold."""
    names = segments_of(srv.proc.pid)
    held = 0
    for n in names:
        try:
            held += os.stat(f"/dev/shm/{n}").st_blocks * 512
        except FileNotFoundError:
            pass
    return len(names), held


def test_many_large_requests_leak_no_shared_memory(srv):
    """200 requests with tensors above the inline limit, alternating HTTP and gRPC, all outputs
    or only one (the other steps' outputs are then intermediate and must be given back too). An
    arena chunk is unlinked once nothing has used it for 0.3 s, and a server at rest holds no
    segment; a slot never given back keeps its chunk, and so a segment, forever."""
    h = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        wait_for(lambda: shm_usage(srv) == (0, 0), 30,
                 f"the server's segments to go before the test (now {shm_usage(srv)}): an "
                 f"earlier test left a slot in use")
        most = (0, 0)
        for i in range(200):
            mod, c = (httpclient, h) if i % 2 == 0 else (grpcclient, g)
            x = big_input(1 + i % 4, i)
            wanted = None if i % 3 == 0 else [MAIN_OUTPUTS[i % 3]]
            res = infer(mod, c, "ens", {"IN": x}, outputs=wanted)
            want = expected(x)
            for name in wanted or MAIN_OUTPUTS:
                np.testing.assert_array_equal(res.as_numpy(name), want[name], err_msg=name)
            most = max(most, shm_usage(srv))
        assert most[0] > 0 and most[1] >= x.nbytes, \
            "the large tensors should have gone through the server's segments"
        wait_for(lambda: shm_usage(srv) == (0, 0), 30,
                 f"the server's segments to go after the requests (now {shm_usage(srv)}, at "
                 f"most {most}): a leaked output slot keeps its chunk")
    finally:
        h.close()
        g.close()


# ---- 3. client system shared memory ----------------------------------------------------------
class Region:
    def __init__(self, size):
        self.name = f"ens{uuid.uuid4().hex[:10]}"
        self.key = f"/shmtest_{self.name}"
        self.size = size
        self.handle = shm.create_shared_memory_region(self.name, self.key, size)

    def destroy(self):
        shm.destroy_shared_memory_region(self.handle)


@pytest.fixture
def regions(proto):
    _, _, c = proto
    made = []

    def make(size):
        r = Region(size)
        made.append(r)
        c.register_system_shared_memory(r.name, r.key, size)
        return r
    yield make
    for r in made:
        c.unregister_system_shared_memory(r.name)
        r.destroy()


@pytest.mark.parametrize("width", [16, 20000])        # inline-sized and above the limit
def test_client_shared_memory_in_and_out(proto, regions, width):
    _, mod, c = proto
    x = (np.arange(2 * width, dtype=np.float32).reshape(2, width) % 97) - 40
    inr = regions(x.nbytes + 512)
    outr = regions(2 * x.nbytes + 256)
    shm.set_shared_memory_region(inr.handle, [x], offset=512)
    inp = mod.InferInput("IN", list(x.shape), "FP32")
    inp.set_shared_memory(inr.name, x.nbytes, offset=512)
    chain = mod.InferRequestedOutput("CHAIN")
    chain.set_shared_memory(outr.name, x.nbytes, offset=0)
    double = mod.InferRequestedOutput("DOUBLE")
    double.set_shared_memory(outr.name, x.nbytes, offset=x.nbytes + 256)
    plus = mod.InferRequestedOutput("PLUS")                  # returned in the response
    res = c.infer("ens", [inp], outputs=[chain, double, plus])
    want = expected(x)
    np.testing.assert_array_equal(res.as_numpy("PLUS"), want["PLUS"])
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(outr.handle, np.float32, x.shape, offset=0), want["CHAIN"])
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(outr.handle, np.float32, x.shape, offset=x.nbytes + 256),
        want["DOUBLE"])
    # the region outputs come back without data, as for any model
    r = res.get_response()
    if isinstance(r, dict):
        by_name = {o["name"]: o for o in r["outputs"]}
        assert "data" not in by_name["CHAIN"] and "parameters" not in by_name["CHAIN"]
        assert by_name["PLUS"]["parameters"]["binary_data_size"] == x.nbytes
    else:
        names = [o.name for o in r.outputs]
        assert r.raw_output_contents[names.index("CHAIN")] == b""
        assert r.raw_output_contents[names.index("DOUBLE")] == b""
        assert len(r.raw_output_contents[names.index("PLUS")]) == x.nbytes


def test_intermediate_tensor_written_to_a_client_region(proto, regions):
    """PLUS feeds step 1 and is also asked for into the client's region: step 1 still reads the
    right values, and the region holds them."""
    _, mod, c = proto
    x = np.arange(2 * 300, dtype=np.float32).reshape(2, 300)
    outr = regions(x.nbytes)
    inp = mod.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    plus = mod.InferRequestedOutput("PLUS")
    plus.set_shared_memory(outr.name, x.nbytes)
    res = c.infer("ens", [inp], outputs=[plus, mod.InferRequestedOutput("CHAIN")])
    want = expected(x)
    np.testing.assert_array_equal(res.as_numpy("CHAIN"), want["CHAIN"])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outr.handle, np.float32, x.shape),
                                  want["PLUS"])
    # and the next request (same slots reused) is still right
    res = infer(mod, c, "ens", {"IN": x + 1})
    np.testing.assert_array_equal(res.as_numpy("PLUS"), expected(x + 1)["PLUS"])


def test_output_region_too_small_is_refused(proto, regions):
    _, mod, c = proto
    x = np.ones((2, 64), dtype=np.float32)
    outr = regions(x.nbytes // 2)
    inp = mod.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = mod.InferRequestedOutput("CHAIN")
    out.set_shared_memory(outr.name, x.nbytes // 2)
    e = error_of(lambda: c.infer("ens", [inp], outputs=[out]))
    assert str(e.status()) in BAD_REQUEST, e.status()
    # the step that writes CHAIN finds the region too small (the message names that step and
    # its model's own output name)
    assert e.message().startswith("in ensemble 'ens', step 1 (model 'times2'): shared memory "
                                  "size specified with the request for output"), e.message()
    assert f"({x.nbytes // 2} bytes) should be at least {x.nbytes} bytes" in e.message()
    res = infer(mod, c, "ens", {"IN": x})                       # still serving
    np.testing.assert_array_equal(res.as_numpy("CHAIN"), expected(x)["CHAIN"])


# ---- 4. a subset of the outputs; an unknown one -----------------------------------------------
def test_only_the_requested_outputs_come_back(proto):
    _, mod, c = proto
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for wanted in (["DOUBLE"], ["CHAIN"], ["PLUS"], ["CHAIN", "DOUBLE"], ["DOUBLE", "PLUS"]):
        res = infer(mod, c, "ens", {"IN": x}, outputs=wanted)
        assert sorted(output_names(res)) == sorted(wanted)
        for name in wanted:
            np.testing.assert_array_equal(res.as_numpy(name), expected(x)[name], err_msg=name)
    res = infer(mod, c, "ens_nb", {"IN": x}, outputs=["CHAIN"])
    assert output_names(res) == ["CHAIN"]
    np.testing.assert_array_equal(res.as_numpy("CHAIN"), expected(x)["CHAIN"])


def test_an_unknown_output_is_a_bad_request(proto):
    _, mod, c = proto
    x = np.ones((1, 3), dtype=np.float32)
    for wanted in (["NOPE"], ["CHAIN", "NOPE"], ["OUTPUT0"]):
        e = error_of(lambda: infer(mod, c, "ens", {"IN": x}, outputs=wanted))
        bad = wanted[-1]
        assert str(e.status()) in BAD_REQUEST, e.status()
        assert f"unexpected inference output '{bad}' for model 'ens'" in e.message(), e.message()
    # an intermediate tensor (T: step 0 -> step 1) is not an output of the ensemble
    e = error_of(lambda: infer(mod, c, "guarded", {"IN": np.array([3], np.int32)}, outputs=["T"],
                               dtype="INT32"))
    assert str(e.status()) in BAD_REQUEST, e.status()
    assert "unexpected inference output 'T' for model 'guarded'" in e.message(), e.message()


# ---- 5. a failing step --------------------------------------------------------------------------
def test_a_failing_step_names_the_ensemble_step_and_model(proto):
    _, mod, c = proto
    for value in (0, 1):          # faulty sees value + 1: raises on 1, answers an error on 2
        direct = error_of(lambda: infer(mod, c, "faulty", {"INPUT0": np.array([value + 1], np.int32)},
                                        dtype="INT32"))
        e = error_of(lambda: infer(mod, c, "guarded", {"IN": np.array([value], np.int32)},
                                   dtype="INT32"))
        assert e.message() == f"in ensemble 'guarded', step 1 (model 'faulty'): {direct.message()}"
        assert str(e.status()) == str(direct.status())
        want = "faulty raised on purpose" if value == 0 else "faulty refuses the value 2"
        assert want in e.message()
        # the server keeps serving, that ensemble too
        res = infer(mod, c, "guarded", {"IN": np.array([4, 5], np.int32)}, dtype="INT32")
        np.testing.assert_array_equal(res.as_numpy("OUT"), [5, 6])
    assert str(error_of(lambda: infer(mod, c, "guarded", {"IN": np.array([1], np.int32)},
                                      dtype="INT32")).status()) in BAD_REQUEST


def test_failing_steps_with_large_tensors_leak_no_shared_memory(srv):
    """Step 0's output (above the inline limit) feeds the failing step 1 while step 2 runs
    beside it: every slot is given back, whichever of them answers first."""
    n = 3 * INLINE_LIMIT // 4
    h = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        wait_for(lambda: shm_usage(srv) == (0, 0), 30,
                 f"the server's segments to go before the test (now {shm_usage(srv)})")
        for i in range(40):
            mod, c = (httpclient, h) if i % 2 == 0 else (grpcclient, g)
            x = np.full(n, i % 2, dtype=np.int32)       # faulty sees 1 (raises) or 2 (error)
            e = error_of(lambda: infer(mod, c, "guarded", {"IN": x}, dtype="INT32"))
            assert e.message().startswith("in ensemble 'guarded', step 1 (model 'faulty'): "), \
                e.message()
        x = np.arange(n, dtype=np.int32) + 3
        res = infer(httpclient, h, "guarded", {"IN": x}, dtype="INT32")
        np.testing.assert_array_equal(res.as_numpy("OUT"), x + 1)
        np.testing.assert_array_equal(res.as_numpy("SIDE"), x + 1)
        wait_for(lambda: shm_usage(srv) == (0, 0), 30,
                 f"the server's segments to go after the failures (now {shm_usage(srv)})")
    finally:
        h.close()
        g.close()


# ---- 6. statistics -------------------------------------------------------------------------------
def stats_of(srv, model) -> dict:
    c = httpclient.InferenceServerClient(srv.url)
    try:
        s = c.get_inference_statistics(model)["model_stats"]
    finally:
        c.close()
    assert len(s) == 1, s
    return s[0]


def counts(s: dict) -> tuple[int, int, int, int]:
    st = s["inference_stats"]
    return (s["inference_count"], s["execution_count"], st["success"]["count"],
            st["fail"]["count"])


def test_statistics_count_the_ensemble_and_its_composing_models(srv):
    k, batch = 5, 3
    h = httpclient.InferenceServerClient(srv.url)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        before = {m: counts(stats_of(srv, m)) for m in ("stats_ens", "s_add", "s_mul")}
        assert before["stats_ens"] == (0, 0, 0, 0)
        for i in range(k):
            mod, c = (httpclient, h) if i % 2 else (grpcclient, g)
            x = np.full((batch, 4), float(i), dtype=np.float32)
            res = infer(mod, c, "stats_ens", {"IN": x})
            np.testing.assert_array_equal(res.as_numpy("OUT"), (x + 1) * 3)
        ens = stats_of(srv, "stats_ens")
        inference, executions, success, fail = counts(ens)
        assert success == k and fail == 0
        assert inference == k * batch
        assert executions == k
        assert int(ens["inference_stats"]["success"]["ns"]) > 0
        assert int(ens["last_inference"]) > 0
        for m in ("s_add", "s_mul"):
            inference, executions, success, fail = counts(stats_of(srv, m))
            assert success == k and fail == 0, m
            assert inference == k * batch, m
            assert executions == k, m       # sequential requests, no dynamic batcher
        # the same numbers over gRPC
        gs = g.get_inference_statistics("stats_ens", as_json=True)["model_stats"][0]
        assert int(gs["inference_stats"]["success"]["count"]) == k
        assert int(gs["inference_count"]) == k * batch
    finally:
        h.close()
        g.close()


def test_a_failed_request_counts_as_a_failure_of_the_ensemble(srv):
    h = httpclient.InferenceServerClient(srv.url)
    try:
        before = counts(stats_of(srv, "guarded"))
        faulty_before = counts(stats_of(srv, "faulty"))
        error_of(lambda: infer(httpclient, h, "guarded", {"IN": np.array([0], np.int32)},
                               dtype="INT32"))
        infer(httpclient, h, "guarded", {"IN": np.array([3], np.int32)}, dtype="INT32")
        after = counts(stats_of(srv, "guarded"))
        # one failed request counts twice, as in Triton: its failed step's request counts
        # against the ensemble too, then the request itself
        assert after[3] == before[3] + 2, (before, after)
        assert after[2] == before[2] + 1, (before, after)        # one success
        assert after[0] == before[0] + 1, (before, after)        # only the good one inferred
        faulty_after = counts(stats_of(srv, "faulty"))
        assert faulty_after[3] == faulty_before[3] + 1, (faulty_before, faulty_after)
        assert faulty_after[2] == faulty_before[2] + 1, (faulty_before, faulty_after)
    finally:
        h.close()


# ---- 7. bad input to the ensemble -----------------------------------------------------------------
def test_bad_inputs_are_refused_naming_the_input(proto):
    _, mod, c = proto
    cases = [
        # wrong data type
        (lambda: infer(mod, c, "ens", {"IN": np.ones((1, 3), np.int32)}, dtype="INT32"),
         "inference input 'IN' data-type is 'INT32', but model 'ens' expects 'FP32'"),
        # wrong shape, without batching: [2, -1] wanted
        (lambda: infer(mod, c, "ens_nb", {"IN": np.ones((3, 4), np.float32)}),
         "unexpected shape for input 'IN' for model 'ens_nb'"),
        (lambda: infer(mod, c, "ens_nb", {"IN": np.ones(8, np.float32)}),
         "unexpected shape for input 'IN' for model 'ens_nb'"),
        # wrong shape with batching: [3] per row wanted
        (lambda: infer(mod, c, "pair", {"A": np.ones((1, 4), np.int32),
                                        "B": np.ones((1, 4), np.int32)}, dtype="INT32"),
         "unexpected shape for input 'A' for model 'pair'"),
        # a batch above the ensemble's max_batch_size
        (lambda: infer(mod, c, "ens", {"IN": np.ones((5, 2), np.float32)}),
         "inference request batch-size must be <= 4 for 'ens'"),
        # a missing input
        (lambda: infer(mod, c, "pair", {"A": np.ones((1, 3), np.int32)}, dtype="INT32"),
         "missing required input(s) ['B']"),
        # an input it does not have: more inputs than the model has, counted first as Triton
        # does, naming what was given
        (lambda: infer(mod, c, "ens", {"IN": np.ones((1, 2), np.float32),
                                       "PLUS": np.ones((1, 2), np.float32)}),
         "expected 1 inputs but got 2 inputs for model 'ens'. Got input(s) ['IN','PLUS']"),
        # in place of the one it has
        (lambda: infer(mod, c, "ens", {"PLUS": np.ones((1, 2), np.float32)}),
         "unexpected inference input 'PLUS' for model 'ens'"),
    ]
    for call, text in cases:
        e = error_of(call)
        assert str(e.status()) in BAD_REQUEST, (text, e.status(), e.message())
        assert text in e.message(), (text, e.message())
    res = infer(mod, c, "pair", {"A": np.ones((1, 3), np.int32), "B": np.ones((1, 3), np.int32)},
                dtype="INT32")
    np.testing.assert_array_equal(res.as_numpy("SUM"), [[2, 2, 2]])
