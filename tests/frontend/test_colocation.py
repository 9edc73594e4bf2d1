"""Colocation, the frontend's choice of where its worker waits: on the frontend's CPU while
short requests come one at a time, off it while they overlap. Driven request by request with
the CPU and the pinning injected and the time given with each request, so nothing here moves
this test's own thread."""
import errno
import logging

from shmserve.frontend.colocation import (
    ENTER,
    MAX_GAP_NS,
    ColocateMode,
    Colocation,
    Pairing,
)
from shmserve.ipc.messages.to_worker import ANYWHERE, apart_from

US = 1000
STEP = 400 * US         # identity at concurrency 1: a request every 400 µs


class Pins:
    def __init__(self, fail: OSError | None = None):
        self.calls: list[int | None] = []
        self.fail = fail

    def __call__(self, cpu):
        if self.fail is not None:
            raise self.fail
        self.calls.append(cpu)


class Feed:
    """Requests at a fixed pace."""

    def __init__(self, c: Colocation, step: int = STEP):
        self.c, self.step, self.now = c, step, 0

    def __call__(self, in_flight: int = 0, took: int | None = None) -> int:
        """One request; with ``took``, its answer comes that many ns after it."""
        self.now += self.step
        hint = self.c.on_request(in_flight, self.now)
        if took is not None:
            self.c.on_answer(self.now, self.now + took)
        return hint


def make(mode=ColocateMode.AUTO, cpu=3, pins=None, **kw):
    pins = pins if pins is not None else Pins()
    c = Colocation(mode, cpu=lambda: cpu, pin=pins, **kw)
    return c, pins, Feed(c)


def test_pairs_after_enough_requests_that_came_alone_and_names_its_cpu():
    c, pins, feed = make()
    hints = [feed() for _ in range(ENTER - 1)]
    assert hints == [ANYWHERE] * (ENTER - 1) and pins.calls == []
    assert feed() == 3                          # the ENTER-th pins and is sent with the CPU
    assert pins.calls == [3] and c.state is Pairing.PAIRED
    assert [feed() for _ in range(100)] == [3] * 100
    assert pins.calls == [3]                    # pinned once, not per request


def test_a_request_that_finds_another_in_flight_spreads_at_once_and_starts_the_count_again():
    c, pins, feed = make(enter=4)
    for _ in range(4):
        feed()
    assert c.state is Pairing.PAIRED
    assert feed(1) == apart_from(3)             # overlapping: wait anywhere but here
    assert pins.calls == [3, None] and c.state is Pairing.SPREAD
    # three alone, one crowded, three alone: never four in a row, never paired
    for n in (0, 0, 0, 2, 0, 0, 0):
        assert feed(n) == (apart_from(3) if n else ANYWHERE)
    assert pins.calls == [3, None]
    assert feed() == 3 and c.pairings == 2


def test_requests_far_apart_are_not_paired():
    # 4 MiB over HTTP at concurrency 1: one every 6 ms; a hop is nothing beside that
    c, pins, feed = make(enter=4)
    feed.step = 6 * MAX_GAP_NS
    assert [feed() for _ in range(50)] == [ANYWHERE] * 50
    assert pins.calls == []
    # the pace picks up: once a run of four is quick (the run under way when it changed may
    # still hold a slow gap), they are paired
    feed.step = MAX_GAP_NS // 2
    hints = [feed() for _ in range(8)]
    assert hints[-1] == 3 and hints.index(3) >= 3


def test_the_pace_is_a_mean_over_the_run():
    c, _, feed = make(enter=4)
    feed.step = MAX_GAP_NS * 3 // 2             # a little slow each time: never
    assert {feed() for _ in range(40)} == {ANYWHERE}
    c2, _, feed2 = make(enter=4)
    # one long gap early in the run and three quick ones: 3 gaps average past the limit
    for step in (1, 3 * MAX_GAP_NS, 10, 10):
        feed2.step = step
        hint = feed2()
    assert hint == ANYWHERE and c2.state is Pairing.SPREAD


def test_a_pairing_is_chosen_again_after_repick_ns():
    c, pins, feed = make(enter=2, repick_ns=STEP * 3)
    feed()
    assert feed() == 3
    assert feed() == 3 and feed() == 3          # 2 steps after pairing
    assert feed() == ANYWHERE and c.state is Pairing.SPREAD   # 3: the CPU may be taken now
    assert feed() == 3                          # where the thread is now
    assert pins.calls == [3, None, 3]


def test_overlapping_requests_keep_the_worker_off_the_cpu_each_is_sent_from():
    cpus = iter([1, 0, 0, 5, -1])               # the frontend moves; -1: the C library failed
    c = Colocation(ColocateMode.AUTO, cpu=lambda: next(cpus), pin=(pins := Pins()))
    feed = Feed(c)
    assert [feed(n) for n in (3, 8, 1, 31, 2)] == [
        apart_from(1), apart_from(0), apart_from(0), apart_from(5), ANYWHERE]
    assert pins.calls == [] and c.state is Pairing.SPREAD   # the frontend itself stays free
    assert apart_from(0) == -2 and apart_from(1) == -3 and apart_from(-1) == ANYWHERE


def test_off_never_pins():
    c, pins, feed = make(mode=ColocateMode.OFF)
    assert {feed() for _ in range(3 * ENTER)} == {ANYWHERE}
    assert {feed(n) for n in range(1, 8)} == {ANYWHERE}       # nor keeps them apart
    assert pins.calls == []


def test_a_pin_refused_turns_it_off_and_says_so_once(caplog):
    pins = Pins(fail=OSError(errno.EINVAL, "Invalid argument"))
    c, _, feed = make(pins=pins, enter=2)
    with caplog.at_level(logging.WARNING, logger="shmserve.frontend"):
        assert [feed() for _ in range(10)] == [ANYWHERE] * 10
    assert c.mode is ColocateMode.OFF and c.state is Pairing.SPREAD
    assert [r.getMessage() for r in caplog.records] == [
        "cannot keep the frontend on one CPU ([Errno 22] Invalid argument); --colocate is off"]


def test_close_gives_the_cpus_back_only_when_paired():
    c, pins, feed = make(enter=1)
    c.close()
    assert pins.calls == []
    feed()
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
        cpu = c.on_request(0, 0)
        seen["paired"] = (cpu, os.sched_getaffinity(0))
        c.on_request(1, 1)
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


def test_a_trial_keeps_the_pairing_whose_answers_come_sooner():
    c, pins, feed = make(enter=4, repick_ns=100 * STEP)
    hints = [feed(took=150 * US) for _ in range(3)]      # spread: 150 µs each
    assert hints == [ANYWHERE] * 3
    hints = [feed(took=120 * US) for _ in range(4)]      # the trial: paired, 120 µs each
    assert hints == [3] * 4 and c.state is Pairing.PAIRED and not c.trial
    assert [feed(took=500 * US) for _ in range(50)] == [3] * 50   # kept: no more trial
    assert pins.calls == [3] and c.measuring is None


def test_a_pairing_not_clearly_faster_is_not_kept():
    c, pins, feed = make(enter=4)
    for _ in range(3):
        feed(took=100 * US)
    for _ in range(4):
        feed(took=97 * US)                                # 3% sooner: noise
    assert c.state is Pairing.SPREAD and pins.calls == [3, None]


def test_a_trial_whose_paired_answers_are_slower_spreads_until_repick_ns():
    c, pins, feed = make(enter=4, repick_ns=20 * STEP)
    assert [feed(took=120 * US) for _ in range(3)] == [ANYWHERE] * 3
    assert [feed(took=140 * US) for _ in range(4)] == [3] * 4     # the trial, slower
    assert c.state is Pairing.SPREAD and pins.calls == [3, None]
    # alone and quick, but no other trial until repick_ns has passed since its end
    assert [feed(took=140 * US) for _ in range(19)] == [ANYWHERE] * 19
    assert pins.calls == [3, None]
    hints = [feed(took=100 * US) for _ in range(5)]       # counted again, then tried again
    assert hints[-2:] == [ANYWHERE, 3] and pins.calls == [3, None, 3]


def test_a_request_that_finds_another_in_flight_ends_the_trial_and_its_times():
    c, pins, feed = make(enter=4)
    for _ in range(3):
        feed(took=100 * US)
    feed(took=90 * US)                                    # paired, on trial
    assert c.trial
    feed(1)                                               # crowded: the trial ends unjudged
    c.on_answer(feed.now, feed.now + 999 * US)           # the answer of a crowded request
    assert c.state is Pairing.SPREAD and not c.trial and c.times[Pairing.PAIRED] == [90 * US]
    # a new count, new spread times (the old ones are not mixed in), a new trial
    assert [feed(took=200 * US) for _ in range(3)] == [ANYWHERE] * 3
    assert c.times[Pairing.SPREAD] == [200 * US] * 3
    assert [feed(took=150 * US) for _ in range(4)] == [3] * 4
    assert c.state is Pairing.PAIRED and not c.trial


def test_only_the_answer_of_a_request_that_came_alone_is_timed():
    c, _, feed = make(enter=8)
    feed()
    c.on_answer(feed.now, feed.now + 100 * US)
    c.on_answer(feed.now, feed.now + 999 * US)            # no request waits for it
    assert c.times[Pairing.SPREAD] == [100 * US]
    c_off, _, feed_off = make(mode=ColocateMode.OFF)
    feed_off(took=100 * US)
    assert c_off.measuring is None and c_off.times[Pairing.SPREAD] == []
