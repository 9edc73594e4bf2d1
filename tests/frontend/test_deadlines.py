"""The frontend's request deadline (issue 13): the pure bookkeeping (frontend/deadlines.py) and
the EngineClient that acts on it, against a fake scheduler socket that never answers."""
import asyncio
import tempfile
import time

import pytest
import zmq

from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend.deadlines import TIMEOUT_GRACE_S, Deadlines
from shmserve.frontend.engine_client import EngineClient
from shmserve.ipc import channel
from shmserve.ipc.messages.common import ErrorCode, InferPayload
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.messages.to_scheduler import CancelRequest, FrontendHello, SubmitRequest

S = 1_000_000_000


def test_default_deadlines_expire_in_order_and_answered_ones_are_forgotten():
    d = Deadlines(default_s=2)
    for rid in (1, 2, 3):
        d.add(rid, received_ns=rid * S)
    live = {1, 3}                               # 2 was answered
    assert d.expired(2 * S, live) == []
    assert d.next_ns() == 3 * S
    assert d.expired(4 * S, live) == [(1, False)]
    assert len(d) == 1                              # 2 went without a word
    assert d.expired(5 * S, live) == [(3, False)]
    assert len(d) == 0 and d.next_ns() is None


def test_a_request_timeout_sets_an_earlier_deadline_with_a_grace():
    d = Deadlines(default_s=60)
    own = d.add(1, received_ns=0, timeout_us=500_000)
    assert own == int((0.5 + TIMEOUT_GRACE_S) * S)
    assert d.add(2, received_ns=0, timeout_us=3_600_000_000) == 60 * S    # later: the default
    assert d.expired(own - 1, {1, 2}) == []
    assert d.expired(own, {1, 2}) == [(1, True)]
    assert "timeout" in d.message(True) and "--request-deadline-secs" in d.message(False)
    assert d.message(False).startswith("Request timeout expired")


def test_answered_entries_behind_a_live_one_are_compacted():
    d = Deadlines(default_s=3600)
    d.add(0, received_ns=0)                     # held for ever at the front
    for rid in range(1, 5000):
        d.add(rid, received_ns=rid)
    d.compact({0})
    assert len(d) == 1
    d.compact({0})                              # nothing to do
    assert len(d) == 1


# ---- the EngineClient ------------------------------------------------------------------------------
def _prepared(timeout_us: int = 0) -> PreparedRequest:
    return PreparedRequest(InferPayload("", [], []), batch_size=1, outputs={}, request_id="",
                           timeout_us=timeout_us)


@pytest.fixture
def run_dir():
    with tempfile.TemporaryDirectory(prefix="shmserve-deadlines-") as d:
        yield d


def test_engine_client_answers_at_the_deadline_cancels_and_leaks_nothing(run_dir):
    scheduler = channel.Inbox(channel.address(run_dir, "scheduler"))     # never answers

    async def scenario():
        loop = asyncio.get_running_loop()
        client = EngineClient(run_dir, 0, loop, request_deadline_secs=0.3)
        try:
            results: dict[int, InferResult] = {}
            t = time.monotonic()
            a = client.submit("m", 1, _prepared(), lambda r: results.setdefault(r.req_id, r))
            b = client.submit("m", 1, _prepared(), lambda r: results.setdefault(r.req_id, r),
                              ordered=True)
            while len(results) < 2 and time.monotonic() - t < 10:
                await asyncio.sleep(0.02)
            return client, results, a, b
        finally:
            client.close()

    client, results, a, b = asyncio.run(scenario())
    for rid in (a, b):
        assert results[rid].code is ErrorCode.UNAVAILABLE
        assert results[rid].error.startswith("Request timeout expired")
        assert results[rid].model == "m"
    # nothing left behind
    assert client.pending == {} and client.sent == {} and client.held == {}
    assert client.ordered_key == {} and not any(client.order.values())
    assert len(client.deadlines) == 0
    seen = []
    while True:
        try:
            seen.append(scheduler.recv(channel.NOBLOCK)[0])
        except zmq.Again:
            break
    scheduler.close()
    assert isinstance(seen[0], FrontendHello)
    assert [m.req_id for m in seen if isinstance(m, SubmitRequest)] == [a, b]
    assert sorted(m.req_id for m in seen if isinstance(m, CancelRequest)) == [a, b]


def test_an_answer_in_time_is_delivered_once_and_a_late_one_dropped(run_dir):
    scheduler = channel.Inbox(channel.address(run_dir, "scheduler"))

    async def scenario():
        loop = asyncio.get_running_loop()
        client = EngineClient(run_dir, 0, loop, request_deadline_secs=0.3)
        try:
            got: list[InferResult] = []
            rid = client.submit("m", 1, _prepared(), got.append)
            me = channel.outbox_for(channel.frontend_address(run_dir, 0))
            me.send(InferResult(rid, "m", 1, outputs=[]))
            t = time.monotonic()
            # answered, then past its deadline: the sweep drops the entry without a word
            while (not got or len(client.deadlines)) and time.monotonic() - t < 10:
                await asyncio.sleep(0.02)
            me.close()
            return client, got
        finally:
            client.close()

    client, got = asyncio.run(scenario())
    scheduler.close()
    assert len(got) == 1 and not got[0].error
    assert client.pending == {} and client.sent == {} and len(client.deadlines) == 0
