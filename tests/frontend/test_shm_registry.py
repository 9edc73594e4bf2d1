"""Client shared-memory registration: who may register, use, list and unregister regions, whose
segments a client may register, and which keys name a segment at all."""
import os
import socket
import subprocess
import sys
import uuid

import pytest

from shmserve.frontend import peer_uid
from shmserve.frontend.shm.registry import ShmRegistry, is_local_peer
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode


@pytest.fixture
def segment():
    name = f"shmtest_{uuid.uuid4().hex}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    yield name
    os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv6:[::1]:5000", True), ("unix:/tmp/s", True),
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("", True), ("ipv4:10.1.2.3:5000", False), ("ipv6:[2001:db8::1]:443", False),
    ("192.168.1.5", False), ("not-an-address", False),
])
def test_local_peers(peer, local):
    assert is_local_peer(peer) is local


@pytest.fixture
def loopback():
    """Real loopback TCP connections: yields connect(family) -> the server side's peer, in
    gRPC's form, of a new connection made by this process."""
    made = []

    def connect(family=socket.AF_INET, host="127.0.0.1"):
        srv = socket.socket(family)
        srv.bind((host, 0))
        srv.listen()
        c = socket.create_connection(srv.getsockname()[:2], timeout=5)
        s, address = srv.accept()
        made.extend((srv, c, s))
        return peer_uid.peer_name(address)
    yield connect
    for sock in made:
        sock.close()


def test_only_local_clients_register_by_default(segment, loopback):
    reg = ShmRegistry()
    with pytest.raises(InferError) as e:
        reg.register_system("r", f"/{segment}", 0, 64, peer="ipv4:10.1.2.3:5000")
    assert "accepted only from clients on this host (--client-shm-from=local)" in e.value.message
    assert reg.system == {}
    reg.register_system("r", f"/{segment}", 0, 64, peer=loopback())
    ShmRegistry(local_only=False).register_system("r", f"/{segment}", 0, 64, peer="10.1.2.3")


def test_a_client_not_allowed_to_register_can_neither_list_use_nor_unregister(segment):
    """Regions are for the clients allowed to register them: a remote peer under
    --client-shm-from=local learns nothing of the local clients' regions (not even whether a
    name exists) and cannot touch them."""
    reg = ShmRegistry()
    reg.register_system("r", f"/{segment}", 0, 64)
    remote = "ipv6:[2001:db8::7]:40000"
    for call in (lambda: reg.status_system("", remote), lambda: reg.status_system("r", remote),
                 lambda: reg.unregister_system("r", remote),
                 lambda: reg.unregister_system("", remote),
                 lambda: reg.status_cuda("", remote), lambda: reg.unregister_cuda("", remote)):
        with pytest.raises(InferError) as e:
            call()
        assert "accepted only from clients on this host" in e.value.message
        assert remote in e.value.message
    for name in ("r", "no-such-region"):
        with pytest.raises(InferError) as e:
            reg.for_peer(remote).resolve(name, 16, 0, "input 'INPUT0'")
        assert e.value.message.startswith(f"input 'INPUT0': shared memory region '{name}': "
                                          f"shared memory is accepted only from clients")
    assert set(reg.system) == {"r"}
    # local peers, and any peer with --client-shm-from=any, use the same regions
    assert reg.for_peer("127.0.0.1") is reg and reg.for_peer("ipv6:[::1]:5") is reg
    assert reg.for_peer("::ffff:127.0.0.1") is reg
    assert reg.for_peer("127.0.0.1").resolve("r", 16, 0, "x")[1].nbytes == 16
    anyone = ShmRegistry(local_only=False, table=reg.table)
    assert anyone.for_peer(remote) is anyone and [r["name"] for r in
                                                   anyone.status_system("", remote)] == ["r"]


def _segment_of(uid):
    name = f"shmtest_{uuid.uuid4().hex}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    os.chown(path, uid, -1)
    return name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a client of another user")
@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_local_client_registers_only_segments_its_user_owns(family, host):
    """A client of user 65534 (nobody), connected over loopback TCP, may register its own
    segment but not root's, which the server (root here) could open for it."""
    srv = socket.socket(family)
    srv.bind((host, 0))
    srv.listen()
    # the numeric address needs no name lookup (the stdlib under /root is out of nobody's reach)
    # (a socket belongs to the user who created it)
    code = (f"import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            f"c = socket.socket({int(family)})\nc.connect(({host!r}, {srv.getsockname()[1]}))\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    mine, roots = _segment_of(65534), _segment_of(0)
    try:
        srv.settimeout(10)
        s, address = srv.accept()
        peer = peer_uid.peer_name(address)
        assert peer_uid.socket_uid(peer) == 65534
        reg = ShmRegistry()
        with pytest.raises(InferError) as e:
            reg.register_system("theirs", f"/{roots}", 0, 64, peer=peer)
        assert ("the segment belongs to user 0, not to the client's user 65534; register a "
                "segment your client created") in e.value.message
        reg.register_system("mine", f"/{mine}", 0, 64, peer=peer)
        assert set(reg.system) == {"mine"}
        s.close()
    finally:
        child.communicate(b"", timeout=10)
        srv.close()
        for n in (mine, roots):
            os.unlink(f"/dev/shm/{n}")


def test_a_client_whose_user_cannot_be_told_is_refused(segment):
    """A loopback peer with no socket behind it (it left): nobody to check the segment's
    owner against, so no registration."""
    with pytest.raises(InferError) as e:
        ShmRegistry().register_system("r", f"/{segment}", 0, 64, peer="ipv4:127.0.0.1:1")
    assert "cannot tell which user the client ipv4:127.0.0.1:1 runs as" in e.value.message


def test_the_owner_of_a_loopback_socket_is_found_for_each_address_form(loopback):
    me = os.geteuid()
    assert peer_uid.socket_uid(loopback()) == me
    assert peer_uid.socket_uid(loopback(socket.AF_INET6, "::1")) == me
    # an IPv4 client of a dual-stack server shows as a v4-mapped address
    v4 = loopback()
    assert peer_uid.socket_uid("ipv6:[::ffff:" + v4[5:].replace(":", "]:", 1)) == me
    assert peer_uid.socket_uid("unix:/tmp/s") is None and peer_uid.socket_uid("") is None


@pytest.mark.parametrize("key", ["/..", "..", "/.", "/a/b", "/x\0y"])
def test_keys_that_are_not_segment_names(key):
    with pytest.raises(InferError) as e:
        ShmRegistry().register_system("r", key, 0, 1)
    assert "is not a valid POSIX shared memory name" in e.value.message


@pytest.mark.parametrize("key, text", [
    # Triton's key rules, in its words
    ("", "cannot register shared memory region 'r' - invalid shm key ''"),
    ("/", "cannot register shared memory region 'r' - invalid shm key '/'"),
    ("///", "cannot register shared memory region 'r' - invalid shm key '///'"),
    ("/triton_python_backend_shm_region_1", "cannot register shared memory region 'r' with key "
     "'/triton_python_backend_shm_region_1' as the key contains the reserved prefix "
     "'triton_python_backend_shm_region_'"),
    ("//triton_python_backend_shm_region_x", "as the key contains the reserved prefix"),
])
def test_tritons_key_rules(key, text):
    with pytest.raises(InferError) as e:
        ShmRegistry().register_system("r", key, 0, 1)
    assert text in e.value.message and e.value.code == ErrorCode.INVALID_ARG


def test_directories_and_symlinks_are_not_segments(segment):
    d = f"/dev/shm/shmtest_dir_{uuid.uuid4().hex}"
    link = f"/dev/shm/shmtest_link_{uuid.uuid4().hex}"
    os.mkdir(d)
    os.symlink(f"/dev/shm/{segment}", link)
    try:
        for key in (d[len("/dev/shm"):], link[len("/dev/shm"):]):
            with pytest.raises(InferError) as e:
                ShmRegistry().register_system("r", key, 0, 1)
            assert "not a shared memory segment" in e.value.message
    finally:
        os.rmdir(d)
        os.unlink(link)
