"""The frontend's priority governor (pure) and its shell, driven tick by tick without a running
loop: the scheduling call is injected, so nothing here changes this process's priority."""
import asyncio
import errno
import logging

import pytest

from shmserve.frontend import priority
from shmserve.frontend.priority import Priority, PriorityGovernor, PriorityMode, PriorityShell


def feed(gov, counts):
    return [gov.sample(n) for n in counts]


def test_normal_mode_never_changes():
    gov = PriorityGovernor(PriorityMode.NORMAL, window=2)
    assert feed(gov, [100] * 10) == [None] * 10
    assert gov.current is Priority.NORMAL


def test_realtime_mode_changes_once_whatever_the_load():
    gov = PriorityGovernor(PriorityMode.REALTIME)
    assert feed(gov, [0, 0, 50]) == [Priority.REALTIME, None, None]


def test_auto_waits_for_a_full_window_then_enters_at_the_mean():
    gov = PriorityGovernor(PriorityMode.AUTO, enter=8, leave=4, window=4)
    # three busy ticks are not a window yet
    assert feed(gov, [20, 20, 20]) == [None, None, None]
    assert gov.sample(20) is Priority.REALTIME
    assert gov.current is Priority.REALTIME


def test_auto_takes_the_mean_so_a_burst_between_quiet_ticks_does_not_enter():
    gov = PriorityGovernor(PriorityMode.AUTO, enter=8, leave=4, window=4)
    # bursty arrivals: one tick of 31 among quiet ones is a mean of 7.75, below 8
    assert feed(gov, [31, 0, 0, 0]) == [None] * 4
    assert feed(gov, [31]) == [None]
    assert feed(gov, [31]) == [Priority.REALTIME]      # two of four: 15.5


def test_auto_holds_between_the_thresholds_and_leaves_below_the_lower_one():
    gov = PriorityGovernor(PriorityMode.AUTO, enter=8, leave=4, window=2)
    feed(gov, [10, 10])
    assert gov.current is Priority.REALTIME
    assert feed(gov, [5, 5, 4, 4]) == [None] * 4       # between leave and enter: stays
    assert feed(gov, [3]) == [Priority.NORMAL]           # mean 3.5 over (4, 3)
    assert feed(gov, [7, 7]) == [None, None]             # below enter: stays normal


def test_thresholds_must_be_ordered():
    with pytest.raises(ValueError):
        PriorityGovernor(PriorityMode.AUTO, enter=4, leave=8)


class Recorder:
    def __init__(self, fail: OSError | None = None):
        self.calls: list[Priority] = []
        self.fail = fail

    def __call__(self, p: Priority) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(p)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def shell(loop, mode, counts, apply, **kw):
    it = iter(counts)
    gov = PriorityGovernor(mode, **kw)
    return PriorityShell(loop, gov, lambda: next(it), apply=apply)


def test_shell_applies_each_change_and_ticks_fast_only_while_busy(loop):
    rec = Recorder()
    sh = shell(loop, PriorityMode.AUTO, [1, 12, 12, 1, 1, 0], rec, enter=8, leave=4, window=2)
    sh.tick()                               # one request held: slow tick
    assert sh.handle.when() - loop.time() == pytest.approx(priority.IDLE_TICK_S, abs=0.05)
    sh.tick()
    assert sh.handle.when() - loop.time() == pytest.approx(priority.TICK_S, abs=0.005)
    sh.tick()                               # mean 12 over (12, 12)
    assert rec.calls == [Priority.REALTIME]
    sh.tick()                               # mean 6.5: stays, and ticks fast while real-time
    assert rec.calls == [Priority.REALTIME]
    assert sh.handle.when() - loop.time() == pytest.approx(priority.TICK_S, abs=0.005)
    sh.tick()                               # mean 1
    assert rec.calls == [Priority.REALTIME, Priority.NORMAL] and sh.changes == 2
    sh.tick()
    assert sh.handle.when() - loop.time() == pytest.approx(priority.IDLE_TICK_S, abs=0.05)
    sh.close()
    assert sh.handle is None and rec.calls[-1] is Priority.NORMAL


def test_shell_in_normal_mode_never_ticks(loop):
    rec = Recorder()
    sh = shell(loop, PriorityMode.NORMAL, [], rec)
    assert sh.handle is None
    sh.close()
    assert rec.calls == []


def test_shell_in_realtime_mode_sets_once_and_puts_it_back_on_close(loop):
    rec = Recorder()
    sh = shell(loop, PriorityMode.REALTIME, [0], rec)
    sh.handle.cancel()
    sh.tick()
    assert rec.calls == [Priority.REALTIME] and sh.handle is None
    sh.close()
    assert rec.calls == [Priority.REALTIME, Priority.NORMAL]


def test_shell_without_permission_logs_once_and_stops(loop, caplog):
    rec = Recorder(fail=PermissionError(errno.EPERM, "Operation not permitted"))
    sh = shell(loop, PriorityMode.AUTO, [20, 20, 20], rec, window=1)
    with caplog.at_level(logging.INFO, logger="shmserve.frontend"):
        sh.tick()
    assert sh.handle is None and sh.governor.current is Priority.NORMAL
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "stays at normal priority" in msgs[0] and "CAP_SYS_NICE" in msgs[0]
    assert caplog.records[0].levelno == logging.INFO
    sh.close()                              # nothing to put back


def test_shell_asked_for_realtime_without_permission_warns(loop, caplog):
    rec = Recorder(fail=PermissionError(errno.EPERM, "Operation not permitted"))
    sh = shell(loop, PriorityMode.REALTIME, [0], rec)
    sh.handle.cancel()
    with caplog.at_level(logging.INFO, logger="shmserve.frontend"):
        sh.tick()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
