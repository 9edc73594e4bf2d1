"""L0_decoupled and L0_request_cancellation, as their test.sh run them.

L0_decoupled: the "python" trial (python_backend's repeat/square examples under the suite's
ensembles; libtorch_nobatch_int32_int32_int32, which fan_repeat calls, is gen_qa_models.py's
ONNX twin under that name). The "custom" trial and NonDecoupledTest need Triton's C++
repeat/square backends: SKIP.
L0_request_cancellation: grpc_cancellation_test.py (with the TRITONSERVER_DELAY_* debug
variables test.sh exports to server and client) and its log greps, scheduler_test.py. The C++
programs and the libtorch implicit-state model are SKIP.
"""
from __future__ import annotations

import os
import shutil

from . import models as M
from .harness import Suite, tail
from .runners import run_unittest

DECOUPLED_CASES = ("test_one_to_none", "test_one_to_one", "test_one_to_many", "test_no_streaming",
                   "test_response_order", "test_wrong_shape")


def decoupled(ctx) -> Suite:
    suite = Suite("L0_decoupled", ctx)
    d = os.path.join(ctx.qa, "L0_decoupled")
    suite.skip("custom trial (all cases)", "not applicable: Triton's C++ repeat and square "
               "backends (libtriton_repeat.so, libtriton_square.so)")
    suite.skip("NonDecoupledTest", "not applicable: uses the C++ repeat backend's repeat_int32 "
               "with decoupled: False")
    py = os.path.join(d, "python_models")
    shutil.rmtree(py, ignore_errors=True)
    shutil.copytree(os.path.join(d, "models"), py)
    for name in os.listdir(py):
        os.makedirs(os.path.join(py, name, "1"), exist_ok=True)
    try:
        for name, stem in (("repeat_int32", "repeat"), ("square_int32", "square")):
            os.makedirs(os.path.join(py, name, "1"), exist_ok=True)
            shutil.copy(M.python_backend_example(ctx, f"decoupled/{stem}_model.py"),
                        os.path.join(py, name, "1", "model.py"))
            shutil.copy(M.python_backend_example(ctx, f"decoupled/{stem}_config.pbtxt"),
                        os.path.join(py, name, "config.pbtxt"))
        lt = M.as_libtorch(ctx, "libtorch_nobatch_int32_int32_int32", py)
        M.sed(os.path.join(lt, "config.pbtxt"), r"dims:.*\[.*\]", "dims: [ 1 ]")
    except M.Missing as e:
        suite.skip("python trial (all cases)", str(e))
        return suite

    for step, extra in (("python", []), ("python, --grpc-max-response-pool-size=1",
                                         ["--grpc-max-response-pool-size=1"])):
        server = suite.start(step, [f"--model-repository={py}", *extra], "inference_server.log", d)
        if not server:
            continue
        try:
            for t in DECOUPLED_CASES:   # each case waits out its own delays: up to ~20 min
                run_unittest(suite, step, d, [f"decoupled_test.DecoupledTest.{t}"], ctx.env(),
                             timeout=2400)
            if not extra:       # test.sh exports the client-side variable for this one case
                run_unittest(suite, step, d, ["decoupled_test.DecoupledTest.test_one_to_multi_many"],
                             ctx.env(TRITONSERVER_DELAY_GRPC_RESPONSE="2000"), timeout=2400)
        finally:
            server.stop()
    return suite


# test case -> the debug variables test.sh exports (to the server and the client)
CANCEL_CASES = {
    "test_grpc_async_infer": {},
    "test_grpc_stream_infer": {},
    "test_aio_grpc_async_infer": {},
    "test_aio_grpc_stream_infer": {},
    "test_grpc_async_infer_cancellation_at_step_start": {"TRITONSERVER_DELAY_GRPC_PROCESS": "5000"},
    "test_grpc_async_infer_response_complete_during_cancellation": {
        "TRITONSERVER_DELAY_GRPC_NOTIFICATION": "5000", "TRITONSERVER_DELAY_GRPC_ENQUEUE": "5000"},
    "test_grpc_async_infer_cancellation_before_finish_0": {
        "TRITONSERVER_DELAY_GRPC_NOTIFICATION": "5000",
        "TRITONSERVER_DELAY_RESPONSE_COMPLETION": "5000"},
    "test_grpc_async_infer_cancellation_before_finish_1": {
        "TRITONSERVER_DELAY_GRPC_PROCESS_ENTRY": "1000",
        "TRITONSERVER_DELAY_RESPONSE_COMPLETION": "5000"},
    "test_grpc_async_infer_cancellation_before_response_complete_and_process_after_final_response": {
        "TRITONSERVER_DELAY_GRPC_NOTIFICATION": "5000",
        "TRITONSERVER_DELAY_RESPONSE_COMPLETE_EXEC": "5000"},
}
CANCEL_LOG_LINE = "Cancellation notification received for "


def request_cancellation(ctx) -> Suite:
    suite = Suite("L0_request_cancellation", ctx)
    d = os.path.join(ctx.qa, "L0_request_cancellation")
    test_sh = os.path.join(d, "test.sh")
    suite.skip("request_cancellation_test (C API)", "not applicable: a C++ test program of "
               "Triton's build (in-process C API)")
    shutil.rmtree(os.path.join(d, "models"), ignore_errors=True)
    os.makedirs(os.path.join(d, "models"))
    M.shell_block(test_sh, "# Python gRPC cancellation tests", r"config\.pbtxt\)\s*$", d)
    for case, hooks in CANCEL_CASES.items():
        server = suite.start(case, [f"--model-repository={d}/models", "--log-verbose=2"],
                             f"grpc_cancellation_test.{case}.server.log", d, hooks)
        if not server:
            continue
        try:
            run_unittest(suite, case, d, [f"grpc_cancellation_test.GrpcCancellationTest.{case}"],
                         ctx.env(**hooks))
            text = server.log_text()
            n = text.count(CANCEL_LOG_LINE)
            suite.check(f"{case}: '{CANCEL_LOG_LINE.strip()}' in log", n == 1,
                        f"exactly 1 '{CANCEL_LOG_LINE.strip()}' in the server log (--log-verbose=2)",
                        f"{n}", tail(text, 30))
            if case not in ("test_grpc_async_infer", "test_aio_grpc_async_infer"):
                n = text.count("StateRelease")
                suite.check(f"{case}: 'StateRelease' in log", n == 1, "exactly 1 'StateRelease' "
                            "(Triton's gRPC handler logs it when the call's state is freed)",
                            f"{n}")
        finally:
            server.stop()
    suite.skip("grpc_cancellation_test (C++ client, 10 cases)",
               "needs Triton's C++ test program ../clients/grpc_cancellation_test")

    shutil.rmtree(os.path.join(d, "models"))
    os.makedirs(os.path.join(d, "models"))
    M.shell_block(test_sh, "# End-to-end scheduler tests", r"echo '\] }' >> config\.pbtxt\)", d)
    server = suite.start("scheduler_test", [f"--model-repository={d}/models", "--log-verbose=2"],
                         "scheduler_test.server.log", d)
    if server:
        try:
            run_unittest(suite, "scheduler_test", d, ["scheduler_test"], ctx.env(), timeout=300)
        finally:
            server.stop()
    suite.skip("implicit_state_test", "not applicable: sequence_state is a libtorch model "
               "(implicit_state_model/model.pt)")
    return suite
