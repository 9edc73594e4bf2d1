"""The response cache (Triton's ``--cache-config local,size=N`` with ``response_cache { enable:
true }`` in a model's config): answers of earlier requests, by a hash of what decides them.

It lives in the frontend, so that a hit is answered where the request was parsed: no message
to the scheduler or a worker, no shared memory touched but the client's. Each frontend process
keeps its own cache (with ``--frontends N`` each gets 1/N of the size).

The key is a 128-bit BLAKE2b digest of the model name and version and of every input (name,
datatype, shape and bytes), as Triton's is, plus what Triton leaves out but a model can read
and answer by: the outputs asked for (with their classification counts), the request's custom
parameters, and its correlation id and sequence flags. How the outputs travel back (JSON,
binary, a client's region) is not in the key: an entry holds the outputs' bytes and each hit
writes them the way its request asks.

Neither the key nor an entry is ever made of bytes a client can still write:
frontend/cache/submit.py copies inputs out of clients' regions before hashing them, and has
a cached request's outputs written into the worker's slots, not into the client's region.

Bounded by bytes (what an entry holds: the outputs' bytes, names, datatypes and shapes, its
parameters and key, plus a fixed cost per entry and per output); the least recently used
entries go first. An answer larger than the whole cache is not kept (Triton's "Failed to insert
key"). ``ResponseCache`` is pure: no sockets, no clock.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgspec

from shmserve.ipc.messages.common import ErrorCode, InferPayload, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmError

# what an entry costs beyond its bytes (the record, its dict slot, the key), and each output
ENTRY_OVERHEAD = 200
OUTPUT_OVERHEAD = 100

_encode_params = msgspec.json.Encoder(order="sorted").encode


@dataclass(slots=True, frozen=True)
class CachedOutput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(slots=True)
class CacheEntry:
    model: str
    version: int
    owner: object           # the model's catalog view when it was kept: a new one (a state
                            # change, a reload, a new config) makes the entry stale
    outputs: tuple[CachedOutput, ...]
    parameters: dict[str, Any]
    size: int


@dataclass(slots=True)
class CacheCounters:
    hits: int = 0
    misses: int = 0
    inserted: int = 0
    evicted: int = 0
    too_large: int = 0


class ResponseCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self.counters = CacheCounters()

    # ---- keys ------------------------------------------------------------------------------
    @staticmethod
    def key(model: str, version: int, payload: InferPayload,
            read: Callable[[ShmRef], memoryview]) -> bytes | None:
        """The request's digest; None when it cannot be cached (an input in GPU memory).
        ``read`` gives the bytes of an input that lives in shared memory."""
        h = hashlib.blake2b(digest_size=16)
        h.update(b"%d:%s\0%d\0" % (len(model), model.encode(), version))
        for t in sorted(payload.inputs, key=_name):
            if t.cuda is not None:
                return None
            data = t.data if t.shm is None else read(t.shm)
            assert data is not None
            h.update(b"I%d:%s\0%s\0%s\0%d\0" % (len(t.name), t.name.encode(), t.datatype.encode(),
                                               ",".join(map(str, t.shape)).encode(), len(data)))
            h.update(data)
        for o in payload.outputs:
            if o.cuda is not None:
                return None     # written into a client's GPU memory: not kept (CPU only)
            h.update(b"O%d:%s\0%d\0" % (len(o.name), o.name.encode(), o.classification))
        if payload.parameters:
            h.update(b"P")
            h.update(_encode_params(payload.parameters))
        if payload.correlation_id or payload.flags:
            cid = payload.correlation_id
            text = str(cid).encode()
            h.update(b"S%s%d:%s\0%d" % (b"s" if isinstance(cid, str) else b"i", len(text),
                                        text, payload.flags))
        return h.digest()

    # ---- lookups and inserts ---------------------------------------------------------------------
    def get(self, key: bytes) -> CacheEntry | None:
        entry = self.entries.get(key)
        if entry is None:
            self.counters.misses += 1
            return None
        self.entries.move_to_end(key)
        self.counters.hits += 1
        return entry

    def put(self, key: bytes, model: str, version: int, owner: object,
            outputs: Iterable[CachedOutput], parameters: dict[str, Any]) -> bool:
        """Keep an answer; False when it is larger than the whole cache (nothing is evicted
        for it then)."""
        outs = tuple(outputs)
        size = entry_size(key, model, outs, parameters)
        if size > self.capacity:
            self.counters.too_large += 1
            return False
        old = self.entries.pop(key, None)
        if old is not None:         # two misses of the same request raced: keep the later
            self.used -= old.size
        while self.used + size > self.capacity:
            _, gone = self.entries.popitem(last=False)
            self.used -= gone.size
            self.counters.evicted += 1
        self.entries[key] = CacheEntry(model, version, owner, outs, dict(parameters), size)
        self.used += size
        self.counters.inserted += 1
        return True

    def retain(self, keep: Callable[[CacheEntry], bool]) -> int:
        """Drop the entries ``keep`` refuses (a model changed); returns how many."""
        gone = [k for k, e in self.entries.items() if not keep(e)]
        for k in gone:
            self.used -= self.entries.pop(k).size
        return len(gone)


def cacheable(payload: InferPayload) -> bool:
    """Whether the request can be cached at all: nothing of it lives in GPU memory."""
    return all(t.cuda is None for t in payload.inputs) and \
        all(o.cuda is None for o in payload.outputs)


def entry_size(key: bytes, model: str, outputs: Iterable[CachedOutput],
               parameters: dict[str, Any]) -> int:
    """What an entry costs the cache: everything it holds, plus the fixed costs."""
    size = ENTRY_OVERHEAD + len(key) + len(model)
    if parameters:
        size += len(_encode_params(parameters))
    for o in outputs:
        size += OUTPUT_OVERHEAD + len(o.name) + len(o.datatype) + 8 * len(o.shape) + len(o.data)
    return size


def _name(t: Tensor) -> str:
    return t.name


def outputs_of(result: InferResult,
               read: Callable[[ShmRef], memoryview]) -> list[CachedOutput] | None:
    """The outputs of a successful answer as an entry keeps them (copied out of the worker's
    slots); None when one of them cannot be kept (left in GPU memory)."""
    outs = []
    for t in result.outputs:
        if t.cuda is not None:
            return None
        data = bytes(read(t.shm)) if t.shm is not None else (t.data or b"")
        outs.append(CachedOutput(t.name, t.datatype, tuple(t.shape), data))
    return outs


def answer(entry: CacheEntry, req_id: int, regions: dict[str, ShmRef],
           view: Callable[[ShmRef], memoryview]) -> InferResult:
    """A hit's answer: the entry's outputs, inline, except those the request wants in a
    client's region (``regions``), which are written there now, as a worker would have."""
    outs = []
    for o in entry.outputs:
        ref = regions.get(o.name)
        if ref is None:
            outs.append(Tensor(o.name, o.datatype, list(o.shape), o.data))
            continue
        placed = into_region(o, ref, view)
        if isinstance(placed, str):
            return _failed(entry, req_id, placed)
        outs.append(placed)
    return InferResult(req_id, entry.model, entry.version, outs, parameters=dict(entry.parameters))


def into_region(o: CachedOutput, ref: ShmRef, view: Callable[[ShmRef], memoryview]) -> Tensor | str:
    """Write an output into the client's region ``ref``; the tensor that says where it is, or
    why it could not be written (in the worker's words)."""
    n = len(o.data)
    if n > ref.nbytes:
        return (f"shared memory size specified with the request for output '{o.name}' "
                f"({ref.nbytes} bytes) should be at least {n} bytes to hold the results")
    placed = ShmRef(ref.segment, ref.offset, n)
    try:
        view(placed)[:] = o.data
    except ShmError as e:
        return f"failed to write output '{o.name}' into its shared memory region: {e}"
    return Tensor(o.name, o.datatype, list(o.shape), None, placed)


def _failed(entry: CacheEntry, req_id: int, message: str) -> InferResult:
    return InferResult(req_id, entry.model, entry.version, error=message,
                       code=ErrorCode.INVALID_ARG)
