"""ipc/model_files.py: reading a repository's files without trusting them to be plain files.
Real FIFOs, directories, symlink loops, devices and sparse files; none of them may block or
read without bound."""
import os

import pytest

from shmserve.ipc import model_files
from shmserve.ipc.model_files import ModelFileError


def _make(tmp_path, kind: str) -> str:
    path = str(tmp_path / "f")
    if kind == "fifo":
        os.mkfifo(path)             # opened for reading, it would wait for a writer for ever
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "loop":
        os.symlink("f", path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    elif kind == "socket":
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()
    return path


@pytest.mark.parametrize("kind, words", [
    ("fifo", "it is a FIFO (named pipe), not a regular file"),
    ("directory", "it is a directory, not a regular file"),
    ("device", "it is a character device, not a regular file"),
    ("socket", "it is a socket, not a regular file"),
])
def test_what_is_not_a_regular_file_is_refused_unopened(tmp_path, kind, words):
    path = _make(tmp_path, kind)
    for read in (lambda: model_files.read_bytes(path, 100),
                 lambda: model_files.read_prefix(path, 100),
                 lambda: model_files.check_regular(path)):
        with pytest.raises(ModelFileError) as e:
            read()
        assert str(e.value) == words
    assert not model_files.is_regular(path)


def test_a_symlink_loop_is_the_systems_error(tmp_path):
    path = _make(tmp_path, "loop")
    with pytest.raises(OSError) as e:
        model_files.read_bytes(path, 100)
    assert e.value.strerror == "Too many levels of symbolic links"


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        model_files.read_bytes(str(tmp_path / "none"), 100)


def test_a_sparse_file_larger_than_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(10 << 30)        # 10 GB, no block written
    with pytest.raises(ModelFileError) as e:
        model_files.read_bytes(str(path), model_files.CONFIG_MAX_BYTES)
    assert str(e.value) == "it holds 10737418240 bytes, more than the limit of 1048576"
    # a data file of which only the first bytes are used: those are read, nothing more
    assert model_files.read_prefix(str(path), 16) == bytes(16)


def test_a_regular_file_and_a_symlink_to_one_are_read(tmp_path):
    path = tmp_path / "real"
    path.write_bytes(b"abc")
    (tmp_path / "link").symlink_to("real")
    assert model_files.read_bytes(str(path), 3) == b"abc"
    assert model_files.read_bytes(str(tmp_path / "link"), 3) == b"abc"
    assert model_files.read_prefix(str(path), 2) == b"ab"
    with pytest.raises(ModelFileError):
        model_files.read_bytes(str(path), 2)
