"""Which user a client on this host runs as, from its TCP connection alone.

A registration of a shared-memory segment lets the client read and write that segment through
the server's own permissions; the registry accepts a segment only from the user who owns it
(frontend/shm/registry.py). A TCP connection carries no credentials (SO_PEERCRED is for unix
sockets), but a loopback client's socket is one of this host's, and the kernel lists every TCP
socket of this network namespace in /proc/net/tcp and /proc/net/tcp6 with the uid that owns it:
the client's socket is the one whose local address and port are the peer's.

Read on registration only, never per request: a read of one of those files costs the kernel a
walk of its whole TCP hash table, about 3.5 ms however few sockets are open (measured on a
2-core VM), so the second file is read only when the first does not list the client.
"""
from __future__ import annotations

import socket
import struct

_FILES: dict[int, str] = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}
# socket states (include/net/tcp_states.h) whose entries do not name an owner: a TIME_WAIT
# entry shows uid 0 and inode 0, a listening socket is not a client's
_TIME_WAIT, _LISTEN = b"06", b"0A"


def peer_name(address) -> str:
    """A socket's peer address (``getpeername()``) in gRPC's form ("ipv4:127.0.0.1:5000",
    "ipv6:[::1]:5000", "unix:/path"); "" for none."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return f"unix:{address}" if address else ""


def host_port(peer: str) -> tuple[str, int] | None:
    """(host, port) of a peer in gRPC's form ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000");
    None for any other form (a unix socket, a bare host)."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return None
    host, _, port = peer[5:].rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _hex_address(family: int, host: str) -> str:
    """The address as /proc/net/tcp* print it: each 32-bit word in host byte order, in hex."""
    raw = socket.inet_pton(family, host)
    return "".join("%08X" % w for w in struct.unpack(f"={len(raw) // 4}I", raw))


def _places(host: str) -> list[tuple[int, str]]:
    """Where a client socket with this address may be listed: an IPv4 client is in tcp, or in
    tcp6 as a v4-mapped address when its socket is a dual-stack IPv6 one."""
    mapped = host.lower().removeprefix("::ffff:")
    try:
        socket.inet_pton(socket.AF_INET, mapped)
        v4 = mapped
    except OSError:
        v4 = ""
    if v4:
        return [(socket.AF_INET, _hex_address(socket.AF_INET, v4)),
                (socket.AF_INET6, _hex_address(socket.AF_INET6, "::ffff:" + v4))]
    return [(socket.AF_INET6, _hex_address(socket.AF_INET6, host))]


def socket_uid(peer: str) -> int | None:
    """The uid owning the TCP socket at the peer's address and port on this host; None when
    there is none, or when several sockets of different users share that address and port
    (possible with SO_REUSEADDR: then nobody can tell which one is the client)."""
    hp = host_port(peer)
    if hp is None:
        return None
    host, port = hp
    try:
        places = _places(host)
    except OSError:
        return None
    uids = set()
    for family, address in places:
        needle = f": {address}:{port:04X} ".encode()
        try:
            with open(_FILES[family], "rb") as f:
                table = f.read()
        except OSError:
            continue
        at = table.find(needle)
        while at >= 0:
            end = table.find(b"\n", at)
            fields = table[at:end if end >= 0 else len(table)].split()
            # fields: ':', local, remote, state, queues, timer, retransmits, uid, timeout, inode
            if len(fields) > 9 and fields[3] not in (_TIME_WAIT, _LISTEN) and fields[9] != b"0":
                uids.add(int(fields[7]))
            at = table.find(needle, at + 1)
        if uids:
            break
    return uids.pop() if len(uids) == 1 else None
