"""POSIX shared memory: segments and the owner-side ``ShmArena`` allocator; the reader side,
``ShmMapCache``, is in ipc/shm_maps.py (and importable from here).

We call shm_open/mmap ourselves instead of ``multiprocessing.shared_memory``: its resource tracker
unlinks a segment when any process that merely attached exits, which would pull segments from
under the process that owns them.

Every segment shmserve creates is named ``shmserve_<launcher pid>_<token>_<owner>_<n>``: the token
is random (so names cannot be guessed by clients) and the pid lets the next start remove what a
killed server left behind.

/dev/shm is a tmpfs: a page of a sparse segment is taken only when first touched, and when the
tmpfs is full that touch is SIGBUS, which kills the process. So nothing is touched before it is
reserved: ``posix_fallocate`` takes the pages up front, and a full /dev/shm is ENOSPC there, which
becomes ``ShmFull`` (an error for one request) instead of a dead process.
"""
from __future__ import annotations

import _posixshmem
import errno
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from shmserve.ipc.messages.common import ShmRef

# the reader side, and the names both sides share (imported from here as well)
from shmserve.ipc.shm_maps import PREFIX, SHM_DIR, ShmError, ShmMapCache, attach_segment  # noqa: F401

log = logging.getLogger("shmserve.shm")

_ALIGN = 64
# Arena chunks reserve pages in steps of this much, so most allocations cost no syscall.
RESERVE_STEP = 2 << 20
_PAGE = mmap.PAGESIZE
# Seconds an unused arena chunk is kept (default 10): for tests, or to get memory back sooner.
IDLE_RELEASE_ENV = "SHMSERVE_SHM_IDLE_RELEASE_S"


class ShmFull(ShmError):
    """/dev/shm has no room for the pages an allocation needs (ENOSPC when reserving them)."""


def new_server_prefix() -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}_"


def free_bytes() -> int | None:
    """What /dev/shm can still hold, or None if it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _full(need: int, nbytes: int) -> ShmFull:
    free = free_bytes()
    return ShmFull(f"not enough shared memory: {SHM_DIR} is full "
                   f"({'?' if free is None else free} bytes free, {need} needed to hold "
                   f"{nbytes} bytes); enlarge /dev/shm (docker run --shm-size)")


def _reserve(fd: int, start: int, length: int, nbytes: int) -> None:
    """Take the pages of [start, start + length) now, so touching them later cannot SIGBUS
    (``nbytes``: what the caller wants to place, for the error)."""
    try:
        os.posix_fallocate(fd, start, length)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _full(length, nbytes) from None
        raise ShmError(f"cannot reserve {length} bytes of shared memory: "
                       f"{e.strerror or e}") from None


def _open_new(name: str, size: int) -> tuple[int, mmap.mmap]:
    """Create a sparse segment and map it; returns its fd (still open) and the mapping."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        if e.errno == errno.ENOSPC:         # the tmpfs is out of inodes
            raise _full(size, size) from None
        raise
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        _posixshmem.shm_unlink("/" + name)
        raise


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create and map a new segment with all its pages reserved; raises ShmFull when /dev/shm
    cannot hold it (touching a page of a full tmpfs is SIGBUS)."""
    fd, m = _open_new(name, size)
    try:
        if size:
            _reserve(fd, 0, size, size)
        return m
    except BaseException:
        m.close()
        _posixshmem.shm_unlink("/" + name)
        raise
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
    return launcher_alive(int(pid_text))


def launcher_alive(pid: int) -> bool:
    """Whether the launcher that named something after ``pid`` still runs. Asked by a launcher
    that is starting, before it names anything: what carries its own pid was left by an earlier
    one with the same pid, as in a container, where every launcher is pid 1 and /dev/shm and
    /tmp may outlive a restart."""
    return pid != os.getpid() and pid_alive(pid)


def remove_stale_segments() -> int:
    """Unlink segments of shmserve servers whose launcher process no longer exists (called by a
    launcher at its start, before it makes any)."""
    stale = [n for n in _names(PREFIX) if not _launcher_alive(n)]
    for name in stale:
        unlink_segment(name)
    return len(stale)


@dataclass(slots=True)
class Slot:
    ref: ShmRef
    view: memoryview


class _Chunk:
    __slots__ = ("name", "size", "fd", "map", "view", "free", "used", "reserved", "idle_since")

    def __init__(self, name: str, size: int, now: float):
        self.name = name
        self.size = size
        self.fd, self.map = _open_new(name, size)   # the fd stays open to reserve pages with
        self.view = memoryview(self.map)
        self.free: list[list[int]] = [[0, size]]  # sorted [offset, length] holes
        self.used = 0
        self.reserved = 0               # [0, reserved) has its pages reserved
        self.idle_since = now

    def alloc(self, n: int, limit: int) -> int | None:
        """First fit of ``n`` bytes ending at or below ``limit``."""
        for i, hole in enumerate(self.free):
            off = hole[0]
            if off + n > limit:
                return None             # holes are sorted: every later one starts higher
            if hole[1] >= n:
                if hole[1] == n:
                    del self.free[i]
                else:
                    hole[0] += n
                    hole[1] -= n
                self.used += n
                return off
        return None

    def reserve(self, end: int, nbytes: int) -> None:
        """Reserve pages up to ``end`` at least: a whole step if /dev/shm has room, else exactly
        what is needed; raises ShmFull when even that does not fit."""
        step = min(self.size, (end + RESERVE_STEP - 1) & ~(RESERVE_STEP - 1))
        try:
            _reserve(self.fd, self.reserved, step - self.reserved, nbytes)
            self.reserved = step
        except ShmFull:
            exact = min(self.size, (end + _PAGE - 1) & ~(_PAGE - 1))
            if exact == step:
                raise
            _reserve(self.fd, self.reserved, exact - self.reserved, nbytes)
            self.reserved = exact

    def release(self, off: int, n: int, now: float) -> bool:
        """Give [off, off + n) back; False (nothing changes) when any of it is free already: a
        slot given back twice, or a range that was never handed out, must not make a hole two
        later slots would share."""
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        if off < 0 or off + n > self.size or (lo > 0 and sum(free[lo - 1]) > off) or \
                (lo < len(free) and off + n > free[lo][0]):
            return False
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
            self.idle_since = now
        return True

    def close(self) -> None:
        unlink_segment(self.name)
        os.close(self.fd)
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it is collected


class ShmArena:
    """Allocator over segments owned by one process; only the owner allocates and frees.

    A chunk is created sparse and its pages are reserved (fallocate) from its start up to the
    highest byte ever handed out, in steps of RESERVE_STEP: an allocation that fits below that mark
    makes no syscall, and a 64 MiB chunk costs only what is used of it. When /dev/shm cannot hold
    the pages an allocation needs, ``alloc`` raises ``ShmFull`` and nothing is left allocated.

    Memory stays reserved and mapped while it is being reused (faulting pages in again costs more
    than the copy it serves); a chunk nothing has used for ``idle_release_s`` is unlinked by
    ``trim``, which ``free`` calls at most once a second and the owner's loop calls when it is
    idle, so a burst of large tensors does not pin memory forever.
    """

    def __init__(self, name_prefix: str, chunk_size: int = 64 << 20,
                 idle_release_s: float | None = None, clock: Callable[[], float] | None = None):
        self.name_prefix = name_prefix
        self.chunk_size = chunk_size
        if idle_release_s is None:
            try:
                idle_release_s = float(os.environ.get(IDLE_RELEASE_ENV, "10"))
            except ValueError:
                idle_release_s = 10.0
        self.idle_release_s = idle_release_s
        self._clock = clock or time.monotonic
        self._chunks: dict[str, _Chunk] = {}
        self._counter = 0
        self._last_trim = self._clock()

    def alloc(self, nbytes: int) -> Slot:
        n = max(_ALIGN, (nbytes + _ALIGN - 1) & ~(_ALIGN - 1))
        chunks = self._chunks.values()
        for chunk in chunks:            # the hot path: space whose pages are already reserved
            off = chunk.alloc(n, chunk.reserved)
            if off is not None:
                return Slot(ShmRef(chunk.name, off, nbytes), chunk.view[off:off + nbytes])
        for chunk in chunks:
            off = chunk.alloc(n, chunk.size)
            if off is not None:
                return self._reserved(chunk, off, n, nbytes)
        size = max(self.chunk_size, (n + RESERVE_STEP - 1) & ~(RESERVE_STEP - 1))
        name = f"{self.name_prefix}{self._counter}"
        self._counter += 1
        chunk = _Chunk(name, size, self._clock())
        self._chunks[name] = chunk
        chunk.alloc(n, size)            # a new chunk's first slot is at offset 0
        return self._reserved(chunk, 0, n, nbytes)

    def _reserved(self, chunk: _Chunk, off: int, n: int, nbytes: int) -> Slot:
        try:
            chunk.reserve(off + n, nbytes)
        except ShmError:
            # give the space back without making an idle chunk look used just now
            chunk.release(off, n, chunk.idle_since)
            if chunk.reserved == 0:     # a chunk that never held anything goes at once
                del self._chunks[chunk.name]
                chunk.close()
            raise
        return Slot(ShmRef(chunk.name, off, nbytes), chunk.view[off:off + nbytes])

    def free(self, ref: ShmRef) -> None:
        chunk = self._chunks.get(ref.segment)
        if chunk is None:
            return
        n = max(_ALIGN, (ref.nbytes + _ALIGN - 1) & ~(_ALIGN - 1))
        now = self._clock()
        if not chunk.release(ref.offset, n, now):
            log.warning("ignored the return of a slot that is not in use: %s at %d, %d bytes",
                        ref.segment, ref.offset, ref.nbytes)
        if now - self._last_trim > 1.0:
            self.trim(now)

    def trim(self, now: float | None = None) -> None:
        """Unlink every chunk that nothing has used for more than idle_release_s."""
        now = self._clock() if now is None else now
        self._last_trim = now
        for name, chunk in list(self._chunks.items()):
            if chunk.used == 0 and now - chunk.idle_since > self.idle_release_s:
                del self._chunks[name]
                chunk.close()

    @property
    def bytes_mapped(self) -> int:
        return sum(c.size for c in self._chunks.values())

    @property
    def bytes_reserved(self) -> int:
        """What the arena holds of /dev/shm."""
        return sum(c.reserved for c in self._chunks.values())

    @property
    def bytes_used(self) -> int:
        return sum(c.used for c in self._chunks.values())

    def close(self) -> None:
        for chunk in self._chunks.values():
            chunk.close()
        self._chunks.clear()
