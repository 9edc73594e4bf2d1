"""Colocation, the frontend's choice to share a CPU with its worker while requests come one at
a time: driven request by request with the CPU, the pinning and the clock injected, so nothing
here moves this test's own thread."""
import errno
import logging

from shmserve.frontend.colocation import ENTER, NO_CPU, ColocateMode, Colocation, Pairing


class Pins:
    def __init__(self, fail: OSError | None = None):
        self.calls: list[int | None] = []
        self.fail = fail

    def __call__(self, cpu):
        if self.fail is not None:
            raise self.fail
        self.calls.append(cpu)


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self) -> int:
        return self.now


def make(mode=ColocateMode.AUTO, cpu=3, pins=None, clock=None, **kw):
    pins = pins if pins is not None else Pins()
    clock = clock if clock is not None else Clock()
    return Colocation(mode, cpu=lambda: cpu, pin=pins, clock=clock, **kw), pins, clock


def test_pairs_after_enough_requests_that_came_alone_and_names_its_cpu():
    c, pins, _ = make()
    hints = [c.on_request(0) for _ in range(ENTER - 1)]
    assert hints == [NO_CPU] * (ENTER - 1) and pins.calls == []
    assert c.on_request(0) == 3                 # the ENTER-th pins and is sent with the CPU
    assert pins.calls == [3] and c.state is Pairing.PAIRED
    assert [c.on_request(0) for _ in range(100)] == [3] * 100
    assert pins.calls == [3]                    # pinned once, not per request


def test_a_request_that_finds_another_in_flight_spreads_at_once_and_starts_the_count_again():
    c, pins, _ = make(enter=4)
    for _ in range(4):
        c.on_request(0)
    assert c.state is Pairing.PAIRED
    assert c.on_request(1) == NO_CPU
    assert pins.calls == [3, None] and c.state is Pairing.SPREAD
    # three alone, one crowded, three alone: never four in a row, never paired
    for n in (0, 0, 0, 2, 0, 0, 0):
        assert c.on_request(n) == NO_CPU
    assert pins.calls == [3, None]
    assert c.on_request(0) == 3 and c.pairings == 2


def test_a_pairing_is_chosen_again_after_repick_ns():
    c, pins, clock = make(enter=2, repick_ns=1000)
    c.on_request(0)
    assert c.on_request(0) == 3
    clock.now = 999
    assert c.on_request(0) == 3
    clock.now = 1000                            # the CPU may since have been taken by others
    assert c.on_request(0) == NO_CPU and c.state is Pairing.SPREAD
    assert c.on_request(0) == 3                 # where the thread is now
    assert pins.calls == [3, None, 3]


def test_off_never_pins():
    c, pins, _ = make(mode=ColocateMode.OFF)
    assert {c.on_request(0) for _ in range(3 * ENTER)} == {NO_CPU}
    assert pins.calls == []


def test_a_pin_refused_turns_it_off_and_says_so_once(caplog):
    pins = Pins(fail=OSError(errno.EINVAL, "Invalid argument"))
    c, _, _ = make(pins=pins, enter=2)
    with caplog.at_level(logging.WARNING, logger="shmserve.frontend"):
        assert [c.on_request(0) for _ in range(10)] == [NO_CPU] * 10
    assert c.mode is ColocateMode.OFF and c.state is Pairing.SPREAD
    assert [r.getMessage() for r in caplog.records] == [
        "cannot keep the frontend on one CPU ([Errno 22] Invalid argument); --colocate is off"]


def test_close_gives_the_cpus_back_only_when_paired():
    c, pins, _ = make(enter=1)
    c.close()
    assert pins.calls == []
    c.on_request(0)
    c.close()
    assert pins.calls == [3, None]


def test_the_real_calls_pin_and_unpin_the_calling_thread_only():
    import os
    import threading

    everywhere = os.sched_getaffinity(0)
    seen = {}

    def run():
        c = Colocation(ColocateMode.AUTO, enter=1)
        if c.mode is ColocateMode.OFF:          # a machine with one CPU: nothing to pair
            seen["off"] = True
            return
        cpu = c.on_request(0)
        seen["paired"] = (cpu, os.sched_getaffinity(0))
        c.on_request(1)
        seen["spread"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if seen.get("off"):
        assert len(everywhere) == 1
        return
    cpu, mask = seen["paired"]
    assert mask == {cpu} and cpu in everywhere
    assert seen["spread"] == everywhere
    assert os.sched_getaffinity(0) == everywhere        # this thread was never moved
