"""EXECUTION_ENV_PATH for python models (engine/lifecycle/execution_env.py, engine/processes/env_worker.py):
two models importing two versions of one package side by side in one server, each from its own
environment (a real venv, tarred); one unpack per tarball content, shared and kept across reloads,
gone with the run directory; hostile or broken environments fail their model's load with the
reason, write nothing outside the cache, and leave the other models serving."""
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for

from shmserve.engine.lifecycle import execution_env

PY = execution_env.python_dir()         # python3.11 for this interpreter
SITE = f"lib/{PY}/site-packages"

MODEL = '''
import json, os, sys
import numpy as np
import triton_python_backend_utils as pb_utils
try:
    import envpkg
except ImportError:
    envpkg = None

class TritonPythonModel:
    def execute(self, requests):
        try:
            import pthmod
            pth = pthmod.NAME
        except ImportError:
            pth = ""
        info = {"version": getattr(envpkg, "VERSION", ""), "file": getattr(envpkg, "__file__", ""),
                "ld": os.environ.get("LD_LIBRARY_PATH", "").split(":")[0], "pth": pth,
                "numpy": np.__file__}
        out = np.array([json.dumps(info).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INFO", out)]) for _ in requests]
'''

CONFIG = '''
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "INFO", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


def _config(env_path: str | None, instances: int = 1) -> str:
    config = CONFIG + f"    instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]\n"
    if env_path is None:
        return config
    return config + f'''
    parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env_path}" }} }}
'''


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _root(file: str) -> str:
    """The environment a module was imported from."""
    return file[:file.index(os.sep + SITE)]


def _venv(path: str, version: str, pth: bool = False) -> str:
    """A real venv (no pip) with envpkg VERSION = ``version`` in its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=60)
    site = os.path.join(path, SITE)
    os.makedirs(os.path.join(site, "envpkg"))
    with open(os.path.join(site, "envpkg", "__init__.py"), "w") as f:
        f.write(f"VERSION = {version!r}\n")
    if pth:     # a .pth file the worker must read, as a site directory's
        os.makedirs(os.path.join(site, "pthdir"))
        with open(os.path.join(site, "pthdir", "pthmod.py"), "w") as f:
            f.write("NAME = 'from a .pth'\n")
        with open(os.path.join(site, "extra.pth"), "w") as f:
            f.write("pthdir\n")
    return path


def _tar_dir(src: str, dest: str) -> str:
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(src, arcname=".")
    return dest


def _tar_members(dest: str, members: list[tuple[tarfile.TarInfo, bytes]]) -> str:
    with tarfile.open(dest, "w:gz") as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return dest


def _file(name: str, data: bytes = b"x = 1\n") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, b""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("execenv"))
    repo, shared, outside = (os.path.join(base, d) for d in ("models", "shared", "outside"))
    for d in (repo, shared, outside):
        os.makedirs(d)
    started = time.monotonic()
    v1, v2 = _venv(os.path.join(base, "venv1"), "1"), _venv(os.path.join(base, "venv2"), "2", pth=True)
    tar1 = _tar_dir(v1, os.path.join(shared, "env1.tar.gz"))
    tar2 = _tar_dir(v2, os.path.join(shared, "env2.tar.gz"))
    print(f"two venvs made and tarred in {time.monotonic() - started:.2f} s")
    # env_a: the tarball in its model directory; env_a2 (three instances, unpacking at once with
    # env_a's): the same bytes elsewhere; env_b: version 2 by absolute path; env_dir: version 2's
    # directory, used in place
    write_model(repo, "env_a", _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
    shutil.copy(tar1, os.path.join(repo, "env_a", "env.tar.gz"))
    os.makedirs(os.path.join(shared, "copy"))
    shutil.copy(tar1, os.path.join(shared, "copy", "env.tar.gz"))
    write_model(repo, "env_a2", _config(os.path.join(shared, "copy", "env.tar.gz"), 3), MODEL)
    write_model(repo, "env_b", _config(tar2), MODEL)
    write_model(repo, "env_dir", _config(v2), MODEL)
    write_model(repo, "plain", _config(None), MODEL)
    # a python-based backend's model (the backend's model.py, the model's environment)
    backends = os.path.join(base, "backends")
    os.makedirs(os.path.join(backends, "envinfo"))
    with open(os.path.join(backends, "envinfo", "model.py"), "w") as f:
        f.write(MODEL)
    write_model(repo, "env_backend", _config(tar2).replace('backend: "python"', 'backend: "envinfo"'),
                None)
    write_model(repo, "timed", _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
    _tar_dir(_venv(os.path.join(base, "venv3"), "3"), os.path.join(repo, "timed", "env.tar.gz"))
    # hostile and broken ones
    bad = {
        "bad_escape": [_file(f"{SITE}/envpkg/__init__.py"), _file("../escape_1"),
                       _file("../../escape_2"), _file("../../../escape_3")],
        "bad_symlink": [_file(f"{SITE}/envpkg/__init__.py"), _link(f"{SITE}/evil", outside),
                        _file(f"{SITE}/evil/pwned.txt")],
        "bad_version": [_file("lib/python3.7/site-packages/envpkg/__init__.py")],
        "bad_no_site": [_file("README.txt")],
        "bad_bytes": [_file(f"{SITE}/envpkg/__init__.py"), _file(f"{SITE}/big.bin", bytes(4 << 20))],
        "bad_files": [_file(f"{SITE}/envpkg/__init__.py")] +
                     [_file(f"{SITE}/f{i}.py") for i in range(300)],
        # the environment's packages come first for the worker's own imports too
        "bad_breaks_numpy": [_file(f"{SITE}/numpy/__init__.py", b"raise ImportError('this numpy is broken')\n")],
    }
    for name, members in bad.items():
        write_model(repo, name, _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
        _tar_members(os.path.join(repo, name, "env.tar.gz"), members)
    write_model(repo, "bad_not_tar", _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
    with open(os.path.join(repo, "bad_not_tar", "env.tar.gz"), "wb") as f:
        f.write(b"this is not a tarball\n" * 100)
    write_model(repo, "bad_truncated", _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
    with open(tar2, "rb") as f:
        data = f.read()
    with open(os.path.join(repo, "bad_truncated", "env.tar.gz"), "wb") as f:
        f.write(data[:len(data) // 2])
    write_model(repo, "bad_missing", _config("$$TRITON_MODEL_DIRECTORY/nothing.tar.gz"), MODEL)
    write_model(repo, "bad_out_of_dir", _config("$$TRITON_MODEL_DIRECTORY/../shared/env2.tar.gz"), MODEL)
    # a temp dir of its own (short: sockets live under it): the run directory is found there
    tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "*", "--strict-readiness", "false",
               "--backend-directory", backends,
               env={"TMPDIR": tmp, execution_env.MAX_BYTES_ENV: str(1 << 20),
                    execution_env.MAX_FILES_ENV: "200"})
    (run_dir,) = [os.path.join(tmp, d) for d in os.listdir(tmp) if d.startswith("shmserve-")]
    wait_for(lambda: all(e.get("state") in ("READY", "UNAVAILABLE") for e in _index(s).values()), 60,
             "every model to have loaded or failed")
    w = {"server": s, "repo": repo, "run_dir": run_dir, "tmp": tmp, "outside": outside, "base": base,
         "cache": os.path.join(run_dir, execution_env.CACHE_DIR), "v2": v2,
         "sha1": _sha(tar1), "sha2": _sha(tar2)}
    yield w
    if s.proc.poll() is None:
        s.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def _info(srv: Server, model: str) -> dict:
    c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    inp = httpclient.InferInput("INPUT0", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    out = c.infer(model, [inp]).as_numpy("INFO")
    return json.loads(out[0])


def _index(srv: Server) -> dict:
    return {e["name"]: e for e in
            requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}


def _unpacked_dirs(cache: str) -> list[str]:
    return sorted(d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d)))


def test_each_model_imports_its_own_environment(world):
    srv, cache = world["server"], world["cache"]
    a, a2, b, d = (_info(srv, m) for m in ("env_a", "env_a2", "env_b", "env_dir"))
    plain = _info(srv, "plain")
    assert (a["version"], a2["version"], b["version"], d["version"]) == ("1", "1", "2", "2")
    assert plain["version"] == "" and plain["pth"] == ""       # no environment: not importable
    assert _info(srv, "env_backend")["version"] == "2"          # a python-based backend's model
    # unpacked in the run directory's cache, by content: env_a and env_a2 share one
    assert _root(a["file"]) == _root(a2["file"]) == os.path.join(cache, world["sha1"])
    assert _root(b["file"]) == os.path.join(cache, world["sha2"])
    assert _root(d["file"]) == world["v2"]                      # a directory: used in place
    # the environment's lib/ first for shared libraries; its .pth files count
    assert a["ld"] == os.path.join(_root(a["file"]), "lib")
    assert d["ld"] == os.path.join(world["v2"], "lib")
    assert b["pth"] == d["pth"] == "from a .pth" and a["pth"] == ""
    # the worker's own dependencies still import, from the server's environment
    assert a["numpy"] == plain["numpy"]


def _unpacks(srv: Server, sha: str) -> tuple[int, int]:
    """Log lines of workers that unpacked the tarball ``sha``, and of those that found it."""
    text = srv.log_text()
    return text.count(f"(unpacked, sha256 {sha[:12]}"), text.count(f"(already unpacked, sha256 {sha[:12]}")


def test_one_unpack_per_tarball_content_shared_and_kept_across_reloads(world):
    srv, cache = world["server"], world["cache"]
    # four workers (env_a, env_a2's three) needed tarball 1 at once: one unpacked it
    assert _unpacks(srv, world["sha1"]) == (1, 3), srv.log_text()
    assert _unpacks(srv, world["sha2"])[0] == 1
    assert not [d for d in os.listdir(cache) if ".tmp-" in d]       # no unpack left half done
    inode = os.stat(os.path.join(cache, world["sha1"])).st_ino
    c = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    c.load_model("env_a")       # a reload: a new worker, the environment as it was
    assert _info(srv, "env_a")["version"] == "1"
    assert _unpacks(srv, world["sha1"]) == (1, 4)
    assert os.stat(os.path.join(cache, world["sha1"])).st_ino == inode


def test_load_time_with_an_environment_unpacked_and_cached(world):
    """A measurement (printed), not a bound: a load that unpacks, one that finds it unpacked, and
    a model without an environment (a forked worker)."""
    srv, repo = world["server"], world["repo"]
    c = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    times = {}
    for what, model in (("no environment", "plain"), ("cached", "timed")):
        c.unload_model(model)
        started = time.monotonic()
        c.load_model(model)
        times[what] = time.monotonic() - started
    # new bytes in the model's tarball: the next load unpacks them
    v4 = _venv(os.path.join(world["base"], "venv4"), "4")
    sha = _sha(_tar_dir(v4, os.path.join(repo, "timed", "env.tar.gz")))
    started = time.monotonic()
    c.load_model("timed")
    times["unpack"] = time.monotonic() - started
    assert _info(srv, "timed")["version"] == "4" and _unpacks(srv, sha) == (1, 0)
    print("load times: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items()))


BAD = {
    "bad_escape": "unsafe archive member: '../escape_1' would be extracted to",
    "bad_symlink": "is a link to an absolute path",
    "bad_version": "is for Python 3.7 (lib/python3.7/site-packages), but the server runs Python",
    "bad_no_site": f"has no lib/{PY}/site-packages",
    "bad_bytes": "unpacks to more than 1048576 bytes",
    "bad_files": "has more than 200 members",
    "bad_breaks_numpy": "the worker cannot start with the execution environment's packages",
    "bad_not_tar": "is not a tar archive (plain, gzip, bzip2 or xz) nor a directory",
    "bad_truncated": "could not be unpacked",
    "bad_missing": "does not exist",
    "bad_out_of_dir": "leads out of the model directory",
}


@pytest.mark.parametrize("model", sorted(BAD))
def test_a_bad_environment_fails_its_load_with_the_reason(world, model):
    entry = _index(world["server"])[model]
    assert entry["state"] == "UNAVAILABLE", entry
    assert "EXECUTION_ENV_PATH" in entry["reason"] and BAD[model] in entry["reason"], entry


def test_nothing_is_written_outside_the_cache_and_the_others_serve(world):
    srv, cache, run_dir = world["server"], world["cache"], world["run_dir"]
    for path in (os.path.join(cache, "escape_1"), os.path.join(run_dir, "escape_2"),
                 os.path.join(world["tmp"], "escape_3")):
        assert not os.path.exists(path), path
    assert os.listdir(world["outside"]) == []
    assert not [d for d in os.listdir(cache) if ".tmp-" in d]       # failed unpacks removed
    index = _index(srv)
    assert all(index[m]["state"] == "READY" for m in ("env_a", "env_a2", "env_b", "env_dir", "plain"))
    assert _info(srv, "env_b")["version"] == "2"


def test_the_cache_goes_with_the_run_directory(tmp_path):
    repo = str(tmp_path / "models")
    write_model(repo, "env", _config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), MODEL)
    _tar_dir(_venv(str(tmp_path / "venv"), "5"), os.path.join(repo, "env", "env.tar.gz"))
    tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
    try:
        srv = Server(repo, env={"TMPDIR": tmp})
        try:
            (run_dir,) = [os.path.join(tmp, d) for d in os.listdir(tmp) if d.startswith("shmserve-")]
            assert _info(srv, "env")["version"] == "5"
            assert os.path.isdir(os.path.join(run_dir, execution_env.CACHE_DIR))
        finally:
            assert srv.stop() == 0
        assert not os.path.exists(run_dir)
        assert [d for d in os.listdir(tmp) if d.startswith("shmserve-")] == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
