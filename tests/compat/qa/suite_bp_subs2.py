"""L0_backend_python's sub-suites logging and model_readiness, as their test.sh run them."""
from __future__ import annotations

import os
import shutil
import time

import requests

from . import models as M
from .harness import QaServer, Suite, descendants, tail
from .runners import run_pytest, run_unittest


def _count(text: str, msg: str) -> int:
    return sum(msg in line for line in text.splitlines())


def logging(ctx) -> Suite:
    suite = Suite("L0_backend_python/logging", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "logging")
    repo = os.path.join(d, "models")
    shutil.rmtree(repo, ignore_errors=True)
    M.python_model(qa, "identity_fp32_logging", repo)
    args = [f"--model-repository={repo}"]

    def verify(step: str, server: QaServer, non_verbose: int, verbose: int) -> None:
        text = server.log_text()
        for msg, want in (("Specific Msg!", non_verbose), ("Info Msg!", non_verbose),
                          ("Warning Msg!", non_verbose), ("Error Msg!", non_verbose),
                          ("Verbose Msg!", verbose)):
            n = _count(text, msg)
            suite.check(f"{step}: '{msg}' lines", n == want, f"exactly {want} lines in the "
                        "server log", f"{n}", "\n".join(line for line in text.splitlines()
                                                        if "Msg!" in line))

    # default log settings: initialize, execute, finalize each log once per level (4 x 1)
    for step, settings, non_verbose, verbose in (
            ("default", [], 4, 0),
            ("verbose", [{"log_verbose_level": 1}], 4, 3),
            ("disabled", [{"log_info": False}, {"log_warning": False}, {"log_error": False}], 1, 0)):
        server = suite.start(step, args, "logging_server.log", d)
        if not server:
            continue
        try:
            for body in settings:
                r = requests.post("http://localhost:8000/v2/logging", json=body, timeout=10)
                suite.check(f"{step}: POST /v2/logging {body}", r.status_code == 200,
                            "HTTP 200", f"{r.status_code} {r.text[:200]}")
            run_pytest(suite, step, d, "logging_test.py", ctx.env())
        finally:
            server.stop()
        verify(step, server, non_verbose, verbose)
    return suite


def _worker_pids(server: QaServer, model: str) -> list[int]:
    """The processes serving ``model`` (Triton: pgrep -f triton_python_backend_stub)."""
    label = f'"model_name":"{model}"'.encode()
    out = []
    for pid in descendants(server.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if label in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def _readiness_model(d: str, name: str, value: str, delay: str) -> None:
    repo = os.path.join(d, "models")
    dst = os.path.join(repo, name)
    os.makedirs(os.path.join(dst, "1"))
    src = "readiness_coroutine_model.py" if name == "is_ready_fn_coroutine_returns_true" \
        else "readiness_model.py"
    shutil.copy(os.path.join(d, "test_models", src), os.path.join(dst, "1", "model.py"))
    shutil.copy(os.path.join(repo, "identity_fp32", "config.pbtxt"), dst)
    M.rename(dst, name)
    M.append(os.path.join(dst, "config.pbtxt"), f"""parameters: {{
  key: "READINESS_FN_RETURN_VALUE"
  value: {{ string_value: "{value}" }}
}}
parameters: {{
  key: "READINESS_FN_DELAY_SECS"
  value: {{ string_value: "{delay}" }}
}}""")


def model_readiness(ctx) -> Suite:
    suite = Suite("L0_backend_python/model_readiness", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python", "model_readiness")
    repo = os.path.join(d, "models")
    shutil.rmtree(repo, ignore_errors=True)
    M.python_model(qa, "identity_fp32", repo)
    args = [f"--model-repository={repo}", "--log-verbose=1"]
    env = ctx.env()
    expected = ("Model 'identity_fp32' version 1 is not ready: Stub process 'identity_fp32_0_0' "
                "is not healthy.")
    for sig in (11, 9):
        step = f"signal {sig}"
        server = suite.start(step, args, f"model_readiness_signal_{sig}_server.log", d)
        if not server:
            continue
        try:
            ok = run_unittest(suite, step, d, ["test_model_readiness.TestModelReadiness."
                                               "test_model_ready"], env)
            if ok != ["PASS"]:
                continue            # test.sh: initial readiness check failed, exit 1
            pids = _worker_pids(server, "identity_fp32")
            if not suite.check(f"{step}: find the model's process", len(pids) >= 1,
                               "the process serving identity_fp32 (Triton's stub)", "none"):
                continue
            for pid in pids:
                os.kill(pid, sig)
            time.sleep(1)
            ok = run_unittest(suite, step, d, ["test_model_readiness.TestModelReadiness."
                                               "test_model_not_ready"], env)
            if ok == ["PASS"]:
                n = _count(server.log_text(), expected)
                suite.check(f"{step}: 'not healthy' log lines", n == 2,
                            f"exactly 2 lines (one per HTTP and gRPC readiness check) of "
                            f"\"{expected}\"", f"{n}; log ends: " +
                            tail(server.log_text(), 3).replace("\n", " | "),
                            tail(server.log_text(), 30))
        finally:
            server.stop()

    # the user-defined is_ready() function
    for name, value, delay in (("is_ready_fn_returns_true", "true", "0.1"),
                               ("is_ready_fn_returns_false", "false", "0.1"),
                               ("is_ready_fn_raises_error", "exception", "0.1"),
                               ("is_ready_fn_returns_non_boolean", "non_boolean", "0.1"),
                               ("is_ready_fn_timeout", "true", "8"),
                               ("is_ready_fn_coroutine_returns_true", "coroutine", "0.1")):
        _readiness_model(d, name, value, delay)
    M.copytree(os.path.join(d, "test_models", "is_ready_fn_returns_true_decoupled"),
               os.path.join(repo, "is_ready_fn_returns_true_decoupled"))
    src = os.path.join(repo, "is_ready_fn_returns_true_decoupled")
    os.makedirs(os.path.join(src, "1"), exist_ok=True)
    os.replace(os.path.join(src, "model.py"), os.path.join(src, "1", "model.py"))
    server = suite.start("user-defined is_ready", args + ["--strict-readiness=false"],
                         "test_user_defined_model_readiness_function_server.log", d)
    if server:
        try:
            run_unittest(suite, "user-defined is_ready", d,
                         ["test_model_readiness.TestUserDefinedModelReadinessFunction"], env)
        finally:
            server.stop()
    return suite
