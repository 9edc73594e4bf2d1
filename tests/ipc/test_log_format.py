"""ipc/logformat.py and the settings side of ipc/logs.py: Triton's two line formats, which
levels pass, message escaping, changing the settings while the process runs, and the log file
shared by several processes."""
import calendar
import logging
import os
import re

import pytest

from shmserve.ipc import logformat, logs
from shmserve.ipc.messages.common import LogFormat, LogSettings

# 2024-05-20 20:03:25.829575 UTC
CREATED = calendar.timegm((2024, 5, 20, 20, 3, 25)) + 0.829575


@pytest.fixture(autouse=True)
def _root_logger_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    logs.stop()
    logs.apply(LogSettings(), announce=False)
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def _record(level=logging.INFO, msg="hello", args=()):
    r = logging.LogRecord("x", level, "/a/b/model.py", 42, msg, args, None)
    r.created, r.process = CREATED, 3355
    return r


def test_the_two_formats():
    assert logformat.prefix(LogFormat.DEFAULT, logging.INFO, CREATED, 3355, "model.py", 42) == \
        "I0520 20:03:25.829575 3355 model.py:42] "
    assert logformat.prefix(LogFormat.ISO8601, logging.WARNING, CREATED, 3355, "model.py", 42) == \
        "2024-05-20T20:03:25Z W 3355 model.py:42] "


@pytest.mark.parametrize("level,letter", [(logging.DEBUG, "I"), (logging.INFO, "I"),
                                          (logging.WARNING, "W"), (logging.ERROR, "E"),
                                          (logging.CRITICAL, "E")])
def test_severity_letters(level, letter):
    assert logformat.level_letter(level) == letter


def test_messages_are_json_strings_unless_turned_off():
    fmt = logformat.TritonFormatter(lambda: LogSettings(), escape=True)
    line = fmt.format(_record(msg='model "%s"\nI0101 00:00:00.000000 1 fake.py:1] injected',
                              args=("m",)))
    assert line == ('I0520 20:03:25.829575 3355 model.py:42] "model \\"m\\"\\nI0101 '
                    '00:00:00.000000 1 fake.py:1] injected"')
    assert "\n" not in line                 # a client's text cannot start a line of its own
    raw = logformat.TritonFormatter(lambda: LogSettings(format=LogFormat.ISO8601), escape=False)
    assert raw.format(_record(msg="as is")) == "2024-05-20T20:03:25Z I 3355 model.py:42] as is"


def test_the_environment_turns_escaping_off(monkeypatch):
    monkeypatch.setenv(logformat.ESCAPE_ENV, "0")
    assert not logformat.escape_messages()
    monkeypatch.setenv(logformat.ESCAPE_ENV, "1")
    assert logformat.escape_messages()
    monkeypatch.delenv(logformat.ESCAPE_ENV)
    assert logformat.escape_messages()


def test_which_levels_pass():
    quiet = LogSettings(info=False, warning=False, error=True, verbose=0)
    assert [logformat.allowed(quiet, lv) for lv in (10, 20, 30, 40)] == [False, False, False, True]
    # verbose lines do not depend on log_info
    loud = LogSettings(info=False, warning=True, error=False, verbose=1)
    assert [logformat.allowed(loud, lv) for lv in (10, 20, 30, 40)] == [True, False, True, False]


def test_settings_change_while_running(tmp_path):
    path = str(tmp_path / "server.log")
    logs.setup("tester", settings=LogSettings(info=False), path=path)
    log = logging.getLogger("shmserve.test")
    log.info("info while off")
    log.debug("verbose while off")
    log.warning("warning in default format")
    assert logs.apply(LogSettings(verbose=1, format=LogFormat.ISO8601))
    assert not logs.apply(LogSettings(verbose=1, format=LogFormat.ISO8601))    # no change
    log.info("info in ISO8601")
    log.debug("verbose in ISO8601")
    assert logs.current() == LogSettings(verbose=1, format=LogFormat.ISO8601)
    assert logs.log_file() == path
    assert logs.flush(5)
    lines = open(path).read().splitlines()
    assert len(lines) == 4, lines
    assert re.match(r'^W\d{4} [\d:.]+ \d+ test_log_format\.py:\d+\] "warning in default format"$',
                    lines[0])
    assert lines[1].endswith('] "log settings now: log_info=true log_warning=true '
                             'log_error=true log_verbose_level=1 log_format=ISO8601"')
    assert re.match(r'^\d{4}-\d\d-\d\dT[\d:]+Z I \d+ test_log_format\.py:\d+\] "info in ISO8601"$',
                    lines[2])
    assert lines[3].endswith('] "verbose in ISO8601"')


def test_the_log_file_is_appended_to_by_every_process(tmp_path):
    path = str(tmp_path / "server.log")
    with open(path, "w") as f:
        f.write("earlier\n")
    logs.setup("tester", path=path)
    long = "x" * 20000                  # longer than a pipe's atomic write: still one line
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            for i in range(50):
                logging.getLogger("child").warning("%d %s", i, long)
            os._exit(0 if logs.flush(10) else 1)
        pids.append(pid)
    for i in range(50):
        logging.getLogger("parent").warning("%d %s", i, long)
    assert logs.flush(10)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    lines = open(path).read().splitlines()
    assert lines[0] == "earlier" and len(lines) == 1 + 4 * 50
    for line in lines[1:]:
        assert re.match(r'^W\d{4} [\d:.]+ \d+ test_log_format\.py:\d+\] "\d+ x{20000}"$', line)
    assert len({line.split()[2] for line in lines[1:]}) == 4        # four pids


def test_the_launcher_reloads_what_the_scheduler_saved(tmp_path):
    logs.setup("tester", stream=open(os.devnull, "w"))
    new = LogSettings(warning=False, format=LogFormat.ISO8601)
    logs.save(new, str(tmp_path))
    logs.reload(str(tmp_path))
    assert logs.current() == new
    logs.reload(str(tmp_path / "missing"))              # nothing saved: nothing changes
    assert logs.current() == new
