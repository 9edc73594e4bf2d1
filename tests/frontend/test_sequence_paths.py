"""One way at a time for each sequence's requests (frontend/sequence_paths.py), in-process."""
from dataclasses import dataclass

from shmserve.frontend.sequence_paths import HOLD, SequencePaths

SEQ = ("seq", 1, 7)


@dataclass
class FakeLease:
    lease_id: int


def send(paths, rid, lease, key=SEQ):
    """What the engine client does with a new request: returns where it went."""
    how = paths.choose(key, lease)
    paths.track(key, rid)
    if how is HOLD:
        paths.hold(rid)
    else:
        paths.went(rid, how.lease_id if how is not None else 0)
    return how


def test_with_nothing_on_the_way_a_request_takes_the_best_way():
    p = SequencePaths()
    lease = FakeLease(3)
    assert send(p, 1, lease) is lease
    assert p.finished(1) == [] and not p.flights and not p
    assert send(p, 2, None) is None


def test_behind_one_through_the_scheduler_the_next_goes_there_too():
    p = SequencePaths()
    assert send(p, 1, None) is None
    lease = FakeLease(3)                    # granted meanwhile
    assert send(p, 2, lease) is None        # the scheduler forwards both, in order
    p.went(1, 3)                            # LeaseGranted.forwarded
    assert send(p, 3, lease) is None        # 2 is still on its way through the scheduler
    p.went(2, 3)
    p.went(3, 3)
    assert send(p, 4, lease) is lease       # all under the lease now


def test_behind_one_under_an_ended_lease_the_next_waits_and_then_follows_it():
    p = SequencePaths()
    old = FakeLease(3)
    assert send(p, 1, old) is old
    assert send(p, 2, None) is HOLD         # the lease was revoked: 1 may come back
    assert send(p, 3, FakeLease(4)) is HOLD  # a new lease too: behind 2, in order
    p.went(1, 0)                            # bounced: on its way to the scheduler
    assert p.finished(99) == []             # another sequence's answer changes nothing
    assert p.finished(1) == [2, 3]          # answered: 2 and 3 go now, in order
    assert p.choose(SEQ, FakeLease(4)).lease_id == 4


def test_a_held_request_that_expires_leaves_no_trace():
    p = SequencePaths()
    send(p, 1, FakeLease(3))
    assert send(p, 2, None) is HOLD
    assert p.finished(2) == []              # its deadline passed while it waited
    assert p.finished(1) == []
    assert not p.flights and not p


def test_sequences_are_independent():
    p = SequencePaths()
    lease = FakeLease(3)
    assert send(p, 1, lease, key=("seq", 1, 1)) is lease
    assert send(p, 2, None, key=("seq", 1, 2)) is None
    assert send(p, 3, None, key=("seq", 1, 1)) is HOLD
    assert send(p, 4, lease, key=("seq", 1, 2)) is None
    assert send(p, 5, lease, key=("seq", 1, "s")) is lease
