"""Streams its input back one element at a time (see config.pbtxt). Each request is answered
from a thread of its own, so execute() returns at once and the instance takes the next
requests while earlier ones still stream: the way a token streamer keeps many clients going."""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            if len(delays) != len(values):
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"IN has {len(values)} elements but DELAY has {len(delays)}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            # copies: the request's tensors are not ours once execute() has returned
            thread = threading.Thread(target=self.stream, daemon=True, args=(
                request.get_response_sender(), values.copy(), delays.copy(),
                int(wait[0]) if len(wait) else 0))
            with self.lock:
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()
        return None

    @staticmethod
    def stream(sender, values, delays, wait_ms):
        for i, (value, delay) in enumerate(zip(values, delays)):
            if sender.is_cancelled():
                break               # the client has gone: stop early
            time.sleep(int(delay) / 1000.0)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32))]))
        time.sleep(wait_ms / 1000.0)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=30)
