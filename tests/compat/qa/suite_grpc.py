"""L0_grpc, as its test.sh runs it: python_unit_test.py GrpcTest, grpc_client_plugin_test.py,
python_grpc_aio_test.py, the gRPC health checks (test.sh uses grpc-health-probe; here the same
grpc.health.v1 Check call from Python), the restricted-protocol start checks and
RestrictedProtocolTest. Client examples, C++ client tests and nginx are SKIP."""
from __future__ import annotations

import os
import shutil

from . import models as M
from .harness import Suite
from .runners import run_unittest
from .suite_http import CLIENTS, NO_DYNA, example_repo

EXAMPLES = ("simple", "simple_dyna_sequence", "simple_int8", "simple_identity", "simple_sequence",
            "simple_string", "densenet_onnx")


def health_check(timeout: float = 5) -> tuple[bool, str]:
    """grpc-health-probe -addr=localhost:8001: (answered, status or error)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel("localhost:8001") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout)
            return True, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"


def run(ctx) -> Suite:
    suite = Suite("L0_grpc", ctx)
    d = os.path.join(ctx.qa, "L0_grpc")
    env = ctx.env()
    models = os.path.join(d, "models")
    example_repo(ctx, suite, models, EXAMPLES)
    for what in ("python client examples (simple_grpc_*.py, image_client.py, ...)",
                 "C++ client examples and cc_client_test", "response compression client checks",
                 "simple_grpc_model_control.py", "dyna sequence clients"):
        suite.skip(what, CLIENTS)
    suite.skip("grpc_basic_auth_test.py", "needs nginx in front of the server (test.sh starts one)")

    # duplicate outputs and bytes_contents
    repo = os.path.join(d, "grpc_test_models")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    shutil.copytree(os.path.join(models, "simple"), os.path.join(repo, "simple"))
    dst = M.copytree(os.path.join(ctx.qa, "python_models", "string_identity"),
                     os.path.join(repo, "string_identity"))
    os.makedirs(os.path.join(dst, "1"))
    os.replace(os.path.join(dst, "model.py"), os.path.join(dst, "1", "model.py"))
    M.sed(os.path.join(dst, "config.pbtxt"), r"dims: \[ 1 \]", "dims: [ -1 ]")
    server = suite.start("GrpcTest", [f"--model-repository={repo}"],
                         "inference_server_grpc_test.log", d)
    if server:
        try:
            run_unittest(suite, "GrpcTest", d, ["python_unit_test.GrpcTest"], env)
        finally:
            server.stop()

    server = suite.start("client plugin", [f"--model-repository={d}/client_plugin_models",
                                           "--http-header-forward-pattern=.*",
                                           "--grpc-header-forward-pattern=.*"],
                         "inference_server_plugin.log", d)
    if server:
        try:
            run_unittest(suite, "client plugin", d, ["grpc_client_plugin_test"], env)
        finally:
            server.stop()

    server = suite.start("aio", [f"--model-repository={models}", "--allow-client-shm=true"],
                         "inference_server_aio.log", d)
    if server:
        try:
            run_unittest(suite, "aio", d, ["python_grpc_aio_test"], env,
                         {"TestGrpcAioClient.test_get_model_repository_index": NO_DYNA})
        finally:
            server.stop()

    answered, status = health_check(timeout=3)
    suite.check("health probe, no server", not answered,
                "the Check call to fail (grpc-health-probe: 'timeout: failed to connect service')",
                status)
    server = suite.start("health probe", [f"--model-repository={models}"],
                         "inference_server_health.log", d)
    if server:
        try:
            answered, status = health_check()
            suite.check("health probe, server up", answered and status == "SERVING",
                        "status: SERVING", status)
        finally:
            server.stop()

    base = [f"--model-repository={models}"]
    suite.expect_start_failure("restricted protocol: 'health' in two groups", base + [
        "--grpc-restricted-protocol=model-repository,health:k1=v1",
        "--grpc-restricted-protocol=metadata,health:k2=v2"], "inference_server_restricted.log", d,
        ["protocol 'health' can not be specified in multiple config groups"])
    suite.expect_start_failure("restricted protocol: unknown protocol", base + [
        "--grpc-restricted-protocol=model-reposit,health:k1=v1",
        "--grpc-restricted-protocol=metadata,health:k2=v2"], "inference_server_restricted.log", d,
        ["unknown restricted protocol 'model-reposit'"])
    server = suite.start("restricted protocol", base + [
        "--grpc-restricted-protocol=model-repository:admin-key=admin-value",
        "--grpc-restricted-protocol=inference,health:infer-key=infer-value"],
        "inference_server_restricted.log", d)
    if server:
        try:
            run_unittest(suite, "restricted protocol", d, ["python_unit_test.RestrictedProtocolTest"],
                         env)
        finally:
            server.stop()
    return suite
