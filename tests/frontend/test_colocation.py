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


def trial(feed, enter, spread=None, apart=None, paired=None):
    """Requests alone: ``enter - 1`` spread, then the trial's ``enter`` apart and ``enter``
    paired, each answered after the time given (None: not answered); their hints."""
    return [feed(took=spread) for _ in range(enter - 1)], \
        [feed(took=apart) for _ in range(enter)], [feed(took=paired) for _ in range(enter)]


def test_a_trial_tries_apart_then_paired_after_enough_requests_that_came_alone():
    c, pins, feed = make()
    spread, apart, paired = trial(feed, ENTER, 150 * US, 140 * US, 100 * US)
    assert spread == [ANYWHERE] * (ENTER - 1)
    assert apart == [apart_from(3)] * ENTER     # the ENTER-th starts the trial, unpinned
    assert paired == [3] * ENTER                # then pinned once, each sent with the CPU
    assert pins.calls == [3] and c.state is Pairing.PAIRED and not c.trial
    assert [feed() for _ in range(100)] == [3] * 100
    assert pins.calls == [3]                    # pinned once, not per request


def test_a_trial_waits_for_the_answers_of_the_way_it_tries():
    c, pins, feed = make(enter=4)
    trial(feed, 4)                              # no answers: APART stays on trial
    assert c.state is Pairing.APART and c.trial and pins.calls == []
    assert feed() == apart_from(3) and c.measuring is Pairing.APART


def test_a_request_that_finds_another_in_flight_spreads_at_once_and_starts_the_count_again():
    c, pins, feed = make(enter=4)
    trial(feed, 4, 150 * US, 140 * US, 100 * US)
    assert c.state is Pairing.PAIRED
    assert feed(1) == apart_from(3)             # overlapping: wait anywhere but here
    assert pins.calls == [3, None] and c.state is Pairing.SPREAD
    # three alone, one crowded, three alone: never four in a row, never tried
    for n in (0, 0, 0, 2, 0, 0, 0):
        assert feed(n) == (apart_from(3) if n else ANYWHERE)
    assert pins.calls == [3, None] and c.state is Pairing.SPREAD
    assert feed() == apart_from(3) and c.state is Pairing.APART and c.trial


def test_requests_far_apart_are_not_tried():
    # 4 MiB over HTTP at concurrency 1: one every 6 ms; a hop is nothing beside that
    c, pins, feed = make(enter=4)
    feed.step = 6 * MAX_GAP_NS
    assert [feed() for _ in range(50)] == [ANYWHERE] * 50
    assert pins.calls == [] and c.state is Pairing.SPREAD
    # the pace picks up: once a run of four is quick (the run under way when it changed may
    # still hold a slow gap), a trial starts
    feed.step = MAX_GAP_NS // 2
    hints = [feed() for _ in range(8)]
    assert hints[-1] == apart_from(3) and hints.index(apart_from(3)) >= 3


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


def test_a_kept_way_is_chosen_again_after_repick_ns():
    c, pins, feed = make(enter=2, repick_ns=STEP * 3)
    feed(took=150 * US)
    assert [feed(took=140 * US) for _ in range(2)] == [apart_from(3)] * 2
    assert [feed(took=100 * US) for _ in range(2)] == [3, 3]     # paired on trial, kept
    assert c.state is Pairing.PAIRED and not c.trial
    assert feed() == 3                          # 3 steps after the pairing: chosen again
    assert feed() == ANYWHERE and c.state is Pairing.SPREAD     # the CPU may be taken now
    assert feed() == apart_from(3) and c.trial  # counted again (2), tried again
    assert pins.calls == [3, None]


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
        spread, apart, paired = trial(feed, 2, 150 * US, 140 * US, 100 * US)
        assert [feed(took=100 * US) for _ in range(10)] == [ANYWHERE] * 10
    assert spread + apart == [ANYWHERE] + [apart_from(3)] * 2 and paired == [ANYWHERE] * 2
    assert c.mode is ColocateMode.OFF and c.state is Pairing.SPREAD and not c.trial
    assert [r.getMessage() for r in caplog.records] == [
        "cannot keep the frontend on one CPU ([Errno 22] Invalid argument); --colocate is off"]


def test_close_gives_the_cpus_back_only_when_paired():
    c, pins, feed = make(enter=1)
    c.close()
    assert pins.calls == []
    feed()                                      # APART on trial: nothing pinned
    c.close()
    assert pins.calls == [] and c.state is Pairing.SPREAD
    feed(took=100 * US)                         # APART's one time: PAIRED on trial
    c.close()
    assert pins.calls == [3, None] and c.state is Pairing.SPREAD


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
        c.on_request(0, 0)                      # APART on trial
        c.on_answer(0, 10)                      # its one time: PAIRED's trial, pinned
        cpu = c.on_request(0, 20)
        seen["paired"] = (cpu, os.sched_getaffinity(0))
        c.on_request(1, 30)
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


def test_a_trial_keeps_the_way_whose_answers_come_soonest():
    c, pins, feed = make(enter=4, repick_ns=100 * STEP)
    trial(feed, 4, 150 * US, 130 * US, 120 * US)
    assert c.state is Pairing.PAIRED and not c.trial
    assert [feed(took=500 * US) for _ in range(50)] == [3] * 50   # kept: no more trial
    assert pins.calls == [3] and c.measuring is None
    c, pins, feed = make(enter=4, repick_ns=100 * STEP)
    trial(feed, 4, 150 * US, 100 * US, 120 * US)     # a core busy: apart is soonest
    assert c.state is Pairing.APART and not c.trial and pins.calls == [3, None]
    assert [feed(took=500 * US) for _ in range(50)] == [apart_from(3)] * 50
    assert pins.calls == [3, None] and c.measuring is None


def test_a_way_not_clearly_faster_than_spread_is_not_kept():
    c, pins, feed = make(enter=4)
    trial(feed, 4, 100 * US, 97 * US, 98 * US)       # 2-3% sooner: noise
    assert c.state is Pairing.SPREAD and pins.calls == [3, None]


def test_a_trial_whose_ways_are_slower_spreads_until_repick_ns():
    c, pins, feed = make(enter=4, repick_ns=20 * STEP)
    spread, apart, paired = trial(feed, 4, 120 * US, 130 * US, 140 * US)
    assert spread == [ANYWHERE] * 3 and apart == [apart_from(3)] * 4 and paired == [3] * 4
    assert c.state is Pairing.SPREAD and pins.calls == [3, None]
    # alone and quick, but no other trial until repick_ns has passed since its end
    assert [feed(took=140 * US) for _ in range(19)] == [ANYWHERE] * 19
    assert pins.calls == [3, None]
    hints = [feed(took=100 * US) for _ in range(5)]       # counted again, then tried again
    assert hints[-2:] == [ANYWHERE, apart_from(3)] and c.state is Pairing.APART


def test_a_request_that_finds_another_in_flight_ends_the_trial_and_its_times():
    c, pins, feed = make(enter=4)
    for _ in range(3):
        feed(took=100 * US)
    feed(took=90 * US)                                    # apart, on trial
    assert c.trial and c.state is Pairing.APART
    feed(1)                                               # crowded: the trial ends unjudged
    c.on_answer(feed.now, feed.now + 999 * US)           # the answer of a crowded request
    assert c.state is Pairing.SPREAD and not c.trial and c.times[Pairing.APART] == [90 * US]
    # a new count, new spread times (the old ones are not mixed in), a new trial
    assert [feed(took=200 * US) for _ in range(3)] == [ANYWHERE] * 3
    assert c.times[Pairing.SPREAD] == [200 * US] * 3
    trial_hints = [feed(took=150 * US) for _ in range(4)] + [feed(took=140 * US) for _ in range(4)]
    assert trial_hints == [apart_from(3)] * 4 + [3] * 4
    assert c.times[Pairing.APART] == [150 * US] * 4
    assert c.state is Pairing.PAIRED and not c.trial and pins.calls == [3]


def test_only_the_answer_of_a_request_that_came_alone_is_timed():
    c, _, feed = make(enter=8)
    feed()
    c.on_answer(feed.now, feed.now + 100 * US)
    c.on_answer(feed.now, feed.now + 999 * US)            # no request waits for it
    assert c.times[Pairing.SPREAD] == [100 * US]
    c_off, _, feed_off = make(mode=ColocateMode.OFF)
    feed_off(took=100 * US)
    assert c_off.measuring is None and c_off.times[Pairing.SPREAD] == []
