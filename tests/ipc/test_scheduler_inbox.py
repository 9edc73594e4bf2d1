"""channel.SchedulerInbox: ZeroMQ (frontends, inproc threads) and packets (workers) behind one
blocking receive, workers' messages first, with the receive timeout the scheduler's loop uses."""
import itertools
import threading
import time

import pytest
import zmq

from shmserve.ipc import channel
from shmserve.ipc.messages.to_scheduler import BatchDone, FrontendHello, ProcessExited, Wake

_wakes = itertools.count()


@pytest.fixture
def inbox(tmp_path):
    box = channel.SchedulerInbox(channel.address(str(tmp_path), "scheduler"),
                                 channel.scheduler_worker_address(str(tmp_path)))
    # inproc names are per process, and a closed socket gives its name back asynchronously
    box.wake = f"inproc://test-scheduler-wake-{next(_wakes)}"
    box.bind_also(box.wake)
    yield box
    box.close()


def test_messages_from_both_transports_arrive_with_their_frames(inbox):
    frontend = channel.Outbox(inbox.address, wait_connected_s=5)
    worker = channel.outbox_for(inbox.worker_address)
    frontend.send(FrontendHello(1, "unix:///x"), (b"payload",))
    worker.send(BatchDone(3, 7))
    inbox.set_timeout(5000)
    got = [inbox.recv() for _ in range(2)]
    assert (BatchDone(3, 7), []) in got and (FrontendHello(1, "unix:///x"), [b"payload"]) in got
    frontend.close()
    worker.close()


def test_a_workers_last_words_come_before_the_news_of_its_exit(inbox):
    wake = channel.context().socket(zmq.PUSH)
    wake.connect(inbox.wake)
    worker = channel.outbox_for(inbox.worker_address)
    worker.send(BatchDone(3, 7))            # written before it "exits"
    worker.close()
    wake.send(channel.messages.encode(ProcessExited(3)))
    inbox.set_timeout(5000)
    assert inbox.recv()[0] == BatchDone(3, 7)
    assert inbox.recv()[0] == ProcessExited(3)
    wake.close(0)


def test_the_timeout_covers_the_whole_receive_and_noblock_does_not_wait(inbox):
    with pytest.raises(zmq.Again):
        inbox.recv(channel.NOBLOCK)
    inbox.set_timeout(200)
    t = time.monotonic()
    with pytest.raises(zmq.Again):
        inbox.recv()
    assert 0.15 < time.monotonic() - t < 5


def test_a_blocking_receive_wakes_for_a_message_from_a_thread(inbox):
    def later():
        time.sleep(0.1)
        s = channel.context().socket(zmq.PUSH)
        s.connect(inbox.wake)
        s.send(channel.messages.encode(Wake()))
        s.close(linger=1000)

    t = threading.Thread(target=later)
    t.start()
    inbox.set_timeout(-1)
    assert inbox.recv()[0] == Wake()
    t.join()
