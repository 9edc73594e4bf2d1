"""ModelStreamInfer under arbitrary request messages, in-process: the real servicer and
FrontendService over the fuzz models, with an engine that answers at once. Whatever a stream
carries (unknown models, junk fields, shapes past every limit, more requests than a stream may
have in flight), each request gets exactly one answer, in order, carrying its id: a response or
an error message. Nothing escapes the stream and nothing hangs."""
import asyncio
import itertools

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies import big_ints, datatypes, names
from test_fuzz_grpc_shm_config import infer_parameter, infer_requests
from test_fuzz_http import ARENA, CATALOG
from test_http_codec import CONFIGS
from tritonclient.grpc import service_pb2 as pb

from shmserve.engine.requests.prepare import RequestLimits
from shmserve.frontend.grpc.service import STREAM_MAX_INFLIGHT, InferenceService
from shmserve.frontend.service import FrontendService
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import dtypes, shm
from shmserve.ipc.messages.common import ErrorCode, Tensor
from shmserve.ipc.messages.to_frontend import InferResult

STREAM_TIMEOUT_S = 20       # far beyond what a stream of these needs: reaching it is a hang
# a stream runs many requests per example: a third of the profile's examples (ci: 100)
SOME = settings(max_examples=max(30, settings.default.max_examples // 3))


class AnsweringEngine:
    """Stands in for EngineClient: answers every request on the next turn of the loop, with its
    requested outputs (empty), or, for every third request, the model's error."""

    def __init__(self):
        self.catalog = CATALOG
        self.ids = itertools.count(1)
        self.pending = 0

    def submit(self, model, version, prepared, on_result, ordered=False):
        req_id = next(self.ids)
        if req_id % 3 == 0:
            result = InferResult(req_id, model, version, error="the model failed",
                                 code=ErrorCode.INTERNAL)
        else:
            result = InferResult(req_id, model, version, outputs=[
                Tensor(name, "UINT8", [0], b"") for name in prepared.outputs])
        self.pending += 1

        def answer():
            self.pending -= 1
            on_result(result)
        asyncio.get_running_loop().call_soon(answer)
        return req_id

    def cancel(self, req_id):
        pass

    def release(self, worker, refs):
        pass


class _Context:
    """The stream's call as a client on this host made it (no metadata)."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def invocation_metadata(self):
        return ()


def _service(engine) -> InferenceService:
    svc = FrontendService(engine, ARENA, shm.ShmMapCache(), ShmRegistry(), "fuzz", "0",
                          strict_readiness=True,
                          limits=RequestLimits(max_tensor_bytes=1 << 20, max_json_elements=64))
    return InferenceService(svc, max_message=1 << 16)


async def _stream(messages: list[pb.ModelInferRequest]) -> list[pb.ModelStreamInferResponse]:
    async def requests():
        for m in messages:
            yield m
    engine = AnsweringEngine()
    answers = [a async for a in _service(engine).ModelStreamInfer(requests(), _Context())]
    assert engine.pending == 0
    return answers


def _run(messages: list[pb.ModelInferRequest]) -> None:
    answers = asyncio.run(asyncio.wait_for(_stream(messages), STREAM_TIMEOUT_S))
    assert len(answers) == len(messages)
    for m, a in zip(messages, answers):
        assert a.infer_response.id == m.id
        if a.error_message:
            event("error")
        else:
            event("answered")
            assert a.infer_response.model_name == m.model_name


models = st.one_of(st.sampled_from(sorted(CONFIGS)), st.text(max_size=6))
versions = st.one_of(st.just(""), st.sampled_from(["1", "2", "-1", "0x1", "99999999999999999999"]),
                     st.text(max_size=4))


@st.composite
def stream_requests(draw):
    req = draw(infer_requests())
    req.model_name = draw(models)
    req.model_version = draw(versions)
    return req


@st.composite
def undecodable_as_empty(draw):
    """Arbitrary bytes read as a ModelInferRequest, as grpc would deserialize them (bytes that
    do not decode never reach the servicer; they stand for an empty message here)."""
    data = draw(st.binary(max_size=80))
    try:
        return pb.ModelInferRequest.FromString(data)
    except Exception:
        return pb.ModelInferRequest()


def valid(model: str, batch: int) -> pb.ModelInferRequest:
    """A request the model accepts, as the starting point for one mutation."""
    view = CATALOG.get(model)
    req = pb.ModelInferRequest(model_name=model, id=f"{model}-{batch}")
    lead = [batch] if view.max_batch_size else []
    for spec in view.inputs.values():
        shape = lead + [d if d >= 0 else 2 for d in spec.dims]
        n = dtypes.element_count(shape)
        if spec.datatype == "BYTES":
            data = dtypes.serialize_bytes(np.array([b"ab"] * n, dtype=object)).tobytes()
        else:
            data = bytes(n * dtypes.ELEMENT_SIZE[spec.datatype])
        req.inputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
        req.raw_input_contents.append(data)
    return req


@st.composite
def mutated_requests(draw):
    req = valid(draw(st.sampled_from(sorted(CONFIGS))), draw(st.integers(1, 3)))
    what = draw(st.sampled_from(["none", "name", "datatype", "shape", "raw", "drop_raw",
                                 "extra_raw", "param", "output", "model", "version"]))
    event(f"mutation: {what}")
    i = draw(st.integers(0, 3)) % len(req.inputs)
    if what == "name":
        req.inputs[i].name = draw(names)
    elif what == "datatype":
        req.inputs[i].datatype = draw(datatypes)
    elif what == "shape":
        del req.inputs[i].shape[:]
        req.inputs[i].shape.extend(draw(st.lists(st.integers(0, 2 ** 63 - 1) | big_ints.filter(
            lambda d: -(2 ** 63) <= d < 2 ** 63), max_size=4)))
    elif what == "raw":
        req.raw_input_contents[i] = draw(st.binary(max_size=40))
    elif what == "drop_raw":
        del req.raw_input_contents[i]
    elif what == "extra_raw":
        req.raw_input_contents.append(draw(st.binary(max_size=8)))
    elif what == "param":
        req.parameters[draw(st.text(max_size=6))].CopyFrom(draw(infer_parameter()))
    elif what == "output":
        req.outputs.add(name=draw(names))
    elif what == "model":
        req.model_name = draw(models)
    elif what == "version":
        req.model_version = draw(versions)
    return req


@SOME
@given(messages=st.lists(st.one_of(stream_requests(), mutated_requests(),
                                   undecodable_as_empty()), max_size=12))
def test_stream_of_arbitrary_requests(messages):
    _run(messages)


@SOME
@given(message=st.one_of(mutated_requests(), stream_requests()),
       n=st.integers(STREAM_MAX_INFLIGHT, 3 * STREAM_MAX_INFLIGHT))
def test_stream_longer_than_its_in_flight_bound(message, n):
    """More requests than a stream may hold at once: the reader waits for answers to be
    written, and every request is still answered once, in order."""
    messages = []
    for i in range(n):
        m = pb.ModelInferRequest()
        m.CopyFrom(message)
        m.id = str(i)
        messages.append(m)
    _run(messages)
