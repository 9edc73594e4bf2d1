"""Worker deaths, seen the moment they happen, delivered as messages into the scheduler's inbox.

A thread waits on the workers' pidfds with epoll and sends ``ProcessExited`` over inproc. The
scheduler's loop then has one thing to wait on, its inbox, and blocks in a plain receive, which
is cheaper per message than polling the inbox together with one pidfd per worker
(bench/zmq_options.py measures both). No SIGCHLD handler is involved.
"""
from __future__ import annotations

import os
import select
import threading

import zmq

from shmserve.ipc import messages
from shmserve.ipc.messages.to_scheduler import ProcessExited


class ExitWatcher:
    def __init__(self, context: zmq.Context, address: str):
        self._context = context
        self._address = address
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._spawn_of: dict[int, int] = {}     # pidfd -> spawn id
        self._wake_r, self._wake_w = os.pipe()  # ends the wait on close
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmserve-exits", daemon=True)
        self._thread.start()

    def watch(self, pidfd: int, spawn_id: int) -> None:
        with self._lock:
            self._spawn_of[pidfd] = spawn_id
            # one-shot: an exited process stays readable, and one message about it is enough
            self._epoll.register(pidfd, select.EPOLLIN | select.EPOLLONESHOT)

    def rearm(self, pidfd: int) -> None:
        """After a report about a process that turned out to be alive (the descriptor number
        was reused between the event and its report): wait for this one's real exit."""
        with self._lock:
            if pidfd in self._spawn_of:
                self._epoll.modify(pidfd, select.EPOLLIN | select.EPOLLONESHOT)

    def unwatch(self, pidfd: int) -> None:
        """Call before closing the pidfd, so a reused descriptor number is never confused."""
        with self._lock:
            if self._spawn_of.pop(pidfd, None) is not None:
                try:
                    self._epoll.unregister(pidfd)
                except (OSError, ValueError):
                    pass

    def _run(self) -> None:
        out = self._context.socket(zmq.PUSH)   # made and used only in this thread
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self._address)
        try:
            while not self._closed:
                try:
                    events = self._epoll.poll()
                except InterruptedError:
                    continue
                for fd, _ in events:
                    if fd == self._wake_r:
                        continue
                    with self._lock:
                        sid = self._spawn_of.get(fd)
                    if sid is not None:
                        out.send(messages.encode(ProcessExited(sid)))
        finally:
            out.close(0)

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=1)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
