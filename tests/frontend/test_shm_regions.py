"""The client shared-memory table the frontend processes of one server share (a file, a lock and
a generation counter in the run directory)."""
import multiprocessing
import os

import pytest
from shm_regions_child import register_in_child

from shmserve.frontend.shm.regions import RegionTable, SystemRegion
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ErrorCode


def region(name: str, size: int = 64) -> SystemRegion:
    return SystemRegion(name, f"/{name}_key", 0, size, f"{name}_key")


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "client-shm")


def test_a_change_through_one_table_is_seen_by_another(path):
    a, b = RegionTable(path), RegionTable(path)
    assert b.current() == {}
    with a.change() as t:
        t["r1"] = region("r1")
    assert list(b.current()) == ["r1"]
    with b.change() as t:
        del t["r1"]
        t["r2"] = region("r2", 128)
    assert list(a.current()) == ["r2"] and a.current()["r2"].byte_size == 128


def test_a_failed_change_publishes_nothing(path):
    a, b = RegionTable(path), RegionTable(path)
    with a.change() as t:
        t["kept"] = region("kept")
    with pytest.raises(ValueError):
        with b.change() as t:
            t["dropped"] = region("dropped")
            raise ValueError("refused")
    assert list(a.current()) == ["kept"] and list(b.current()) == ["kept"]


def test_region_objects_and_their_in_use_counts_survive_a_reload(path):
    a, b = RegionTable(path), RegionTable(path)
    with a.change() as t:
        t["held"] = region("held")
    held = b.current()["held"]
    held.in_use = 2                     # b's requests in flight
    with a.change() as t:
        t["other"] = region("other")
    assert b.current()["held"] is held and held.in_use == 2
    with a.change() as t:               # re-registered with another size: a new region
        t["held"] = region("held", 32)
    assert b.current()["held"] is not held and b.current()["held"].in_use == 0


def test_a_table_without_a_path_is_private(path):
    local = RegionTable()
    with local.change() as t:
        t["r"] = region("r")
    assert RegionTable(path).current() == {} and list(local.current()) == ["r"]
    with pytest.raises(KeyError):
        with local.change() as t:
            t["x"] = region("x")
            raise KeyError("x")
    assert list(local.current()) == ["r"]


def test_a_registration_from_another_process_is_seen_and_names_stay_unique(path):
    segment = f"shmregions_test_{os.getpid()}"
    fd = os.open(f"/dev/shm/{segment}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 256)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            assert pool.apply(register_in_child, (path, "shared", segment)) == ""
        mine = ShmRegistry(table=RegionTable(path))
        assert [r["name"] for r in mine.status_system("")] == ["shared"]
        with pytest.raises(InferError) as e:
            mine.register_system("shared", f"/{segment}", 0, 64)
        assert e.value.code == ErrorCode.ALREADY_EXISTS and "already in manager" in str(e.value)
        assert mine.unregister_system("shared") == [segment]
        with ctx.Pool(1) as pool:        # and the other process sees it gone
            assert pool.apply(register_in_child, (path, "shared", segment)) == ""
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{segment}")
