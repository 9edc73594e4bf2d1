"""Decode image files into the input of classifier_onnx (see config.pbtxt)."""
import io

import numpy as np
import triton_python_backend_utils as pb_utils

SIZE = 224


def decode(data: bytes) -> np.ndarray:
    """An image file -> FP32 [3, SIZE, SIZE], pixels scaled to [-1, 1]."""
    try:
        from PIL import Image
    except ImportError:
        raise pb_utils.TritonModelException(
            "image_preprocess needs Pillow to decode images: pip install pillow") from None
    try:
        img = Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE),
                                                                 Image.BILINEAR)
    except Exception as e:      # not an image Pillow knows
        raise pb_utils.TritonModelException(f"cannot decode the image: {e}") from None
    pixels = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return np.transpose(pixels, (2, 0, 1))


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            files = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            try:
                batch = np.stack([decode(bytes(row[0])) for row in files])
            except pb_utils.TritonModelException as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", batch)]))
        return responses
