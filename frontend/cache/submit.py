"""Submitting a request of a model with the response cache (frontend/cache/store.py): a hit
is answered here, a miss is sent and its answer kept.

Neither the key nor an entry may be made of bytes a client can still write, or a client could
poison what other clients get:
- inputs that live in a client's region are copied into this frontend's memory once (inline
  when small, else a slot of its arena, freed with the request's other slots); the key is
  hashed from that copy and the worker reads that copy, so both see the same bytes however the
  client flips its region meanwhile;
- outputs the client wants in its region are written by the worker into its own slots; the
  entry is copied from there, and the region is written from the entry's copy afterwards, as a
  hit's are.
Requests of models without the cache never come here: the plain shared-memory path (the worker
reading and writing the client's regions in place) costs no copy.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec

from shmserve.engine.requests.catalog import ModelView
from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend.cache import store as response_cache
from shmserve.frontend.cache.store import CachedOutput, ResponseCache
from shmserve.frontend.engine_client import EngineClient
from shmserve.ipc.channel import INLINE_LIMIT
from shmserve.ipc.messages.common import CacheRecord, ErrorCode, ShmRef
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena, ShmError, ShmMapCache


class CachedRequests:
    def __init__(self, cache: ResponseCache, client: EngineClient, arena: ShmArena,
                 maps: ShmMapCache, release_outputs: Callable[[InferResult, list[ShmRef]], None]):
        self.cache = cache
        self.client = client
        self.arena = arena
        self.maps = maps
        self.release_outputs = release_outputs      # gives a worker's output slots back
        client.on_table = self.forget_changed

    def submit(self, view: ModelView, version: int, prepared: PreparedRequest,
               on_result: Callable[[InferResult], None]) -> int:
        """Answer from the cache, or send the request and keep its answer. Returns its id."""
        cache, client, clock = self.cache, self.client, time.monotonic_ns
        name = view.name
        payload = prepared.payload
        if not response_cache.cacheable(payload):
            return client.submit(name, version, prepared, on_result, view.preserve_ordering)
        t0 = clock()
        try:
            self._own_inputs(prepared)
            key = cache.key(name, version, payload, self.maps.view)
        except ShmError:
            key = None          # an input's region is gone: the worker says so, as always
        if key is None:
            return client.submit(name, version, prepared, on_result, view.preserve_ordering)
        regions = {n: w.ref for n, w in prepared.outputs.items()
                   if w.region and type(w.ref) is ShmRef}
        entry = cache.get(key)
        if entry is not None:
            req_id = client.new_id()
            result = response_cache.answer(entry, req_id, regions, self.maps.view)
            t1 = clock()
            client.cache_record(CacheRecord(name, version, True, t1 - t0, t1 - t0))
            # answered after this call returns, as any other request is (callers keep its id)
            asyncio.get_running_loop().call_soon(on_result, result)
            return req_id
        client.cache_record(CacheRecord(name, version, False, clock() - t0))
        if regions:             # into the worker's slots: copied into the regions on the answer
            for o in payload.outputs:
                o.shm = None
        catalog = client.catalog

        def answered(result: InferResult) -> None:
            if not result.error:
                t = clock()
                try:
                    outs = response_cache.outputs_of(result, self.maps.view)
                except ShmError:
                    outs = None
                # kept only if the model is as it was when the request went out: an answer of
                # a version reloaded meanwhile must not be served for the new one
                if outs is not None and catalog.models.get(name) is view:
                    cache.put(key, name, version, view, outs, result.parameters)
                client.cache_record(CacheRecord(name, version, False, clock() - t, count=0))
                if regions:
                    result = self._into_regions(result, outs, regions)
            on_result(result)
        return client.submit(name, version, prepared, answered, view.preserve_ordering)

    def _own_inputs(self, prepared: PreparedRequest) -> None:
        """Copy the inputs that live in a client's region into this frontend's memory."""
        arena, ours = self.arena, self.arena.name_prefix
        for t in prepared.payload.inputs:
            ref = t.shm
            if ref is None or ref.segment.startswith(ours):
                continue
            src = self.maps.view(ref)
            if ref.nbytes <= INLINE_LIMIT:
                t.data, t.shm = bytes(src), None
                continue
            slot = arena.alloc(ref.nbytes)
            prepared.scratch.append(slot.ref)
            slot.view[:] = src
            t.shm = slot.ref

    def _into_regions(self, result: InferResult, outs: list[CachedOutput] | None,
                      regions: dict[str, ShmRef]) -> InferResult:
        """The answer of a miss whose outputs for the client's regions are still in the
        worker's slots: write them into the regions from the copy the entry was made of, and
        give those slots back (a failure gives every slot back: the answer carries none)."""
        kept = {o.name: o for o in outs or ()}
        tensors, error = [], ""
        for t in result.outputs:
            ref = regions.get(t.name)
            if ref is None:
                tensors.append(t)
                continue
            o = kept.get(t.name)
            placed = response_cache.into_region(o, ref, self.maps.view) if o is not None else \
                f"cannot read output '{t.name}' from the worker's shared memory"
            if isinstance(placed, str):
                error = error or placed
            else:
                tensors.append(placed)
        refs = [t.shm for t in result.outputs
                if t.shm is not None and (error or t.name in regions)]
        self.release_outputs(result, refs)
        if error:
            return msgspec.structs.replace(result, outputs=[], error=error,
                                           code=ErrorCode.INVALID_ARG)
        return msgspec.structs.replace(result, outputs=tensors)

    def forget_changed(self) -> None:
        """A new model table: a model whose view changed (a version loading, unloading or
        reloaded, a new config) loses its cached answers; the catalog keeps the view of a
        model that did not change, so the others keep theirs."""
        models = self.client.catalog.models
        self.cache.retain(lambda e: models.get(e.model) is e.owner)
