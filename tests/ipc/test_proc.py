"""StopFlag's wake-up and second-signal hooks, and InboxWaker ending a blocking receive."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from shmserve.ipc import channel
from shmserve.ipc.messages.to_scheduler import Wake
from shmserve.ipc.messages.to_worker import Ping
from shmserve.ipc.proc import InboxWaker, StopFlag, StoppingMark


@pytest.fixture
def restore_sigusr1():
    old = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, old)


def test_first_signal_wakes_later_ones_repeat(restore_sigusr1):
    calls = []
    stop = StopFlag(signals=(signal.SIGUSR1,), on_signal=lambda s: calls.append(("wake", s)),
                    on_repeat=lambda s: calls.append(("repeat", s)))
    assert not stop.set
    os.kill(os.getpid(), signal.SIGUSR1)    # the handler runs before the next bytecode
    assert stop.set and stop.signum == signal.SIGUSR1
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert calls == [("wake", signal.SIGUSR1), ("repeat", signal.SIGUSR1),
                     ("repeat", signal.SIGUSR1)]


def test_stop_flag_without_hooks_is_as_before(restore_sigusr1):
    stop = StopFlag(signals=(signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.set and stop.signum == signal.SIGUSR1


def test_signal_ends_a_blocking_receive_with_wake(tmp_path, restore_sigusr1):
    inbox = channel.Inbox(channel.address(str(tmp_path), "inbox"))
    waker = InboxWaker("test-proc")
    inbox.bind_also(waker.address)
    try:
        stop = StopFlag(signals=(signal.SIGUSR1,), on_signal=waker)
        # without the waker this receive would run into its 30 s timeout (zmq.Again)
        inbox.set_timeout(30_000)
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        msg, frames = inbox.recv()
        timer.join()
        assert isinstance(msg, Wake) and frames == [] and stop.set
        # a message already queued comes first; the wake follows it
        out = channel.Outbox(inbox.address)
        out.send(Ping(1))
        channel_msg, _ = inbox.recv()
        assert channel_msg == Ping(1)
        out.close()
    finally:
        waker.close()
        waker()                             # after close: ignored, never raises
        inbox.close()


def test_freeze_startup_heap_takes_what_lives_out_of_the_collectors_reach():
    # in a fresh interpreter: freezing this one would hold pytest's garbage for ever
    code = ("import gc; from shmserve.ipc.proc import freeze_startup_heap; "
            "keep = [[i] for i in range(20000)]; before = len(gc.get_objects()); "
            "freeze_startup_heap(); "
            "print(gc.get_freeze_count() >= 20000, len(gc.get_objects()) < before // 10)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.split() == ["True", "True"]


def test_the_stopping_mark_set_in_one_process_is_seen_by_another(tmp_path):
    mark = StoppingMark(str(tmp_path), create=True)
    reader = (f"import sys, time; sys.path.insert(0, {os.getcwd()!r})\n"
              f"from shmserve.ipc.proc import StoppingMark\n"
              f"m = StoppingMark({str(tmp_path)!r})\n"
              f"print(m.is_set(), flush=True)\n"
              f"deadline = time.monotonic() + 30\n"
              f"while not m.is_set() and time.monotonic() < deadline:\n"
              f"    time.sleep(0.001)\n"
              f"print(m.is_set(), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", reader], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "False"
        mark.set()
        assert child.stdout.readline().strip() == "True"
    finally:
        child.wait(timeout=30)
        mark.close()
    with pytest.raises(FileNotFoundError):      # a frontend without a launcher has none
        StoppingMark(str(tmp_path / "elsewhere"))
