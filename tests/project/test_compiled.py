"""The request path compiled by setup.py (mypyc): built here, found stale when its source was edited
after the build, and the pure-Python fallback serving the same requests."""
from __future__ import annotations

import ast
import gzip
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from serverproc import REPO_ROOT, Server

from shmserve.ipc import compiled
from shmserve.ipc.compiled import FOLDERS


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _maps_compiled(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "compiled__mypyc" in f.read()
    except OSError:
        return False


def _infer(server: Server) -> None:
    x = np.arange(16, dtype=np.float32)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                        "data": x.tolist()}]}
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == x.tolist()
    # a compressed body is inflated into a bytearray: a compiled module checks that type
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer",
                      data=gzip.compress(json.dumps(body).encode()),
                      headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=b"{not json",
                      timeout=30)
    assert r.status_code == 400 and "error" in r.json(), r.text
    # gRPC's connection (compiled: one class of traits; pure: the same classes in Python)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x.reshape(1, 16))
    assert client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0").tolist() == [x.tolist()]
    client.close()


def _fresh(expr: str, env: dict | None = None):
    """``expr`` evaluated in a new interpreter: what the server's processes would see, whatever
    this test process has imported or patched."""
    out = subprocess.run([sys.executable, "-c", f"from shmserve.ipc import compiled; print({expr})"],
                         capture_output=True, text=True, timeout=60,
                         env=None if env is None else {**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout)


def test_the_build_compiled_every_listed_module():
    # CI's machine has a C compiler: a build that fell back to pure Python (setup.py warns in
    # pip's output) would lose the speed without failing anything else
    assert _fresh("compiled.compiled()") == [compiled.module_name(p) for p in compiled.SOURCES]


def test_no_process_entry_is_compiled():
    # python -m cannot run an extension as __main__: a compiled entry would fail every start
    # of its process (a worker spawned as `python -m shmserve.workers.main` did, once)
    for path in compiled.SOURCES:
        with open(os.path.join(REPO_ROOT, path)) as f:
            assert 'if __name__ == "__main__"' not in f.read(), path


def test_a_source_edited_after_its_build_is_stale(tmp_path):
    assert _fresh("compiled.stale()") == []
    with open(compiled.RECORDS) as f:
        built = json.load(f)
    name = compiled.module_name(compiled.SOURCES[-1])
    # the records of a build from before an edit to one module: its digest differs
    records = tmp_path / "records.json"
    records.write_text(json.dumps({**built, name: "0" * 64}))
    assert _fresh(f"compiled.stale({str(records)!r})") == [name]
    # a build that recorded nothing (records lost): every module is suspect
    records.write_text("{}")
    assert _fresh(f"compiled.stale({str(records)!r})") == [
        compiled.module_name(p) for p in compiled.SOURCES]


def test_an_extension_left_from_a_module_no_longer_compiled_is_stale(tmp_path):
    # a copy of the installed tree with its builds, plus the extension of a module that an
    # earlier build compiled and the list has since dropped: Python imports it before the source
    tree = tmp_path / "tree" / "shmserve"
    for folder in FOLDERS:
        shutil.copytree(os.path.join(REPO_ROOT, folder), tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    [built] = [f for f in os.listdir(tree / "workers") if f.startswith("worker.") and
               f.endswith(".so")]
    shutil.copy(tree / "workers" / built, tree / "workers" / built.replace("worker.", "zygote."))
    assert _fresh("compiled.stale()", env={"PYTHONPATH": str(tree.parent)}) == [
        "shmserve.workers.zygote"]


def test_compiled_and_pure_python_serve_alike(example_repo, tmp_path):
    # the four folders copied without their builds: Python imports the .py files there
    pure = tmp_path / "pure" / "shmserve"
    for folder in FOLDERS:
        shutil.copytree(os.path.join(REPO_ROOT, folder), pure / folder,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for env, expect_compiled in ((None, True), ({"PYTHONPATH": str(pure.parent)}, False)):
        server = Server(example_repo, "--model-control-mode", "explicit", "--load-model",
                        "identity_fp32", env=env)
        try:
            _infer(server)
            pids = _descendants(server.proc.pid)
            assert any(_maps_compiled(p) for p in pids) == expect_compiled
        finally:
            assert server.stop() == 0


def test_a_server_whose_build_is_older_than_its_source_says_so(example_repo, tmp_path):
    # a copy of the installed tree with its builds, then one module edited after the build
    tree = tmp_path / "edited" / "shmserve"
    for folder in FOLDERS:
        shutil.copytree(os.path.join(REPO_ROOT, folder), tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    path = compiled.SOURCES[-1]
    with open(tree / path, "a") as f:
        f.write("# an edit after the build\n")
    server = Server(example_repo, "--model-control-mode", "explicit",
                    env={"PYTHONPATH": str(tree.parent)})
    try:
        assert (f"{compiled.module_name(path)} runs compiled from an older source"
                in server.log_text())
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("broken", ["no C compiler", "mypyc refuses a module"])
def test_a_build_that_cannot_compile_installs_pure_python(broken, tmp_path):
    # the repository as committed, built into a wheel the way pip builds it for a user
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(os.path.join(REPO_ROOT, name)):
            os.symlink(os.readlink(os.path.join(REPO_ROOT, name)), target)
        else:
            shutil.copy2(os.path.join(REPO_ROOT, name), target)
    # an extension an earlier editable build left, of a module no longer compiled: it goes
    leftover = src / "workers" / f"zygote{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    leftover.write_bytes(b"")
    env = dict(os.environ)
    if broken == "no C compiler":
        env["CC"] = "/bin/false"
    else:
        with open(src / compiled.SOURCES[-1], "a") as f:
            f.write("\nnot_an_int: int = 'a string'\n")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(src)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "installing the pure-Python modules" in out.stdout + out.stderr
    [wheel] = os.listdir(tmp_path / "wheels")
    with zipfile.ZipFile(tmp_path / "wheels" / wheel) as z:
        names = z.namelist()
    assert "shmserve/frontend/http/server.py" in names
    assert not [n for n in names if n.endswith(".so") or n.endswith("compiled_sources.json")]
    assert not leftover.exists()
