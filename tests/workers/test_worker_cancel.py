"""Worker.poll_cancelled (request.is_cancelled()): reads the inbox without blocking, records
cancellations of the running batch only, and keeps every other message, in order, for the loop."""
from __future__ import annotations

import threading
from collections import deque

import pytest
from bare_worker import BareWorker
from serverproc import wait_for

from shmserve.ipc import channel
from shmserve.ipc.messages.to_scheduler import CancelRequest, ForgetSegments
from shmserve.ipc.messages.to_worker import Ping, RequestRoute
from shmserve.workers.leases.chain import Chains


@pytest.fixture
def worker(tmp_path):
    w = BareWorker()              # only what poll_cancelled uses; no model, no arena
    w.chains, w.bls = Chains(w), None   # no ensemble runs worker to worker, no BLS
    w.sequence_lease = None             # not a sequence model
    w.inbox = channel.inbox_for(channel.worker_address(str(tmp_path), 1))
    w.backlog, w.running, w.cancelled = deque(), None, set()
    w.streams, w.stream_cancelled, w.responses_reported = {}, set(), {}
    w.main_thread = threading.get_ident()
    out = channel.outbox_for(w.inbox.address)
    yield w, out
    out.close()
    w.inbox.close()


def _queued(w, n):
    """Receive n messages the way the loop does (ipc:// delivers asynchronously)."""
    w.inbox.set_timeout(10_000)
    got = [w.inbox.recv() for _ in range(n)]
    w.inbox.set_timeout(-1)
    return got


def test_records_cancels_of_the_running_batch_and_keeps_the_rest(worker):
    w, out = worker
    w.running = [RequestRoute(5, 0), RequestRoute(6, 1)]
    for msg in (Ping(1), CancelRequest(1, 6), ForgetSegments(["a"]), CancelRequest(0, 99),
                Ping(2)):
        out.send(msg)
    # the model asks again and again; ipc:// delivers asynchronously, so ask until the last
    # message has been read
    wait_for(lambda: (w.poll_cancelled((0, 5)), w.backlog and w.backlog[-1][0] == Ping(2))[1],
             10, "every message to be read")
    assert w.poll_cancelled((1, 6)) and not w.poll_cancelled((0, 5))
    assert [m for m, _ in w.backlog] == [Ping(1), ForgetSegments(["a"]), Ping(2)]
    assert w.cancelled == {(1, 6)}                  # (0, 99) is not running: dropped


def test_outside_a_batch_nothing_is_read(worker):
    w, out = worker
    out.send(CancelRequest(0, 1))
    assert not w.poll_cancelled((0, 1))
    assert not w.backlog and not w.cancelled
    msg, _ = _queued(w, 1)[0]
    assert msg == CancelRequest(0, 1)               # still there for the loop, which drops it


def test_other_threads_read_only_what_was_recorded(worker):
    w, out = worker
    w.running = [RequestRoute(3, 0)]
    w.cancelled.add((0, 3))
    out.send(Ping(9))
    seen = []
    t = threading.Thread(target=lambda: seen.append((w.poll_cancelled((0, 3)),
                                                      w.poll_cancelled((0, 4)))))
    t.start()
    t.join()
    assert seen == [(True, False)] and not w.backlog


def test_a_request_still_streaming_stays_cancelled_after_its_batch(worker):
    """A decoupled model's request answers past execute(): a cancel read while its batch ran,
    or by the loop later, is kept until its last answer, for the model's own threads too."""
    w, out = worker
    key = (1, 6)
    w.streams[key] = (RequestRoute(6, 1), {}, {})
    w.running = [RequestRoute(6, 1)]
    out.send(CancelRequest(1, 6))
    wait_for(lambda: w.poll_cancelled(key), 10, "the cancel to be read")
    w.running, w.cancelled = None, set()        # the batch is over; the stream is not
    assert w.poll_cancelled(key)
    seen = []
    t = threading.Thread(target=lambda: seen.append(w.poll_cancelled(key)))
    t.start()
    t.join(10)
    assert seen == [True]
    w.cancel_stream(CancelRequest(0, 99))        # not streaming: dropped
    assert w.stream_cancelled == {key}
