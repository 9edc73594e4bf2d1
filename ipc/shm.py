"""POSIX shared memory: segments, the owner-side ``ShmArena`` allocator, and ``ShmMapCache``.

We call shm_open/mmap ourselves instead of ``multiprocessing.shared_memory``: its resource tracker
unlinks a segment when any process that merely attached exits, which would pull segments from
under the process that owns them.

Every segment shmserve creates is named ``shmserve_<launcher pid>_<token>_<owner>_<n>``: the token
is random (so names cannot be guessed by clients) and the pid lets the next start remove what a
killed server left behind.
"""
from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
import stat
import time
from dataclasses import dataclass

from .messages import ShmRef

PREFIX = "shmserve_"
SHM_DIR = "/dev/shm"
_ALIGN = 64


class ShmError(Exception):
    pass


def new_server_prefix() -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}_"


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create and map a new segment; refuses to overfill /dev/shm (a full tmpfs turns writes into SIGBUS)."""
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and size > free:
        raise ShmError(f"not enough space in {SHM_DIR} for {size} bytes ({free} free); "
                       f"enlarge /dev/shm (docker: --shm-size)")
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)


def attach_segment(name: str, writable: bool = True) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR if writable else os.O_RDONLY, 0)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmError(f"'{name}' is not a shared memory segment")
        return mmap.mmap(fd, st.st_size,
                         access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _names(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def unlink_prefixed(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; returns how many."""
    names = _names(prefix)
    for name in names:
        unlink_segment(name)
    return len(names)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:
        pass
    return True


def _launcher_alive(name: str) -> bool:
    pid_text = name[len(PREFIX):].split("_", 1)[0]
    if not (pid_text.isascii() and pid_text.isdigit()):
        return True                 # not a name we made: leave it alone
    return pid_alive(int(pid_text))


def remove_stale_segments() -> int:
    """Unlink segments of shmserve servers whose launcher process no longer exists."""
    stale = [n for n in _names(PREFIX) if not _launcher_alive(n)]
    for name in stale:
        unlink_segment(name)
    return len(stale)


@dataclass(slots=True)
class Slot:
    ref: ShmRef
    view: memoryview


class _Chunk:
    __slots__ = ("name", "size", "map", "view", "free", "used", "idle_since")

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self.map = create_segment(name, size)
        self.view = memoryview(self.map)
        self.free: list[list[int]] = [[0, size]]  # sorted [offset, length] holes
        self.used = 0
        self.idle_since = time.monotonic()

    def alloc(self, n: int) -> int | None:
        for i, hole in enumerate(self.free):
            if hole[1] >= n:
                off = hole[0]
                if hole[1] == n:
                    del self.free[i]
                else:
                    hole[0] += n
                    hole[1] -= n
                self.used += n
                return off
        return None

    def release(self, off: int, n: int) -> None:
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, [off, n])
        # merge with the following hole, then with the preceding one
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo][1] += free[lo + 1][1]
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1][1] += free[lo][1]
            del free[lo]
        self.used -= n
        if self.used == 0:
            self.idle_since = time.monotonic()

    def close(self) -> None:
        unlink_segment(self.name)
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it is collected


class ShmArena:
    """Allocator over segments owned by one process; only the owner allocates and frees.

    Memory stays mapped while it is being reused (faulting pages in again costs more than the copy
    it serves), and whole chunks that have been idle for ``idle_release_s`` are unlinked, so a
    burst of large tensors does not pin memory forever.
    """

    def __init__(self, name_prefix: str, chunk_size: int = 64 << 20, idle_release_s: float = 10.0):
        self.name_prefix = name_prefix
        self.chunk_size = chunk_size
        self.idle_release_s = idle_release_s
        self._chunks: dict[str, _Chunk] = {}
        self._counter = 0
        self._last_trim = time.monotonic()

    def alloc(self, nbytes: int) -> Slot:
        n = max(_ALIGN, (nbytes + _ALIGN - 1) & ~(_ALIGN - 1))
        for chunk in self._chunks.values():
            off = chunk.alloc(n)
            if off is not None:
                return Slot(ShmRef(chunk.name, off, nbytes), chunk.view[off:off + nbytes])
        size = max(self.chunk_size, (n + (2 << 20) - 1) & ~((2 << 20) - 1))
        name = f"{self.name_prefix}{self._counter}"
        self._counter += 1
        chunk = _Chunk(name, size)
        self._chunks[name] = chunk
        off = chunk.alloc(n)
        return Slot(ShmRef(name, off, nbytes), chunk.view[off:off + nbytes])

    def free(self, ref: ShmRef) -> None:
        chunk = self._chunks.get(ref.segment)
        if chunk is None:
            return
        n = max(_ALIGN, (ref.nbytes + _ALIGN - 1) & ~(_ALIGN - 1))
        chunk.release(ref.offset, n)
        now = time.monotonic()
        if now - self._last_trim > 1.0:
            self._last_trim = now
            self.trim(now)

    def trim(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name, chunk in list(self._chunks.items()):
            if chunk.used == 0 and now - chunk.idle_since > self.idle_release_s:
                del self._chunks[name]
                chunk.close()

    @property
    def bytes_mapped(self) -> int:
        return sum(c.size for c in self._chunks.values())

    @property
    def bytes_used(self) -> int:
        return sum(c.used for c in self._chunks.values())

    def close(self) -> None:
        for chunk in self._chunks.values():
            chunk.close()
        self._chunks.clear()


class ShmMapCache:
    """Reader side: maps segments by name once and hands out views; drops mappings left unused.

    Every mapping holds a file descriptor (Python's mmap keeps a dup of it), so at most
    ``max_maps`` are cached, least recently used going first: a client with 20,000 regions
    must not exhaust the process's descriptors. A client's segment can shrink after it was
    mapped, and touching a page past its end is SIGBUS: its size is checked on every use
    (one fstat); the server's own segments never shrink and skip the check."""

    def __init__(self, idle_unmap_s: float = 30.0, max_maps: int = 512):
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}
        self._last_used: dict[str, float] = {}
        self.idle_unmap_s = idle_unmap_s
        self.max_maps = max_maps
        self._last_sweep = time.monotonic()

    def view(self, ref: ShmRef) -> memoryview:
        entry = self._maps.get(ref.segment)
        if entry is None:
            try:
                m = attach_segment(ref.segment)
            except FileNotFoundError:
                raise ShmError(f"shared memory segment '{ref.segment}' does not exist") from None
            except OSError as e:        # a directory, a symlink, no permission, EMFILE, ...
                raise ShmError(f"cannot map shared memory segment '{ref.segment}': "
                               f"{e.strerror or e}") from None
            if len(self._maps) >= self.max_maps:
                self._drop(min(self._last_used, key=self._last_used.__getitem__))
            entry = (m, memoryview(m))
            self._maps[ref.segment] = entry
        end = ref.offset + ref.nbytes
        if ref.offset < 0 or ref.nbytes < 0 or end > len(entry[1]):
            raise ShmError(f"range [{ref.offset}, {end}) is outside segment "
                           f"'{ref.segment}' of {len(entry[1])} bytes")
        if not ref.segment.startswith(PREFIX):
            try:
                size = entry[0].size()      # fstat: what the segment holds now
            except OSError as e:
                raise ShmError(f"shared memory segment '{ref.segment}': {e}") from None
            if end > size:
                self._drop(ref.segment)
                raise ShmError(f"shared memory segment '{ref.segment}' shrank to {size} bytes "
                               f"after it was registered; the range [{ref.offset}, {end}) is "
                               f"no longer inside it")
        now = time.monotonic()
        self._last_used[ref.segment] = now
        if now - self._last_sweep > 5.0:
            self._sweep(now)
        return entry[1][ref.offset:ref.offset + ref.nbytes]

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        for name, last in list(self._last_used.items()):
            if now - last > self.idle_unmap_s:
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
