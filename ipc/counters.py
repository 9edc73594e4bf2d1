"""Byte and message counters for every frame that crosses a process boundary, whatever the
transport, so tests and metrics can prove that tensor bytes above the inline limit travel
through shared memory instead."""
from __future__ import annotations


class IpcCounters:
    __slots__ = ("sent_bytes", "received_bytes", "sent_messages", "received_messages",
                 "largest_sent", "largest_received")

    def __init__(self):
        self.sent_bytes = self.received_bytes = 0
        self.sent_messages = self.received_messages = 0
        self.largest_sent = self.largest_received = 0

    def received(self, size: int) -> None:
        self.received_bytes += size
        self.received_messages += 1
        if size > self.largest_received:
            self.largest_received = size

    def sent(self, size: int) -> None:
        self.sent_bytes += size
        self.sent_messages += 1
        if size > self.largest_sent:
            self.largest_sent = size

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


COUNTERS = IpcCounters()
