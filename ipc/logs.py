"""Logging that never blocks the thread that logs, in Triton's line format (ipc/logformat.py).

A log call only puts the record in a bounded queue; one writer thread per process writes the
queue out to stderr, or appends it to the log file (--log-file) when there is one: every
process opens that file for appending and writes each line with one write(), so the lines of
the launcher, the scheduler, the frontends and the workers interleave whole. What a model
prints to stdout or stderr is left alone (it goes where the server's output goes).

When stderr is a pipe nobody reads, the writer thread blocks and nothing else does: the
frontend's event loop, the scheduler's loop and the launcher's loop keep going. Once the queue
is full, further records are dropped and counted, and when the output moves again the writer
reports "N log line(s) dropped".

The descriptor is left as it is: O_NONBLOCK on the inherited stdout/stderr would change them for
every process that shares them, the workers and the models' own prints included.

Every shmserve process calls ``setup`` once, and ``flush`` before an ``os._exit``. ``apply``
changes the settings (levels, verbose level, format) while the process runs; the logging
extension sends them to every process (SetLogSettings).
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

import msgspec

from shmserve.ipc.logformat import SettingsFilter, TritonFormatter
from shmserve.ipc.messages.common import LogSettings
from shmserve.ipc.spawn_args import ServerSettings

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
                    handler.handle(logging.LogRecord(
                        "shmserve.log", logging.WARNING, __file__, sys._getframe().f_lineno,
                        f"{n} log line(s) dropped: the log output was not being read", None,
                        None))
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


class AppendFileHandler(logging.Handler):
    """Appends each formatted record to a file with one write() (O_APPEND): several processes
    share the file and none of their lines is cut into another's."""

    def __init__(self, path: str):
        super().__init__()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")
            while data:
                data = data[os.write(self.fd, data):]
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()


_writer: _Writer | None = None
_settings: tuple | None = None          # setup's arguments, for a forked child
_current = LogSettings()
_log_file = ""


def from_server(settings: ServerSettings) -> LogSettings:
    """The log settings the command line asked for."""
    return LogSettings(settings.log_info, settings.log_warning, settings.log_error,
                       settings.log_verbose, settings.log_format)


def current() -> LogSettings:
    """The settings this process's log lines obey now."""
    return _current


def log_file() -> str:
    """The file every process appends its log lines to ("": stderr)."""
    return _log_file


def setup(process: str, verbose: int = 0, stream: TextIO | None = None,
          capacity: int = QUEUE_RECORDS, settings: LogSettings | None = None,
          path: str = "") -> DroppingQueueHandler:
    """Route every log record of this process through a bounded queue to a writer thread,
    which writes them to ``stream`` (default stderr), or appends them to the file ``path``.
    ``settings`` (default: all levels on, ``verbose``, the default format) say which records
    are written and how. ``process`` names the process (launcher, scheduler, frontend,
    worker x) in the writer thread's name; each line carries the pid."""
    global _writer, _settings, _log_file
    _settings = (process, verbose, stream, capacity, None, path)
    out: logging.Handler = AppendFileHandler(path) if path else \
        logging.StreamHandler(stream if stream is not None else sys.stderr)
    out.setFormatter(TritonFormatter(current))
    _log_file = path
    records: queue.Queue = queue.Queue(maxsize=capacity)
    stop()
    _writer = _Writer(records, out)
    _writer.thread.name = f"shmserve-log ({process})"
    handler = DroppingQueueHandler(records, _writer)
    handler.addFilter(SettingsFilter(current))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    apply(settings if settings is not None else LogSettings(verbose=verbose), announce=False)
    logging.captureWarnings(True)       # warnings would write to stderr from the caller's thread
    return handler


def apply(settings: LogSettings, announce: bool = True) -> bool:
    """Obey ``settings`` from now on; False when they are the ones already in force. A change
    is announced with a verbose line (so each process that got it says so at level 1)."""
    global _current
    changed = settings != _current
    _current = settings
    # records below INFO are made (and formatted) only while a verbose level asks for them,
    # and only ours: a library's debug lines (hpack logs each header it decodes) are not
    # Triton's verbose log, and would cost every request many lines
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("shmserve").setLevel(logging.DEBUG if settings.verbose > 0
                                           else logging.NOTSET)
    if changed and announce:
        logging.getLogger("shmserve.log").debug("log settings now: %s", describe(settings))
    return changed


def describe(settings: LogSettings) -> str:
    on = {True: "true", False: "false"}
    return (f"log_info={on[settings.info]} log_warning={on[settings.warning]} "
            f"log_error={on[settings.error]} log_verbose_level={settings.verbose} "
            f"log_format={settings.format.value}")


SETTINGS_FILE = "log-settings.json"


def save(settings: LogSettings, run_dir: str) -> None:
    """Leave the settings in the run directory for the launcher, which has no inbox: it
    ``reload``s them before it logs (it logs little, and only at start and stop)."""
    path = os.path.join(run_dir, SETTINGS_FILE)
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(msgspec.json.encode(settings))
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def reload(run_dir: str) -> None:
    try:
        with open(os.path.join(run_dir, SETTINGS_FILE), "rb") as f:
            apply(msgspec.json.decode(f.read(), type=LogSettings), announce=False)
    except (OSError, msgspec.DecodeError):
        pass


def flush(timeout_s: float = 1.0) -> bool:
    """Wait up to ``timeout_s`` for the queued records to be written; False if they were not
    (the output is blocked). Call before ``os._exit``, which skips the atexit hook."""
    writer = _writer
    if writer is None:
        return True
    records = writer.records
    with records.all_tasks_done:
        return records.all_tasks_done.wait_for(lambda: records.unfinished_tasks == 0, timeout_s)


def written_before_answer(logger: logging.Logger, message: str, *args) -> None:
    """Log a verbose line about a request and wait (briefly) until it is written, before the
    answer leaves: a client that reads the answer and kills the server at once still finds
    the line, as with Triton's log, which writes in the caller's thread. For the error path
    of verbose logging only: the wait is a thread hand-off."""
    logger.debug(message, *args)
    flush(0.05)


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
    if not writer.thread.is_alive() and isinstance(writer.handler, AppendFileHandler):
        writer.handler.close()


def _after_fork_in_child() -> None:
    """A process forked by a model (multiprocessing) has the queue but not the writer thread:
    give it a writer of its own, or its log lines would wait in the queue for ever."""
    global _writer
    if _writer is not None and _settings is not None:
        _writer = None
        process, verbose, stream, capacity, _, path = _settings
        setup(process, verbose, stream, capacity, _current, path)


atexit.register(flush)
os.register_at_fork(after_in_child=_after_fork_in_child)
