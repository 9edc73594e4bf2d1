"""L0_backend_python's sub-suites response_sender, async_execute, decoupled and model_control,
each as its folder's test.sh runs it."""
from __future__ import annotations

import os
import shutil

from . import models as M
from .harness import Suite, tail
from .runners import run_pytest
from .suite_backend_python import HAS_TORCH, NO_TORCH


def _fresh(d: str) -> str:
    repo = os.path.join(d, "models")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    return repo


def response_sender(ctx) -> Suite:
    suite = Suite("L0_backend_python/response_sender", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "response_sender")
    repo = _fresh(d)
    for decoupled in (False, True):
        for asynchronous in (False, True):
            for batching in (False, True):
                name = "response_sender" + ("_decoupled" if decoupled else "") + \
                    ("_async" if asynchronous else "") + ("_batching" if batching else "")
                dst = M.python_model(qa, "response_sender", repo, name,
                                     "model_async.py" if asynchronous else "model.py",
                                     files=("model_common.py",))
                cfg = os.path.join(dst, "config.pbtxt")
                if decoupled:
                    M.append(cfg, "model_transaction_policy { decoupled: True }")
                if batching:
                    M.append(cfg, "dynamic_batching { max_queue_delay_microseconds: 500000 }")
    args = [f"--model-repository={d}/models", "--log-verbose=1"]
    log = "response_sender_test.server.log"
    server = suite.start("response_sender_test", args, log, d)
    if server:
        try:
            run_pytest(suite, "response_sender_test", d, "response_sender_test.py",
                       ctx.env(SERVER_LOG=log))
        finally:
            server.stop()

    repo = _fresh(d)
    M.python_model(qa, "response_sender_complete_final", repo)
    log = "response_sender_complete_final_test.server.log"
    server = suite.start("complete_final_test", args, log, d)
    if server:
        try:
            run_pytest(suite, "complete_final_test", d, "response_sender_complete_final_test.py",
                       ctx.env(SERVER_LOG=log))
        finally:
            server.stop()
    return suite


def async_execute(ctx) -> Suite:
    suite = Suite("L0_backend_python/async_execute", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "async_execute")
    repo = _fresh(d)
    M.python_model(qa, "async_execute_decouple", repo)
    M.python_model(qa, "async_execute_decouple_bls", repo)
    log = "concurrency_test.server.log"
    server = suite.start("concurrency_test", [f"--model-repository={d}/models",
                                              "--log-verbose=1"], log, d)
    if server:
        try:
            run_pytest(suite, "concurrency_test", d, "concurrency_test.py",
                       ctx.env(SERVER_LOG=log))
        finally:
            suite.stopped_gracefully("concurrency_test", server)   # bash -e: wait $SERVER_PID
    return suite


def decoupled(ctx) -> Suite:
    suite = Suite("L0_backend_python/decoupled", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "decoupled")
    repo = os.path.join(d, "models")            # the folder's own models, plus these
    M.python_model(qa, "identity_fp32", repo)
    M.python_model(qa, "execute_cancel", repo)
    M.append(os.path.join(repo, "execute_cancel", "config.pbtxt"),
             "model_transaction_policy { decoupled: True }")
    M.python_model(qa, "response_sender_until_cancelled", repo)
    skips = {}
    try:
        square = M.python_backend_example(ctx, "decoupled/square_model.py")
        os.makedirs(os.path.join(repo, "square_int32", "1"), exist_ok=True)
        shutil.copy(square, os.path.join(repo, "square_int32", "1", "model.py"))
        shutil.copy(M.python_backend_example(ctx, "decoupled/square_config.pbtxt"),
                    os.path.join(repo, "square_int32", "config.pbtxt"))
    except M.Missing as e:
        skips.update({"DecoupledTest.test_decoupled_bls_stream": str(e)})
    if HAS_TORCH:
        M.python_model(qa, "dlpack_add_sub", repo)
    else:
        shutil.rmtree(os.path.join(repo, "decoupled_bls"))     # imports torch
        skips["DecoupledTest.test_decoupled_bls"] = NO_TORCH
    log = "decoupled_server.log"
    server = suite.start("decoupled_test", [f"--model-repository={d}/models", "--log-verbose=1"],
                         log, d)
    if not server:
        return suite
    try:
        run_pytest(suite, "decoupled_test", d, "decoupled_test.py", ctx.env(), skips)
    finally:
        server.stop()
    text = server.log_text()
    if HAS_TORCH:
        for msg in ("Specific Msg!", "Info Msg!", "Warning Msg!", "Error Msg!"):
            n = sum(msg in line for line in text.splitlines())
            suite.check(f"server log: '{msg}' lines", n >= 1, "at least 1 line (decoupled_bls's "
                        "pb_utils.Logger messages)", f"{n}")
    else:
        suite.skip("server log: decoupled_bls's logger messages", NO_TORCH + " (decoupled_bls)")
    for msg in ("Finalize invoked", "Finalize complete..."):
        n = sum(msg in line for line in text.splitlines())
        if HAS_TORCH:
            suite.check(f"server log: '{msg}' lines", n == 3, "exactly 3 lines (finalize of "
                        "decoupled_bls and decoupled_execute_error, after SIGTERM)", f"{n}",
                        tail(text, 30))
        else:       # Triton's count includes decoupled_bls's; here only print() of the other
            suite.check(f"server log: '{msg}' lines (decoupled_bls absent: >= 1)", n >= 1,
                        "decoupled_execute_error's print() in finalize in the server log after "
                        "SIGTERM", f"{n}", tail(text, 30))
    return suite


def model_control(ctx) -> Suite:
    suite = Suite("L0_backend_python/model_control", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "model_control")
    repo = _fresh(d)
    M.python_model(qa, "identity_fp32", repo)
    os.makedirs(os.path.join(repo, "simple_identity_fp32", "1"))
    shutil.copy(os.path.join(qa, "python_models", "simple_identity_fp32", "config.pbtxt"),
                os.path.join(repo, "simple_identity_fp32"))
    server = suite.start("model_control_test", [f"--model-repository={d}/models",
                                                "--model-control-mode=explicit",
                                                "--log-verbose=1"], "model_control_server.log", d)
    if server:
        try:
            run_pytest(suite, "model_control_test", d, "model_control_test.py", ctx.env())
            run_pytest(suite, "model_id_validation", d,
                       "model_control_test.py::ModelIDValidationTest", ctx.env())
        finally:
            server.stop()
    return suite
