"""PROBS = softmax(LOGITS) over the 256 values, CLASS = argmax (step 3 of ensemble_mlp). The
requests of one call are stacked into one array and split again."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        logits = [pb_utils.get_input_tensor_by_name(r, "LOGITS").as_numpy() for r in requests]
        x = np.concatenate(logits)
        e = np.exp(x - x.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        classes = probs.argmax(axis=1).astype(np.int32).reshape(-1, 1)
        ends = np.cumsum([len(x) for x in logits])[:-1]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PROBS", p), pb_utils.Tensor("CLASS", c)])
                for p, c in zip(np.split(probs, ends), np.split(classes, ends))]
