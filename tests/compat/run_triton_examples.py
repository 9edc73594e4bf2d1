#!/usr/bin/env python3
"""Run Triton's own Python client examples, unchanged, against shmserve serving configs/models.

Not part of the test suite (CI has no copy of Triton's client repository); the e2e tests in
tests/e2e/test_client_examples.py make the same calls in our own words. This script is how the
list in docs/operations.md ("Triton's examples") is measured.

Usage: python tests/compat/run_triton_examples.py EXAMPLES_DIR [IMAGE]
  EXAMPLES_DIR: triton-inference-server/client's src/python/examples
  IMAGE: a picture for image_client.py / grpc_image_client.py (one is drawn when absent)

Prints one line per example: PASS, FAIL (with the output's last lines) or SKIP (with why).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from serverproc import Server  # noqa: E402

REPO = os.path.join(ROOT, "configs", "models")

# Examples that need what shmserve does not have yet, and the issue that brings it.
SKIP = {
    "simple_grpc_cudashm_client.py": "a GPU (issue 19)",
    "simple_http_cudashm_client.py": "a GPU (issue 19)",
}
# Run against a server in explicit model-control mode, as Triton's QA runs them. They check how
# many models the repository holds (the two QA repositories differ), so each gets a repository of
# that many of configs/models.
EXPLICIT = {"simple_http_model_control.py": 7, "simple_grpc_model_control.py": 8}
# Examples that talk to localhost:8000 (HTTP) and 8001 (gRPC) and take no -u: a server of
# their own on those ports, which nothing else may hold.
FIXED_PORTS = ("memory_growth_test.py",)
FIRST = ("simple", "simple_string", "simple_int8", "simple_identity", "identity_fp32",
         "identity_bytes", "mlp_onnx")


def _repository_of(n: int) -> str:
    repo = tempfile.mkdtemp(prefix="shmserve-examples-repo-")
    names = list(FIRST) + sorted(set(os.listdir(REPO)) - set(FIRST))
    for name in names[:n]:
        os.symlink(os.path.join(REPO, name), os.path.join(repo, name))
    return repo


def _image(path: str | None) -> str:
    if path:
        return path
    from PIL import Image
    out = os.path.join(tempfile.mkdtemp(prefix="shmserve-examples-"), "picture.jpg")
    Image.new("RGB", (320, 240), (200, 120, 40)).save(out)
    return out


def _argvs(example: str, server: Server, image: str) -> list[list[str]]:
    """The command lines an example runs with (all must pass), as Triton's QA passes them."""
    url = server.grpc_url if "grpc" in example else server.url
    if example in ("image_client.py", "grpc_image_client.py"):
        return [["-u", url, "-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION", image]]
    if example == "ensemble_image_client.py":    # preprocess_inception_ensemble
        return [["-u", server.url, "-c", "3", image],
                ["-i", "grpc", "-u", server.grpc_url, "-c", "3", image]]
    if example == "memory_growth_test.py":      # custom_identity_int32 (the identity backend)
        return [["-i", "http"], ["-i", "grpc"]]
    if example == "reuse_infer_objects_client.py":
        return [["-i", "http", "-u", server.url], ["-i", "grpc", "-u", server.grpc_url]]
    return [["-u", url]]


def run_one(example: str, path: str, server: Server, image: str) -> tuple[str, str]:
    with open(path) as f:
        says_pass = "PASS" in f.read()
    for argv in _argvs(example, server, image):
        try:
            done = subprocess.run([sys.executable, path, *argv], capture_output=True, text=True,
                                  timeout=120)
        except subprocess.TimeoutExpired:
            return "FAIL", f"{' '.join(argv)}: timed out after 120 s"
        text = done.stdout + done.stderr
        if done.returncode != 0 or (says_pass and "PASS" not in text):
            tail = " | ".join(text.strip().splitlines()[-3:])
            return "FAIL", f"{' '.join(argv)}: rc={done.returncode}: {tail}"
    return "PASS", ""


def main(examples_dir: str, image: str | None = None) -> int:
    image = _image(image)
    names = sorted(n for n in os.listdir(examples_dir) if n.endswith(".py"))
    results = {}
    runs = [(REPO, (), [n for n in names if n not in SKIP and n not in EXPLICIT
                        and n not in FIXED_PORTS])]
    runs += [(REPO, ("--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"),
              [n for n in FIXED_PORTS if n in names])]
    runs += [(_repository_of(count), ("--model-control-mode=explicit", "--load-model=simple"),
              [name]) for name, count in EXPLICIT.items() if name in names]
    for repo, extra, todo in runs:
        if not todo:
            continue
        server = Server([repo], *extra)
        try:
            for name in todo:
                results[name] = run_one(name, os.path.join(examples_dir, name), server, image)
        finally:
            server.stop()
            if repo != REPO:
                shutil.rmtree(repo)
    for name in names:
        verdict, why = results.get(name, ("SKIP", SKIP.get(name, "")))
        print(f"{verdict:4}  {name}{'  -- ' + why if why else ''}")
    passed = sum(v == "PASS" for v, _ in results.values())
    print(f"\n{passed} of {len(names)} pass unchanged ({len(results)} run, "
          f"{len(names) - len(results)} skipped)")
    return 0 if all(v == "PASS" for v, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
