"""A receiver that reads a packet inbox's address packet by packet, as the wire carries them.

``ipc/packets.PacketInbox`` hides packet boundaries (it hands out messages); tests that check how
senders pack messages into packets read the socket with this instead: each ``packet()`` is the
messages one packet (or one fragmented message's packets) held, decoded and in order.
"""
from __future__ import annotations

import os
import select
import socket

from shmserve.ipc import messages, packets


class PacketReader:
    def __init__(self, addr: str):
        self.address = addr
        self.path = addr[len(packets.SCHEME):]
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.conn: socket.socket | None = None

    def accept(self, timeout_s: float = 5.0) -> None:
        """Takes the sender's connection (one sender), if not taken yet."""
        if self.conn is None:
            if not select.select([self.listener], [], [], timeout_s)[0]:
                raise TimeoutError("no sender connected")
            self.conn, _ = self.listener.accept()

    def packet(self, timeout_s: float = 5.0) -> list[tuple[object, list[bytes]]]:
        """The next packet's messages: (decoded message, payload frames) each."""
        self.accept(timeout_s)
        assert self.conn is not None
        parts = []
        while True:
            if not select.select([self.conn], [], [], timeout_s)[0]:
                raise TimeoutError("no packet arrived")
            data = self.conn.recv(packets.MAX_PACKET + 64)
            if not data:
                raise ConnectionError("the sender closed its end")
            parts.append(data[1:])
            if not data[0] & packets.MORE:      # the last (or only) packet of its message(s)
                break
        return [(messages.decode(head), frames)
                for head, frames in packets._decode_frames(b"".join(parts))]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        os.unlink(self.path)
