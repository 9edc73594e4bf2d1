"""Every message that crosses a process boundary, with its one encode and one decode place.

Messages are msgspec Structs encoded as msgpack arrays (``array_like``) with an integer tag, so a
frame costs a few bytes of framing and decoding yields typed objects, not dicts.

A message travels as ZeroMQ multipart: frame 0 is the encoded message; ``SubmitRequest`` and
``ExecuteBatch`` are followed by one opaque frame per request holding the encoded ``InferPayload``.
The scheduler only decodes frame 0 and forwards the payload frames untouched, so tensor data that
rides inline is never decoded or re-encoded on the way to a worker.

The messages themselves live in one module per receiving process: ``to_scheduler``,
``to_frontend`` and ``to_worker``, with what they all carry in ``common``.
"""
from __future__ import annotations

from typing import Union

import msgspec

from shmserve.ipc.messages.common import CustomMetrics, InferPayload
from shmserve.ipc.messages.to_frontend import (
    ControlReply,
    InferResult,
    InferResults,
    LeaseBounced,
    LeaseGranted,
    LeaseLost,
    LeaseRevoked,
    ModelTable,
    ReadinessReply,
    StatsReply,
    WorkerGone,
)
from shmserve.ipc.messages.to_scheduler import (
    BatchDone,
    CancelRequest,
    ControlRequest,
    ForgetSegments,
    FrontendHello,
    LeasedDone,
    LeaseEnded,
    Pong,
    ProcessExited,
    ReadinessQuery,
    ReadinessReport,
    ResponseReport,
    SequencesLost,
    SetLogSettings,
    SetTraceSettings,
    StatsQuery,
    SubmitRequest,
    Wake,
    WorkerLoadFailed,
    WorkerReady,
)
from shmserve.ipc.messages.to_worker import (
    ChainExecute,
    CheckReadiness,
    ExecuteBatch,
    LeasedExecute,
    LendSequences,
    Ping,
    ReleaseOutputs,
    RevokeLease,
    Shutdown,
)

Message = Union[
    FrontendHello, SubmitRequest, SequencesLost, StatsQuery, ControlRequest, CancelRequest, ModelTable,
    StatsReply,
    ControlReply, ExecuteBatch,
    Shutdown, Ping, Pong, ReleaseOutputs, ForgetSegments, WorkerReady, WorkerLoadFailed,
    BatchDone, CustomMetrics, ResponseReport, InferResult, InferResults, Wake, ProcessExited, WorkerGone,
    RevokeLease, LendSequences, LeasedExecute, ChainExecute, LeasedDone, LeaseEnded, LeaseBounced, LeaseGranted,
    LeaseRevoked, LeaseLost,
    SetLogSettings, SetTraceSettings, ReadinessQuery, ReadinessReport, ReadinessReply, CheckReadiness,
]


_encoder = msgspec.msgpack.Encoder()


_decoder = msgspec.msgpack.Decoder(Message)


_payload_decoder = msgspec.msgpack.Decoder(InferPayload)


# the decoders' own methods, not functions around them: a message is decoded on every hop, and
# a Python call around the decode costs a frame of the interpreter each time
encode = _encoder.encode
decode = _decoder.decode                    # a Message
decode_payload = _payload_decoder.decode    # an InferPayload
