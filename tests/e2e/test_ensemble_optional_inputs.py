"""An ensemble with an optional input runs worker to worker when the client sends every input,
and on the scheduler's path (which skips what cannot run and leaves the input out of what can)
when it leaves the optional one out; both answer right, alternating, over HTTP and gRPC."""
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, leased_requests, wait_for

# Z = X + SHIFT, plus Y when the request brings it
ADD = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        p = json.loads(args["model_config"]).get("parameters", {})
        self.shift = float(p.get("SHIFT", {}).get("string_value", "0"))

    def execute(self, requests):
        out = []
        for r in requests:
            z = pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + self.shift
            y = pb_utils.get_input_tensor_by_name(r, "Y")
            if y is not None:
                z = z + y.as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Z", z.astype(np.float32))]))
        return out
'''


def add_config(shift: float) -> str:
    return f'''
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }},
                {{ name: "Y", data_type: TYPE_FP32, dims: [ 4 ], optional: true }} ]
        output [ {{ name: "Z", data_type: TYPE_FP32, dims: [ 4 ] }} ]
        parameters {{ key: "SHIFT" value: {{ string_value: "{shift}" }} }}'''


# P = IN + 1; OUT = P + 10 (+ EXTRA when sent)
ENSEMBLE = '''
    platform: "ensemble"
    max_batch_size: 8
    input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] },
            { name: "EXTRA", data_type: TYPE_FP32, dims: [ 4 ], optional: true } ]
    output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
    ensemble_scheduling { step [
      { model_name: "o_inc" model_version: -1 input_map { key: "X" value: "IN" }
        output_map { key: "Z" value: "P" } },
      { model_name: "o_add" model_version: -1 input_map { key: "X" value: "P" }
        input_map { key: "Y" value: "EXTRA" } output_map { key: "Z" value: "OUT" } } ] }
'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("optional"))
    write_model(repo, "o_inc", add_config(1), ADD)
    write_model(repo, "o_add", add_config(10), ADD)
    write_model(repo, "opt", ENSEMBLE, None)
    s = Server(repo)
    yield s
    assert s.stop() == 0, s.log_text()


def infer(mod, c, x: np.ndarray, extra: np.ndarray | None) -> np.ndarray:
    inputs = []
    for name, a in (("IN", x), ("EXTRA", extra)):
        if a is not None:
            i = mod.InferInput(name, list(a.shape), "FP32")
            i.set_data_from_numpy(a)
            inputs.append(i)
    return c.infer("opt", inputs).as_numpy("OUT")


def counted(client) -> int:
    """Successful requests of the ensemble, in its statistics."""
    return int(client.get_inference_statistics("opt")["model_stats"][0]["inference_stats"]
               ["success"]["count"])


def test_with_every_input_worker_to_worker_without_the_optional_one_on_the_scheduler(srv):
    h = httpclient.InferenceServerClient(srv.url)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        e = np.full((1, 4), 100, dtype=np.float32)
        before = leased_requests(srv, "opt")
        wait_for(lambda: (infer(httpclient, h, x, e) == x + 111).all() and
                 leased_requests(srv, "opt") > before, 30, "the ensemble worker to worker")
        for extra, want, lent_ok in ((None, 11, range(0, 1)), (e, 111, range(8, 14))):
            # (a request on the scheduler's path uses the steps' instances there, so their
            # leases come back only after a while: phases, not alternating requests)
            if extra is not None:
                wait_for(lambda: (infer(httpclient, h, x, e) == x + 111).all() and
                         leased_requests(srv, "opt") > before, 30, "worker to worker again")
            start, before = counted(h), leased_requests(srv, "opt")
            for i in range(12):
                mod, c = (httpclient, h) if i % 2 == 0 else (grpcclient, g)
                v = x + i
                assert (infer(mod, c, v, extra) == v + want).all()
            # every request counted (leased ones' records come in bulk, 50 ms apart: one of
            # the request before may be among them): those without EXTRA never go worker to
            # worker, those with it do (a lease is renewed every 2 s: one may take the
            # scheduler now and then)
            wait_for(lambda: counted(h) >= start + 12, 10, "every request counted")
            lent = leased_requests(srv, "opt") - before
            assert lent in lent_ok, (extra is not None, lent)
            before = leased_requests(srv, "opt")
    finally:
        h.close()
        g.close()
