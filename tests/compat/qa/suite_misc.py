"""L0_input_validation, L0_parameters and L0_client_timeout, as their test.sh run them."""
from __future__ import annotations

import importlib.util
import os
import shutil

from . import models as M
from .harness import Suite
from .runners import run_pytest, run_unittest
from .suite_shared_memory import _Exits

CPP = "not applicable: a C++ test program of Triton's build ({})"


def input_validation(ctx) -> Suite:
    suite = Suite("L0_input_validation", ctx)
    d = os.path.join(ctx.qa, "L0_input_validation")
    models = os.path.join(d, "models")
    server = suite.start("InputValTest", [f"--model-repository={models}"],
                         "inference_server.log", d)
    if server:
        try:
            run_pytest(suite, "InputValTest", d, "input_validation_test.py::InputValTest", ctx.env())
        finally:
            server.stop()

    skips = {"InputShapeTest.test_input_shape_validation":
             "not applicable: pt_identity is a TorchScript model test.sh makes with torch",
             "InputShapeTest.test_wrong_input_shape_tensor_size":
             "not applicable: TensorRT shape-tensor models (plan_*_float32_int32)"}
    M.generated(ctx, "qa_model_repository", "onnx_object_int32_int32", models)
    server = suite.start("InputShapeTest", [f"--model-repository={models}",
                                            "--allow-client-shm=true"], "inference_server.log", d)
    if server:
        try:
            run_pytest(suite, "InputShapeTest", d, "input_validation_test.py::InputShapeTest",
                       ctx.env(), skips)
        finally:
            server.stop()
    suite.skip("input_byte_size_test", CPP.format("in-process C API"))
    suite.skip("tensor_size_test", CPP.format("in-process C API"))

    test_models = os.path.join(d, "test_models")
    shutil.rmtree(test_models, ignore_errors=True)
    os.makedirs(test_models)
    server = suite.start("ModelNameValidationTest", [f"--model-repository={test_models}",
                                                     "--model-control-mode=explicit",
                                                     "--log-verbose=1"],
                         "model_name_validation_server.log", d)
    if server:
        try:
            run_pytest(suite, "ModelNameValidationTest", d,
                       "input_validation_test.py::ModelNameValidationTest", ctx.env(), extra=("-s",))
        finally:
            server.stop()
    return suite


def parameters(ctx) -> Suite:
    suite = Suite("L0_parameters", ctx)
    d = os.path.join(ctx.qa, "L0_parameters")
    repo = "model_repository"
    os.makedirs(os.path.join(d, repo, "identity", "1"), exist_ok=True)
    os.makedirs(os.path.join(d, repo, "ensemble", "1"), exist_ok=True)
    for test, extra in (
            ("test_params", []),
            ("test_params_reserved_rejected", []),
            ("test_headers", ["--grpc-header-forward-pattern", "MY_HEADER.*",
                              "--http-header-forward-pattern", "MY_HEADER.*"]),
            ("test_grpc_header_forward_pattern_case_sensitive",
             ["--grpc-header-forward-pattern", "(?-i)MY_HEADER.*"]),
            ("test_headers_reserved_rejected", ["--grpc-header-forward-pattern", ".*",
                                                "--http-header-forward-pattern", ".*"])):
        server = suite.start(test, [f"--model-repository={repo}", "--exit-timeout-secs=120",
                                    *extra], "inference_server.log", d)
        if not server:
            continue
        try:
            run_unittest(suite, test, d, [f"parameters_test.InferenceParametersTest.{test}"],
                         ctx.env())
        finally:
            server.stop()

    models = os.path.join(d, "models")
    shutil.rmtree(models, ignore_errors=True)
    M.python_model(ctx.qa, "identity_fp32", models)
    dst = M.python_model(ctx.qa, "identity_fp32", models, "identity_bytes")
    M.sed(os.path.join(dst, "config.pbtxt"), "identity_fp32", "identity_bytes", count=1)
    M.sed(os.path.join(dst, "config.pbtxt"), "TYPE_FP32", "TYPE_STRING", count=1)
    exits = _Exits()
    for client in ("http", "grpc"):
        step = f"class_count_test [{client}]"
        server = suite.start(step, [f"--model-repository={models}", "--log-verbose=1"],
                             f"class_count_test_{client}_server.log", d)
        if not server:
            continue
        try:
            run_unittest(suite, step, d, ["class_count_test"], ctx.env(CLIENT_TYPE=client))
        finally:
            exits.stop(step, server)
    suite.check("class_count_test: servers exit 0 after SIGTERM", not exits.bad,
                "exit status 0", "; ".join(exits.bad))
    return suite


def client_timeout(ctx) -> Suite:
    suite = Suite("L0_client_timeout", ctx)
    d = os.path.join(ctx.qa, "L0_client_timeout")
    models = os.path.join(d, "models")
    os.makedirs(os.path.join(models, "custom_identity_int32", "1"), exist_ok=True)
    suite.skip("client_timeout_test (C++ client, gRPC/HTTP infer and non-infer APIs)",
               "needs Triton's C++ client test program ../clients/client_timeout_test")
    server = suite.start("ClientInferTimeoutTest", [f"--model-repository={models}",
                                                    "--log-verbose", "2"], "server.log", d)
    if server:
        try:
            for t in ("test_grpc_infer", "test_grpc_async_infer", "test_grpc_stream_infer",
                      "test_http_infer", "test_http_async_infer"):
                run_unittest(suite, "ClientInferTimeoutTest", d,
                             [f"client_infer_timeout_test.ClientInferTimeoutTest.{t}"], ctx.env())
        finally:
            server.stop()
    # test.sh exports this debug variable of Triton's gRPC server (each non-inference response
    # delayed 2 s) before starting the server; the test expects those calls to time out.
    hook = {"TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC": "2"}
    server = suite.start("ClientNonInferTimeoutTest (TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC=2)",
                         [f"--model-repository={models}", "--log-verbose", "2",
                          "--model-control-mode=explicit", "--allow-client-shm=true",
                          "--load-model=custom_identity_int32", "--log-verbose", "2"],
                         "server.log", d, hook)
    if server:
        try:
            skips = {} if importlib.util.find_spec("cuda") else {
                "ClientNonInferTimeoutTest.test_grpc_register_cuda_shared_memory":
                "not applicable: CUDA shared memory (tritonclient needs cuda-python and a GPU)"}
            run_unittest(suite, "ClientNonInferTimeoutTest (delay hook)", d,
                         ["client_non_infer_timeout_test"], ctx.env(**hook), skips)
        finally:
            server.stop()
    return suite
