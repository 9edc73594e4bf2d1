"""WaitingCpu: the worker waits pinned to the CPU its frontend names and takes its full mask
back on waking, before any model code runs. The pinning call is injected."""
import errno
import logging

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


def test_a_cpu_it_may_not_use_turns_it_off(caplog):
    pins = Pins(fail=OSError(errno.EINVAL, "Invalid argument"))
    w = WaitingCpu(pin=pins, everywhere={0, 1})
    w.hint(7)
    with caplog.at_level(logging.WARNING, logger="shmserve.worker"):
        w.before_wait()
        w.after_wait()
        w.before_wait()
    assert pins.calls == [] and not w.enabled
    assert len(caplog.records) == 1 and "cannot wait on CPU 7" in caplog.records[0].getMessage()


def test_one_cpu_means_nothing_to_do():
    pins = Pins()
    w = WaitingCpu(pin=pins, everywhere={0})
    w.hint(0)
    w.before_wait()
    w.after_wait()
    assert pins.calls == []
