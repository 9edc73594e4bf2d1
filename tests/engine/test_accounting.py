"""engine/accounting.py in-process: what a finished batch, a leased request and a worker's custom
metrics add, and the statistics reply (the core's own tests drive it end to end)."""
from types import SimpleNamespace

from shmserve.engine.accounting import Accounting
from shmserve.engine.batching.queues import QueuedRequest
from shmserve.engine.states import ModelState
from shmserve.engine.stats import VersionStats
from shmserve.ipc.messages.common import ENSEMBLE_FRONTEND, CustomMetrics, LeasedRecord
from shmserve.ipc.messages.to_scheduler import BatchDone, StatsQuery


def version(name="m", v=1):
    return SimpleNamespace(name=name, version=v,
                           stats=VersionStats(name, v, wall_clock=lambda: 1_700_000_000.0),
                           queue=[],
                           state=ModelState.READY)


def book(now=10_000):
    timings = []
    return Accounting(lambda: now, lambda *t: timings.append(t)), timings


def test_a_batch_counts_its_execution_once_and_each_request():
    acc, timings = book()
    ver = version()
    batch = [QueuedRequest(1, 0, 2, None, enqueued_ns=100, received_ns=100, dispatched_ns=400),
             QueuedRequest(2, ENSEMBLE_FRONTEND, 3, None, enqueued_ns=200, received_ns=200,
                           dispatched_ns=400),
             QueuedRequest(3, 0, 1, None, enqueued_ns=300, received_ns=300, dispatched_ns=400)]
    acc.account(ver, batch, BatchDone(7, 1, [2], 10, 20, 30))     # the third failed
    s = ver.stats.snapshot(0)
    assert (s.inference_count, s.execution_count) == (5, 1)       # failed ones do not execute
    assert s.success.count == 2 and s.fail.count == 1
    assert timings == [(2, 200, 10, 20, 30)]    # the ensemble's step: its times go up to it


def leased(batch_size, received_ns, finished_ns, times=(10, 20, 30), executed=-1,
           failed=False):
    return LeasedRecord(7, "m", 1, batch_size, received_ns, finished_ns, *times, failed,
                        executed)


def test_leased_requests_count_even_when_their_version_is_gone():
    acc, _ = book()
    ver = version()
    acc.leased(ver, "m", [leased(4, 1_000, 5_000, executed=4)])
    acc.leased(None, "m", [leased(1, 1_000, 5_000)])
    assert acc.leased_counts == {"m": 2}
    s = ver.stats.snapshot(0)
    assert (s.inference_count, s.execution_count) == (4, 1)
    assert s.queue.ns == 5_000 - 60 - 1_000     # from the frontend's stamp to the start


def test_leased_records_in_bulk_count_as_the_batch_path_would_count_them():
    """A frontend's report of many leased requests (mixed batch sizes, a leased batch whose
    first record counts the execution, a failure) adds what the same requests would add as
    batches the scheduler dispatched, the queue time being the wait before the start."""
    acc, _ = book()
    bulk, one_by_one = version(), version()
    records = [leased(1, 100, 1_000),
               leased(2, 200, 2_000, times=(5, 6, 7)),
               leased(1, 300, 3_000, executed=3, times=(1, 2, 3)),  # a leased batch of 3:
               leased(2, 310, 3_000, executed=0, times=(1, 2, 3)),  # this one rides with it
               leased(1, 400, 4_000, failed=True),
               leased(8, 500, 60_000_000_000)]                      # a minute: another bucket
    acc.leased(bulk, "m", records)
    now = [0]
    expected = Accounting(lambda: now[0], lambda *t: None)

    def queued(r):
        started = r.finished_ns - r.compute_input_ns - r.compute_infer_ns - r.compute_output_ns
        return QueuedRequest(0, 0, r.batch_size, None, enqueued_ns=r.received_ns,
                             received_ns=r.received_ns, dispatched_ns=started)
    for batch in ([0], [1], [2, 3], [4], [5]):      # the third batch: requests 3 and 4
        first = records[batch[0]]
        now[0] = first.finished_ns
        expected.account(one_by_one, [queued(records[i]) for i in batch],
                         BatchDone(7, 1, [0] if first.failed else [], first.compute_input_ns,
                                   first.compute_infer_ns, first.compute_output_ns))
    got, want = bulk.stats.snapshot(0), one_by_one.stats.snapshot(0)
    assert got == want
    assert (got.inference_count, got.execution_count, got.fail.count) == (14, 5, 1)
    assert [b.batch_size for b in got.batch_stats] == [1, 2, 3, 8]
    assert got.latency_buckets == [4, 0, 0, 0, 1]


def test_the_reply_names_what_is_missing_and_keeps_live_workers_metrics():
    acc, _ = book()
    versions = {("m", 1): version()}
    acc.custom_metrics_in(CustomMetrics(3, []))
    acc.custom_metrics_in(CustomMetrics(4, []))
    acc.worker_gone(4)
    r = acc.reply(StatsQuery(0, 9), versions, {"m"}, {3: None}, {})
    assert [m.name for m in r.models] == ["m"] and [m.spawn_id for m in r.custom_metrics] == [3]
    assert acc.reply(StatsQuery(0, 9, "x"), versions, {"m"}, {}, {}).error == \
        "requested model 'x' is not available"
    assert acc.reply(StatsQuery(0, 9, "m", 2), versions, {"m"}, {}, {}).error == \
        "requested model version is not available for model 'm'"

