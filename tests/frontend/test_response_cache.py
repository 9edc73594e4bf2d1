"""In-process tests of frontend/cache/store.py: what the key covers, the byte bound and its
least-recently-used order, dropping a model's entries, and a hit's answer (inline, or written
into a client's region)."""
import pytest

from shmserve.frontend.cache.store import (
    ENTRY_OVERHEAD,
    OUTPUT_OVERHEAD,
    CachedOutput,
    ResponseCache,
    answer,
    outputs_of,
)
from shmserve.ipc.messages.common import CudaRef, ErrorCode, InferPayload, OutputSpec, ShmRef, Tensor
from shmserve.ipc.messages.to_frontend import InferResult

OWNER = object()     # the catalog view an entry belongs to (any object here)


def payload(data=b"\0" * 16, name="INPUT0", shape=(1, 4), outputs=("OUTPUT0",), params=None,
            extra=()):
    inputs = [Tensor(name, "FP32", list(shape), data), *extra]
    return InferPayload("", inputs, [OutputSpec(o) for o in outputs], params or {})


def no_shm(ref):
    raise AssertionError("no input is in shared memory here")


def key(p, model="m", version=1, read=no_shm):
    return ResponseCache.key(model, version, p, read)


def test_equal_requests_have_equal_keys_and_any_difference_changes_it():
    base = key(payload())
    assert base == key(payload()) and len(base) == 16
    different = [
        key(payload(), model="n"), key(payload(), version=2),
        key(payload(data=b"\1" + b"\0" * 15)), key(payload(name="INPUT1")),
        key(payload(shape=(4, 1))), key(payload(shape=(2, 2))),
        key(payload(outputs=("OUTPUT0", "OUTPUT1"))), key(payload(outputs=())),
        key(payload(params={"k": 1})),
    ]
    assert base not in different and len(set(different)) == len(different)


def test_the_correlation_id_and_sequence_flags_are_part_of_the_key():
    """A model without a sequence batcher still reads them (request.correlation_id(),
    request.flags()): two requests that differ only there may have different answers."""
    def seq(cid, flags=0):
        p = payload()
        p.correlation_id, p.flags = cid, flags
        return key(p)
    keys = [key(payload()), seq(7), seq(8), seq("7"), seq(7, 1), seq(7, 2), seq("a"), seq("b")]
    assert len(set(keys)) == len(keys)
    assert seq(7, 1) == seq(7, 1) and seq(0) == key(payload())


def test_the_key_does_not_depend_on_the_order_of_inputs_or_parameters():
    a = Tensor("A", "INT32", [1], b"\1\0\0\0")
    b = Tensor("B", "INT32", [1], b"\2\0\0\0")
    one = InferPayload("", [a, b], [OutputSpec("O")], {"x": 1, "y": "z"})
    two = InferPayload("", [b, a], [OutputSpec("O")], {"y": "z", "x": 1})
    assert key(one) == key(two)


def test_name_and_data_boundaries_cannot_alias():
    # the same bytes in all, cut at another place: lengths are part of the key
    one = payload(name="AB", data=b"C")
    two = payload(name="A", data=b"BC")
    assert key(one) != key(two)


def test_the_classification_count_is_part_of_the_key():
    plain = payload()
    top = payload()
    top.outputs = [OutputSpec("OUTPUT0", classification=3)]
    assert key(plain) != key(top)


def test_inputs_in_shared_memory_are_read_where_they_are():
    ref = ShmRef("seg", 64, 16)
    inline = payload(data=b"x" * 16)
    shm = payload()
    shm.inputs[0] = Tensor("INPUT0", "FP32", [1, 4], None, ref)
    seen = []

    def read(r):
        seen.append(r)
        return memoryview(b"x" * 16)
    assert key(shm, read=read) == key(inline) and seen == [ref]


def test_gpu_inputs_and_outputs_are_not_cached():
    gpu_in = payload()
    gpu_in.inputs[0] = Tensor("INPUT0", "FP32", [1, 4], cuda=CudaRef(b"h" * 64, 0, 0, 16))
    assert key(gpu_in) is None
    gpu_out = payload()
    gpu_out.outputs = [OutputSpec("OUTPUT0", cuda=CudaRef(b"h" * 64, 0, 0, 16))]
    assert key(gpu_out) is None


def out(name="O", n=16):
    return CachedOutput(name, "FP32", (1, n // 4), b"\7" * n)


def size_of(k, *outs, model="m", params=b""):
    """Everything an entry holds: key, model name, encoded parameters, each output's name,
    datatype, shape (8 bytes a dim) and bytes, plus the fixed costs."""
    return ENTRY_OVERHEAD + len(k) + len(model) + len(params) + sum(
        OUTPUT_OVERHEAD + len(o.name) + len(o.datatype) + 8 * len(o.shape) + len(o.data)
        for o in outs)


def test_get_counts_hits_and_misses_and_put_keeps_the_answer():
    c = ResponseCache(10_000)
    k = key(payload())
    assert c.get(k) is None
    assert c.put(k, "m", 1, OWNER, [out()], {"p": 1})
    e = c.get(k)
    assert e.outputs == (out(),) and e.parameters == {"p": 1} and e.model == "m"
    assert (c.counters.hits, c.counters.misses, c.counters.inserted) == (1, 1, 1)
    assert c.used == size_of(k, out(), params=b'{"p":1}')


def test_least_recently_used_goes_first_and_the_bound_holds():
    k1, k2, k3 = (key(payload(data=bytes([i]) * 16)) for i in range(3))
    c = ResponseCache(2 * size_of(k1, out()))
    c.put(k1, "m", 1, OWNER, [out()], {})
    c.put(k2, "m", 1, OWNER, [out()], {})
    assert c.get(k1) is not None            # k1 is now the most recent
    c.put(k3, "m", 1, OWNER, [out()], {})     # evicts k2
    assert c.get(k2) is None and c.get(k1) is not None and c.get(k3) is not None
    assert c.used <= c.capacity and c.counters.evicted == 1


def test_an_answer_larger_than_the_cache_is_not_kept_and_evicts_nothing():
    k1, k2 = key(payload()), key(payload(data=b"\1" * 16))
    c = ResponseCache(size_of(k1, out()))
    assert c.put(k1, "m", 1, OWNER, [out()], {})
    assert not c.put(k2, "m", 1, OWNER, [out(n=64)], {})
    assert c.get(k1) is not None and c.get(k2) is None
    assert c.counters.too_large == 1 and c.used == size_of(k1, out())


def test_putting_a_key_again_replaces_its_entry():
    k = key(payload())
    c = ResponseCache(10_000)
    c.put(k, "m", 1, OWNER, [out(n=16)], {})
    c.put(k, "m", 1, OWNER, [out(n=32)], {})
    assert len(c.entries) == 1 and c.used == size_of(k, out(n=32))
    assert len(c.get(k).outputs[0].data) == 32


def test_retain_drops_what_the_predicate_refuses():
    c = ResponseCache(10_000)
    for i, model in enumerate(("a", "b", "a")):
        c.put(key(payload(data=bytes([i]) * 16), model=model), model, 1, OWNER, [out()], {})
    assert c.retain(lambda e: e.model != "a") == 2
    assert [e.model for e in c.entries.values()] == ["b"]
    assert c.used == size_of(b"k" * 16, out(), model="b")


def test_a_hit_answers_inline_with_the_entry():
    c = ResponseCache(10_000)
    k = key(payload())
    c.put(k, "m", 3, OWNER, [out("A"), out("B", 8)], {"p": "q"})
    res = answer(c.get(k), 42, {}, no_shm)
    assert (res.req_id, res.model, res.version, res.error) == (42, "m", 3, "")
    assert [(t.name, t.shape, t.data) for t in res.outputs] == [
        ("A", [1, 4], b"\7" * 16), ("B", [1, 2], b"\7" * 8)]
    assert res.parameters == {"p": "q"}


def test_a_hit_writes_an_output_into_the_clients_region():
    region = bytearray(32)
    c = ResponseCache(10_000)
    k = key(payload())
    c.put(k, "m", 1, OWNER, [out("A")], {})
    wanted = ShmRef("client", 8, 24)     # 24 bytes from offset 8 of the client's segment

    def view(ref):
        assert ref.segment == "client"
        return memoryview(region)[ref.offset:ref.offset + ref.nbytes]
    res = answer(c.get(k), 1, {"A": wanted}, view)
    assert res.outputs[0].data is None and res.outputs[0].shm == ShmRef("client", 8, 16)
    assert region == bytearray(8) + b"\7" * 16 + bytearray(8)


def test_a_region_too_small_for_the_cached_output_fails_that_request():
    c = ResponseCache(10_000)
    k = key(payload())
    c.put(k, "m", 1, OWNER, [out("A", 16)], {})
    res = answer(c.get(k), 1, {"A": ShmRef("client", 0, 8)}, no_shm)
    assert res.code == ErrorCode.INVALID_ARG
    assert res.error == ("shared memory size specified with the request for output 'A' "
                         "(8 bytes) should be at least 16 bytes to hold the results")


def test_outputs_of_copies_out_of_shared_memory_and_refuses_gpu_outputs():
    backing = bytearray(b"abcdefgh")
    res = InferResult(1, "m", 1, [Tensor("A", "UINT8", [2], b"xy"),
                                  Tensor("B", "UINT8", [4], None, ShmRef("w", 2, 4))])
    outs = outputs_of(res, lambda r: memoryview(backing)[r.offset:r.offset + r.nbytes])
    backing[:] = bytes(8)       # the slot is reused after the answer: the entry keeps its copy
    assert outs == [CachedOutput("A", "UINT8", (2,), b"xy"),
                    CachedOutput("B", "UINT8", (4,), b"cdef")]
    gpu = InferResult(1, "m", 1, [Tensor("A", "UINT8", [2], cuda=CudaRef(b"h" * 64, 0, 0, 2))])
    assert outputs_of(gpu, no_shm) is None


@pytest.mark.parametrize("capacity", [0, 100])
def test_a_tiny_cache_keeps_nothing(capacity):
    c = ResponseCache(capacity)
    k = key(payload())
    assert not c.put(k, "m", 1, OWNER, [out()], {}) and c.get(k) is None and c.used == 0


def test_an_entry_is_counted_with_its_names_shapes_and_parameters():
    """An answer whose outputs are small but whose parameters (or output names, or shape)
    are large costs what it holds: the bound holds for it, and one larger than the cache is
    refused."""
    k = key(payload())
    big_params = {"note": "x" * 5000}
    c = ResponseCache(4000)
    assert not c.put(k, "m", 1, OWNER, [out()], big_params)
    assert c.counters.too_large == 1 and c.used == 0
    long = CachedOutput("O" * 3000, "FP32", (1,) * 200, b"")
    assert not c.put(k, "m", 1, OWNER, [long], {})
    c = ResponseCache(20_000)
    for i in range(10):
        c.put(key(payload(data=bytes([i]) * 16)), "m", 1, OWNER, [out()], big_params)
        assert c.used <= c.capacity
    assert len(c.entries) == 3      # each ~5.3 kB
