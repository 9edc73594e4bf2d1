"""A traced request (RequestRoute.trace, frontend/observability/trace.py) gets its execution's times in its
answer, in order; an untraced one does not carry them. Through Worker.execute, in process."""
import os
import time

import numpy as np
from test_sequence_worker import EXAMPLES, load_worker

from shmserve.ipc.messages import encode
from shmserve.ipc.messages.common import InferPayload, OutputSpec, Tensor
from shmserve.ipc.messages.to_frontend import InferResult, InferResults
from shmserve.ipc.messages.to_worker import ExecuteBatch, RequestRoute


def frame(i: int) -> bytes:
    data = np.full((1, 16), i, np.float32).tobytes()
    return encode(InferPayload(f"r{i}", [Tensor("INPUT0", "FP32", [1, 16], data)],
                               [OutputSpec("OUTPUT0")], {}))


def answers(w) -> dict[int, InferResult]:
    out = {}
    for msg in w.sent:
        for res in msg.results if isinstance(msg, InferResults) else [msg]:
            if isinstance(res, InferResult):
                out[res.req_id] = res
    return out


def test_only_traced_requests_carry_the_execution_times():
    w = load_worker(os.path.join(EXAMPLES, "identity_fp32"))
    w.sent.clear()
    before = time.monotonic_ns()
    w.execute(ExecuteBatch(1, [RequestRoute(1, 0, trace=True), RequestRoute(2, 0)]),
              [frame(1), frame(2)])
    after = time.monotonic_ns()
    got = answers(w)
    assert not got[1].error and not got[2].error
    start, inputs_read, outputs_start, end = got[1].compute_ns
    assert before <= start <= inputs_read <= outputs_start <= end <= after
    assert got[2].compute_ns == []
