"""L0_backend_python's own test.sh (not its sub-folders): python_test.py against the models it
builds, the non-graceful exit check, the multi-file / environment models, and the start-up
failures it expects (init_exit, non_existent_model)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import time

from . import models as M
from .harness import QaServer, Suite, _alive, descendants, tail
from .runners import run_pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
NO_TORCH = "not applicable: the model imports torch, which is not installed here"
GPU = "not applicable: CUDA shared memory / GPU tensors (no GPU in this run)"


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def shm_left(suite: Suite, step: str, before: set[str], server: QaServer) -> None:
    """test.sh's get_shm_pages before/after: nothing the server made stays in /dev/shm. Only
    its own segments (shmserve_<launcher pid>_...) and python-backend pools count, so that a
    test run beside this one cannot make it fail."""
    mine = re.compile(rf"(shmserve_{server.pid}_|triton_python_backend_shm)")
    new: list[str] = []
    for _ in range(10):                 # a second or two for the last unlinks
        new = sorted(n for n in shm_entries() - before if mine.match(n))
        if not new:
            break
        time.sleep(0.5)
    suite.check(f"{step}: /dev/shm clean after stop", not new,
                "no /dev/shm entry of the server left after it stopped",
                f"left behind: {', '.join(new[:8])}")


def build_main(qa: str, d: str) -> None:
    repo = os.path.join(d, "models")
    shutil.rmtree(repo, ignore_errors=True)
    M.python_model(qa, "identity_fp32", repo)
    if HAS_TORCH:
        M.python_model(qa, "identity_bf16", repo)
    for name, dtype in (("identity_uint8", "TYPE_UINT8"), ("identity_uint8_nobatch", "TYPE_UINT8"),
                        ("identity_uint32", "TYPE_UINT32"), ("identity_bool", "TYPE_BOOL")):
        dst = M.copytree(os.path.join(repo, "identity_fp32"), os.path.join(repo, name))
        cfg = os.path.join(dst, "config.pbtxt")
        M.rename(dst, name)
        M.sed(cfg, "TYPE_FP32", dtype)
        if name == "identity_uint8":
            M.sed(cfg, r"^max_batch_size:.*", "max_batch_size: 8")
            M.append(cfg, "dynamic_batching { preferred_batch_size: [8], "
                          "max_queue_delay_microseconds: 12000000 }")
        elif name == "identity_uint8_nobatch":
            M.sed(cfg, r"^max_batch_size:.*", "")
    dst = M.copytree(os.path.join(repo, "identity_fp32"), os.path.join(repo, "default_model_name"))
    os.rename(os.path.join(dst, "1", "model.py"), os.path.join(dst, "1", "mymodel.py"))
    M.rename(dst, "default_model_name")
    M.append(os.path.join(dst, "config.pbtxt"), 'default_model_filename: "mymodel.py"')
    if HAS_TORCH:
        M.python_model(qa, "pytorch_fp32_fp32", repo)
    for name in ("delayed_model", "init_args", "optional", "non_contiguous", "string",
                 "string_fixed", "dlpack_identity"):
        M.python_model(qa, name, repo)


def run(ctx) -> Suite:
    suite = Suite("L0_backend_python", ctx)
    qa, d = ctx.qa, os.path.join(ctx.qa, "L0_backend_python")
    base = [f"--model-repository={d}/models", "--log-verbose=1"]
    server_env = {"TRITON_DIR": ctx.work}           # init_args checks $TRITON_DIR/qa/... paths

    # python_test.py
    build_main(qa, d)
    M.sed(os.path.join(d, "models", "init_args", "config.pbtxt"), "TRITON_DIR_PATH", ctx.work)
    skips = {"PythonTest.test_gpu_tensor_error": GPU, "PythonTest.test_dlpack_tensor_error": GPU,
             "PythonTest.test_growth_error": "not applicable: expects the python backend's shm "
             "pool to fail to grow ('Failed to increase the shared memory pool size') in Triton "
             "CI's 1 GiB /dev/shm; shmserve has no such pool (the 64 MiB HTTP input limit is "
             "L0_http's input size cases)"}
    if not HAS_TORCH:
        skips.update({"PythonTest.test_bf16": NO_TORCH, "PythonTest.test_infer_pytorch": NO_TORCH})
    before = shm_entries()
    server = suite.start("python_test", base + ["--allow-client-shm=true",
                         "--backend-config=python,shm-default-byte-size=5242880"],
                         "inference_server.log", d, server_env)
    if server:
        try:
            run_pytest(suite, "python_test", d, "python_test.py", ctx.env(), skips)
        finally:
            server.stop()
        shm_left(suite, "python_test", before, server)

    # Triton non-graceful exit: SIGKILL to the server; its processes must end by themselves
    server = suite.start("non-graceful exit", base + [
        "--backend-config=python,shm-default-byte-size=5242880"], "inference_server.log", d,
        server_env)
    if server:
        time.sleep(5)
        tree = descendants(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(10)
        alive = [p for p in tree if _alive(p)]
        suite.check("non-graceful exit: server's processes end after SIGKILL", not alive,
                    "every process under the server gone 10 s after kill -9 of the server",
                    f"{len(alive)} of {len(tree)} still running: {_cmds(alive)}")
        server.kill()
        server.stop()

    suite.skip("KIND_GPU model add_sub_gpu", "not applicable: KIND_GPU instance (no GPU)")

    # multi-file model
    repo = os.path.join(d, "models")
    shutil.rmtree(repo)
    dst = M.python_model(qa, "multi_file", repo, config=None, files=("file1.py", "file2.py"))
    shutil.copy(os.path.join(qa, "python_models", "identity_fp32", "config.pbtxt"), dst)
    M.rename(dst, "multi_file")
    _starts(suite, "multi_file model", base + [
        "--backend-config=python,shm-default-byte-size=5242880"], d, server_env)

    # environment variable propagation
    shutil.rmtree(repo)
    M.python_model(qa, "model_env", repo)
    _starts(suite, "model_env (MY_ENV propagated)", base + [
        "--backend-config=python,shm-default-byte-size=5242880"], d,
        {**server_env, "MY_ENV": "MY_ENV"})

    suite.skip("shm-default-byte-size region sizes", "not applicable: Triton's python backend "
               "shm pools (/dev/shm/triton_python_backend_shm*); shmserve makes none, so "
               "test.sh's size loop has nothing to check")

    # a model whose stub dies during initialize
    shutil.rmtree(repo)
    M.python_model(qa, "init_exit", repo)
    suite.expect_start_failure("init_exit", base, "init_exit_server.log", d,
                               ["Stub process 'init_exit_0_0' is not healthy."],
                               count_exact=False)

    # a model directory without model.py
    shutil.rmtree(repo)
    os.makedirs(os.path.join(repo, "non_existent_model", "1"))
    shutil.copy(os.path.join(qa, "python_models", "identity_fp32", "config.pbtxt"),
                os.path.join(repo, "non_existent_model"))
    M.rename(os.path.join(repo, "non_existent_model"), "non_existent_model")
    for mode, extra in (("default", []), ("auto_config_disabled", ["--disable-auto-complete-config"])):
        suite.expect_start_failure(
            f"non_existent_model ({mode})", base + extra, f"non_existent_model_server_{mode}.log",
            d, ["Failed to preinitialize Python stub: Python model file not found in "
                f"'{d}/models/non_existent_model/1/model.py'",
                "failed to load 'non_existent_model'"], count_exact=False)
    return suite


def _starts(suite: Suite, step: str, args: list[str], d: str, env: dict) -> None:
    before = shm_entries()
    server = QaServer(args, os.path.join(d, "inference_server.log"), d, env)
    suite.check(f"{step}: server starts", server.started, "the server to become ready",
                f"{server.why_not}: " + tail(server.log_text(), 3).replace("\n", " | "),
                tail(server.log_text(), 40))
    server.stop()
    if server.started:
        shm_left(suite, step, before, server)


def _cmds(pids: list[int]) -> str:
    out = []
    for p in pids[:4]:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{p}:{cmd[:80]}")
        except OSError:
            out.append(str(p))
    return "; ".join(out)
