"""The EngineClient's sends under a lease, in process, against real sockets standing in for the
scheduler (a ZeroMQ inbox) and the leased worker (a packet inbox): a request to an idle worker
goes at once; requests to a busy one made in the same turn of the event loop go in one packet;
what the worker cannot take (gone, or its inbox full) goes to the scheduler, and nothing is lost."""
import asyncio
import tempfile
import time

import pytest
import zmq
from packet_reader import PacketReader

from shmserve.engine.requests.prepare import PreparedRequest
from shmserve.frontend.engine_client import EngineClient
from shmserve.ipc import channel, packets
from shmserve.ipc.messages.common import ErrorCode, InferPayload, ShmRef
from shmserve.ipc.messages.to_frontend import InferResult, LeaseGranted
from shmserve.ipc.messages.to_scheduler import SubmitRequest
from shmserve.ipc.messages.to_worker import LeasedExecute, ReleaseOutputs

SPAWN = 7


def _prepared() -> PreparedRequest:
    return PreparedRequest(InferPayload("", [], []), batch_size=1, outputs={}, request_id="")


@pytest.fixture
def run_dir():
    with tempfile.TemporaryDirectory(prefix="shmserve-leased-") as d:
        yield d


class Rig:
    """A scheduler inbox and a worker inbox around one EngineClient holding a lease."""

    def __init__(self, run_dir: str):
        self.scheduler = channel.Inbox(channel.address(run_dir, "scheduler"))
        self.worker = PacketReader(channel.worker_address(run_dir, SPAWN))
        self.packets: list[int] = []        # messages in each packet of requests read
        self.run_dir = run_dir
        self.results: dict[int, InferResult] = {}

    async def client(self, depth: int = 0) -> EngineClient:
        client = EngineClient(self.run_dir, 0, asyncio.get_running_loop())
        me = packets.PacketOutbox(channel.frontend_address(self.run_dir, 0))
        me.send(LeaseGranted(1, "m", 1, SPAWN, depth=depth))
        me.close()
        await until(lambda: client.leases)
        return client

    def submit(self, client: EngineClient) -> int:
        return client.submit("m", 1, _prepared(), lambda r: self.results.setdefault(r.req_id, r))

    def at_worker(self, n: int) -> list[int]:
        got: list[int] = []
        while len(got) < n:
            msgs = self.worker.packet(timeout_s=2.0)
            assert all(isinstance(msg, LeasedExecute) for msg, _ in msgs)
            self.packets.append(len(msgs))
            got += [msg.head.req_id for msg, _ in msgs]
        assert len(got) == n
        return got

    def at_scheduler(self) -> list[SubmitRequest]:
        got = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                msg, _ = self.scheduler.recv(channel.NOBLOCK)
            except zmq.Again:
                time.sleep(0.01)
                continue
            if isinstance(msg, SubmitRequest):
                got.append(msg)
        return got

    def close(self):
        self.scheduler.close()
        self.worker.close()


async def until(cond, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_an_idle_worker_gets_a_request_at_once_a_busy_one_a_packet_per_turn(run_dir):
    rig = Rig(run_dir)

    async def scenario():
        client = await rig.client()
        first = rig.submit(client)
        # sent before the turn ends: the worker was idle
        assert rig.at_worker(1) == [first] and rig.packets == [1]
        rest = [rig.submit(client) for _ in range(5)]       # it is busy with the first
        assert client.corked
        await until(lambda: not client.corked)
        assert rig.at_worker(5) == rest
        assert rig.packets == [1, 5]
        assert set(client.leases.direct) == {first, *rest}
        assert client.leases.held[("m", 1)][0].inflight == 6
        client.close()

    try:
        asyncio.run(scenario())
    finally:
        rig.close()


def test_a_request_cancelled_while_held_for_its_worker_never_reaches_it(run_dir):
    """A client that resets a call in the read after it sent it (rapid reset): the request,
    still held for the busy worker, was sent first and cancelled after, so the model ran it."""
    rig = Rig(run_dir)

    async def scenario():
        client = await rig.client()
        first = rig.submit(client)
        assert rig.at_worker(1) == [first]
        kept, dropped = rig.submit(client), rig.submit(client)
        assert client.corked
        client.cancel(dropped)
        assert rig.results[dropped].code == ErrorCode.CANCELLED
        assert dropped not in client.pending and dropped not in client.leases.direct
        await until(lambda: not client.corked)
        assert rig.at_worker(1) == [kept]
        assert client.leases.held[("m", 1)][0].inflight == 2     # first and kept
        client.cancel(kept)         # sent already: the worker is told (after it)
        client.close()

    try:
        asyncio.run(scenario())
    finally:
        rig.close()


def test_requests_held_for_a_worker_that_has_gone_go_to_the_scheduler(run_dir):
    rig = Rig(run_dir)

    async def scenario():
        client = await rig.client()
        first = rig.submit(client)
        rig.at_worker(1)
        rest = [rig.submit(client) for _ in range(3)]
        rig.worker.close()                  # the worker dies before the turn ends
        await until(lambda: not client.corked)
        await until(lambda: not client.leases)      # its lease is forgotten
        sent = rig.at_scheduler()
        assert [h.req_id for h in sent] == rest
        assert all(h.no_lease for h in sent)        # not to be handed back to us
        assert set(client.pending) == {first, *rest}    # nothing answered, nothing lost
        assert set(client.leases.direct) == {first}
        client.close()

    try:
        asyncio.run(scenario())
    finally:
        rig.scheduler.close()


def test_what_a_full_worker_inbox_cannot_take_goes_to_the_scheduler(run_dir):
    rig = Rig(run_dir)

    async def scenario():
        client = await rig.client(depth=0)
        rig.submit(client)                  # opens the connection; the worker is now busy
        box = next(iter(client.workers.values()))
        rig.worker.accept()                 # accept it, then never read
        filler = 0
        try:
            while True:                     # fill the worker's socket buffer
                box.send(LeasedExecute(1, SubmitRequest(-1, 0, "m", 1, 1)), (b"f" * 60_000,),
                         channel.NOBLOCK)
                filler += 1
        except zmq.Again:
            pass
        rest = [rig.submit(client) for _ in range(3)]
        await until(lambda: not client.corked)
        sent = rig.at_scheduler()
        assert [h.req_id for h in sent] == rest
        # a lease with no depth limit we hold but could not use: not to be handed back to us
        assert all(h.no_lease for h in sent)
        assert client.leases                        # kept: the worker is only busy
        assert not set(rest) & set(client.leases.direct)
        assert set(rest) <= set(client.pending)
        client.close()
        return filler

    try:
        assert asyncio.run(scenario()) > 0
    finally:
        rig.close()


def test_output_slots_go_back_to_the_workers_that_hold_them_or_whole_to_the_scheduler(run_dir):
    """A worker's answer: each slot to the worker whose arena (named from the server's prefix)
    holds it, one message each; a slot of any other segment to the answering worker. The
    scheduler's answer (an ensemble it ran): every slot to it, which counts their references."""
    prefix = "shmserve_1_ab_"
    boxes = {sid: packets.PacketInbox(channel.worker_address(run_dir, sid)) for sid in (5, 7)}
    sched = packets.PacketInbox(channel.scheduler_worker_address(run_dir))

    def ref(segment: str, offset: int = 0) -> ShmRef:
        return ShmRef(segment, offset, 64)

    def taken(box) -> list[ReleaseOutputs]:
        got = []
        box.set_timeout(50)
        while True:
            try:
                msg, _ = box.recv()
            except zmq.Again:
                return got
            got.append(msg)

    async def main():
        client = EngineClient(run_dir, 0, asyncio.get_running_loop(), segment_prefix=prefix)
        w5, w7 = (channel.worker_segment_prefix(prefix, s) for s in (5, 7))
        client.release(channel.worker_address(run_dir, 5),
                       [ref(w5 + "0"), ref(w7 + "1", 128), ref(w5 + "0", 64), ref("other")])
        assert taken(boxes[5]) == [ReleaseOutputs([ref(w5 + "0"), ref(w5 + "0", 64),
                                                   ref("other")])]
        assert taken(boxes[7]) == [ReleaseOutputs([ref(w7 + "1", 128)])]
        shared = [ref(w5 + "0"), ref(w5 + "0"), ref(w7 + "1")]     # one slot, two outputs
        client.release(channel.scheduler_worker_address(run_dir), shared)
        assert taken(sched) == [ReleaseOutputs(shared)]
        assert taken(boxes[5]) == [] and taken(boxes[7]) == []
        client.close()

    try:
        asyncio.run(main())
    finally:
        for box in [*boxes.values(), sched]:
            box.close()
