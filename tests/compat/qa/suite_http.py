"""L0_http, as its test.sh runs it: the binary/JSON curl checks, python_http_aio_test.py,
http_client_plugin_test.py, http_test.py, generate_endpoint_test.py, the restricted-API start
checks and http_restricted_api_test.py, http_input_size_limit_test.py and
http_request_many_chunks.py. Client examples, C++ client tests and nginx are SKIP."""
from __future__ import annotations

import importlib.util
import os
import shutil

import requests

from . import models as M
from .harness import Suite
from .runners import run_unittest

EXAMPLES = ("simple", "simple_dyna_sequence", "simple_identity", "simple_sequence",
            "simple_string", "densenet_onnx")
NO_DYNA = ("the repository lacks simple_string_dyna_sequence (test.sh builds it on Triton's custom "
           "C++ dyna_sequence backend), and the test counts the models")
CLIENTS = "needs Triton's client examples and C++ clients (qa/clients, not in qa/): " \
          "tests/compat/run_triton_examples.py runs the Python ones"


def example_repo(ctx, suite: Suite, repo: str, names=EXAMPLES) -> None:
    """qa/L0_*/models as Dockerfile.QA fills it from docs/examples/model_repository."""
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    for name in names:
        try:
            dst = M.example(ctx, name, repo)
            if not any(f for f in os.listdir(os.path.join(dst, "1"))):
                shutil.rmtree(dst)          # densenet_onnx without its downloaded model.onnx
        except M.Missing:
            pass


SEQ16 = list(range(1, 17))
SUM, ZERO = "[2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32]", "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]"


def _inputs(n0=16, with1=True):
    ins = [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(1, n0 + 1))}]
    if with1:
        ins.append({"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": SEQ16})
    return ins


# (what, request body, expected status (None: anything but 200), {text: lines holding it})
CURL = [
    ("no parameters, no outputs: JSON output", {"inputs": _inputs()}, 200, {SUM: 1, ZERO: 1}),
    ("OUTPUT0 binary, OUTPUT1 binary_data=false",
     {"inputs": _inputs(), "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}},
                                       {"name": "OUTPUT1", "parameters": {"binary_data": False}}]},
     200, {SUM: 0, ZERO: 1}),
    ("OUTPUT0 binary, OUTPUT1 without parameters",
     {"inputs": _inputs(), "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}},
                                       {"name": "OUTPUT1"}]}, 200, {SUM: 0, ZERO: 1}),
    ("binary_data_output=true, no outputs",
     {"parameters": {"binary_data_output": True}, "inputs": _inputs()}, 200, {SUM: 0, ZERO: 0}),
    ("binary_data_output=true, OUTPUT0 binary_data=false",
     {"parameters": {"binary_data_output": True}, "inputs": _inputs(),
      "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}]},
     200, {SUM: 1, ZERO: 1}),
    ("'data' shorter than 'shape'", {"inputs": _inputs(15, False)}, None,
     {"{\"error\":\"Failed to parse 'data' field: shape does not match true shape\"}": 1}),
    ("'data' longer than 'shape'", {"inputs": _inputs(18, False)}, None,
     {"{\"error\":\"Unable to parse 'data': Shape does not match true shape of 'data' field\"}": 1}),
    ("still serving after the bad requests", {"inputs": _inputs()}, 200, {SUM: 1, ZERO: 1}),
]


def curl_checks(suite: Suite) -> None:
    import json
    for what, body, status, greps in CURL:
        name = f"binary/JSON curl: {what}"
        r = requests.post("http://localhost:8000/v2/models/simple/infer", data=json.dumps(body),
                          timeout=30)
        lines = r.content.split(b"\n")
        problems = []
        if (status is None and r.status_code == 200) or (status and r.status_code != status):
            problems.append(f"status {r.status_code} (expected {status or 'an error'})")
        for text, want in greps.items():
            n = sum(text.encode() in line for line in lines)
            if n != want:
                problems.append(f"{text} in {n} line(s), expected {want}")
        suite.check(name, not problems, "; ".join(problems), "body: " +
                    r.content[:300].decode(errors="replace"), r.content[:2000].decode(errors="replace"))


def run(ctx) -> Suite:
    suite = Suite("L0_http", ctx)
    d = os.path.join(ctx.qa, "L0_http")
    env = ctx.env()
    models = os.path.join(d, "models")
    example_repo(ctx, suite, models)
    for what in ("python client examples (simple_http_*.py, image_client.py, ...)",
                 "C++ client examples and cc_client_test", "base_path URL client checks",
                 "simple_http_model_control.py + 'Invalid config override' log grep",
                 "dyna sequence clients (simple_string_dyna_sequence: custom C++ backend)"):
        suite.skip(what, CLIENTS)
    suite.skip("http_basic_auth_test.py", "needs nginx in front of the server (test.sh starts one)")

    server = suite.start("client plugin", [f"--model-repository={models}",
                                           "--allow-client-shm=true"], "inference_server.log", d)
    if server:
        try:
            run_unittest(suite, "client plugin", d, ["http_client_plugin_test"], env)
        finally:
            server.stop()

    server = suite.start("binary/JSON", [f"--model-repository={models}"],
                         "inference_server_binaryjson.log", d)
    if server:
        try:
            curl_checks(suite)
        finally:
            server.stop()

    server = suite.start("aio", [f"--model-repository={models}", "--allow-client-shm=true"],
                         "inference_server_aio.log", d)
    if server:
        try:
            run_unittest(suite, "aio", d, ["python_http_aio_test"], env,
                         {"TestHttpAioClient.test_get_model_repository_index": NO_DYNA})
        finally:
            server.stop()

    # http_test.py
    repo = os.path.join(d, "python_unit_test_models")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    for name in ("onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16",
                 "onnx_zero_3_float32"):
        M.generated(ctx, "qa_identity_model_repository", name, repo)
    one = M.copytree(os.path.join(repo, "onnx_zero_1_object"),
                     os.path.join(repo, "onnx_zero_1_object_1_element"))
    M.sed(os.path.join(one, "config.pbtxt"), "onnx_zero_1_object", "onnx_zero_1_object_1_element")
    M.sed_first(os.path.join(one, "config.pbtxt"), "-1", "1")
    q = M.copytree(os.path.join(repo, "onnx_zero_1_float32"),
                   os.path.join(repo, "onnx_zero_1_float32_queue"))
    M.sed(os.path.join(q, "config.pbtxt"), "onnx_zero_1_float32", "onnx_zero_1_float32_queue")
    M.append(os.path.join(q, "config.pbtxt"), "dynamic_batching { \n    max_queue_delay_microseconds:"
             " 1000000\n    preferred_batch_size: [ 8 ]\n    default_queue_policy {\n"
             "        max_queue_size: 1\n    }\n}")
    shutil.copytree(os.path.join(models, "simple_identity"), os.path.join(repo, "simple_identity"))
    i64 = M.copytree(os.path.join(models, "simple_identity"),
                     os.path.join(repo, "simple_identity_int64"))
    M.sed(os.path.join(i64, "config.pbtxt"), "TYPE_STRING", "TYPE_INT64", count=1)
    M.sed(os.path.join(i64, "config.pbtxt"), "simple_identity", "simple_identity_int64", count=1)
    server = suite.start("http_test", [f"--model-repository={repo}", "--model-control-mode=explicit",
                                       "--load-model=*"], "inference_server_http_test.log", d)
    if server:
        try:
            run_unittest(suite, "http_test", d, ["http_test"], env)
        finally:
            server.stop()

    # generate endpoint
    if importlib.util.find_spec("sseclient") is None:
        suite.skip("generate_endpoint_test", "needs sseclient-py (test.sh pip-installs it)")
    else:
        server = suite.start("generate_endpoint_test", [
            f"--model-repository={ctx.qa}/python_models/generate_models", "--log-verbose=1"],
            "inference_server_generate_endpoint_test.log", d)
        if server:
            try:
                run_unittest(suite, "generate_endpoint_test", d, ["generate_endpoint_test"], env)
            finally:
                server.stop()

    # restricted APIs
    base = [f"--model-repository={models}"]
    suite.expect_start_failure("restricted api: 'health' in two groups", base + [
        "--http-restricted-api=model-repository,health:k1=v1",
        "--http-restricted-api=metadata,health:k2=v2"], "http_restricted_endpoint_test.log", d,
        ["api 'health' can not be specified in multiple config groups"])
    suite.expect_start_failure("restricted api: unknown api", base + [
        "--http-restricted-api=model-reposit,health:k1=v1",
        "--http-restricted-api=metadata,health:k2=v2"], "http_restricted_endpoint_test.log", d,
        ["unknown restricted api 'model-reposit'"])
    server = suite.start("restricted api", base + [
        "--http-restricted-api=model-repository:admin-key=admin-value",
        "--http-restricted-api=inference,metadata:infer-key=infer-value"],
        "http_restricted_endpoint_test.log", d)
    if server:
        try:
            run_unittest(suite, "restricted api", d, ["http_restricted_api_test.RestrictedAPITest"],
                         env)
        finally:
            server.stop()

    input_size_limits(ctx, suite, d, models, env)

    server = suite.start("many chunks", [f"--model-repository={models}", "--allow-client-shm=true",
                                         "--log-verbose=1", "--model-control-mode=explicit",
                                         "--load-model=simple"],
                         "inference_server_request_many_chunks.log", d)
    if server:
        try:
            run_unittest(suite, "many chunks", d, ["http_request_many_chunks"],
                         ctx.env(SERVER_PID=str(server.pid)))
        finally:
            server.stop()
    return suite


def input_size_limits(ctx, suite: Suite, d: str, models: str, env: dict) -> None:
    repo = os.path.join(d, "http_input_size_limit_test_models")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    M.generated(ctx, "qa_identity_model_repository", "onnx_zero_1_float32", repo)
    shutil.copytree(os.path.join(models, "simple_identity"), os.path.join(repo, "simple_identity"))
    cls = "http_input_size_limit_test.InferSizeLimitTest."
    for step, extra, tests in (
            ("input size: default limit", [], ["test_default_limit_raw_binary",
                                               "test_default_limit_json", "test_large_string_in_json",
                                               "test_default_limit_compressed",
                                               "test_json_dtype_size_expansion_exceeds_limit_error",
                                               "test_no_leak_on_invalid_inference_header_length"]),
            ("input size: 128 MiB limit", [f"--http-max-input-size={2 ** 27}"],
             ["test_large_input_raw_binary", "test_large_input_json",
              "test_large_input_compressed"])):
        server = suite.start(step, [f"--model-repository={repo}", *extra],
                             "inference_server_input_size.log", d)
        if not server:
            continue
        try:
            for t in tests:
                run_unittest(suite, step, d, [cls + t], {**env, "SERVER_PID": str(server.pid)})
        finally:
            server.stop()
    for what, value in (("zero", "0"), ("negative", "-1024")):
        suite.expect_start_failure(f"input size: {what} --http-max-input-size", [
            f"--model-repository={repo}", f"--http-max-input-size={value}"],
            f"inference_server_{what}_limit.log", d,
            ["Error: --http-max-input-size must be greater than 0."])

