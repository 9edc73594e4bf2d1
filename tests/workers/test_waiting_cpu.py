"""WaitingCpu: the worker waits pinned to the CPU its frontend names, or off the one it names,
and takes its full mask back on waking, before any model code runs. The pinning call is
injected."""
import errno
import logging

from shmserve.ipc.messages.to_worker import ANYWHERE, apart_from, waiting_cpus
from shmserve.workers.waiting_cpu import WaitingCpu


class Pins:
    def __init__(self, fail: OSError | None = None):
        self.calls: list[set[int]] = []
        self.fail = fail

    def __call__(self, cpus):
        if self.fail is not None and len(cpus) == 1:
            raise self.fail
        self.calls.append(set(cpus))


def test_waits_on_the_named_cpu_and_wakes_with_every_cpu():
    pins = Pins()
    w = WaitingCpu(pin=pins, everywhere={0, 1, 2, 3})
    w.before_wait()
    w.after_wait()
    assert pins.calls == []                     # nothing named: waits anywhere, no calls
    w.hint(2)
    w.before_wait()
    assert pins.calls == [{2}]
    w.after_wait()
    w.after_wait()                              # only once per wait
    assert pins.calls == [{2}, {0, 1, 2, 3}]
    w.hint(-1)                                  # a request from the scheduler: anywhere again
    w.before_wait()
    w.after_wait()
    assert pins.calls == [{2}, {0, 1, 2, 3}]


def test_apart_waits_on_every_cpu_but_the_frontends():
    pins = Pins()
    w = WaitingCpu(pin=pins, everywhere={0, 1, 2, 3})
    w.hint(apart_from(1))
    w.before_wait()
    w.after_wait()
    assert pins.calls == [{0, 2, 3}, {0, 1, 2, 3}]
    w.hint(apart_from(1))                       # the same hint again: the same wait
    w.before_wait()
    assert pins.calls[-1] == {0, 2, 3}
    w.after_wait()
    pins.calls.clear()
    w.hint(apart_from(7))                       # not one of ours: every CPU already, no calls
    w.before_wait()
    w.after_wait()
    w.hint(ANYWHERE)
    w.before_wait()
    w.after_wait()
    assert pins.calls == []
    alone = WaitingCpu(pin=pins, everywhere={0, 1})
    alone.hint(apart_from(0))                   # two CPUs: the other one
    alone.before_wait()
    assert pins.calls == [{1}]
    # what each hint means for a mask: one CPU, all but one, or no pin at all
    assert waiting_cpus(2, {0, 1, 2}) == {2}
    assert waiting_cpus(apart_from(2), {0, 1, 2}) == {0, 1}
    assert waiting_cpus(apart_from(5), {5}) is None         # nothing would be left
    assert waiting_cpus(apart_from(3), {0, 1}) is None      # nothing to take away
    assert waiting_cpus(ANYWHERE, {0, 1}) is None


def test_a_cpu_it_may_not_use_turns_it_off(caplog):
    pins = Pins(fail=OSError(errno.EINVAL, "Invalid argument"))
    w = WaitingCpu(pin=pins, everywhere={0, 1})
    w.hint(7)
    with caplog.at_level(logging.WARNING, logger="shmserve.worker"):
        w.before_wait()
        w.after_wait()
        w.before_wait()
    assert pins.calls == [] and not w.enabled
    assert len(caplog.records) == 1 and "cannot wait on CPUs 7" in caplog.records[0].getMessage()


def test_one_cpu_means_nothing_to_do():
    pins = Pins()
    w = WaitingCpu(pin=pins, everywhere={0})
    w.hint(0)
    w.before_wait()
    w.after_wait()
    assert pins.calls == []
