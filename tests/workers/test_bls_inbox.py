"""The BLS client's shared inbox (workers/python_backend/bls_inbox.py) on a real packet inbox: a waiting caller
reads its own answer, a background thread reads while nobody waits, and each hands the other the
reading token without losing a message."""
import queue
import threading
import time

import pytest
from serverproc import wait_for

from shmserve.ipc import channel, packets
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.workers.python_backend.bls_inbox import SharedInbox


@pytest.fixture
def shared(tmp_path):
    inbox = packets.PacketInbox(channel.frontend_address(str(tmp_path), 99))
    queues: dict[int, queue.SimpleQueue] = {}
    handled: list = []
    flushed: list = []

    def handle(msg):
        handled.append((threading.current_thread().name, msg.req_id))
        queues.setdefault(msg.req_id, queue.SimpleQueue()).put(msg)
    s = SharedInbox(inbox, handle, lambda: None, lambda: False, lambda: flushed.append(1))
    s.start()
    out = packets.PacketOutbox(inbox.address)
    yield s, out, queues, handled
    s.close(10)
    assert not s.thread.is_alive()
    inbox.close()
    out.close()


def test_the_background_thread_reads_while_nobody_waits(shared):
    s, out, queues, handled = shared
    out.send(InferResult(1, "m", 1))
    wait_for(lambda: handled, 10, "the background thread to read it")
    assert handled == [("bls-receiver", 1)]


def test_a_caller_reads_its_own_answer_and_others_on_the_way(shared):
    s, out, queues, handled = shared
    mine = queues.setdefault(7, queue.SimpleQueue())
    got: list = []
    caller = threading.Thread(target=lambda: got.append(s.wait(mine, None)), name="caller")
    caller.start()
    # the caller took the token from the background thread (a Wake), and waits in the inbox
    wait_for(lambda: s.reading, 10, "the caller to hold the token")
    out.send(InferResult(3, "m", 1))        # another call's answer
    out.send(InferResult(7, "m", 1))
    caller.join(10)
    assert [r.req_id for r in got] == [7]
    assert handled == [("caller", 3), ("caller", 7)]
    assert queues[3].get_nowait().req_id == 3       # delivered to its own queue
    # nobody waits now: the background thread takes the inbox back
    wait_for(lambda: not s.reading and s._quiet(), 10, "a quiet spell")
    out.send(InferResult(8, "m", 1))
    wait_for(lambda: len(handled) == 3, 10, "the background thread to read again")
    assert handled[-1] == ("bls-receiver", 8)


def test_a_caller_past_its_deadline_gets_nothing(shared):
    s, out, queues, handled = shared
    with pytest.raises(queue.Empty):
        s.wait(queue.SimpleQueue(), time.monotonic() + 0.05)
    out.send(InferResult(5, "m", 1))        # the inbox still works afterwards
    wait_for(lambda: handled, 10, "the answer to be read")
