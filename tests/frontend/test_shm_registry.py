"""Client shared-memory registration: who may register, and which keys name a segment at all."""
import os
import uuid

import pytest

from shmserve.frontend.errors import InferError
from shmserve.frontend.shm_registry import ShmRegistry, is_local_peer


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


def test_only_local_clients_register_by_default(segment):
    reg = ShmRegistry()
    with pytest.raises(InferError) as e:
        reg.register_system("r", f"/{segment}", 0, 64, peer="ipv4:10.1.2.3:5000")
    assert "accepted only from clients on this host (--client-shm-from=local)" in e.value.message
    assert reg.system == {}
    reg.register_system("r", f"/{segment}", 0, 64, peer="ipv4:127.0.0.1:5000")
    ShmRegistry(local_only=False).register_system("r", f"/{segment}", 0, 64, peer="10.1.2.3")


@pytest.mark.parametrize("key", ["/..", "..", "/.", "/a/b", "/x\0y", "/"])
def test_keys_that_are_not_segment_names(key):
    with pytest.raises(InferError) as e:
        ShmRegistry().register_system("r", key, 0, 1)
    assert "'key'" in e.value.message or "is not a valid POSIX shared memory name" in e.value.message


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
