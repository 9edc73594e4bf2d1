"""engine/accounting.py in-process: what a finished batch, a leased request and a worker's custom
metrics add, and the statistics reply (the core's own tests drive it end to end)."""
from types import SimpleNamespace

from shmserve.engine.accounting import Accounting
from shmserve.engine.batching import QueuedRequest
from shmserve.engine.states import ModelState
from shmserve.engine.stats import VersionStats
from shmserve.ipc.messages import (
    ENSEMBLE_FRONTEND,
    BatchDone,
    CustomMetrics,
    StatsQuery,
    SubmitRequest,
)


def version(name="m", v=1):
    return SimpleNamespace(name=name, version=v, stats=VersionStats(name, v), queue=[],
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


def test_leased_requests_count_even_when_their_version_is_gone():
    acc, _ = book()
    ver = version()
    head = SubmitRequest(1, 0, "m", 1, 4, 1_000)
    done = BatchDone(7, 0, [], 10, 20, 30, finished_ns=5_000, executed=4)
    acc.leased(ver, head, done)
    acc.leased(None, SubmitRequest(2, 0, "m", 1, 1, 1_000), done)
    assert acc.leased_counts == {"m": 2}
    s = ver.stats.snapshot(0)
    assert (s.inference_count, s.execution_count) == (4, 1)
    assert s.queue.ns == 5_000 - 60 - 1_000     # from the frontend's stamp to the start


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

