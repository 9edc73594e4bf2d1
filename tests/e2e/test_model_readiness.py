"""A model's readiness as Triton reports it. A python model's own ``is_ready()`` decides: only
True is ready; False, an exception, another value or no answer within 5 s is not ready. It is
called on a thread of the worker, so a slow check holds up no inference. With
--strict-readiness (the default), a model whose instance's process died reads not ready until
the restarted instance runs. Over HTTP and gRPC, with the real server."""
import concurrent.futures
import os
import signal
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for, worker_pid

MODEL = textwrap.dedent('''
    import asyncio
    import json
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"]).get("parameters", {})
            self.answer = params.get("ANSWER", {}).get("string_value", "true")
            self.delay = float(params.get("DELAY", {}).get("string_value", "0"))

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                if x.flat[0] > 0:           # a slow batch: readiness must not wait for it
                    time.sleep(float(x.flat[0]))
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out

        def is_ready(self):
            time.sleep(self.delay)
            return {"true": True, "false": False, "non_boolean": "ready"}.get(self.answer) \\
                if self.answer != "exception" else self._raise()

        def _raise(self):
            raise RuntimeError("Internal check failed")
''')

COROUTINE = MODEL.replace("    def is_ready(self):\n        time.sleep(self.delay)",
                          "    async def is_ready(self):\n        await asyncio.sleep(self.delay)")
PLAIN = MODEL.split("    def is_ready(self):")[0]
assert COROUTINE != MODEL and PLAIN != MODEL

CONFIG = '''
    backend: "python"
    max_batch_size: 4
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    instance_group [ { count: 2, kind: KIND_CPU } ]
    parameters: { key: "ANSWER" value: { string_value: "%s" } }
    parameters: { key: "DELAY" value: { string_value: "%s" } }
'''

MODELS = {      # name: (code, answer, delay)
    "says_true": (MODEL, "true", "0.1"),
    "says_false": (MODEL, "false", "0.1"),
    "raises": (MODEL, "exception", "0.1"),
    "non_boolean": (MODEL, "non_boolean", "0.1"),
    "coroutine": (COROUTINE, "true", "0.1"),
    "too_slow": (MODEL, "true", "8"),
    "no_is_ready": (PLAIN, "true", "0"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("readiness"))
    for name, (code, answer, delay) in MODELS.items():
        write_model(repo, name, CONFIG % (answer, delay), code)
    s = Server(repo, "--strict-readiness", "false")
    yield s
    assert s.stop() == 0


def _clients(server):
    return (httpclient.InferenceServerClient(server.url, network_timeout=30),
            grpcclient.InferenceServerClient(server.grpc_url))


def _infer(client, mod, model: str, value: float = 0.0) -> None:
    inp = mod.InferInput("INPUT0", [1, 1], "FP32")
    inp.set_data_from_numpy(np.full((1, 1), value, np.float32))
    assert client.infer(model, [inp]).as_numpy("OUTPUT0")[0, 0] == value


@pytest.mark.parametrize("model, ready", [
    ("says_true", True), ("coroutine", True), ("no_is_ready", True),
    ("says_false", False), ("raises", False), ("non_boolean", False),
])
def test_the_model_says_whether_it_is_ready(server, model, ready):
    h, g = _clients(server)
    for _ in range(3):
        assert h.is_model_ready(model) is ready
        assert g.is_model_ready(model) is ready
    # whatever it says, it serves (readiness is what a balancer reads, not a gate)
    _infer(h, httpclient, model)
    _infer(g, grpcclient, model)


def test_no_answer_within_five_seconds_is_not_ready_and_holds_up_no_inference(server):
    h, g = _clients(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        checks = [pool.submit(h.is_model_ready, "too_slow"), pool.submit(g.is_model_ready, "too_slow")]
        for _ in range(3):          # the model's 8 s is_ready() runs beside these
            _infer(g, grpcclient, "too_slow")
        # the checks were asked before these answers and end only at their 5 s timeout
        assert not any(c.done() for c in checks)
        assert [c.result(timeout=30) for c in checks] == [False, False]


# its restarts take a while (its first load leaves a mark), so that the window between a death
# and the restarted instance is seen from outside
SLOW_RESTART = PLAIN.replace("    def initialize(self, args):", """    def initialize(self, args):
        import pathlib
        mark = pathlib.Path(json.loads(args["model_config"])["parameters"]["MARK"]["string_value"])
        if mark.exists():
            time.sleep(3)
        mark.touch()""")
assert SLOW_RESTART != PLAIN


@pytest.fixture(scope="module", params=["strict", "not-strict"])
def restarting(request, tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("restarts"))
    mark = os.path.join(repo, "loaded-once")
    write_model(repo, "slow_restart", CONFIG.replace("count: 2", "count: 1") % ("true", "0")
                + f'parameters: {{ key: "MARK" value: {{ string_value: "{mark}" }} }}\n', SLOW_RESTART)
    s = Server(repo, "--strict-readiness", "true" if request.param == "strict" else "false")
    yield s, request.param == "strict"
    assert s.stop() == 0


def test_an_instance_that_died_is_not_ready_until_it_runs_again(restarting):
    server, strict = restarting
    h, g = _clients(server)
    assert h.is_model_ready("slow_restart") and g.is_model_ready("slow_restart")
    os.kill(worker_pid(server, "slow_restart"), signal.SIGKILL)
    wait_for(lambda: "instance slow_restart_0_0 of model 'slow_restart'" in server.log_text(), 30,
             "the scheduler to see the death")
    if strict:      # (the frontend learns it from the next model table) Triton's words, logged
        # (a check that comes before the model table may read it not ready on its own path,
        # the model's is_ready() finding no worker, which logs nothing; the log is written
        # by another thread: both are polled)
        line = "Model 'slow_restart' version 1 is not ready: Stub process 'slow_restart_0_0' is not healthy."
        wait_for(lambda: not h.is_model_ready("slow_restart") and not g.is_model_ready("slow_restart")
                 and server.log_text().count(line) >= 2, 10, "both protocols to read it not ready, logged")
    else:           # without strict readiness a restarting instance keeps its model ready
        assert h.is_model_ready("slow_restart") and g.is_model_ready("slow_restart")
    wait_for(lambda: h.is_model_ready("slow_restart"), 60, "the restarted instance")
    _infer(g, grpcclient, "slow_restart")
