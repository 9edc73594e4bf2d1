"""DrainPriority, the frontend's priority around a drain of answers: driven call by call with
the scheduling call injected, so nothing here changes this process's priority."""
import errno
import logging

from shmserve.frontend.priority import THRESHOLD, DrainPriority, Priority, PriorityMode


class Recorder:
    def __init__(self, fail: OSError | None = None):
        self.calls: list[Priority] = []
        self.fail = fail

    def __call__(self, p: Priority) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(p)


EPERM = PermissionError(errno.EPERM, "Operation not permitted")


def test_auto_raises_only_from_the_threshold_and_lowers_after():
    rec = Recorder()
    d = DrainPriority(PriorityMode.AUTO, apply=rec)
    assert rec.calls == []                  # nothing at start
    assert d.raise_for(THRESHOLD - 1) is False and rec.calls == []
    assert d.raise_for(THRESHOLD) is True
    d.lower()
    assert d.raise_for(40) is True
    d.lower()
    assert rec.calls == [Priority.REALTIME, Priority.NORMAL] * 2
    assert d.raised_drains == 2
    d.close()                               # nothing held raised: nothing to put back
    assert len(rec.calls) == 4


def test_auto_says_once_that_it_raises(caplog):
    d = DrainPriority(PriorityMode.AUTO, apply=Recorder())
    with caplog.at_level(logging.INFO, logger="shmserve.frontend"):
        for _ in range(3):
            assert d.raise_for(20)
            d.lower()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "real-time priority" in msgs[0] and "--frontend-priority" in msgs[0]


def test_normal_never_raises():
    rec = Recorder()
    d = DrainPriority(PriorityMode.NORMAL, apply=rec)
    assert d.raise_for(1000) is False
    d.close()
    assert rec.calls == []


def test_realtime_is_raised_from_the_start_for_good_and_put_back_on_close():
    rec = Recorder()
    d = DrainPriority(PriorityMode.REALTIME, apply=rec)
    assert rec.calls == [Priority.REALTIME]
    assert d.raise_for(1000) is False       # already raised: no per-drain calls
    d.close()
    assert rec.calls == [Priority.REALTIME, Priority.NORMAL]


def test_auto_without_permission_logs_once_at_info_and_stops_trying(caplog):
    rec = Recorder(fail=EPERM)
    d = DrainPriority(PriorityMode.AUTO, apply=rec)
    with caplog.at_level(logging.INFO, logger="shmserve.frontend"):
        assert d.raise_for(20) is False
        assert d.raise_for(20) is False
    assert d.mode is PriorityMode.NORMAL
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(msgs) == 1 and msgs[0][0] == logging.INFO
    assert "stays at normal priority" in msgs[0][1] and "CAP_SYS_NICE" in msgs[0][1]


def test_realtime_without_permission_warns():
    rec = Recorder(fail=EPERM)
    logger = logging.getLogger("shmserve.frontend")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        d = DrainPriority(PriorityMode.REALTIME, apply=rec)
    finally:
        logger.removeHandler(handler)
    assert [r.levelno for r in seen] == [logging.WARNING]
    assert d.mode is PriorityMode.NORMAL     # nothing to put back on close
    d.close()
