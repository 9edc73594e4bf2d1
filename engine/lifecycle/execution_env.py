"""The execution environment (config parameter ``EXECUTION_ENV_PATH``) of a python model or a
python-based backend's model, Triton's way.

The parameter names a conda-pack or venv tarball, or a directory that holds one unpacked;
``$$TRITON_MODEL_DIRECTORY`` in it stands for the model's directory. The model's worker runs on
the server's own interpreter with the environment's ``lib/pythonX.Y/site-packages`` first on
its import path (PYTHONPATH) and its ``lib/`` first on LD_LIBRARY_PATH, so the model imports the
environment's packages and the worker's own dependencies still import.

A tarball is unpacked once per content: into ``<run dir>/execution-envs/<sha256>/``, shared by
every model whose tarball has those bytes, kept until the server stops (the launcher removes
the run directory). Unpacking runs in the worker's own process before it execs the worker
(engine/processes/env_worker.py, then workers/env_start.py), never in the scheduler's loop;
processes that unpack the same tarball at once take turns on a lock file, and the later ones
find the first one's result.

The archive is untrusted: tarfile's ``data`` filter keeps every member inside the destination (a
leading / is dropped, a ``..`` that leads out is refused) and refuses links that lead out and
device files; sparse members are refused; the member count and the bytes written
are bounded (``Limits``). A symlink in the environment's ``bin/`` that leads out (a venv's
``bin/python3`` points at the Python it was made with) is left out rather than refused: the
environment's executables are never run.

Everything but ``prepare`` (which reads and writes files) is pure; ``EnvError`` carries the
reason a load fails with.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from typing import IO, Mapping

from shmserve.ipc.backend_catalog import spec_runs_python

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIR_KEYWORD = "$$TRITON_MODEL_DIRECTORY"
CACHE_DIR = "execution-envs"        # under the server's run directory
# set for the worker: the environment's site-packages, whose .pth files workers/env_start.py reads
SITE_ENV = "SHMSERVE_EXECUTION_ENV_SITE"

# The bounds on one unpack (environment variables of the server override them): a conda-pack
# environment with PyTorch and CUDA unpacks to about 5 to 10 GB and 50,000 to 100,000 files.
MAX_BYTES_ENV = "SHMSERVE_EXECUTION_ENV_MAX_BYTES"
MAX_FILES_ENV = "SHMSERVE_EXECUTION_ENV_MAX_FILES"
DEFAULT_MAX_BYTES = 16 << 30
DEFAULT_MAX_FILES = 500_000
BLOCK = 4096                # what a member costs on disk at least (an inode's block)
KEEP_FREE_FRACTION = 20     # an unpack leaves 1/20 (5 %) of the run directory's filesystem free


class EnvError(Exception):
    """Why the model's execution environment cannot be used (the load fails with it)."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES

    @staticmethod
    def from_environ(environ: Mapping[str, str]) -> Limits:
        def read(name: str, default: int) -> int:
            text = environ.get(name, "").strip()
            if not text:
                return default
            try:
                value = int(text)
            except ValueError:
                value = 0
            if value <= 0:
                raise EnvError(f"{name} must be a positive whole number, not {text!r}")
            return value
        return Limits(read(MAX_BYTES_ENV, DEFAULT_MAX_BYTES), read(MAX_FILES_ENV, DEFAULT_MAX_FILES))


@dataclass(frozen=True)
class Environment:
    root: str           # its top directory
    site: str           # root/lib/pythonX.Y/site-packages
    lib: str            # root/lib
    digest: str = ""    # sha256 of the tarball ("" for a directory)
    unpacked: bool = False      # unpacked by this call (not cached, not a directory)


# ---- the pure part ------------------------------------------------------------------------------------
def requested(backend: str, config_json: str, backend_source: str = "") -> str:
    """The config's EXECUTION_ENV_PATH, as written ("" when none), for a python model or a
    model of a python-based backend (``backend_source``, InstanceSpec's, is then the backend's
    model.py, an absolute path; a plug-in's is "module:attr"); other backends have none."""
    if not spec_runs_python(backend, backend_source):
        return ""
    try:
        params = json.loads(config_json).get("parameters") or {}
    except (ValueError, AttributeError):
        return ""
    p = params.get(PARAMETER) if isinstance(params, dict) else None
    if isinstance(p, dict):
        p = p.get("string_value", "")
    return "" if p is None else str(p).strip()


def expand(value: str, model_dir: str) -> str:
    """The absolute path ``value`` names: ``$$TRITON_MODEL_DIRECTORY`` is the model's directory,
    and a path made with it must stay inside it; any other relative path is relative to the
    server's working directory (as in Triton)."""
    if MODEL_DIR_KEYWORD not in value:
        return os.path.abspath(value)
    base = os.path.normpath(os.path.abspath(model_dir))
    path = os.path.normpath(value.replace(MODEL_DIR_KEYWORD, base))
    if os.path.commonpath([base, path]) != base:
        raise EnvError(f"the path leads out of the model directory '{base}' (to '{path}')")
    return path


def python_dir(version: tuple[int, int] | None = None, free_threaded: bool | None = None) -> str:
    """``pythonX.Y`` (``pythonX.Yt`` on a free-threaded build): the name under lib/ that
    packages for this interpreter are installed under."""
    major, minor = version or sys.version_info[:2]
    if free_threaded is None:
        free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    return f"python{major}.{minor}{'t' if free_threaded else ''}"


_PYTHON_DIR = re.compile(r"python\d+\.\d+t?")


def layout(root: str, expected: str | None = None) -> Environment:
    """The environment whose top is ``root`` (or its only subdirectory, for a tarball made of
    the environment's directory rather than of its contents). Its site-packages must be under
    lib/<``expected`` (``python_dir()``)>."""
    expected = expected or python_dir()
    if not os.path.isdir(os.path.join(root, "lib")):
        entries = os.listdir(root)
        if len(entries) == 1 and os.path.isdir(os.path.join(root, entries[0], "lib")):
            root = os.path.join(root, entries[0])
    lib = os.path.join(root, "lib")
    site = os.path.join(lib, expected, "site-packages")
    if os.path.isdir(site):
        return Environment(root, site, lib)
    try:
        found = sorted(d for d in os.listdir(lib) if _PYTHON_DIR.fullmatch(d)
                       and os.path.isdir(os.path.join(lib, d, "site-packages")))
    except OSError:
        found = []
    if found:
        versions = ", ".join(f"Python {d[len('python'):]}" for d in found)
        raise EnvError(f"the execution environment is for {versions} (lib/{found[0]}/site-packages), "
                       f"but the server runs Python {expected[len('python'):]}: it must be the same "
                       f"Python version")
    raise EnvError(f"the execution environment has no lib/{expected}/site-packages")


def worker_environ(environ: Mapping[str, str], env: Environment) -> dict[str, str]:
    """The worker's environment variables: the environment's site-packages first on PYTHONPATH,
    its lib/ first on LD_LIBRARY_PATH, and SITE_ENV naming the site-packages (workers/env_start.py
    reads its .pth files)."""
    out = dict(environ)
    for name, first in (("PYTHONPATH", env.site), ("LD_LIBRARY_PATH", env.lib)):
        rest = [p for p in out.get(name, "").split(os.pathsep) if p and p != first]
        out[name] = os.pathsep.join([first, *rest])
    out[SITE_ENV] = env.site
    return out


def _bin_link(name: str) -> bool:
    """Whether ``name`` is right inside the environment's bin/ (or <top>/bin/)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return len(parts) in (2, 3) and parts[-2] == "bin"


class MemberFilter:
    """tarfile's ``data`` filter, plus the bounds: extractall calls it for each member in turn
    and it raises EnvError at the first member that is unsafe or over a bound."""

    def __init__(self, max_bytes: int, max_files: int, bytes_why: str = ""):
        self.max_bytes, self.max_files = max_bytes, max_files
        self.bytes_why = bytes_why or f"{MAX_BYTES_ENV}={max_bytes}"
        self.files = 0
        self.bytes = 0
        self.left_out: list[str] = []

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        self.files += 1
        if self.files > self.max_files:
            raise EnvError(f"the archive has more than {self.max_files} members "
                           f"({MAX_FILES_ENV}={self.max_files})")
        if member.issparse():
            raise EnvError(f"the archive member '{member.name}' is a sparse file")
        try:
            safe = tarfile.data_filter(member, dest)
        except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError) as e:
            if member.issym() and _bin_link(member.name):
                self.left_out.append(member.name)
                return None
            raise EnvError(f"unsafe archive member: {e}") from e
        except tarfile.FilterError as e:
            raise EnvError(f"unsafe archive member: {e}") from e
        size = -(-safe.size // BLOCK) * BLOCK if safe.isreg() else 0
        self.bytes += max(size, BLOCK)
        if self.bytes > self.max_bytes:
            raise EnvError(f"the archive unpacks to more than {self.max_bytes} bytes "
                           f"({self.bytes_why}; every member counts at least {BLOCK})")
        return safe     # the data filter's modes: the owner may read, write and remove all


def sha256_of(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


# ---- unpacking --------------------------------------------------------------------------------------
def prepare(value: str, model_dir: str, cache_dir: str, limits: Limits = Limits()) -> Environment:
    """The environment EXECUTION_ENV_PATH ``value`` names, unpacked into ``cache_dir`` if it is
    a tarball (once per content), checked. Raises EnvError with the reason."""
    path = expand(value, model_dir)
    if os.path.isdir(path):
        return layout(os.path.realpath(path))
    try:        # not blocking on a FIFO: only a regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise EnvError(f"the execution environment '{path}' does not exist") from None
    except OSError as e:
        raise EnvError(f"cannot read the execution environment '{path}': {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EnvError(f"the execution environment '{path}' is neither a file nor a directory")
        digest = sha256_of(f)
        target = os.path.join(cache_dir, digest)
        if os.path.isdir(target):       # complete: a finished unpack is renamed into place
            return _checked(target, digest, False)
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        with open(os.path.join(cache_dir, digest + ".lock"), "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # another process may be unpacking it
            if os.path.isdir(target):
                return _checked(target, digest, False)
            for name in os.listdir(cache_dir):      # what a killed unpack of it left
                if name.startswith(digest + ".tmp-"):
                    shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
            f.seek(0)
            tmp = tempfile.mkdtemp(prefix=digest + ".tmp-", dir=cache_dir)
            try:
                _unpack(f, path, tmp, limits, cache_dir)
                layout(tmp)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return _checked(target, digest, True)


def _checked(target: str, digest: str, unpacked: bool) -> Environment:
    env = layout(target)
    return Environment(env.root, env.site, env.lib, digest, unpacked)


def _unpack(f: IO[bytes], path: str, dest: str, limits: Limits, cache_dir: str) -> None:
    if not hasattr(tarfile, "data_filter"):
        raise EnvError("this Python's tarfile has no extraction filters (3.10.12, 3.11.4 or "
                       "later has them): an execution environment cannot be unpacked safely")
    fs = os.statvfs(cache_dir)
    spare = fs.f_bavail * fs.f_frsize - fs.f_blocks * fs.f_frsize // KEEP_FREE_FRACTION
    max_bytes, why = limits.max_bytes, f"{MAX_BYTES_ENV}={limits.max_bytes}"
    if spare < max_bytes:
        max_bytes, why = max(spare, 0), (f"what the run directory's filesystem can spare while "
                                         f"keeping 1/{KEEP_FREE_FRACTION} of it free")
    keep = MemberFilter(max_bytes, limits.max_files, why)
    try:
        with tarfile.open(fileobj=f, mode="r:*") as tar:
            tar.errorlevel = 2          # every extraction error is an error
            tar.extractall(dest, filter=keep)
    except EnvError:
        raise
    except (tarfile.TarError, EOFError, ValueError, OSError) as e:
        if isinstance(e, tarfile.ReadError) and keep.files == 0:
            raise EnvError(f"the execution environment '{path}' is not a tar archive (plain, gzip, "
                           f"bzip2 or xz) nor a directory") from None
        raise EnvError(f"the execution environment '{path}' could not be unpacked: "
                       f"{getattr(e, 'strerror', None) or e}") from None
    except Exception as e:      # zlib.error, lzma.LZMAError: a corrupt stream
        raise EnvError(f"the execution environment '{path}' could not be unpacked: "
                       f"{type(e).__name__}: {e}") from None


def describe(env: Environment, seconds: float) -> str:
    how = "unpacked" if env.unpacked else ("already unpacked" if env.digest else "a directory")
    return f"execution environment {env.root} ({how}, sha256 {env.digest[:12] or '-'}, " \
           f"ready in {seconds:.2f} s)"
