"""VersionStats: the scheduler's per-version counters, with an injected wall clock."""
import pytest

from shmserve.engine.stats import DEFAULT_LATENCY_BUCKETS_MS, FAILURE_REASONS, VersionStats
from shmserve.ipc.messages.to_frontend import Duration

MS = 1_000_000      # ns per millisecond


class Wall:
    def __init__(self, t=1_700_000_000.5):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def wall():
    return Wall()


@pytest.fixture
def stats(wall):
    return VersionStats("m", 3, wall_clock=wall)


def test_fresh_record(stats):
    r = stats.snapshot(0)
    assert (r.name, r.version) == ("m", 3)
    assert (r.last_inference, r.inference_count, r.execution_count, r.pending) == (0, 0, 0, 0)
    for d in (r.success, r.fail, r.queue, r.compute_input, r.compute_infer, r.compute_output,
              r.cache_hit, r.cache_miss):
        assert d == Duration(0, 0)
    assert r.batch_stats == []
    assert r.failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 0}
    assert list(r.failures) == list(FAILURE_REASONS)
    assert r.latency_buckets == [0] * (len(DEFAULT_LATENCY_BUCKETS_MS) + 1)
    assert r.latency_sum_ms == 0.0


def test_succeeded_accumulates(stats):
    stats.successes([4], totals=[10 * MS], queues=[1_000], inputs=[200], infers=[3_000],
                    outputs=[40])
    stats.successes([1], totals=[20 * MS], queues=[2_000], inputs=[100], infers=[1_000],
                    outputs=[60])
    r = stats.snapshot(0)
    assert r.inference_count == 5                  # batch sizes, not requests
    assert r.success == Duration(2, 30 * MS)
    assert r.queue == Duration(2, 3_000)
    assert r.compute_input == Duration(2, 300)
    assert r.compute_infer == Duration(2, 4_000)
    assert r.compute_output == Duration(2, 100)
    assert r.execution_count == 0                  # executions are counted by executions()
    assert r.fail == Duration(0, 0)


def test_negative_durations_count_as_zero(stats):
    stats.successes([1], totals=[-5], queues=[-1], inputs=[-1], infers=[-1], outputs=[-1])
    stats.failed("BACKEND", -7)
    stats.executions([1], [-1], [-2], [-3])
    r = stats.snapshot(0)
    assert r.success == Duration(1, 0) and r.queue == Duration(1, 0)
    assert r.fail == Duration(1, 0)
    assert r.batch_stats[0].compute_infer == Duration(1, 0)


def test_failed_by_reason(stats):
    stats.failed("REJECTED", 100)
    stats.failed("REJECTED", 200)
    stats.failed("BACKEND", 50)
    stats.failed("CANCELED", 1)
    stats.failed("SOMETHING_ELSE", 10)
    stats.failed("", 10)
    r = stats.snapshot(0)
    assert r.fail == Duration(6, 371)
    assert r.failures == {"REJECTED": 2, "CANCELED": 1, "BACKEND": 1, "OTHER": 2}
    assert r.inference_count == 0 and r.success == Duration(0, 0)
    assert r.latency_buckets == [0] * 5            # failures are not in the latency histogram


def test_executed_counts_executions_and_groups_batch_sizes(stats):
    stats.executions([4], [10], [100], [1])
    stats.executions([1], [20], [200], [2])
    stats.executions([4], [30], [300], [3])
    stats.executions([2], [40], [400], [4])
    r = stats.snapshot(0)
    assert r.execution_count == 4
    assert r.inference_count == 0                  # inferences are counted by successes()
    assert [b.batch_size for b in r.batch_stats] == [1, 2, 4]      # sorted by batch size
    b4 = r.batch_stats[2]
    assert (b4.compute_input, b4.compute_infer, b4.compute_output) == \
        (Duration(2, 40), Duration(2, 400), Duration(2, 4))
    b1 = r.batch_stats[0]
    assert (b1.compute_input, b1.compute_infer, b1.compute_output) == \
        (Duration(1, 20), Duration(1, 200), Duration(1, 2))
    # the batch durations are separate objects, not shared
    assert b4.compute_input is not b4.compute_infer


def test_snapshot_sorts_sizes_added_later(stats):
    stats.executions([8], [1], [1], [1])
    assert [b.batch_size for b in stats.snapshot(0).batch_stats] == [8]
    stats.executions([3], [1], [1], [1])
    stats.executions([5], [1], [1], [1])
    assert [b.batch_size for b in stats.snapshot(0).batch_stats] == [3, 5, 8]


def test_last_inference_from_the_wall_clock(stats, wall):
    stats.successes([1], [1], [1], [1], [1], [1])
    assert stats.snapshot(0).last_inference == 0   # set per execution
    stats.executions([1], [1], [1], [1])
    assert stats.snapshot(0).last_inference == 1_700_000_000_500
    wall.t = 1_700_000_123.25
    stats.executions([1], [1], [1], [1])
    assert stats.snapshot(0).last_inference == 1_700_000_123_250


@pytest.mark.parametrize("total_ms, bucket", [
    (0, 0), (99.5, 0), (100, 0),                   # a value on an edge goes to that bucket
    (100.001, 1), (500, 1), (500.5, 2), (2000, 2), (4999, 3), (5000, 3),
    (5000.001, 4), (60_000, 4),                    # above the last edge: the overflow bucket
])
def test_latency_buckets(stats, total_ms, bucket):
    stats.successes([1], [int(total_ms * MS)], [0], [0], [0], [0])
    r = stats.snapshot(0)
    expected = [0] * 5
    expected[bucket] = 1
    assert r.latency_buckets == expected
    assert r.latency_sum_ms == pytest.approx(total_ms)


def test_latency_sum_and_custom_buckets(wall):
    s = VersionStats("m", 1, buckets_ms=[1, 10], wall_clock=wall)
    for ms in (0.5, 1, 2, 10, 11, 12):
        s.successes([1], [int(ms * MS)], [0], [0], [0], [0])
    r = s.snapshot(0)
    assert r.latency_buckets == [2, 2, 2]
    assert r.latency_sum_ms == pytest.approx(36.5)


def test_many_at_once_add_what_one_at_a_time_adds(wall):
    """successes() and executions() take lists: the many records a frontend reports at once
    in one call. Mixed batch sizes, a negative duration in a column and the summaries'
    windows all come out as if added one by one."""
    cols = ([1, 4, 1, 2], [MS, 600 * MS, 3 * MS, -2], [10, -5, 30, 40], [1, 2, 3, 4],
            [100, 200, 300, 400], [7, 8, -9, 10])
    bulk = VersionStats("m", 1, wall_clock=wall, summaries=True)
    single = VersionStats("m", 1, wall_clock=wall, summaries=True)
    bulk.successes(*cols)
    bulk.executions(cols[0], *cols[3:])
    for row in zip(*cols):
        single.successes(*[[v] for v in row])
        single.executions([row[0]], *[[v] for v in row[3:]])
    assert bulk.snapshot(0) == single.snapshot(0)
    r = bulk.snapshot(0)
    assert r.success == Duration(4, 604 * MS) and r.compute_output == Duration(4, 25)
    assert [(b.batch_size, b.compute_infer.count) for b in r.batch_stats] == \
        [(1, 2), (2, 1), (4, 1)]


def test_empty_lists_add_nothing(stats, wall):
    stats.successes([], [], [], [], [], [])
    stats.executions([], [], [], [])
    assert stats.snapshot(0) == VersionStats("m", 3, wall_clock=wall).snapshot(0)


def test_snapshot_pending(stats):
    assert stats.snapshot(7).pending == 7
    assert stats.snapshot(0).pending == 0


def test_versions_do_not_share_counters(wall):
    a = VersionStats("a", 1, wall_clock=wall)
    b = VersionStats("b", 1, wall_clock=wall)
    a.failed("REJECTED", 1)
    a.successes([2], [50 * MS], [0], [0], [0], [0])
    a.executions([2], [0], [0], [0])
    rb = b.snapshot(0)
    assert rb.failures["REJECTED"] == 0
    assert rb.latency_buckets == [0] * 5
    assert rb.success == Duration(0, 0) and rb.batch_stats == []


def test_cache_hits_are_successes_that_ran_nothing(stats, wall):
    stats.cached(True, 20_000, 50_000, 1)
    stats.cached(True, 30_000, 3 * 1000 * MS, 1)      # a 3 s hit: the (2 s, 5 s] bucket
    r = stats.snapshot(0)
    assert r.cache_hit == Duration(2, 50_000)
    assert r.success == Duration(2, 50_000 + 3000 * MS)
    assert r.queue.count == 2 and r.queue.ns == 0      # success and queue include hits
    assert r.inference_count == 0 and r.execution_count == 0     # inferences do not
    assert r.compute_infer == Duration(0, 0) and r.batch_stats == []
    assert r.latency_buckets[0] == 1 and r.latency_buckets[3] == 1
    assert r.last_inference == int(wall.t * 1000)


def test_cache_misses_count_lookups_and_add_insert_times(stats):
    stats.cached(False, 5_000, 0, 1)        # the lookup
    stats.cached(False, 7_000, 0, 0)        # its insert, once the answer came
    r = stats.snapshot(0)
    assert r.cache_miss == Duration(1, 12_000)
    assert r.success == Duration(0, 0) and r.cache_hit == Duration(0, 0)


def test_cache_lookups_have_summary_windows(wall):
    s = VersionStats("m", 1, wall_clock=wall, summaries=True)
    s.cached(True, 4_000, 9_000, 1)
    s.cached(False, 6_000, 0, 1)
    s.cached(False, 50_000, 0, 0)       # an insert: no observation of its own
    r = s.snapshot(0)
    assert r.summaries["cache_hit"][0] == 4.0 and r.summaries["cache_miss"] == [6.0] * 5
    assert r.summaries["request"][0] == 9.0        # the hit's duration


def test_response_statistics_by_index_and_kind(stats):
    """Triton's response_stats: a success or failure splits its time at the start of its
    outputs; an empty response only computed; a cancelled one counts its clean-up only."""
    stats.response(0, "success", 0, 40 * MS, 60 * MS)
    stats.response(0, "success", 0, 40 * MS, 60 * MS)
    stats.response(1, "fail", 60 * MS, 100 * MS, 120 * MS)
    stats.response(2, "empty", 120 * MS, 0, 160 * MS)
    stats.response(3, "cancel", 160 * MS, 0, 165 * MS)
    rs = stats.snapshot(0).response_stats
    assert sorted(rs) == ["0", "1", "2", "3"]
    assert rs["0"].compute_infer == Duration(2, 80 * MS)
    assert rs["0"].compute_output == Duration(2, 40 * MS)
    assert rs["0"].success == Duration(2, 120 * MS) and rs["0"].fail == Duration()
    assert (rs["1"].fail, rs["1"].compute_infer, rs["1"].compute_output) == \
        (Duration(1, 60 * MS), Duration(1, 40 * MS), Duration(1, 20 * MS))
    assert (rs["2"].empty_response, rs["2"].compute_infer, rs["2"].compute_output) == \
        (Duration(1, 40 * MS), Duration(1, 40 * MS), Duration())
    assert rs["3"].cancel == Duration(1, 5 * MS) and rs["3"].compute_infer == Duration()
    assert stats.snapshot(0).success == Duration()     # the requests' own counters are apart
