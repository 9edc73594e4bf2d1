"""engine/lifecycle/execution_env.py in-process: the parameter, the path rules, the layout and
Python version check, the worker's variables, the member filter (safety and bounds), and
prepare's cache (one unpack per content, even when several unpack at once)."""
import io
import json
import os
import tarfile
import threading
from types import SimpleNamespace

import pytest

from shmserve.engine.lifecycle import execution_env as ee
from shmserve.engine.processes.supervision import execution_env_of, fork_opt_out, worker_command
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers import env_start

PY = ee.python_dir()
SITE = f"lib/{PY}/site-packages"


def _config(value) -> str:
    return json.dumps({"name": "m", "parameters": {"EXECUTION_ENV_PATH": value}})


@pytest.mark.parametrize("backend,value,expected", [
    ("python", {"string_value": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}, "$$TRITON_MODEL_DIRECTORY/env.tar.gz"),
    ("python", {"string_value": "  /abs/env.tar.gz "}, "/abs/env.tar.gz"),
    ("python", {"string_value": ""}, ""),
    ("python", "/plain/string", "/plain/string"),
    ("python", None, ""),
    ("onnxruntime", {"string_value": "/abs/env.tar.gz"}, ""),
])
def test_the_parameter_of_a_python_model(backend, value, expected):
    assert ee.requested(backend, _config(value)) == expected


def test_a_config_without_parameters_or_not_json_asks_for_nothing():
    assert ee.requested("python", json.dumps({"name": "m"})) == ""
    assert ee.requested("python", "not json") == ""
    assert ee.requested("python", json.dumps({"parameters": ["x"]})) == ""


def test_a_model_with_an_environment_starts_in_env_worker_and_is_never_forked():
    def spec(params, backend="python", source=""):
        return InstanceSpec("m", 1, "/x", json.dumps({"parameters": params}), "m_0", "CPU", 0, backend,
                            backend_source=source)
    env = {"EXECUTION_ENV_PATH": {"string_value": "/e.tar.gz"}}
    assert worker_command(spec(env)) == "shmserve.engine.processes.env_worker"
    assert fork_opt_out(spec(env)) == "EXECUTION_ENV_PATH"
    assert worker_command(spec({})) == "shmserve.workers.main"
    # a python-based backend's model (its source: the backend's model.py) may name one too; a
    # plug-in's ("module:attr") or a built-in C++-style backend's may not
    assert execution_env_of(spec(env, "my_backend", "/backends/my_backend/model.py")) == "/e.tar.gz"
    assert execution_env_of(spec(env, "my_plugin", "pkg.mod:Backend")) == ""
    assert worker_command(spec(env, "onnxruntime")) == "shmserve.workers.main"


def test_the_model_directory_keyword_and_where_it_may_lead(tmp_path, monkeypatch):
    model = str(tmp_path / "repo" / "m")
    assert ee.expand("$$TRITON_MODEL_DIRECTORY/env.tar.gz", model) == f"{model}/env.tar.gz"
    assert ee.expand("$$TRITON_MODEL_DIRECTORY/sub/../env", model) == f"{model}/env"
    assert ee.expand("$$TRITON_MODEL_DIRECTORY", model) == model
    for escaping in ("$$TRITON_MODEL_DIRECTORY/../other/env.tar.gz", "$$TRITON_MODEL_DIRECTORY/../m2",
                     "/elsewhere/$$TRITON_MODEL_DIRECTORY/env"):
        with pytest.raises(ee.EnvError, match="leads out of the model directory"):
            ee.expand(escaping, model)
    assert ee.expand("/abs/../env.tar.gz", model) == "/env.tar.gz"
    monkeypatch.chdir(tmp_path)             # as in Triton: relative to the working directory
    assert ee.expand("envs/e.tar.gz", model) == str(tmp_path / "envs" / "e.tar.gz")


def test_the_python_directory_name():
    assert ee.python_dir((3, 11), False) == "python3.11"
    assert ee.python_dir((3, 13), True) == "python3.13t"


def _mkdirs(root, *rels):
    for rel in rels:
        os.makedirs(os.path.join(root, rel), exist_ok=True)
    return str(root)


def test_the_layout_and_the_same_python_version_rule(tmp_path):
    root = _mkdirs(tmp_path / "a", "lib/python3.11/site-packages")
    env = ee.layout(root, "python3.11")
    assert (env.root, env.site, env.lib) == (root, f"{root}/lib/python3.11/site-packages", f"{root}/lib")
    with pytest.raises(ee.EnvError, match=r"is for Python 3\.11 \(lib/python3\.11/site-packages\), but the "
                                          r"server runs Python 3\.12: it must be the same Python version"):
        ee.layout(root, "python3.12")
    wrapped = _mkdirs(tmp_path / "b", "myenv/lib/python3.11/site-packages")     # tar of the directory
    assert ee.layout(wrapped, "python3.11").root == f"{wrapped}/myenv"
    with pytest.raises(ee.EnvError, match="has no lib/python3.11/site-packages"):
        ee.layout(_mkdirs(tmp_path / "c", "lib/python3.11"), "python3.11")
    with pytest.raises(ee.EnvError, match="has no lib/python3.11/site-packages"):
        ee.layout(_mkdirs(tmp_path / "d", "x", "y"), "python3.11")


def test_the_worker_reads_the_variable_the_engine_sets():
    assert env_start.SITE_ENV == ee.SITE_ENV


def test_the_workers_variables_put_the_environment_first():
    env = ee.Environment("/e", "/e/lib/python3.11/site-packages", "/e/lib")
    out = ee.worker_environ({"PYTHONPATH": "/mine:/e/lib/python3.11/site-packages", "HOME": "/h"}, env)
    assert out["PYTHONPATH"] == "/e/lib/python3.11/site-packages:/mine"
    assert out["LD_LIBRARY_PATH"] == "/e/lib"
    assert out[ee.SITE_ENV] == env.site and out["HOME"] == "/h"
    out = ee.worker_environ({"LD_LIBRARY_PATH": "/usr/local/cuda/lib64::"}, env)
    assert out["LD_LIBRARY_PATH"] == "/e/lib:/usr/local/cuda/lib64"


def test_limits_from_the_environment():
    assert ee.Limits.from_environ({}) == ee.Limits(16 << 30, 500_000)
    assert ee.Limits.from_environ({ee.MAX_BYTES_ENV: "1000", ee.MAX_FILES_ENV: " 7 "}) == ee.Limits(1000, 7)
    for bad in ("-1", "0", "1e9", "lots"):
        with pytest.raises(ee.EnvError, match=ee.MAX_BYTES_ENV):
            ee.Limits.from_environ({ee.MAX_BYTES_ENV: bad})


# ---- the member filter ------------------------------------------------------------------------------
def _info(name, type_=tarfile.REGTYPE, size=0, linkname="", mode=0o644):
    m = tarfile.TarInfo(name)
    m.type, m.size, m.linkname, m.mode = type_, size, linkname, mode
    return m


def test_the_filter_refuses_what_would_leave_or_harm_the_destination(tmp_path):
    dest = str(tmp_path)
    keep = ee.MemberFilter(1 << 30, 1000)
    for member, why in [
        (_info("../x"), "outside the destination"),
        (_info("a/../../x"), "outside the destination"),
        (_info(f"{SITE}/evil", tarfile.SYMTYPE, linkname="/etc"), "link to an absolute path"),
        (_info(f"{SITE}/evil", tarfile.SYMTYPE, linkname="../../../../.."), "outside the destination"),
        (_info(f"{SITE}/hard", tarfile.LNKTYPE, linkname="../../../../../etc/passwd"), "outside the destination"),
        (_info("dev/sda", tarfile.BLKTYPE), "'dev/sda' is a special file"),
        (_info("dev/null", tarfile.CHRTYPE), "'dev/null' is a special file"),
        (_info("fifo", tarfile.FIFOTYPE), "'fifo' is a special file"),
    ]:
        with pytest.raises(ee.EnvError, match=why):
            keep(member, dest)
    sparse = _info("s")
    sparse.sparse = [(0, 10)]
    with pytest.raises(ee.EnvError, match="sparse"):
        keep(sparse, dest)


def test_the_filter_leaves_out_links_out_of_bin_and_keeps_the_rest(tmp_path):
    dest = str(tmp_path)
    keep = ee.MemberFilter(1 << 30, 1000)
    assert keep(_info("./bin/python3", tarfile.SYMTYPE, linkname="/usr/bin/python3.11"), dest) is None
    assert keep(_info("myenv/bin/python", tarfile.SYMTYPE, linkname="/usr/bin/python3"), dest) is None
    assert keep.left_out == ["./bin/python3", "myenv/bin/python"]
    # inside: kept (a venv's lib64 -> lib, bin/python -> python3)
    assert keep(_info("lib64", tarfile.SYMTYPE, linkname="lib"), dest) is not None
    assert keep(_info("bin/python", tarfile.SYMTYPE, linkname="python3"), dest) is not None
    # deeper than bin/ itself, or not a symlink: refused
    with pytest.raises(ee.EnvError):
        keep(_info(f"{SITE}/bin/x", tarfile.SYMTYPE, linkname="/usr/bin/x"), dest)
    with pytest.raises(ee.EnvError):
        keep(_info("bin/x", tarfile.LNKTYPE, linkname="/usr/bin/x"), dest)
    # modes (the data filter's): no set-id bits, the owner may write; directories as the umask says
    f = keep(_info("bin/tool", mode=0o4555), dest)
    d = keep(_info("lib", tarfile.DIRTYPE, mode=0o500), dest)
    assert f.mode == 0o755 and d.mode is None


def test_the_filter_bounds_members_and_bytes():
    keep = ee.MemberFilter(10 * ee.BLOCK, 3)
    for i in range(3):
        keep(_info(f"f{i}", size=1), "/d")         # each counts one block
    assert keep.bytes == 3 * ee.BLOCK
    with pytest.raises(ee.EnvError, match=f"more than 3 members .{ee.MAX_FILES_ENV}=3"):
        keep(_info("f3"), "/d")
    keep = ee.MemberFilter(10 * ee.BLOCK, 100)
    keep(_info("big", size=9 * ee.BLOCK), "/d")
    keep(_info("dir", tarfile.DIRTYPE), "/d")
    with pytest.raises(ee.EnvError, match=f"unpacks to more than {10 * ee.BLOCK} bytes"):
        keep(_info("one_byte_more", size=1), "/d")


# ---- prepare: unpacking and the cache ---------------------------------------------------------------
def _tarball(path, files: dict[str, bytes], links: dict[str, str] | None = None, mode="w:gz") -> str:
    with tarfile.open(path, mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return str(path)


def _good(path, version="1", mode="w:gz", prefix="") -> str:
    return _tarball(path, {f"{prefix}{SITE}/envpkg/__init__.py": f"VERSION = {version!r}\n".encode()},
                    {f"{prefix}bin/python3": "/usr/bin/python3"}, mode)


def test_a_tarball_is_unpacked_once_per_content(tmp_path):
    cache = str(tmp_path / "cache")
    a = _good(tmp_path / "a.tar.gz")
    first = ee.prepare(a, "/unused", cache)
    assert first.unpacked and first.root == os.path.join(cache, first.digest)
    with open(os.path.join(first.site, "envpkg", "__init__.py")) as f:
        assert f.read() == "VERSION = '1'\n"
    assert not os.path.lexists(os.path.join(first.root, "bin", "python3"))     # left out
    copy = tmp_path / "m" / "env.tar.gz"
    copy.parent.mkdir()
    copy.write_bytes(open(a, "rb").read())
    again = ee.prepare("$$TRITON_MODEL_DIRECTORY/env.tar.gz", str(copy.parent), cache)
    assert not again.unpacked and again.root == first.root
    other = ee.prepare(_good(tmp_path / "b.tar.gz", "2"), "/unused", cache)
    assert other.unpacked and other.root != first.root
    assert sorted(d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d))) == \
        sorted([first.digest, other.digest])


@pytest.mark.parametrize("mode", ["w", "w:bz2", "w:xz"])
def test_other_tar_formats(tmp_path, mode):
    assert ee.prepare(_good(tmp_path / "e.tar", mode=mode), "/unused", str(tmp_path / "c")).unpacked


def test_a_tarball_of_the_environments_directory(tmp_path):
    env = ee.prepare(_good(tmp_path / "e.tar.gz", prefix="myenv/"), "/unused", str(tmp_path / "c"))
    assert env.root.endswith("/myenv") and os.path.isdir(env.site)


def test_a_directory_is_used_in_place(tmp_path):
    root = _mkdirs(tmp_path / "env", SITE)
    env = ee.prepare("$$TRITON_MODEL_DIRECTORY/env", str(tmp_path), str(tmp_path / "cache"))
    assert env.root == root and not env.unpacked and env.digest == ""
    assert not os.path.exists(tmp_path / "cache")


def test_several_at_once_unpack_once(tmp_path):
    cache, path = str(tmp_path / "cache"), _good(tmp_path / "a.tar.gz")
    results, errors = [], []

    def run():
        try:
            results.append(ee.prepare(path, "/unused", cache))
        except Exception as e:      # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sum(r.unpacked for r in results) == 1 and len({r.root for r in results}) == 1


def test_what_a_killed_unpack_left_is_removed_by_the_next(tmp_path):
    cache, path = tmp_path / "cache", _good(tmp_path / "a.tar.gz")
    digest = ee.sha256_of(open(path, "rb"))
    stale = cache / f"{digest}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "half").write_text("x")
    assert ee.prepare(path, "/unused", str(cache)).unpacked
    assert not stale.exists()


@pytest.mark.parametrize("case,why", [
    ("missing", "does not exist"),
    ("not_tar", "is not a tar archive"),
    ("empty", "is not a tar archive"),
    ("truncated", "could not be unpacked"),
    ("escape", "outside the destination"),
    ("symlink_out", "is a link to an absolute path"),
    ("write_through_link", "outside the destination"),
    ("wrong_python", "is for Python 3.6"),
    ("no_site", f"has no lib/{PY}/site-packages"),
    ("fifo", "neither a file nor a directory"),
])
def test_a_bad_environment_is_refused_and_leaves_nothing(tmp_path, case, why):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    path = str(tmp_path / "env.tar.gz")
    if case == "not_tar":
        open(path, "wb").write(b"PK\x03\x04 a zip, say" * 50)
    elif case == "empty":
        open(path, "wb").close()
    elif case == "truncated":
        big = os.urandom(200_000)           # incompressible, so half the tarball is half the data
        _tarball(path, {f"{SITE}/a.bin": big, f"{SITE}/b.bin": big})
        data = open(path, "rb").read()
        open(path, "wb").write(data[:len(data) // 2])
    elif case == "escape":
        _tarball(path, {f"{SITE}/ok.py": b"", "../../outside/escaped": b"x"})
    elif case == "symlink_out":
        _tarball(path, {}, {f"{SITE}/evil": str(outside)})
    elif case == "write_through_link":
        # a relative link that stays inside is fine; a member written through one that leads
        # out is not (the link itself is refused first)
        _tarball(path, {f"{SITE}/evil/pwned": b"x"}, {f"{SITE}/evil": "../../../../outside"})
    elif case == "wrong_python":
        _tarball(path, {"lib/python3.6/site-packages/envpkg/__init__.py": b""})
    elif case == "no_site":
        _tarball(path, {"README": b"hi"})
    elif case == "fifo":
        os.mkfifo(path)
    with pytest.raises(ee.EnvError, match=why):
        ee.prepare(path, "/unused", str(cache))
    assert os.listdir(outside) == []
    if cache.exists():      # only its lock file: no unpacked or half-unpacked directory
        assert [p for p in os.listdir(cache) if not p.endswith(".lock")] == []


def test_the_unpack_leaves_part_of_the_filesystem_free(tmp_path, monkeypatch):
    real = os.statvfs

    def tight(path):
        # 5 % of the filesystem free and no more: nothing to spare
        return SimpleNamespace(f_frsize=4096, f_blocks=1000, f_bavail=50)
    monkeypatch.setattr(ee.os, "statvfs", tight)
    with pytest.raises(ee.EnvError, match="what the run directory's filesystem can spare"):
        ee.prepare(_good(tmp_path / "a.tar.gz"), "/unused", str(tmp_path / "cache"))
    monkeypatch.setattr(ee.os, "statvfs", real)
    assert ee.prepare(_good(tmp_path / "a.tar.gz"), "/unused", str(tmp_path / "cache")).unpacked


def test_over_the_bounds_is_refused_part_way(tmp_path):
    path = _tarball(tmp_path / "bomb.tar.gz", {f"{SITE}/zeros.bin": bytes(1 << 20)})
    assert os.path.getsize(path) < 10_000       # a small tarball that unpacks large
    with pytest.raises(ee.EnvError, match="unpacks to more than 65536 bytes"):
        ee.prepare(path, "/unused", str(tmp_path / "cache"), ee.Limits(max_bytes=65536))
    files = {f"{SITE}/f{i}": b"" for i in range(50)}
    with pytest.raises(ee.EnvError, match="more than 20 members"):
        ee.prepare(_tarball(tmp_path / "many.tar.gz", files), "/unused", str(tmp_path / "cache"),
                   ee.Limits(max_files=20))
    assert [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".lock")] == []
