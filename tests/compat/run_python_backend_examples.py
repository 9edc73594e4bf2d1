#!/usr/bin/env python3
"""Run python_backend's examples, unchanged, against shmserve: each example's models are copied
into a repository the way its README says, and its client runs as written. The clients connect
to localhost:8000 (HTTP) and localhost:8001 (gRPC), so the server takes those ports; nothing
else may hold them.

Not part of the test suite (CI has no copy of python_backend). This is how the list in docs/operations.md
("python_backend's examples") is measured.

Usage: python tests/compat/run_python_backend_examples.py PYTHON_BACKEND_EXAMPLES_DIR
Prints PASS, FAIL (the output's last lines) or SKIP (why) per example.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from serverproc import Server  # noqa: E402

# example -> (models: name -> (model file, config file or None), clients, modules it needs)
EXAMPLES = {
    "add_sub": ({"add_sub": ("add_sub/model.py", "add_sub/config.pbtxt")},
                ["add_sub/client.py"], []),
    "auto_complete": ({"nobatch_auto_complete": ("auto_complete/nobatch_model.py", None),
                       "batch_auto_complete": ("auto_complete/batch_model.py", None)},
                      ["auto_complete/client.py"], []),
    "custom_metrics": ({"custom_metrics": ("custom_metrics/model.py",
                                           "custom_metrics/config.pbtxt")},
                       ["custom_metrics/client.py"], []),
    "pytorch": ({"pytorch": ("pytorch/model.py", "pytorch/config.pbtxt")},
                ["pytorch/client.py"], ["torch"]),
    "jax": ({"jax": ("jax/model.py", "jax/config.pbtxt")}, ["jax/client.py"], ["jax"]),
    "bls": ({"add_sub": ("add_sub/model.py", "add_sub/config.pbtxt"),
             "pytorch": ("pytorch/model.py", "pytorch/config.pbtxt"),
             "bls_sync": ("bls/sync_model.py", "bls/sync_config.pbtxt"),
             "bls_async": ("bls/async_model.py", "bls/async_config.pbtxt")},
            ["bls/sync_client.py", "bls/async_client.py"], ["torch"]),
    "bls_decoupled": ({"square_int32": ("decoupled/square_model.py",
                                        "decoupled/square_config.pbtxt"),
                       "bls_decoupled_sync": ("bls_decoupled/sync_model.py",
                                              "bls_decoupled/sync_config.pbtxt"),
                       "bls_decoupled_async": ("bls_decoupled/async_model.py",
                                               "bls_decoupled/async_config.pbtxt")},
                      ["bls_decoupled/sync_client.py", "bls_decoupled/async_client.py"], []),
    "decoupled": ({"repeat_int32": ("decoupled/repeat_model.py", "decoupled/repeat_config.pbtxt"),
                   "square_int32": ("decoupled/square_model.py", "decoupled/square_config.pbtxt")},
                  ["decoupled/repeat_client.py", "decoupled/square_client.py"], []),
}
# Examples that need what shmserve does not have yet, and the issue that brings it.
SKIP = {
    "instance_kind": "a GPU, torch and a ResNet-50 exported by the user (issue 19)",
    "preprocessing": "a TensorRT ResNet-50 plan the user builds on a GPU (issue 19) and torchvision",
}


def _repository(examples_dir: str, models: dict) -> str:
    repo = tempfile.mkdtemp(prefix="shmserve-pb-examples-")
    for name, (model, config) in models.items():
        os.makedirs(os.path.join(repo, name, "1"))
        shutil.copy(os.path.join(examples_dir, model), os.path.join(repo, name, "1", "model.py"))
        if config:
            shutil.copy(os.path.join(examples_dir, config),
                        os.path.join(repo, name, "config.pbtxt"))
    return repo


def run_example(examples_dir: str, models: dict, clients: list[str]) -> tuple[str, str]:
    repo = _repository(examples_dir, models)
    server = Server([repo], "--http-port", "8000", "--grpc-port", "8001", "--metrics-port",
                    "8002")
    try:
        for client in clients:
            path = os.path.join(examples_dir, client)
            done = subprocess.run([sys.executable, path], capture_output=True, text=True,
                                  timeout=120, cwd=os.path.dirname(path))
            text = done.stdout + done.stderr
            if done.returncode != 0 or "PASS" not in text:
                tail = " | ".join(text.strip().splitlines()[-3:])
                return "FAIL", f"{client}: rc={done.returncode}: {tail}"
        return "PASS", ""
    finally:
        server.stop()
        shutil.rmtree(repo)


def main(examples_dir: str) -> int:
    names = sorted(n for n in os.listdir(examples_dir)
                   if os.path.isdir(os.path.join(examples_dir, n)))
    results = {}
    for name in names:
        if name in SKIP or name not in EXAMPLES:
            results[name] = ("SKIP", SKIP.get(name, "not known to this script"))
            continue
        models, clients, needs = EXAMPLES[name]
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if missing:
            results[name] = ("SKIP", f"needs {', '.join(missing)} (not installed here)")
            continue
        results[name] = run_example(examples_dir, models, clients)
    for name, (verdict, why) in results.items():
        print(f"{verdict:4}  {name}{'  -- ' + why if why else ''}")
    passed = sum(v == "PASS" for v, _ in results.values())
    print(f"\n{passed} of {len(results)} pass unchanged")
    return 0 if all(v != "FAIL" for v, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
