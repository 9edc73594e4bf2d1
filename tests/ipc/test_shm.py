"""In-process tests of ipc/shm.py: the arena allocator, the reader-side map cache, segment housekeeping."""
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import textwrap

import pytest
from oshelpers import small_shm_possible

from shmserve.ipc import shm
from shmserve.ipc.messages.common import ShmRef

CHUNK = 2 << 20  # chunks are whole multiples of 2 MiB, so this is the smallest chunk_size
DEAD_PID = 4194999  # above the largest pid_max Linux allows (2**22), so never a live process


def shm_names(prefix):
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix))


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def prefix():
    p = shm.new_server_prefix()
    yield p
    shm.unlink_prefixed(p)
    assert shm_names(p) == []


@pytest.fixture
def make_arena(prefix):
    arenas = []

    def make(**kw):
        kw.setdefault("chunk_size", CHUNK)
        arena = shm.ShmArena(prefix, **kw)
        arenas.append(arena)
        return arena

    yield make
    for arena in arenas:
        arena.close()


@pytest.fixture
def cache():
    c = shm.ShmMapCache()
    yield c
    c.close()


@pytest.fixture
def clock():
    return FakeClock()


def test_new_server_prefix_names_this_process_and_is_unique():
    a, b = shm.new_server_prefix(), shm.new_server_prefix()
    assert a.startswith(f"{shm.PREFIX}{os.getpid()}_") and a.endswith("_")
    assert a != b


def test_alloc_is_aligned_and_keeps_the_requested_size(make_arena, prefix):
    arena = make_arena()
    a = arena.alloc(1)
    b = arena.alloc(100)
    c = arena.alloc(0)
    d = arena.alloc(64)
    assert [s.ref.offset for s in (a, b, c, d)] == [0, 64, 192, 256]
    assert [s.ref.nbytes for s in (a, b, c, d)] == [1, 100, 0, 64]
    assert [len(s.view) for s in (a, b, c, d)] == [1, 100, 0, 64]
    assert all(s.ref.offset % 64 == 0 for s in (a, b, c, d))
    assert {s.ref.segment for s in (a, b, c, d)} == {f"{prefix}0"}
    assert arena.bytes_used == 64 + 128 + 64 + 64
    assert arena.bytes_mapped == CHUNK
    assert shm_names(prefix) == [f"{prefix}0"]
    assert os.path.getsize(os.path.join(shm.SHM_DIR, f"{prefix}0")) == CHUNK


def test_freed_space_is_reused(make_arena):
    arena = make_arena()
    a = arena.alloc(1000)
    arena.alloc(10)
    arena.free(a.ref)
    assert arena.bytes_used == 64
    again = arena.alloc(900)
    assert (again.ref.segment, again.ref.offset) == (a.ref.segment, 0)
    assert arena.bytes_mapped == CHUNK


@pytest.mark.parametrize("order", [(1, 2), (2, 1)], ids=["lower-first", "upper-first"])
def test_neighbouring_holes_coalesce(make_arena, prefix, order):
    arena = make_arena()
    q = CHUNK // 4
    slots = [arena.alloc(q) for _ in range(4)]
    assert [s.ref.offset for s in slots] == [0, q, 2 * q, 3 * q]
    for i in order:
        arena.free(slots[i].ref)
    big = arena.alloc(2 * q)  # only fits if the two holes merged
    assert (big.ref.segment, big.ref.offset) == (f"{prefix}0", q)
    assert arena.bytes_mapped == CHUNK
    assert shm_names(prefix) == [f"{prefix}0"]


def test_hole_merges_with_both_neighbours(make_arena, prefix):
    arena = make_arena()
    slots = [arena.alloc(CHUNK // 4) for _ in range(4)]
    for i in (0, 2, 1, 3):  # the last two frees each join holes on both sides
        arena.free(slots[i].ref)
    assert arena.bytes_used == 0
    whole = arena.alloc(CHUNK)
    assert (whole.ref.segment, whole.ref.offset) == (f"{prefix}0", 0)
    assert arena.bytes_mapped == CHUNK


def test_new_chunk_when_full_and_big_chunk_for_big_alloc(make_arena, prefix):
    arena = make_arena()
    arena.alloc(CHUNK)
    second = arena.alloc(1)
    assert (second.ref.segment, second.ref.offset) == (f"{prefix}1", 0)
    big = arena.alloc(3 * CHUNK + 1)
    assert (big.ref.segment, big.ref.offset, big.ref.nbytes) == (f"{prefix}2", 0, 3 * CHUNK + 1)
    assert os.path.getsize(os.path.join(shm.SHM_DIR, f"{prefix}2")) == 8 << 20  # a whole multiple of 2 MiB
    assert arena.bytes_mapped == 2 * CHUNK + (8 << 20)
    assert shm_names(prefix) == [f"{prefix}0", f"{prefix}1", f"{prefix}2"]
    big.view[-1] = 7
    assert big.view[-1] == 7


def test_trim_unlinks_only_fully_free_chunks(make_arena, prefix, clock):
    arena = make_arena(idle_release_s=0, clock=clock)
    a = arena.alloc(CHUNK)
    b = arena.alloc(10)
    assert shm_names(prefix) == [f"{prefix}0", f"{prefix}1"]
    arena.free(a.ref)
    arena.trim()                # idle for 0 s, not more than idle_release_s
    assert shm_names(prefix) == [f"{prefix}0", f"{prefix}1"]
    clock.now += 0.001
    arena.trim()
    assert shm_names(prefix) == [f"{prefix}1"]
    assert arena.bytes_mapped == CHUNK
    # the survivor still allocates, and a fresh chunk gets a new name
    c = arena.alloc(CHUNK - 64)
    assert c.ref.segment == f"{prefix}1"
    d = arena.alloc(1)
    assert d.ref.segment == f"{prefix}2"
    arena.free(b.ref)
    arena.free(c.ref)
    clock.now += 0.001
    arena.trim()
    assert shm_names(prefix) == [f"{prefix}2"]
    # freeing a ref of a trimmed chunk is ignored
    arena.free(a.ref)
    assert arena.bytes_used == 64


def test_trim_waits_for_idle_release(make_arena, prefix, clock):
    arena = make_arena(idle_release_s=10.0, clock=clock)
    a = arena.alloc(10)
    arena.free(a.ref)           # chunk idle since clock.now
    arena.trim(clock.now + 10.0)
    assert shm_names(prefix) == [f"{prefix}0"]
    arena.trim(clock.now + 10.5)
    assert shm_names(prefix) == []
    assert arena.bytes_mapped == 0


def test_free_trims_at_most_once_a_second(make_arena, prefix, clock):
    arena = make_arena(idle_release_s=0, clock=clock)
    a, b = arena.alloc(CHUNK), arena.alloc(CHUNK)
    clock.now += 0.5
    arena.free(a.ref)           # 0.5 s since the arena's last trim: no trim
    assert shm_names(prefix) == [f"{prefix}0", f"{prefix}1"]
    clock.now += 0.6
    arena.free(b.ref)           # 1.1 s: trims chunk 0 (idle 0.6 s), keeps chunk 1 (idle 0 s)
    assert shm_names(prefix) == [f"{prefix}1"]
    clock.now += 0.9
    arena.free(arena.alloc(10).ref)  # 0.9 s since the last trim: chunk 1 stays
    assert shm_names(prefix) == [f"{prefix}1"]
    clock.now += 0.2
    arena.free(arena.alloc(10).ref)  # 1.1 s: trims, but chunk 1 has been idle 0 s
    assert shm_names(prefix) == [f"{prefix}1"]
    clock.now += 0.1
    arena.trim()
    assert shm_names(prefix) == []


def test_slot_is_writable_and_visible_through_the_map_cache(make_arena, cache):
    arena = make_arena()
    arena.alloc(100)
    slot = arena.alloc(5)
    slot.view[:] = b"hello"
    view = cache.view(slot.ref)
    assert bytes(view) == b"hello"
    view[0:1] = b"J"            # the reader's mapping is writable too and shares the pages
    assert bytes(slot.view) == b"Jello"
    other = arena.alloc(3)
    other.view[:] = b"abc"
    assert bytes(cache.view(other.ref)) == b"abc"  # second ref into the same, already mapped segment
    view.release()


def test_map_cache_missing_segment(cache, prefix):
    with pytest.raises(shm.ShmError, match="does not exist"):
        cache.view(ShmRef(f"{prefix}nope", 0, 1))


@pytest.mark.parametrize("offset, nbytes", [(CHUNK - 10, 11), (CHUNK, 1), (-1, 1), (0, -1), (0, CHUNK + 1)])
def test_map_cache_out_of_range(make_arena, cache, offset, nbytes):
    arena = make_arena()
    slot = arena.alloc(10)
    ok = cache.view(ShmRef(slot.ref.segment, 0, CHUNK))
    assert len(ok) == CHUNK
    with pytest.raises(shm.ShmError, match="outside segment"):
        cache.view(ShmRef(slot.ref.segment, offset, nbytes))


def test_map_cache_forget_remaps(make_arena, cache, prefix):
    name = f"{prefix}solo"
    m = shm.create_segment(name, 128)
    try:
        m[0:3] = b"one"
        assert bytes(cache.view(ShmRef(name, 0, 3))) == b"one"
        shm.unlink_segment(name)
        cache.forget(name)
        with pytest.raises(shm.ShmError, match="does not exist"):
            cache.view(ShmRef(name, 0, 3))
    finally:
        m.close()
        shm.unlink_segment(name)


def test_create_segment_refuses_an_existing_name(prefix):
    name = f"{prefix}dup"
    m = shm.create_segment(name, 64)
    try:
        with pytest.raises(FileExistsError):
            shm.create_segment(name, 64)
    finally:
        m.close()
        shm.unlink_segment(name)


def test_remove_stale_segments():
    token = secrets.token_hex(6)
    dead = f"{shm.PREFIX}{DEAD_PID}_{token}_x_0"
    # a launcher that runs (this test's parent stands for one)
    live = f"{shm.PREFIX}{os.getppid()}_{token}_x_0"
    # one named after the caller, a launcher that is starting: an earlier launcher's with the
    # same pid (a container's pid 1 restarted), stale
    own = f"{shm.PREFIX}{os.getpid()}_{token}_x_0"
    maps = [shm.create_segment(n, 64) for n in (dead, live, own)]
    try:
        assert shm.remove_stale_segments() >= 2
        assert not os.path.exists(os.path.join(shm.SHM_DIR, dead))
        assert not os.path.exists(os.path.join(shm.SHM_DIR, own))
        assert os.path.exists(os.path.join(shm.SHM_DIR, live))
    finally:
        for m in maps:
            m.close()
        for n in (dead, live, own):
            shm.unlink_segment(n)


def test_remove_stale_segments_survives_odd_pids():
    token = secrets.token_hex(6)
    huge = f"{shm.PREFIX}{10 ** 20}_{token}_0"      # no pid is that large: stale
    odd = [f"{shm.PREFIX}\u00b2_{token}_0",           # str.isdigit() but not a number int() reads
           f"{shm.PREFIX}notapid_{token}_0"]
    names = [huge] + odd
    maps = [shm.create_segment(n, 64) for n in names]
    try:
        shm.remove_stale_segments()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, huge))
        assert all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in odd)
    finally:
        for m in maps:
            m.close()
        for n in names:
            shm.unlink_segment(n)


def test_unlink_prefixed(prefix):
    other = shm.new_server_prefix()
    names = [f"{prefix}a", f"{prefix}b", f"{other}a"]
    maps = [shm.create_segment(n, 64) for n in names]
    try:
        assert shm.unlink_prefixed(prefix) == 2
        assert shm_names(prefix) == []
        assert shm_names(other) == [f"{other}a"]
        assert shm.unlink_prefixed(prefix) == 0
    finally:
        for m in maps:
            m.close()
        for n in names:
            shm.unlink_segment(n)


def test_unlink_segment_of_missing_name_is_quiet(prefix):
    shm.unlink_segment(f"{prefix}never")


def test_arena_close_unlinks_everything(prefix):
    arena = shm.ShmArena(prefix, chunk_size=CHUNK)
    try:
        arena.alloc(CHUNK)
        arena.alloc(CHUNK)
        assert len(shm_names(prefix)) == 2
    finally:
        arena.close()
    assert shm_names(prefix) == []
    assert arena.bytes_mapped == 0


# ---- what a client can do to its own segments after registering them (issue 13) ----------------
def _client_segment(size: int) -> str:
    import uuid
    name = f"shmtest_{uuid.uuid4().hex}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\1" * size)
    return name


def test_a_segment_that_shrank_is_an_error_not_a_sigbus():
    name = _client_segment(8192)
    maps = shm.ShmMapCache()
    try:
        assert bytes(maps.view(ShmRef(name, 4096, 16))) == b"\1" * 16
        os.truncate(f"/dev/shm/{name}", 100)
        with pytest.raises(shm.ShmError, match="shrank to 100 bytes"):
            maps.view(ShmRef(name, 4096, 16))
        assert bytes(maps.view(ShmRef(name, 0, 16))) == b"\1" * 16     # what is left still reads
    finally:
        maps.close()
        os.unlink(f"/dev/shm/{name}")


def test_a_segment_recreated_under_the_same_name_is_mapped_afresh():
    """No ForgetSegments needed: a client that unlinks its segment and creates another under
    the same key (and registers it again) is read from the new one, whatever order messages
    took to the worker."""
    name = _client_segment(4096)
    maps = shm.ShmMapCache()
    try:
        assert bytes(maps.view(ShmRef(name, 0, 4))) == b"\1" * 4
        os.unlink(f"/dev/shm/{name}")
        # unlinked: gone for the server too (a mapping holds no descriptor to check its size by)
        with pytest.raises(shm.ShmError, match="does not exist"):
            maps.view(ShmRef(name, 0, 4))
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"\2" * 4096)
        assert bytes(maps.view(ShmRef(name, 0, 4))) == b"\2" * 4
    finally:
        maps.close()
        os.unlink(f"/dev/shm/{name}")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_mapping_holds_no_descriptor():
    """300 client segments mapped (more than max_maps would keep if each held a descriptor,
    and each did: Python's mmap keeps a dup) cost no descriptors; views read and write."""
    names = [_client_segment(256) for _ in range(300)]
    maps = shm.ShmMapCache()
    try:
        before = _fds()
        views = [maps.view(ShmRef(n, 8, 16)) for n in names]
        assert len(maps._maps) == 300
        assert _fds() <= before + 2
        views[7][:4] = b"abcd"
        with open(f"/dev/shm/{names[7]}", "rb") as f:
            assert f.read()[8:12] == b"abcd"
    finally:
        maps.close()
        for n in names:
            os.unlink(f"/dev/shm/{n}")


def test_a_view_outlives_its_dropped_mapping_and_the_last_one_unmaps_it():
    name = _client_segment(1 << 20)

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return f"/dev/shm/{name}" in f.read()
    maps = shm.ShmMapCache()
    try:
        v = maps.view(ShmRef(name, 0, 8))
        maps.close()                        # dropped from the cache: the view still reads
        assert mapped() and bytes(v) == b"\1" * 8
        del v
        assert not mapped()
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_segment_grown_after_it_was_mapped_is_mapped_again():
    name = _client_segment(4096)
    maps = shm.ShmMapCache()
    try:
        maps.view(ShmRef(name, 0, 8))
        os.truncate(f"/dev/shm/{name}", 8192)
        assert bytes(maps.view(ShmRef(name, 6000, 8))) == b"\0" * 8
    finally:
        maps.close()
        os.unlink(f"/dev/shm/{name}")


def test_a_directory_or_symlink_in_place_of_a_segment_is_an_error():
    import uuid
    d = f"shmtest_dir_{uuid.uuid4().hex}"
    target = _client_segment(64)
    link = f"shmtest_link_{uuid.uuid4().hex}"
    os.mkdir(f"/dev/shm/{d}")
    os.symlink(f"/dev/shm/{target}", f"/dev/shm/{link}")
    maps = shm.ShmMapCache()
    try:
        for name in (d, link):
            with pytest.raises(shm.ShmError, match="cannot map shared memory segment|is not a"):
                maps.view(ShmRef(name, 0, 8))
    finally:
        maps.close()
        os.rmdir(f"/dev/shm/{d}")
        os.unlink(f"/dev/shm/{link}")
        os.unlink(f"/dev/shm/{target}")


def test_mappings_are_capped_so_descriptors_are_too():
    names = [_client_segment(64) for _ in range(6)]
    maps = shm.ShmMapCache(max_maps=3)
    try:
        for n in names:
            assert bytes(maps.view(ShmRef(n, 0, 4))) == b"\1" * 4
            assert len(maps._maps) <= 3
        assert set(maps._maps) == set(names[-3:])       # the least recently used went first
    finally:
        maps.close()
        for n in names:
            os.unlink(f"/dev/shm/{n}")


# ---- pages are reserved before they are touched, and a full /dev/shm is an error (issue 13) ----
def allocated_bytes(name: str) -> int:
    """What the tmpfs holds for a segment (its reserved or touched pages)."""
    return os.stat(os.path.join(shm.SHM_DIR, name)).st_blocks * 512


def test_a_chunk_reserves_only_what_is_handed_out_in_steps(make_arena, prefix):
    arena = make_arena(chunk_size=64 << 20)
    a = arena.alloc(1)
    assert arena.bytes_mapped == 64 << 20
    assert arena.bytes_reserved == allocated_bytes(f"{prefix}0") == shm.RESERVE_STEP
    b = arena.alloc(shm.RESERVE_STEP)           # ends past the first step: one more step
    assert b.ref.offset == 64
    assert arena.bytes_reserved == allocated_bytes(f"{prefix}0") == 2 * shm.RESERVE_STEP
    arena.free(a.ref)
    arena.free(b.ref)
    assert arena.bytes_reserved == 2 * shm.RESERVE_STEP      # kept for reuse until trimmed
    big = arena.alloc((64 << 20) + 1)           # a chunk of its own, reserved whole
    assert arena.bytes_reserved == 2 * shm.RESERVE_STEP + (66 << 20)
    assert allocated_bytes(big.ref.segment) == 66 << 20


def test_space_already_reserved_costs_no_syscall(make_arena, monkeypatch):
    arena = make_arena(chunk_size=64 << 20)
    calls = []
    real = os.posix_fallocate

    def counting(fd, off, n):
        calls.append((off, n))
        real(fd, off, n)

    monkeypatch.setattr(shm.os, "posix_fallocate", counting)
    first = arena.alloc(64 << 10)
    assert calls == [(0, shm.RESERVE_STEP)]
    arena.free(first.ref)
    for _ in range(100):                        # alloc/free within the reserved step
        slots = [arena.alloc(64 << 10) for _ in range(8)]
        for s in slots:
            arena.free(s.ref)
    assert calls == [(0, shm.RESERVE_STEP)]


def test_reserved_space_is_preferred_to_growing_a_chunk(make_arena, prefix):
    arena = make_arena(chunk_size=64 << 20)
    arena.alloc(shm.RESERVE_STEP)               # chunk 0: its first step, all used
    big = arena.alloc(65 << 20)                 # chunk 1: 66 MiB reserved
    arena.free(big.ref)
    small = arena.alloc(1 << 20)                # fits in chunk 1's reserved pages
    assert small.ref.segment == f"{prefix}1"
    assert arena.bytes_reserved == shm.RESERVE_STEP + (66 << 20)


def test_the_arena_clock_can_be_injected(make_arena, prefix, clock):
    arena = make_arena(idle_release_s=5.0, clock=clock)
    arena.free(arena.alloc(10).ref)
    clock.now += 5.0
    arena.trim()
    assert shm_names(prefix) == [f"{prefix}0"]
    clock.now += 0.1
    arena.trim()
    assert shm_names(prefix) == [] and arena.bytes_reserved == 0


def test_idle_release_comes_from_the_environment(monkeypatch, prefix):
    monkeypatch.setenv(shm.IDLE_RELEASE_ENV, "0.25")
    assert shm.ShmArena(prefix).idle_release_s == 0.25
    assert shm.ShmArena(prefix, idle_release_s=3).idle_release_s == 3
    monkeypatch.setenv(shm.IDLE_RELEASE_ENV, "soon")
    assert shm.ShmArena(prefix).idle_release_s == 10.0


def test_map_cache_sweep_drops_segments_their_owner_unlinked(make_arena, cache, prefix):
    arena = make_arena(idle_release_s=0)
    slot = arena.alloc(100)
    cache.view(slot.ref).release()
    other = f"{prefix}client"
    m = shm.create_segment(other, 64)
    try:
        cache.view(ShmRef(other, 0, 8)).release()
        arena.free(slot.ref)
        arena.trim()
        assert shm_names(prefix) == [other]
        cache.sweep()
        assert set(cache._maps) == {other}      # not idle: only the unlinked one goes
    finally:
        m.close()
        shm.unlink_segment(other)


# A /dev/shm of a few MiB of our own (oshelpers.small_shm_possible).
needs_small_shm = pytest.mark.skipif(not small_shm_possible(),
                                     reason="needs `unshare -m` and mount (root) for a small /dev/shm")


def in_small_shm(size: str, code: str):
    """Run ``code`` with /dev/shm a tmpfs of ``size``; returns what it prints as JSON."""
    prelude = ("import json, os, re\nfrom shmserve.ipc import shm\nfrom shmserve.ipc.messages.common "
               "import ShmRef\nMiB = 1 << 20\n")
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"',
                        sys.executable, "-c", prelude + textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr      # -7 would be SIGBUS
    return json.loads(r.stdout)


@needs_small_shm
def test_a_full_dev_shm_is_an_error_not_a_sigbus():
    out = in_small_shm("8m", """
        arena = shm.ShmArena(shm.new_server_prefix())    # 64 MiB chunks on an 8 MiB /dev/shm
        a = arena.alloc(5 * MiB)
        a.view[:] = b"a" * len(a.view)                   # every page is there to touch
        try:
            arena.alloc(4 * MiB)                         # 3 MiB more pages than reserved
            err = None
        except shm.ShmFull as e:
            err = str(e)
        used_after_error = arena.bytes_used
        try:                                             # a chunk of its own: not left behind
            arena.alloc(100 * MiB)
        except shm.ShmFull:
            pass
        names = os.listdir("/dev/shm")
        b = arena.alloc(2 * MiB)                         # what still fits is served
        b.view[:] = b"b" * len(b.view)
        print(json.dumps({"err": err, "used": used_after_error, "names": len(names),
                          "free": shm.free_bytes()}))
    """)
    m = re.fullmatch(r"not enough shared memory: /dev/shm is full \((\d+) bytes free, (\d+) needed "
                     r"to hold 4194304 bytes\); enlarge /dev/shm \(docker run --shm-size\)",
                     out["err"])
    assert m, out["err"]
    assert (int(m.group(1)), int(m.group(2))) == (2 << 20, 3 << 20)
    assert out["used"] == 5 << 20 and out["names"] == 1
    assert out["free"] < 1 << 20


@needs_small_shm
def test_a_step_that_does_not_fit_falls_back_to_the_exact_size():
    out = in_small_shm("5m", """
        arena = shm.ShmArena(shm.new_server_prefix())
        s = arena.alloc(4 * MiB + 100)                   # a 6 MiB step does not fit in 5 MiB
        s.view[:] = b"x" * len(s.view)
        print(json.dumps({"reserved": arena.bytes_reserved}))
    """)
    assert out["reserved"] == (4 << 20) + 4096          # rounded up to whole pages only


@needs_small_shm
def test_create_segment_refuses_more_than_free_space():
    out = in_small_shm("4m", """
        p = shm.new_server_prefix()
        try:
            shm.create_segment(p + "big", 5 * MiB)
            err = None
        except shm.ShmFull as e:
            err = str(e)
        left = os.listdir("/dev/shm")
        m = shm.create_segment(p + "fits", 3 * MiB)
        m[:] = b"y" * len(m)
        print(json.dumps({"err": err, "left": left, "free": shm.free_bytes()}))
    """)
    assert "/dev/shm is full" in out["err"] and f"{5 << 20} needed" in out["err"]
    assert out["left"] == [] and out["free"] == 1 << 20


@needs_small_shm
def test_trimmed_memory_goes_back_to_dev_shm_once_readers_let_go():
    out = in_small_shm("16m", """
        arena = shm.ShmArena(shm.new_server_prefix(), idle_release_s=0)
        reader = shm.ShmMapCache()
        empty = shm.free_bytes()
        s = arena.alloc(8 * MiB)
        s.view[:] = b"z" * len(s.view)
        v = reader.view(s.ref)                           # another process's mapping, in effect
        held = bytes(v[:1]) == b"z"
        v.release()
        arena.free(s.ref)
        del s
        arena.trim()
        unlinked_but_mapped = shm.free_bytes()
        reader.sweep()
        print(json.dumps({"empty": empty, "mapped": unlinked_but_mapped, "after": shm.free_bytes(),
                          "held": held, "names": os.listdir("/dev/shm")}))
    """)
    assert out["held"] and out["names"] == []
    assert out["mapped"] <= out["empty"] - (8 << 20)    # the reader's mapping kept the pages
    assert out["after"] == out["empty"]


@needs_small_shm
def test_a_failed_allocation_does_not_keep_an_idle_chunk_alive():
    out = in_small_shm("4m", """
        now = [0.0]
        arena = shm.ShmArena(shm.new_server_prefix(), idle_release_s=10, clock=lambda: now[0])
        arena.free(arena.alloc(MiB).ref)                 # idle from 0 s, 2 MiB reserved
        now[0] = 9.0
        try:
            arena.alloc(5 * MiB)                         # would grow that idle chunk: no room
        except shm.ShmFull:
            pass
        now[0] = 10.5
        arena.trim()
        print(json.dumps({"names": os.listdir("/dev/shm"), "free": shm.free_bytes()}))
    """)
    assert out == {"names": [], "free": 4 << 20}


def test_a_slot_given_back_twice_or_never_handed_out_changes_nothing(make_arena, caplog):
    """A release message repeated (or hostile) must not make a hole that two later slots would
    share: the arena ignores a return of space that is free already, and says so."""
    arena = make_arena()
    a = arena.alloc(1000)
    b = arena.alloc(1000)
    arena.free(a.ref)
    used = arena.bytes_used
    with caplog.at_level(logging.WARNING, logger="shmserve.shm"):
        arena.free(a.ref)                                               # twice
        arena.free(ShmRef(a.ref.segment, 64, 100))                      # inside a hole
        arena.free(ShmRef(a.ref.segment, CHUNK - 64, 1000))             # past the end
    assert arena.bytes_used == used
    assert len([r for r in caplog.records if "not in use" in r.getMessage()]) == 3
    c, d = arena.alloc(1000), arena.alloc(1000)                          # the hole, once
    spans = sorted((s.ref.offset, s.ref.offset + 1024) for s in (b, c, d))
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), spans
