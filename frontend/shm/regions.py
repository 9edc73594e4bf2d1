"""The table of client shared-memory regions, one for the whole server.

With several frontend processes (--frontends N) a client may register a region through one
connection and use it through another that the kernel handed to a different frontend (tritonclient
and perf_analyzer do: one client registers, others infer). So the table lives in a file in the
run directory: a change takes an exclusive flock, rewrites the file and bumps a generation
counter in a shared 8-byte mapping before the client hears "registered"; a reader compares that
counter with the generation it loaded (a memory read, no system call) and reloads only when it
moved. Without a path the table is this process's alone (tests, tools).

System and CUDA regions share one namespace (as in Triton): the file holds both kinds of record,
each tagged with its kind.

Region objects are kept across reloads while their record is unchanged: the requests in flight
hold them, and their ``in_use`` counts (this frontend's requests) stay with them.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Union

import msgspec


class RegionRecord(msgspec.Struct, array_like=True, tag=0):
    """A system shared-memory region, as the file keeps it."""
    name: str
    key: str
    offset: int
    byte_size: int
    segment: str                # key without its leading '/'


class CudaRecord(msgspec.Struct, array_like=True, tag=1):
    """A CUDA shared-memory region, as the file keeps it."""
    name: str
    handle: bytes               # the client's cudaIpcMemHandle_t (64 bytes)
    device_id: int
    byte_size: int


@dataclass(eq=False)
class SystemRegion:
    name: str
    key: str
    offset: int
    byte_size: int
    segment: str
    in_use: int = 0             # this frontend's requests in flight that use it

    def record(self) -> RegionRecord:
        return RegionRecord(self.name, self.key, self.offset, self.byte_size, self.segment)


@dataclass(eq=False)
class CudaRegion:
    """A client's device allocation, known by its CUDA IPC handle; the frontend never keeps it
    open (it checked it once, at registration): workers open it when a request uses it."""
    name: str
    handle: bytes
    device_id: int
    byte_size: int
    in_use: int = 0             # this frontend's requests in flight that use it

    def record(self) -> CudaRecord:
        return CudaRecord(self.name, self.handle, self.device_id, self.byte_size)


Region = Union[SystemRegion, CudaRegion]

_GEN = struct.Struct("<Q")
_records = msgspec.msgpack.Decoder(list[Union[RegionRecord, CudaRecord]])
_encode = msgspec.msgpack.Encoder().encode


def _region(rec: RegionRecord | CudaRecord) -> Region:
    if isinstance(rec, CudaRecord):
        return CudaRegion(rec.name, rec.handle, rec.device_id, rec.byte_size)
    return SystemRegion(rec.name, rec.key, rec.offset, rec.byte_size, rec.segment)


class RegionTable:
    def __init__(self, path: str | None = None):
        self.path = path
        self.regions: dict[str, Region] = {}
        self.loaded = 0                         # the generation self.regions reflects
        self.gen: mmap.mmap | None = None
        self.lock_fd = -1
        if path is not None:
            self.lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fd = os.open(path + ".gen", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # two frontends starting at once: one sizes it
                if os.fstat(fd).st_size < _GEN.size:
                    os.ftruncate(fd, _GEN.size)
                fcntl.flock(fd, fcntl.LOCK_UN)
                self.gen = mmap.mmap(fd, _GEN.size)
            finally:
                os.close(fd)

    def current(self) -> dict[str, Region]:
        """The regions (system and CUDA: one namespace) as every frontend knows them now."""
        if self.gen is not None and _GEN.unpack_from(self.gen)[0] != self.loaded:
            fcntl.flock(self.lock_fd, fcntl.LOCK_SH)
            try:
                self._load()
            finally:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        return self.regions

    @contextmanager
    def change(self) -> Iterator[dict[str, Region]]:
        """The up-to-date table to change in place; the change is published (to every
        frontend) when the block ends without an exception, and dropped otherwise."""
        shared = self.gen is not None
        if shared:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        try:
            if shared:
                self._load()
            before = dict(self.regions)
            try:
                yield self.regions
            except BaseException:
                self.regions = before
                raise
            if shared:
                self._publish()
        finally:
            if shared:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def _publish(self) -> None:
        """Write the table and move the generation on (the caller holds the lock)."""
        assert self.gen is not None and self.path is not None
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_encode([r.record() for r in self.regions.values()]))
        os.replace(tmp, self.path)
        self.loaded = _GEN.unpack_from(self.gen)[0] + 1
        _GEN.pack_into(self.gen, 0, self.loaded)

    def _load(self) -> None:
        """Read the table (the caller holds the lock)."""
        assert self.gen is not None and self.path is not None
        gen = _GEN.unpack_from(self.gen)[0]
        try:
            with open(self.path, "rb") as f:
                records = _records.decode(f.read())
        except FileNotFoundError:
            records = []
        old, fresh = self.regions, {}
        for rec in records:
            region = old.get(rec.name)
            if region is None or region.record() != rec:
                region = _region(rec)
            fresh[rec.name] = region
        self.regions, self.loaded = fresh, gen

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
            self.gen = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
