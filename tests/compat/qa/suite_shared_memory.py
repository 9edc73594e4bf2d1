"""L0_shared_memory, as its test.sh runs it: a fresh server for each SharedMemoryTest case and
client type (http, grpc), the unregister-during-inference cases against a delaying python
"simple", and test_large_shm_register_offset over the python and onnx int32 models (BACKENDS,
which test.sh and the test both read, is "python onnx" here: libtorch, plan and openvino are
SKIP). test.sh also requires every server to exit 0 after SIGTERM; that is one case here."""
from __future__ import annotations

import os
import shutil

from . import models as M
from .harness import Suite, tail
from .runners import run_unittest
from .suite_http import example_repo

CASES = ("test_invalid_create_shm", "test_valid_create_set_register",
         "test_unregister_before_register", "test_unregister_after_register",
         "test_reregister_after_register", "test_unregister_after_inference",
         "test_register_after_inference", "test_too_big_shm", "test_mixed_raw_shm",
         "test_unregisterall", "test_infer_offset_out_of_bound",
         "test_infer_byte_size_out_of_bound", "test_infer_integer_overflow",
         "test_register_out_of_bound", "test_register_reserved_names",
         "test_register_invalid_shm_key", "test_python_client_leak")
UNREGISTER = ("test_unregister_shm_during_inference_single_req",
              "test_unregister_shm_during_inference_multiple_req", "test_unregister_shm_after_inference")
BACKENDS = "python onnx"


class _Exits:
    """Every server's exit status after SIGTERM (test.sh: wait $SERVER_PID; $? -ne 0)."""

    def __init__(self):
        self.bad: list[str] = []
        self.n = 0

    def stop(self, step: str, server) -> None:
        code = server.stop()
        self.n += 1
        if code != 0:
            self.bad.append(f"{step}: {code} ({tail(server.log_text(), 1)})")


def run(ctx) -> Suite:
    suite = Suite("L0_shared_memory", ctx)
    d = os.path.join(ctx.qa, "L0_shared_memory")
    models = os.path.join(d, "models")
    example_repo(ctx, suite, models, ("simple",))
    exits = _Exits()

    def one(step: str, repo: str, extra: list[str], test: str, client: str) -> None:
        server = suite.start(step, [f"--model-repository={repo}", "--log-verbose=1", *extra],
                             f"{step.replace(' ', '_').replace('/', '_')}.server.log", d)
        if not server:
            return
        try:
            run_unittest(suite, step, d, [f"shared_memory_test.{test}"],
                         ctx.env(CLIENT_TYPE=client, BACKENDS=BACKENDS))
        finally:
            exits.stop(step, server)

    for client in ("http", "grpc"):
        one(f"shm disabled by default [{client}]", models, [],
            "SharedMemoryTest.test_client_shm_disabled_by_default", client)
    for test in CASES:
        for client in ("http", "grpc"):
            one(f"[{client}]", models, ["--allow-client-shm=true"], f"SharedMemoryTest.{test}",
                client)

    py = os.path.join(d, "python_models")
    shutil.rmtree(py, ignore_errors=True)
    M.python_model(ctx.qa, "execute_delayed_model", py, "simple")
    for test in UNREGISTER:
        for client in ("http", "grpc"):
            one(f"[{client}]", py, ["--allow-client-shm=true"],
                f"TestSharedMemoryUnregister.{test}_{client}", client)

    shutil.rmtree(models)
    os.makedirs(models)
    dst = M.python_model(ctx.qa, "add_sub", models, "python_int32_int32_int32")
    M.sed(os.path.join(dst, "config.pbtxt"), "TYPE_FP32", "TYPE_INT32")
    M.append(os.path.join(dst, "config.pbtxt"), "max_batch_size: 8")
    M.generated(ctx, "qa_model_repository", "onnx_int32_int32_int32", models, only_version="1")
    for backend in ("libtorch", "plan", "openvino"):
        suite.skip(f"test_large_shm_register_offset [{backend}_int32_int32_int32]",
                   f"not applicable: {backend} models (BACKENDS={BACKENDS!r} for this case)")
    for client in ("http", "grpc"):
        one(f"large offset [{client}]", models, ["--allow-client-shm=true"],
            "SharedMemoryTest.test_large_shm_register_offset", client)

    suite.check(f"every server exits 0 after SIGTERM ({exits.n} servers)", not exits.bad,
                "exit status 0 ('Test Server shut down non-gracefully' otherwise)",
                "; ".join(exits.bad[:5]))
    return suite
