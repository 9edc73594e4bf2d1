"""The leased sequence batcher of a worker (workers/leases/sequences.py), in-process with a fake
clock: the scheduler's rules applied to leased requests, and what goes back when the lease
ends."""
import json

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.engine.batching.sequences import sequence_config
from shmserve.ipc.messages.common import ErrorCode, SequenceSlot
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute, LendSequences
from shmserve.workers.leases.sequences import LeasedSequences

S, E = 1, 2


def config(text: str) -> dict:
    cfg = text_format.Parse('name: "seq"\n' + text, mc.ModelConfig())
    return json.loads(json.dumps(json_format.MessageToDict(
        cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))


class Clock:
    ns = 10**12

    def __call__(self) -> int:
        return self.ns


def leased(rid, cid, flags=0, lease=5):
    return LeasedExecute(lease, SubmitRequest(rid, 1, "seq", 1, 1, 0, sequence_id=cid,
                                              sequence_flags=flags))


def rids(batch):
    return [r.req_id for r in batch]


def make(text="max_batch_size: 2\nsequence_batching { max_sequence_idle_microseconds: 1000000 }",
         live=()):
    clock = Clock()
    seqs = LeasedSequences(config(text), clock)
    seqs.lend(LendSequences(5, [SequenceSlot(cid, clock.ns) for cid in live]))
    return seqs, clock


def test_the_workers_config_reads_as_the_schedulers():
    text = ("max_batch_size: 4\nsequence_batching { max_sequence_idle_microseconds: 3000000 "
            "oldest { max_candidate_sequences: 6 preferred_batch_size: [ 2, 3 ] "
            "max_queue_delay_microseconds: 700 } }")
    parsed = text_format.Parse('name: "seq"\n' + text, mc.ModelConfig())
    assert sequence_config(config(text)) == sequence_config(parsed)
    direct = "max_batch_size: 0\nsequence_batching { direct { minimum_slot_utilization: 0.5 } }"
    assert sequence_config(config(direct)) == \
        sequence_config(text_format.Parse('name: "seq"\n' + direct, mc.ModelConfig()))


def test_lent_sequences_go_on_and_the_rules_are_the_schedulers():
    seqs, _ = make(live=[9])
    assert seqs.take(leased(1, 9), ["p1"]) is None           # lent: no START needed
    code, text = seqs.take(leased(2, 4), ["p2"])             # never started
    assert code is ErrorCode.INVALID_ARG and "must specify the START flag" in text
    assert seqs.take(leased(3, 9), ["p3"]) is None           # behind 1: the next batch
    assert seqs.take(leased(4, 8, S), ["p4"]) is None
    batch = seqs.next_batch()
    assert rids(batch) == [1, 4] and batch[0].payload[1] == ["p1"]
    assert seqs.next_batch() == []                           # the worker is busy
    seqs.ran()
    assert rids(seqs.next_batch()) == [3]


def test_a_third_live_sequence_finds_no_slot():
    seqs, _ = make(live=[1, 2])
    assert seqs.take(leased(1, 3, S), []) is None
    assert seqs.crowded()


def test_idle_sequences_end_before_the_next_request_is_judged():
    seqs, clock = make(live=[9])
    clock.ns += 2 * 10**9
    assert seqs.expired() == []
    code, _ = seqs.take(leased(1, 9), [])
    assert code is ErrorCode.INVALID_ARG


def test_the_lease_ends_with_queued_requests_in_order_and_the_live_sequences():
    seqs, clock = make(live=[9])
    for rid, cid, flags in ((1, 9, 0), (2, 9, 0), (3, 5, S), (4, 9, E)):
        assert seqs.take(leased(rid, cid, flags), []) is None
    assert rids(seqs.next_batch()) == [1, 3]
    seqs.ran()
    queued, live = seqs.end()
    # 9 goes on at the scheduler (2 and 4 come back to it in order); 5 ran its START here
    assert rids(queued) == [2, 4]
    assert sorted(s.cid for s in live) == [5, 9]
    assert seqs.next_batch() == [] and not seqs.waiting()


def test_a_cancel_takes_the_sequences_queued_requests():
    seqs, _ = make(live=[9])
    for rid in (1, 2, 3):
        seqs.take(leased(rid, 9), [])
    seqs.next_batch()
    seqs.ran()
    assert rids(seqs.take_cancelled(1, 2)) == [2, 3]
    assert seqs.next_batch() == []


def test_a_batch_delay_sets_the_wait():
    seqs, clock = make("max_batch_size: 4\nsequence_batching { direct { "
                       "max_queue_delay_microseconds: 5000 } }")
    seqs.take(leased(1, 3, S), [])
    assert seqs.next_batch() == [] and seqs.waiting() and seqs.wait_ms() == 5
    clock.ns += 5_000_000
    assert rids(seqs.next_batch()) == [1]
