"""Restricted API groups: parsing the flags, which group each endpoint is in, the checks."""
import pytest
from frontend_fakes import make_service

from shmserve.engine.launch import restricted
from shmserve.frontend.grpc.service import RPC_GROUPS, InferenceService
from shmserve.frontend.http.app import KServeHttpApp, api_group


def test_parse():
    got = restricted.parse(["model-repository,shared-memory:Admin-Key=s3:cr=et",
                            "inference:k=v"])
    assert got == {"model-repository": ("admin-key", "s3:cr=et"),
                   "shared-memory": ("admin-key", "s3:cr=et"), "inference": ("k", "v")}
    assert restricted.parse([]) == {}


@pytest.mark.parametrize("spec, text", [
    ("inference", "expected <api>"), ("inference:k", "expected <api>"), (":k=v", "expected <api>"),
    ("inferencing:k=v", "unknown restricted api 'inferencing'"), ("inference:=v", "expected <api>"),
])
def test_parse_errors(spec, text):
    with pytest.raises(restricted.RestrictionError, match=text):
        restricted.parse([spec])


def test_a_group_is_restricted_once():
    with pytest.raises(restricted.RestrictionError, match="api '[a-z-]+' can not be specified in multiple config groups"):
        restricted.parse(["health:a=1", "health,metadata:b=2"])


def test_grpc_errors_say_protocol_as_tritons_do():
    with pytest.raises(restricted.RestrictionError, match="protocol 'health' can not be specified in multiple config groups"):
        restricted.parse(["model-repository,health:k1=v1", "metadata,health:k2=v2"], "protocol")
    with pytest.raises(restricted.RestrictionError, match="unknown restricted protocol 'model-reposit'"):
        restricted.parse(["model-reposit,health:k1=v1"], "protocol")


def test_every_http_endpoint_has_its_group():
    groups = {p: api_group(p) for _, p, _ in KServeHttpApp(make_service(), 1 << 20).routes()}
    assert groups["/v2/health/live"] == groups["/v2/models/{model}/ready"] == "health"
    assert groups["/v2"] == groups["/v2/models/{model}/versions/{version}"] == "metadata"
    assert groups["/v2/models/{model}/infer"] == "inference"
    assert groups["/v2/models/{model}/generate"] == "inference"
    assert groups["/v2/models/{model}/versions/{version}/generate_stream"] == "inference"
    assert groups["/v2/models/{model}/config"] == "model-config"
    assert groups["/v2/models/stats"] == groups["/v2/models/{model}/stats"] == "statistics"
    assert groups["/v2/repository/index"] == groups["/v2/repository/models/{model}/load"] == \
        "model-repository"
    assert groups["/v2/systemsharedmemory/region/{region}/register"] == "shared-memory"
    assert groups["/v2/cudasharedmemory/status"] == "shared-memory"
    assert groups["/v2/logging"] == "logging"
    assert set(groups.values()) <= set(restricted.GROUPS)


def test_every_rpc_has_its_group():
    rpcs = {n for n in dir(InferenceService) if n[0].isupper() and callable(getattr(InferenceService, n))}
    assert rpcs == set(RPC_GROUPS)
    assert set(RPC_GROUPS.values()) <= set(restricted.GROUPS)


def test_refusals():
    rules = restricted.parse(["inference:infer-key=k1"])
    assert restricted.http_refusal("inference", rules, {"infer-key": "k1"}) == ""
    assert restricted.http_refusal("inference", rules, {"infer-key": "k2"}) == \
        "This API is restricted, expecting header 'infer-key'"
    assert restricted.http_refusal("health", rules, {}) == ""
    assert restricted.grpc_refusal("inference", rules, [("triton-grpc-protocol-infer-key", "k1")]) == ""
    assert restricted.grpc_refusal("inference", rules, [("infer-key", "k1")]) == \
        "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
    assert restricted.grpc_refusal("metadata", rules, None) == ""
