"""Model upload: the ``file:<path>`` parameters of a load request, checked and written to disk.

Triton's load API may carry a model's files instead of naming a model of the repository
(docs/triton-compat.md §1.12): each ``file:<relative path>`` parameter is one file of the model
directory (base64 text over HTTP, raw ``bytes_param`` over gRPC), and the ``config`` parameter,
required with them, is its configuration.

The frontend holds the bytes, so it writes them, into a fresh directory (mode 0700) under the
server's upload directory (``ServerSettings.model_upload_dir``: inside the run directory, which
the launcher removes at exit and after a crash), and sends the scheduler only that directory's
path. Tensors and files never travel through the scheduler's socket. From the moment the
``ControlRequest`` is sent the scheduler owns the directory (engine/lifecycle/uploads.py) and removes it
once nothing loads, serves or drains from it. Nothing is written into a model repository.

Every refusal names the parameter and starts with Triton's "failed to load '<m>', failed to poll
from model repository", which clients look for. A path these rules refuse (one nested deeper
than MAX_DEPTH among them), bad base64 and an upload past ``--model-upload-max-bytes`` are
400s; a path the file system refuses (a component longer than NAME_MAX) is a 500, as Triton
answers it; a full disk is 507.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from base64 import b64decode
from typing import Any

from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode

FILE_PREFIX = "file:"
# how deep a file may sit in an uploaded model directory: model directories are a few levels
# deep; a path of thousands of components is only an attack on the code that walks it
MAX_DEPTH = 32
DIR_MODE = 0o700
FILE_MODE = 0o600

# (parameter name, path components, value as received)
UploadFile = tuple[str, tuple[str, ...], Any]


def shown(key: str) -> str:
    """A parameter name as a message shows it: control characters escaped, so a NUL or a
    newline in a name cannot cut or forge a line of the answer or of the log."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in key)


def _has_control(text: str) -> bool:
    return any(c < " " or c == "\x7f" for c in text)


def refused(model: str, key: str, why: str, code: ErrorCode = ErrorCode.INVALID_ARG) -> InferError:
    return InferError(code, f"failed to load '{model}', failed to poll from model repository: "
                            f"load parameter '{shown(key)}' {why}")


def file_path(model: str, key: str) -> tuple[str, ...]:
    """The components of the path a ``file:`` parameter names inside the model directory, or a
    400 saying why it names none: only plain paths ('1/model.onnx', 'labels.txt'). One leading
    '/' is the model directory itself, as Triton joins the path to it ('file:/1/model.py' is
    '1/model.py'); nothing can name a place outside it."""
    path = key[len(FILE_PREFIX):]
    if path.startswith("/"):
        path = path[1:]
    if not path:
        raise refused(model, key, "names no file: use 'file:<path in the model directory>', "
                                  "e.g. 'file:1/model.onnx'")
    if "\0" in path:
        raise refused(model, key, "contains a NUL byte")
    if _has_control(path):
        raise refused(model, key, "contains a control character")
    if "\\" in path:
        raise refused(model, key, "contains a backslash: separate directories with '/'")
    parts = tuple(path.split("/"))
    if len(parts) > MAX_DEPTH:
        raise refused(model, key, f"has {len(parts)} path components, more than the "
                                  f"{MAX_DEPTH} an uploaded model directory may nest")
    if "" in parts:
        raise refused(model, key, "has an empty path component ('//' or a '/' at its end)")
    if "." in parts or ".." in parts:
        raise refused(model, key, "has a '.' or '..' component: name a path inside the model "
                                  "directory")
    return parts


def check_layout(model: str, paths: dict[str, tuple[str, ...]]) -> None:
    """No file may be named where another one needs a directory ('file:1' with 'file:1/x')."""
    dirs: dict[tuple[str, ...], str] = {}
    for key, parts in paths.items():
        for i in range(1, len(parts)):
            dirs.setdefault(parts[:i], key)
    for key, parts in sorted(paths.items()):
        if parts in dirs:
            raise refused(model, key, f"names a file where '{shown(dirs[parts])}' needs a "
                                      f"directory")


def content_size(model: str, key: str, value: Any, base64_text: bool) -> int:
    """The file's size in bytes, before any decoding (base64's is exact for valid text)."""
    if base64_text:
        if not isinstance(value, str):
            raise refused(model, key, f"must be the file's content as a base64 string, got "
                                      f"{type(value).__name__}")
        return len(value) // 4 * 3 - value[-2:].count("=")
    if not isinstance(value, bytes):
        raise refused(model, key, f"must be a bytes_param holding the file's content, got "
                                  f"{type(value).__name__}")
    return len(value)


def decode(model: str, key: str, value: str) -> bytes:
    if len(value) % 4:
        raise refused(model, key, "is not valid base64: its length is not a multiple of 4")
    try:
        # validate: whitespace or a stray character is an error, not skipped
        return b64decode(value, validate=True)
    except ValueError as e:         # binascii.Error, or a character outside ASCII
        raise refused(model, key, f"is not valid base64: {e}") from None


class ModelUploads:
    """Where one frontend writes uploaded models, and how much one load may carry."""

    def __init__(self, root: str, max_bytes: int):
        self.root = root
        self.max_bytes = max_bytes

    @property
    def base64_bytes(self) -> int:
        """How long the upload limit's worth of files is as base64 (an HTTP body carries that)."""
        return (self.max_bytes + 2) // 3 * 4

    def check(self, model: str, params: dict[str, Any], base64_text: bool) -> list[UploadFile]:
        """Everything about a load's files that can be refused before a byte is written."""
        files = sorted((k, v) for k, v in params.items() if k.startswith(FILE_PREFIX))
        if not files:
            return []
        if self.max_bytes <= 0:
            raise InferError(ErrorCode.UNSUPPORTED, f"failed to load '{model}': model upload is "
                             f"disabled on this server (--model-upload-max-bytes 0), so load "
                             f"parameter '{shown(files[0][0])}' cannot be used")
        if not model.strip() or "/" in model or ".." in model or _has_control(model):
            # it names a new model: Triton's rules for a model name (no path in it)
            raise InferError(ErrorCode.INVALID_ARG, f"invalid model name '{shown(model)}': an "
                             f"uploaded model's name must not be blank nor contain '/', '..' "
                             f"or control characters")
        config = params.get("config")
        if not isinstance(config, str) or not config.strip():
            # Triton's rule: the files replace the model directory, config.pbtxt included
            raise refused(model, "config", f"must be given with '{shown(files[0][0])}': "
                                           f"uploaded files form a new model directory, and "
                                           f"'config' is its configuration (JSON)")
        paths = {key: file_path(model, key) for key, _ in files}
        check_layout(model, paths)
        total = 0
        for key, value in files:
            total += content_size(model, key, value, base64_text)
            if total > self.max_bytes:
                raise refused(model, key, f"takes the upload past --model-upload-max-bytes "
                                          f"({self.max_bytes} bytes of files per load)")
        return [(key, paths[key], value) for key, value in files]

    def write(self, model: str, files: list[UploadFile], base64_text: bool) -> str:
        """Write checked files into a new directory of their own and return its path; on any
        failure nothing is left behind. Blocking: run it off the event loop."""
        self._make_root()
        top = os.path.realpath(tempfile.mkdtemp(prefix="model-", dir=self.root))   # mode 0700
        try:
            total = 0
            for key, parts, value in files:
                data = decode(model, key, value) if base64_text else value
                total += len(data)
                if total > self.max_bytes:      # the estimate was exact for valid base64
                    raise refused(model, key, f"takes the upload past --model-upload-max-bytes "
                                              f"({self.max_bytes} bytes of files per load)")
                _write_file(model, key, top, parts, data)
            return top
        except BaseException:
            shutil.rmtree(top, ignore_errors=True)
            raise

    def discard(self, path: str) -> None:
        """Remove an upload that never reached the scheduler."""
        if os.path.dirname(os.path.realpath(path)) == os.path.realpath(self.root):
            shutil.rmtree(path, ignore_errors=True)

    def _make_root(self) -> None:
        os.makedirs(self.root, mode=DIR_MODE, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise InferError(ErrorCode.INTERNAL, "the server's model upload directory is not a "
                                                 "directory of its own")


def _write_file(model: str, key: str, top: str, parts: tuple[str, ...], data: bytes) -> None:
    try:
        parent = os.path.join(top, *parts[:-1])
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        # the rules above keep every path inside; this makes sure nothing on disk bends it
        real = os.path.realpath(parent)
        if real != top and not real.startswith(top + os.sep):
            raise refused(model, key, "leaves the model directory")
        # O_EXCL and O_NOFOLLOW: a new regular file, never through a link or over a file
        fd = os.open(os.path.join(parent, parts[-1]),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE)
        with open(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            code = ErrorCode.RESOURCE_EXHAUSTED
        elif e.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP):
            code = ErrorCode.INVALID_ARG
        else:       # ENAMETOOLONG among them: Triton answers a name past NAME_MAX with a 500
            code = ErrorCode.INTERNAL
        raise refused(model, key, f"could not be written: {e.strerror}", code) from None
