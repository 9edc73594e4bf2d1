"""Logging that never blocks the thread that logs.

A log call only puts the record in a bounded queue; one writer thread per process writes the
queue out to stderr. When stderr is a pipe nobody reads, that thread blocks and nothing else
does: the frontend's event loop, the scheduler's loop and the launcher's loop keep going. Once
the queue is full, further records are dropped and counted, and when the output moves again
the writer reports "N log line(s) dropped".

The descriptor is left as it is: O_NONBLOCK on the inherited stdout/stderr would change them for
every process that shares them, the workers and the models' own prints included.

Every shmserve process calls ``setup`` once, and ``flush`` before an ``os._exit``.
"""
from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import queue
import sys
import threading
from typing import TextIO

# Records held while the output is blocked; past it, records are dropped and counted.
QUEUE_RECORDS = 1000


class _Writer:
    """The thread that writes the queued records, and the count of those dropped."""

    def __init__(self, records: queue.Queue, handler: logging.Handler):
        self.records = records
        self.handler = handler
        self.dropped = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="shmserve-log", daemon=True)
        self.thread.start()

    def drop(self) -> None:
        with self.lock:
            self.dropped += 1

    def run(self) -> None:
        records, handler = self.records, self.handler
        while True:
            record = records.get()
            try:
                if record is None:
                    return
                handler.handle(record)          # may block: only this thread waits
                # reported where the gap is: after the records that were held
                if self.dropped and records.empty():
                    with self.lock:
                        n, self.dropped = self.dropped, 0
                    handler.handle(logging.makeLogRecord({
                        "name": "shmserve.log", "levelno": logging.WARNING,
                        "levelname": "WARNING",
                        "msg": f"{n} log line(s) dropped: the log output was not being read"}))
            finally:
                records.task_done()


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Puts a record in the queue if there is room; counts it as dropped otherwise."""

    def __init__(self, records: queue.Queue, writer: _Writer):
        super().__init__(records)
        self.writer = writer

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.writer.drop()


_writer: _Writer | None = None
_settings: tuple | None = None          # setup's arguments, for a forked child


def setup(process: str, verbose: int = 0, stream: TextIO | None = None,
          capacity: int = QUEUE_RECORDS) -> DroppingQueueHandler:
    """Route every log record of this process through a bounded queue to a writer thread.
    ``process`` names the process in each line (launcher, scheduler, frontend, worker x)."""
    global _writer, _settings
    _settings = (process, verbose, stream, capacity)
    out = logging.StreamHandler(stream if stream is not None else sys.stderr)
    out.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(message)s"))
    records: queue.Queue = queue.Queue(maxsize=capacity)
    stop()
    _writer = _Writer(records, out)
    handler = DroppingQueueHandler(records, _writer)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(True)       # warnings would write to stderr from the caller's thread
    return handler


def flush(timeout_s: float = 1.0) -> bool:
    """Wait up to ``timeout_s`` for the queued records to be written; False if they were not
    (the output is blocked). Call before ``os._exit``, which skips the atexit hook."""
    writer = _writer
    if writer is None:
        return True
    records = writer.records
    with records.all_tasks_done:
        return records.all_tasks_done.wait_for(lambda: records.unfinished_tasks == 0, timeout_s)


def stop() -> None:
    """Write what is queued (for a moment at most) and end the writer thread."""
    global _writer
    writer, _writer = _writer, None
    if writer is None:
        return
    try:
        writer.records.put(None, timeout=1.0)
    except queue.Full:
        return
    writer.thread.join(timeout=1.0)


def _after_fork_in_child() -> None:
    """A process forked by a model (multiprocessing) has the queue but not the writer thread:
    give it a writer of its own, or its log lines would wait in the queue for ever."""
    global _writer
    if _writer is not None and _settings is not None:
        _writer = None
        setup(*_settings)


atexit.register(flush)
os.register_at_fork(after_in_child=_after_fork_in_child)
