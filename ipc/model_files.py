"""Reading the files of a model repository without trusting them to be plain files.

A repository is a directory tree someone else wrote: a ``config.pbtxt``, a label file or a
warm-up data file may be a FIFO (``open`` blocks until a writer comes, which would stall the
scheduler's loop or a worker's load for ever), a character device (``/dev/zero`` never ends),
a directory, a symlink loop, or a sparse file of many gigabytes. Every read here checks, before
opening, that the path is a regular file (``stat``, which follows symlinks as ``open`` would, so
a model file may still be a symlink into a model store), opens it with ``O_NONBLOCK`` so that a
FIFO swapped in after the check cannot block either, checks the opened file again, and reads at
most ``limit`` bytes. Every refusal is an ``OSError`` (``ModelFileError`` or the system's own,
e.g. ELOOP for a symlink loop) whose text says what is wrong; callers name the file.
"""
from __future__ import annotations

import os
import stat

# What the scheduler reads of a model before it loads it; Triton sets no bound, but the
# scheduler parses a config on its one loop (text protobuf parses at about 3 MiB/s in Python)
CONFIG_MAX_BYTES = 1 << 20
# model.py as the scheduler scans it for ``def auto_complete_config``
SOURCE_MAX_BYTES = 16 << 20
# label files and warm-up / initial-state data files, as workers read them
DATA_MAX_BYTES = 256 << 20


class ModelFileError(OSError):
    """A repository file that is not a readable regular file, or is too large."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str) -> os.stat_result:
    """``path``'s status if it is a regular file (after symlinks); raises FileNotFoundError
    when nothing is there, the system's OSError when it cannot be looked at (ELOOP for a
    symlink loop, EACCES), ModelFileError for anything else that is not a regular file."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"it is {_kind(st.st_mode)}, not a regular file")
    return st


def is_regular(path: str) -> bool:
    try:
        check_regular(path)
    except OSError:
        return False
    return True


def read_bytes(path: str, limit: int) -> bytes:
    """The whole of the regular file ``path``, if it holds at most ``limit`` bytes."""
    st = check_regular(path)
    if st.st_size > limit:
        raise ModelFileError(f"it holds {st.st_size} bytes, more than the limit of {limit}")
    data = _read(path, limit + 1)        # it may have grown since: still bounded
    if len(data) > limit:
        raise ModelFileError(f"it holds more than the limit of {limit} bytes")
    return data


def read_prefix(path: str, nbytes: int) -> bytes:
    """At most the first ``nbytes`` of the regular file ``path`` (a data file of which only
    that much is used, however large it is)."""
    check_regular(path)
    return _read(path, nbytes)


def _read(path: str, most: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):          # replaced between the check and the open
            raise ModelFileError(f"it is {_kind(mode)}, not a regular file")
        chunks, total = [], 0
        while total < most:
            chunk = os.read(fd, min(1 << 20, most - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class LabelFileError(Exception):
    """A label file that cannot be used; the model fails to load with this text."""


def read_labels(config: dict, model_dir: str) -> dict[str, list[bytes]]:
    """Each output's labels (one per line, the line number is the class index), for the outputs
    with a ``label_filename``. The file must lie inside the model directory."""
    labels: dict[str, list[bytes]] = {}
    root = os.path.normpath(os.path.abspath(model_dir))
    for out in config.get("output", []):
        filename, name = out.get("label_filename", ""), out.get("name", "")
        if not filename:
            continue
        path = os.path.normpath(os.path.join(root, filename))
        if os.path.isabs(filename) or os.path.commonpath([root, path]) != root:
            raise LabelFileError(f"label file path '{path}' for output '{name}' in model "
                                 f"'{config.get('name', '')}' is outside the model directory")
        try:
            data = read_bytes(path, DATA_MAX_BYTES)
        except OSError as e:
            raise LabelFileError(f"unable to read the label file '{path}' for output '{name}': "
                                 f"{e.strerror or e}") from None
        lines = data.split(b"\n")
        if lines[-1] == b"":        # the newline that ends the last line starts no label
            lines.pop()
        labels[name] = lines
    return labels
