"""OUTPUT = the running sum of the sequence's INPUTs: a stateful python model that keeps its own
state, one sum per sequence keyed by request.correlation_id(). Only Triton's pb_utils API."""
import json
from collections import OrderedDict

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        # The direct strategy gives an instance max_batch_size slots, the oldest strategy
        # max_candidate_sequences, so at most that many of its sequences are live. One that
        # idles past max_sequence_idle_microseconds loses its slot without an END: the least
        # recently used sum goes when a new sequence needs room.
        oldest = (config.get("sequence_batching") or {}).get("oldest") or {}
        self.capacity = max(int(config.get("max_batch_size", 0)), 1,
                            int(oldest.get("max_candidate_sequences", 0)))
        self.sums = OrderedDict()

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY")
            if ready is not None and not ready.as_numpy().all():
                # Triton's padding for an empty slot: no sequence, nothing to add
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT", np.zeros(value.shape, np.int32))]))
                continue
            cid = request.correlation_id()
            flags = request.flags()
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START or cid not in self.sums:
                total = value.astype(np.int32)
            else:
                total = (self.sums[cid] + value).astype(np.int32)
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                self.sums.pop(cid, None)
            else:
                self.sums[cid] = total
                self.sums.move_to_end(cid)
                while len(self.sums) > self.capacity:
                    self.sums.popitem(last=False)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total)]))
        return responses
