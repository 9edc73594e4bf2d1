"""ipc/logs.py: a log call never waits for the output, even when the output is a full pipe."""
import logging
import os
import re
import threading
import time

import oshelpers
import pytest

from shmserve.ipc import logs


@pytest.fixture(autouse=True)
def _root_logger_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    logs.stop()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture
def full_pipe():
    r, w = oshelpers.full_pipe()
    stream = os.fdopen(w, "w", buffering=1)
    yield r, stream
    logs.stop()
    stream.close()
    os.close(r)


def test_logging_to_a_full_pipe_returns_then_reports_what_it_dropped(full_pipe):
    r, stream = full_pipe
    logs.setup("tester", stream=stream, capacity=10)
    log = logging.getLogger("shmserve.test")
    done = threading.Event()

    def many():
        for i in range(100):
            log.info("line %d", i)
        done.set()
    # in a thread, so that a bug that blocks fails the test instead of hanging it
    threading.Thread(target=many, daemon=True).start()
    assert done.wait(10), "a log call blocked on the full pipe"
    assert not logs.flush(0.1)                  # the output is blocked: nothing written yet

    out = bytearray()

    def drain():
        try:
            while chunk := os.read(r, 65536):
                out.extend(chunk)
        except OSError:
            pass
    threading.Thread(target=drain, daemon=True).start()
    assert logs.flush(10)
    deadline = time.monotonic() + 10
    while b"dropped" not in out and time.monotonic() < deadline:
        time.sleep(0.01)                        # the reader thread catching up
    text = out.replace(b"x", b"").decode()
    assert re.search(r'^I\d{4} [\d:.]+ \d+ test_logs\.py:\d+\] "line 0"$', text, re.M), text
    # the queue held ten (the blocked writer perhaps one more); the rest were dropped, counted
    # and reported after the held ones
    found = re.search(r'^W.* logs\.py:\d+\] "(\d+) log line\(s\) dropped: the log output was not '
                      r'being read"$', text, re.M)
    assert found and int(found[1]) in (89, 90), text
    assert text.index('line 9"\n') < found.start()
    assert "line 99" not in text


def test_records_keep_their_arguments_and_tracebacks(tmp_path):
    path = tmp_path / "log.txt"
    with open(path, "w") as f:
        logs.setup("tester", verbose=1, stream=f)
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("x").exception("failed with %s", "style")
        logging.getLogger("shmserve.x").debug("debug shows with verbose")
        logging.getLogger("hpack").debug("a library's debug line does not")
        assert logs.flush(5)
        logs.stop()
    text = path.read_text()
    # the traceback is part of the message, escaped with it: one line per record
    assert re.search(r'^E.*\] "failed with style\\nTraceback .*ValueError: boom"$', text, re.M), text
    assert re.search(r'^I.*\] "debug shows with verbose"$', text, re.M), text
    assert "a library's debug line" not in text


def test_a_forked_child_gets_a_writer_of_its_own(tmp_path):
    """A model's multiprocessing (fork) child logs through the same setup: its lines come out."""
    path = tmp_path / "log.txt"
    with open(path, "w") as f:
        logs.setup("tester", stream=f)
        pid = os.fork()
        if pid == 0:
            logging.getLogger("x").info("from the child")
            os._exit(0 if logs.flush(5) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        logs.stop()
    assert '] "from the child"' in path.read_text()
