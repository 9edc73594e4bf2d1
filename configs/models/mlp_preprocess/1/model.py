"""PIXELS = IMAGE / 255 as FP32: 256 bytes scaled to [0, 1] for mlp_onnx (step 1 of
ensemble_mlp). The requests of one call are stacked into one array and split again."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy() for r in requests]
        pixels = np.concatenate(images).astype(np.float32) * np.float32(1 / 255)
        ends = np.cumsum([len(x) for x in images])[:-1]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", p)])
                for p in np.split(pixels, ends)]
