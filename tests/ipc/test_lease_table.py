"""The lease taker's table (ipc/lease_table.py): which lease a sequence's request goes under.
Pure: the worker boxes are plain objects."""
from shmserve.ipc.lease_table import LeaseTable
from shmserve.ipc.messages.to_frontend import LeaseGranted


def sequence_leases(*lent: list[int]) -> LeaseTable:
    """A sequence model "seq" lent with one lease per list, each with those live sequences."""
    table = LeaseTable()
    for i, cids in enumerate(lent, start=1):
        table.granted(LeaseGranted(i, "seq", 1, 100 + i, 0, sequences=list(cids), slots=4),
                      lambda spawn_id: f"box-{spawn_id}")
    return table


def test_a_sequence_goes_under_the_lease_whose_worker_has_it():
    table = sequence_leases([1, 2], [3])
    assert table.place("seq", 1, 2, start=False).lease_id == 1
    assert table.place("seq", 1, 3, start=False).lease_id == 2


def test_a_new_sequence_goes_to_the_worker_with_the_fewest_which_takes_it():
    table = sequence_leases([1, 2], [3])
    lease = table.place("seq", 1, 7, start=True)
    assert lease.lease_id == 2 and 7 in lease.cids
    assert table.place("seq", 1, 7, start=False) is lease


def test_a_later_request_of_a_sequence_no_held_worker_has_goes_to_the_scheduler():
    # its instance's lease was revoked before the others' (each revoke is its own message):
    # its state is the scheduler's again, and no other worker ever had it
    table = sequence_leases([1], [2])
    table.revoked(1)
    assert table.place("seq", 1, 1, start=False) is None
    assert table.place("seq", 1, 9, start=False) is None       # one that never started
    assert table.place("seq", 1, 1, start=True).lease_id == 2  # started again: anywhere
