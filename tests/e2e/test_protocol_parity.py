"""HTTP and gRPC give the same answer to the same mistake: one error code, mapped through the one
map of each protocol (errors.http_status / errors.grpc_status), with the same message."""
import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import Server, wait_for
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from shmserve.frontend.grpc.status import grpc_status
from shmserve.ipc.errors import http_status
from shmserve.ipc.messages.common import ErrorCode


@pytest.fixture(scope="module")
def srv(example_repo):
    s = Server(example_repo, "--model-control-mode", "explicit", "--load-model", "simple")
    yield s
    assert s.stop() == 0


def _param(**kw):
    return pb.ModelRepositoryParameter(**kw)


def _infer_request(version: str) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="simple", model_version=version)
    for n in ("INPUT0", "INPUT1"):
        req.inputs.add(name=n, datatype="INT32", shape=[1, 16])
        req.raw_input_contents.append(np.zeros(16, dtype=np.int32).tobytes())
    return req


_INFER_JSON = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}
                          for n in ("INPUT0", "INPUT1")]}

# (case, HTTP (method, path, JSON body), gRPC (method, request), code, text in the message)
CASES = [
    ("load of a missing model",
     ("POST", "/v2/repository/models/no_such_model/load", None),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="no_such_model")),
     ErrorCode.INTERNAL, "failed to poll from model repository"),
    ("load config that is not a string",
     ("POST", "/v2/repository/models/simple/load", {"parameters": {"config": 5}}),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(
         model_name="simple", parameters={"config": _param(int64_param=5)})),
     ErrorCode.INVALID_ARG, "load parameter 'config' must be a string"),
    ("load config that is not JSON",
     ("POST", "/v2/repository/models/simple/load", {"parameters": {"config": "{not json"}}),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(
         model_name="simple", parameters={"config": _param(string_param="{not json")})),
     ErrorCode.INVALID_ARG, "failed to parse"),
    ("unload_dependents that is not a boolean",
     ("POST", "/v2/repository/models/simple/unload", {"parameters": {"unload_dependents": "yes"}}),
     ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(
         model_name="simple", parameters={"unload_dependents": _param(string_param="yes")})),
     ErrorCode.INVALID_ARG, "unload parameter 'unload_dependents' must be a boolean"),
    ("a repository name",
     ("POST", "/v2/repository/other/models/simple/load", None),
     ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(repository_name="other",
                                                           model_name="simple")),
     ErrorCode.UNSUPPORTED, "repository names are not supported"),
    ("stats of an unknown model",
     ("GET", "/v2/models/no_such_model/stats", None),
     ("ModelStatistics", pb.ModelStatisticsRequest(name="no_such_model")),
     ErrorCode.INVALID_ARG, "'no_such_model' is not available"),
    ("ready of an unknown model",
     ("GET", "/v2/models/no_such_model/ready", None),
     ("ModelReady", pb.ModelReadyRequest(name="no_such_model")),
     ErrorCode.NOT_FOUND, "'no_such_model' is not found"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_code_and_message(srv, case):
    _, (method, path, body), (rpc, request), code, text = case
    r = requests.request(method, srv.base + path, json=body, timeout=60)
    with grpc.insecure_channel(srv.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            getattr(pb_grpc.GRPCInferenceServiceStub(ch), rpc)(request, timeout=60)
    assert r.status_code == http_status(code), r.text
    assert e.value.code() == grpc_status(code), e.value.details()
    assert r.json() == {"error": e.value.details()}
    assert text in e.value.details()


VERSION_WORDS = ("failed to get model version from specified version string '1x' (details: "
                 "stol), version should be an integral value > 0")


@pytest.mark.parametrize("path, rpc, message", [
    ("/v2/models/simple/versions/1x/stats", "ModelStatistics",
     pb.ModelStatisticsRequest(name="simple", version="1x")),
    ("/v2/models/simple/versions/1x", "ModelMetadata",
     pb.ModelMetadataRequest(name="simple", version="1x")),
    ("/v2/models/simple/versions/1x/ready", "ModelReady",
     pb.ModelReadyRequest(name="simple", version="1x")),
    ("/v2/models/simple/versions/1x/infer", "ModelInfer", _infer_request("1x")),
], ids=["stats", "metadata", "ready", "infer"])
def test_a_version_that_is_not_digits(srv, path, rpc, message):
    """As Triton: over HTTP no route has such a path (404 Not Found); over gRPC the version
    string is refused in Triton's words."""
    method = "POST" if path.endswith("/infer") else "GET"
    r = requests.request(method, srv.base + path, json=_INFER_JSON if method == "POST" else None,
                         timeout=60)
    assert (r.status_code, r.json()) == (404, {"error": "Not Found"})
    with grpc.insecure_channel(srv.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            getattr(pb_grpc.GRPCInferenceServiceStub(ch), rpc)(message, timeout=60)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, VERSION_WORDS)


def test_unload_dependents_true_is_accepted_over_both(srv):
    """shmserve has no ensembles yet, so no model has dependents: true unloads just the model."""
    h = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        for client in (h, g):
            client.load_model("identity_fp32")
            assert client.is_model_ready("identity_fp32")
            client.unload_model("identity_fp32", unload_dependents=True)
            wait_for(lambda: not srv.model_ready("identity_fp32"), 30,
                     "identity_fp32 to be unloaded")
        assert h.is_model_ready("simple")
    finally:
        h.close()
        g.close()
