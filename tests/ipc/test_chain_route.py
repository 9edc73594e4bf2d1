"""ipc/chain_route.py: which requests of an ensemble the frontend may send worker to worker."""
from shmserve.ipc.chain_route import Route, read_after
from shmserve.ipc.messages.common import ChainHop, InferPayload, OutputSpec, ShmRef, Tensor

# IN and EXTRA feed a (P), P and EXTRA feed b (OUT); a also makes Q, which nothing reads
ROUTE = Route([ChainHop(0, "a", 1, {"X": "IN"}, {"Z": "P", "W": "Q"}),
               ChainHop(1, "b", 1, {"X": "P", "Y": "EXTRA"}, {"Z": "OUT"})])


def request(inputs=("IN", "EXTRA"), **outputs) -> InferPayload:
    return InferPayload("", [Tensor(n, "FP32", [1, 4], b"\0" * 16) for n in inputs],
                        [OutputSpec(n, **spec) for n, spec in outputs.items()])


def test_what_a_route_reads_and_needs():
    assert read_after(ROUTE.hops, 0) == {"P", "EXTRA"} and read_after(ROUTE.hops, 1) == set()
    assert ROUTE.needs == {"IN", "EXTRA"}


def test_plain_requests_with_every_input_go_worker_to_worker():
    assert ROUTE.serves(request(OUT={}, P={}, Q={}))
    assert ROUTE.serves(request())                              # (all outputs)


def test_an_input_left_out_is_the_schedulers():
    assert not ROUTE.serves(request(inputs=("IN",), OUT={}))


def test_an_output_a_later_step_reads_is_only_plain_worker_to_worker():
    region = ShmRef("client_region", 0, 16)
    assert not ROUTE.serves(request(P={"shm": region}))
    assert not ROUTE.serves(request(P={"classification": 2}))
    # one nothing reads after its step is written as asked by that step
    assert ROUTE.serves(request(Q={"shm": region}, OUT={"classification": 3}))
