"""Calls `simple` with BLS (one request per request it gets) and scales its answer: the shape of
a pipeline step written in Python that hands the heavy part to another model."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            scale = pb_utils.get_input_tensor_by_name(request, "SCALE").as_numpy()[0]
            answer = pb_utils.InferenceRequest(
                model_name="simple", requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")]).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor(name, pb_utils.get_output_tensor_by_name(answer, name).as_numpy()
                                * scale)
                for name in ("OUTPUT0", "OUTPUT1")]))
        return responses
