"""Ensembles whose steps could run side by side (a diamond: IN feeds two steps, a third joins
them) on a real server: light steps come to run worker to worker once their statistics show
that running them one after the other loses less than the hops save; heavy branches stay on
the scheduler, which runs them at once. Every answer is right on either path, and a step's
worker that dies on the worker-to-worker path fails that request by its step only."""
import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, descendants, leased_requests, left_nothing, wait_for
from tritonclient.utils import InferenceServerException

# Y = X * SCALE + SHIFT, after sleeping SLEEP_MS (config parameters); Z = X + Y for the join.
# Request parameters: "die" naming the model makes that model's process exit; "branch_ms" makes
# every step but the join sleep that long.
STEP = textwrap.dedent('''
    import json, os, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            cfg = json.loads(args["model_config"])
            self.name = cfg["name"]
            p = {k: float(v["string_value"]) for k, v in cfg.get("parameters", {}).items()}
            self.scale, self.shift = p.get("SCALE", 1.0), p.get("SHIFT", 0.0)
            self.sleep_s = p.get("SLEEP_MS", 0.0) / 1000.0
            self.join = any(t["name"] == "Y" for t in cfg["input"])

        def execute(self, requests):
            out = []
            for r in requests:
                if json.loads(r.parameters()).get("die") == self.name:
                    os._exit(1)
                sleep_s = self.sleep_s + json.loads(r.parameters()).get("branch_ms", 0) / 1000.0 \
                    * (not self.join)
                if sleep_s:
                    time.sleep(sleep_s)
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                if self.join:
                    z = x + pb_utils.get_input_tensor_by_name(r, "Y").as_numpy()
                else:
                    z = x * self.scale + self.shift
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Z", z.astype(np.float32))]))
            return out
''')


def step_config(inputs: tuple[str, ...], dims: str = "4", **params: float) -> str:
    ins = ", ".join(f'{{ name: "{n}", data_type: TYPE_FP32, dims: [ {dims} ] }}' for n in inputs)
    extra = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                    for k, v in params.items())
    return f'''
        backend: "python"
        max_batch_size: 8
        input [ {ins} ]
        output [ {{ name: "Z", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
        {extra}'''


def diamond_config(left: str, right: str, join: str) -> str:
    """OUT = join(left(IN), right(IN)); the join is written first, so the order the steps
    run in is the plan's, not the config's."""
    return f'''
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        ensemble_scheduling {{ step [
          {{ model_name: "{join}" model_version: -1 input_map {{ key: "X" value: "p" }}
            input_map {{ key: "Y" value: "q" }} output_map {{ key: "Z" value: "OUT" }} }},
          {{ model_name: "{left}" model_version: -1 input_map {{ key: "X" value: "IN" }}
            output_map {{ key: "Z" value: "p" }} }},
          {{ model_name: "{right}" model_version: -1 input_map {{ key: "X" value: "IN" }}
            output_map {{ key: "Z" value: "q" }} }} ] }}'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("diamond"))
    # light: OUT = (IN + 1) + 2 * IN; heavy: both branches sleep 40 ms, OUT = IN + 3 * IN
    write_model(repo, "inc", step_config(("X",), SHIFT=1), STEP)
    write_model(repo, "dbl", step_config(("X",), SCALE=2), STEP)
    write_model(repo, "add", step_config(("X", "Y")), STEP)
    write_model(repo, "slow1", step_config(("X",), SLEEP_MS=40), STEP)
    write_model(repo, "slow3", step_config(("X",), SCALE=3, SLEEP_MS=40), STEP)
    write_model(repo, "light", diamond_config("inc", "dbl", "add"), None)
    write_model(repo, "heavy", diamond_config("slow1", "slow3", "add"), None)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def infer(s, model: str, value: float, **params) -> np.ndarray:
    c = httpclient.InferenceServerClient(s.url)
    try:
        inp = httpclient.InferInput("IN", [1, 4], "FP32")
        inp.set_data_from_numpy(np.full((1, 4), value, dtype=np.float32))
        return c.infer(model, [inp], parameters=params or None).as_numpy("OUT")
    finally:
        c.close()


def test_light_steps_run_worker_to_worker_heavy_branches_side_by_side(srv):
    # the heavy diamond runs long enough for its steps to be costed...
    for i in range(10):
        assert (infer(srv, "heavy", float(i)) == 4 * i).all()
    # ...then the light one, until it runs worker to worker (a look every second)
    sent = []

    def chained() -> bool:
        v = float(len(sent))
        sent.append(v)
        assert (infer(srv, "light", v) == 3 * v + 1).all()
        return leased_requests(srv, "light") > 0
    wait_for(chained, 30, "the light diamond to run worker to worker")
    for i in range(20):
        assert (infer(srv, "light", float(i)) == 3 * i + 1).all()
    before = leased_requests(srv, "light")
    assert before >= 19
    # the heavy one was costed at the same looks: one after the other its branches would
    # take 80 ms for 40, so the scheduler goes on running them at once
    for i in range(10):
        assert (infer(srv, "heavy", float(i)) == 4 * i).all()
    assert leased_requests(srv, "heavy") == 0


def test_a_dying_branch_fails_its_request_by_its_step_and_the_diamond_serves_on(srv):
    wait_for(lambda: (infer(srv, "light", 1.0) == 4).all() and
             leased_requests(srv, "light") > 0, 30, "the light diamond worker to worker")
    lent = leased_requests(srv, "light")
    with pytest.raises(InferenceServerException) as e:
        infer(srv, "light", 1.0, die="dbl")
    assert "dbl" in str(e.value)
    # the step's worker restarts; the diamond answers right, and again worker to worker
    wait_for(lambda: (infer(srv, "light", 2.0) == 7).all() and
             leased_requests(srv, "light") > lent, 60,
             "the diamond to run worker to worker again")


def test_branches_that_turn_heavy_go_back_to_the_scheduler_and_return_when_light(srv):
    wait_for(lambda: (infer(srv, "light", 1.0) == 4).all() and
             leased_requests(srv, "light") > 0, 30, "the light diamond worker to worker")

    def settled_on_scheduler() -> bool:
        # each request's branches sleep 30 ms: one after the other they would cost 30 ms more
        before = leased_requests(srv, "light")
        for _ in range(3):
            assert (infer(srv, "light", 2.0, branch_ms=30) == 7).all()
        return leased_requests(srv, "light") == before
    wait_for(settled_on_scheduler, 30, "the heavy diamond to run on the scheduler again")

    def back() -> bool:
        before = leased_requests(srv, "light")
        assert (infer(srv, "light", 4.0) == 13).all()
        return leased_requests(srv, "light") > before
    wait_for(back, 30, "the light diamond to run worker to worker again")


def test_nothing_is_left_behind(tmp_path):
    repo = str(tmp_path)
    write_model(repo, "inc", step_config(("X",), SHIFT=1), STEP)
    write_model(repo, "dbl", step_config(("X",), SCALE=2), STEP)
    write_model(repo, "add", step_config(("X", "Y")), STEP)
    write_model(repo, "light", diamond_config("inc", "dbl", "add"), None)
    s = Server(repo)
    try:
        wait_for(lambda: (infer(s, "light", 1.0) == 4).all() and
                 leased_requests(s, "light") > 0, 30, "the light diamond worker to worker")
        pids = descendants(s.proc.pid)
        assert len(pids) >= 5           # the frontend, the scheduler, a worker a step
    finally:
        assert s.stop() == 0
    left_nothing(s, pids)
