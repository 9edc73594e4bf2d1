"""A model's outputs against its config: a datatype that is not the config's is an error (FP64
bytes for an FP32 output would be misread); a shape that is not the config's passes, as Triton
passes it, and the worker logs it once."""
import re
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for
from tritonclient.utils import InferenceServerException

# INPUT0 [4] FP32 selects what comes back: 0 a good answer, 1 FP64, 2 three elements, 3 a 2-D
# array, 4 a response parameter past 64 bits
WRONG = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = r.inputs()[0].as_numpy()
                how = int(x[0, 0])
                if how == 4:            # a response parameter no protocol can carry
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)],
                                                          parameters={"big": 2 ** 70}))
                    continue
                if how == 5:            # Triton's python backend takes no float parameter
                    try:
                        pb_utils.InferenceResponse([], parameters={"ratio": 0.5})
                    except pb_utils.TritonModelException as e:
                        out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                    continue
                if how == 6:            # the types it takes reach the client
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)],
                        parameters={"s": "text", "i": -7, "b": True}))
                    continue
                y = {0: x, 1: x.astype(np.float64), 2: x[:, :3], 3: x.reshape(1, 2, 2)}[how]
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
            return out
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("outputs"))
    write_model(repo, "wrong_outputs", '''
        backend: "python"
        max_batch_size: 4
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        instance_group [ { count: 1, kind: KIND_CPU } ]     # one worker: one log line
    ''', WRONG)
    s = Server(repo)
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
@pytest.mark.parametrize("how, text", [
    (1, "unexpected datatype FP64 for inference output 'OUTPUT0' of model 'wrong_outputs', "
        "expecting FP32"),
    (4, "response parameter 'big' is out of the 64-bit integer range"),     # killed the worker
    (5, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
])
def test_an_output_that_breaks_the_config_is_an_error(server, client_mod, how, text):
    url = server.url if client_mod is httpclient else server.grpc_url
    c = client_mod.InferenceServerClient(url)
    x = np.full((1, 4), how, dtype=np.float32)
    inp = client_mod.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as e:
        c.infer("wrong_outputs", [inp])
    assert text in e.value.message()
    inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
    np.testing.assert_array_equal(c.infer("wrong_outputs", [inp]).as_numpy("OUTPUT0"),
                                  np.zeros((1, 4), dtype=np.float32))


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
@pytest.mark.parametrize("how, shape", [(2, [1, 3]), (3, [1, 2, 2])])
def test_an_output_of_another_shape_passes_as_it_is(server, client_mod, how, shape):
    url = server.url if client_mod is httpclient else server.grpc_url
    c = client_mod.InferenceServerClient(url)
    x = np.full((1, 4), how, dtype=np.float32)
    inp = client_mod.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(2):
        out = c.infer("wrong_outputs", [inp]).as_numpy("OUTPUT0")
        assert list(out.shape) == shape
        np.testing.assert_array_equal(out.reshape(-1), x.reshape(-1)[:out.size])
    # the first shape of OUTPUT0 that broke the config is logged, once for the worker's life
    noted = re.compile(r"unexpected shape \[1, (3|2, 2)\] for inference output 'OUTPUT0' of model "
                       r"'wrong_outputs', expecting \[-1, 4\] \(passed on as it is; logged once\)")
    wait_for(lambda: noted.search(server.log_text()), 30, "the worker to log the shape")
    assert len(noted.findall(server.log_text())) == 1


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_response_parameters_reach_the_client(server, client_mod):
    url = server.url if client_mod is httpclient else server.grpc_url
    c = client_mod.InferenceServerClient(url)
    inp = client_mod.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), 6, dtype=np.float32))
    result = c.infer("wrong_outputs", [inp])
    if client_mod is httpclient:
        params = result.get_response()["parameters"]
    else:
        raw = result.get_response().parameters
        params = {k: getattr(raw[k], raw[k].WhichOneof("parameter_choice")) for k in raw}
    assert params == {"s": "text", "i": -7, "b": True}
