"""POSIX shared memory, the reader side: ``ShmMapCache`` maps segments by name (the server's own
and clients' regions) and hands out views of them. ipc/shm.py is the owner side (creating
segments, the ``ShmArena`` allocator) and re-exports what is here.
"""
from __future__ import annotations

import _posixshmem
import ctypes
import mmap
import os
import stat
import time
import weakref

from shmserve.ipc.messages.common import ShmRef

PREFIX = "shmserve_"
SHM_DIR = "/dev/shm"


class ShmError(Exception):
    pass


def attach_segment(name: str, writable: bool = True) -> memoryview:
    return _attach(name, writable)[0]


def _attach(name: str, writable: bool = True) -> tuple[memoryview, int]:
    """A view of the whole segment (it holds no descriptor), and the segment's inode (which
    tells a re-created segment of that name)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR if writable else os.O_RDONLY, 0)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmError(f"'{name}' is not a shared memory segment")
        return _map(fd, st.st_size, writable), st.st_ino
    finally:
        os.close(fd)


# mmap(2) through libc: Python's mmap.mmap keeps a dup of the descriptor for as long as the
# mapping lives (before 3.13's trackfd=False), one descriptor per mapped segment; a mapping
# needs none once made
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, size: int, writable: bool) -> memoryview:
    """Map ``size`` bytes of ``fd`` shared; the caller may close ``fd`` at once. The mapping
    is unmapped when the returned view and every slice of it are gone."""
    if size == 0:
        return memoryview(bytearray())
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    buf = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, size)
    view = memoryview(buf).cast("B")
    return view if writable else view.toreadonly()


class ShmMapCache:
    """Reader side: maps segments by name once and hands out views; drops mappings left unused.

    A mapping holds no file descriptor (the descriptor is closed once it is mapped), so a
    client with many regions costs the process address space, not descriptors; at most
    ``max_maps`` are cached all the same, least recently used going first. A client's segment
    can shrink after it was mapped, and touching a page past its end is SIGBUS; or its owner
    can unlink it and create another under the same name, which a mapping of the old one would
    not see. So a client segment is looked up by name on every use (one stat): a new inode is
    mapped afresh, and the size is checked. A segment its owner unlinked is gone for us too:
    with no descriptor left, its size could no longer be checked. That keeps a re-registered
    region correct whatever order messages take (a frontend's leased requests reach a worker on
    another socket than the scheduler's ForgetSegments). The server's own segments are never
    re-created or shrunk and skip it."""

    def __init__(self, idle_unmap_s: float = 30.0, max_maps: int = 512):
        self._maps: dict[str, tuple[memoryview, int]] = {}
        self._last_used: dict[str, float] = {}
        self.idle_unmap_s = idle_unmap_s
        self.max_maps = max_maps
        self._last_sweep = time.monotonic()

    def view(self, ref: ShmRef) -> memoryview:
        entry = self._maps.get(ref.segment)
        client = not ref.segment.startswith(PREFIX)
        size = -1
        if client:
            try:
                st = os.stat(f"{SHM_DIR}/{ref.segment}")
            except FileNotFoundError:
                self._drop(ref.segment)         # unlinked by its owner
                raise ShmError(f"shared memory segment '{ref.segment}' does not exist") from None
            except OSError as e:
                raise ShmError(f"shared memory segment '{ref.segment}': {e}") from None
            if entry is not None and st.st_ino != entry[1]:
                self._drop(ref.segment)         # re-created under the same name
                entry = None
            size = st.st_size                   # what the segment holds now
        end = ref.offset + ref.nbytes
        if entry is not None and end > len(entry[0]) and end <= size:
            self._drop(ref.segment)             # grown since it was mapped: map it whole again
            entry = None
        if entry is None:
            try:
                entry = _attach(ref.segment)
            except FileNotFoundError:
                raise ShmError(f"shared memory segment '{ref.segment}' does not exist") from None
            except OSError as e:        # a directory, a symlink, no permission, EMFILE, ...
                raise ShmError(f"cannot map shared memory segment '{ref.segment}': "
                               f"{e.strerror or e}") from None
            if len(self._maps) >= self.max_maps:
                self._drop(min(self._last_used, key=self._last_used.__getitem__))
            self._maps[ref.segment] = entry
        whole = entry[0]
        if ref.offset < 0 or ref.nbytes < 0 or end > len(whole):
            raise ShmError(f"range [{ref.offset}, {end}) is outside segment "
                           f"'{ref.segment}' of {len(whole)} bytes")
        if end > size >= 0:
            self._drop(ref.segment)
            raise ShmError(f"shared memory segment '{ref.segment}' shrank to {size} bytes "
                           f"after it was registered; the range [{ref.offset}, {end}) is "
                           f"no longer inside it")
        now = time.monotonic()
        self._last_used[ref.segment] = now
        if now - self._last_sweep > 5.0:
            self.sweep(now)
        return whole[ref.offset:end]

    def sweep(self, now: float | None = None) -> None:
        """Drop mappings unused for idle_unmap_s, and at once those of the server's own segments
        that their owner has unlinked: a mapping keeps the pages of an unlinked segment in
        /dev/shm, and the owner's name is never used again."""
        now = time.monotonic() if now is None else now
        self._last_sweep = now
        for name, last in list(self._last_used.items()):
            if now - last > self.idle_unmap_s or (
                    name.startswith(PREFIX) and not os.path.exists(f"{SHM_DIR}/{name}")):
                self._drop(name)

    def _drop(self, name: str) -> None:
        # No explicit close: views handed out may still be alive, and the mapping is unmapped
        # when the last of them is collected.
        self._maps.pop(name, None)
        self._last_used.pop(name, None)

    def forget(self, segment: str) -> None:
        """Drop a mapping whose segment is known to be gone (its owner died or freed it)."""
        self._drop(segment)

    def close(self) -> None:
        for name in list(self._maps):
            self._drop(name)
