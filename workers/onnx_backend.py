"""ONNX Runtime backend: CPU provider, or CUDA for KIND_GPU instances (never a silent fallback)."""
from __future__ import annotations

import json
import os

import numpy as np

from shmserve.ipc.messages import ErrorCode

from . import sequence
from .backend import BackendLoadError, InstanceSpec, WorkRequest, WorkResponse

_ORT_TYPES = {
    "tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16",
    "tensor(bfloat16)": "BF16", "tensor(int8)": "INT8", "tensor(int16)": "INT16",
    "tensor(int32)": "INT32", "tensor(int64)": "INT64", "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL", "tensor(string)": "BYTES",
}


def _param(cfg: dict, *names: str, default: str | None = None) -> str | None:
    params = cfg.get("parameters") or {}
    for n in names:
        if n in params:
            return params[n].get("string_value", default)
    return default


class OnnxBackend:
    def __init__(self, spec: InstanceSpec):
        import onnxruntime as ort

        self.cfg = json.loads(spec.config_json)
        path = os.path.join(spec.model_dir, str(spec.version), self.cfg["default_model_filename"])
        if os.path.isdir(path):
            path = os.path.join(path, "model.onnx")
        opts = ort.SessionOptions()
        threads = _param(self.cfg, "intra_op_thread_count", "intra_op_num_threads", default="1")
        inter = _param(self.cfg, "inter_op_thread_count", "inter_op_num_threads", default="1")
        try:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = int(inter)
        except ValueError:
            raise BackendLoadError(f"parameter intra_op_thread_count must be an integer, got "
                                   f"'{threads}'") from None
        if spec.kind == "GPU":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendLoadError("instance kind KIND_GPU needs onnxruntime's CUDA execution "
                                       "provider, which this installation does not have "
                                       "(install shmserve[gpu] on a machine with a GPU)")
            providers = [("CUDAExecutionProvider", {"device_id": spec.device_id})]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(path, sess_options=opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types
            raise BackendLoadError(f"onnxruntime failed to load {path}: {e}") from None
        if spec.kind == "GPU" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise BackendLoadError("KIND_GPU was requested but onnxruntime did not activate the CUDA "
                                   "execution provider (is a GPU visible?)")
        self.input_names = [i.name for i in self.session.get_inputs()]
        # BYTES arrive as numpy object arrays of bytes; onnxruntime's string tensors take str
        # (given bytes, it feeds their repr, "b'0'", to the graph)
        self.string_inputs = {i.name for i in self.session.get_inputs()
                              if i.type == "tensor(string)"}
        self.output_types = {o.name: _ORT_TYPES.get(o.type, "") for o in self.session.get_outputs()}
        self.output_names = list(self.output_types)
        declared = {i["name"] for i in self.cfg.get("input", [])}
        missing = declared - set(self.input_names)
        if missing:
            raise BackendLoadError(f"config declares input(s) {sorted(missing)} that the ONNX model "
                                   f"does not have (model inputs: {self.input_names})")
        self._check_sequence_tensors()
        self.batching = self.cfg.get("max_batch_size", 0) > 0

    def _check_sequence_tensors(self) -> None:
        """The control and state inputs, and the state outputs, sequence_batching feeds and
        takes: the graph must have them, with the same datatypes (Triton's words)."""
        inputs, outputs = sequence.declared(self.cfg)
        types = {i.name: _ORT_TYPES.get(i.type, "") for i in self.session.get_inputs()}
        for name, wire in inputs.items():
            if name not in types:
                raise BackendLoadError(f"configuration specified sequence control or state input "
                                       f"'{name}', but model does not provide that input")
            if wire and types[name] != wire:
                raise BackendLoadError(f"unable to load model '{self.cfg.get('name', '')}', sequence "
                                       f"input '{name}', the model expects data-type {types[name]} "
                                       f"but the model configuration specifies data-type {wire}")
        for name, wire in outputs.items():
            if name not in self.output_types:
                raise BackendLoadError(f"configuration specified state output '{name}', but model "
                                       f"does not provide that output")
            if wire and self.output_types[name] != wire:
                raise BackendLoadError(f"unable to load model '{self.cfg.get('name', '')}', state "
                                       f"output '{name}', the model produces data-type "
                                       f"{self.output_types[name]} but the model configuration "
                                       f"specifies data-type {wire}")

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        if len(requests) == 1 or not self.batching:
            return [self._run_one(r) for r in requests]
        try:
            feeds = {name: np.concatenate([r.inputs[name] for r in requests], axis=0)
                     for name in requests[0].inputs}
        except ValueError:
            # shapes that differ past the batch dimension: a variable-dim implicit state (the
            # scheduler's shape key sees only the client's inputs). Equal shapes run together.
            return self._by_shape(requests)
        try:
            results = self.session.run(self.output_names, self._text(feeds))
        except _NotText as e:
            return [WorkResponse(error=str(e), code=ErrorCode.INVALID_ARG) for _ in requests]
        except Exception as e:
            return [WorkResponse(error=f"onnxruntime execution failed: {e}", code=ErrorCode.INTERNAL)
                    for _ in requests]
        out, start = [], 0
        for r in requests:
            n = next(iter(r.inputs.values())).shape[0]
            out.append(self._response(r, [a[start:start + n] for a in results]))
            start += n
        return out

    def _by_shape(self, requests: list[WorkRequest]) -> list[WorkResponse]:
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            key = tuple((name, arr.shape[1:]) for name, arr in r.inputs.items())
            groups.setdefault(key, []).append(i)
        if len(groups) == 1:        # not a matter of shapes: one at a time, each its own answer
            return [self._run_one(r) for r in requests]
        out: list[WorkResponse] = [WorkResponse()] * len(requests)
        for members in groups.values():
            for i, resp in zip(members, self.execute([requests[i] for i in members])):
                out[i] = resp
        return out

    def _run_one(self, r: WorkRequest) -> WorkResponse:
        try:
            results = self.session.run(self.output_names, self._text(r.inputs))
        except _NotText as e:
            return WorkResponse(error=str(e), code=ErrorCode.INVALID_ARG)
        except Exception as e:
            return WorkResponse(error=f"onnxruntime execution failed: {e}", code=ErrorCode.INTERNAL)
        return self._response(r, results)

    def _text(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """String inputs as onnxruntime wants them: str elements (UTF-8 decoded)."""
        if not self.string_inputs:
            return feeds
        out = dict(feeds)
        for name in self.string_inputs.intersection(feeds):
            arr = feeds[name]
            try:
                text = [x.decode("utf-8") if type(x) is bytes else str(x)
                        for x in arr.ravel().tolist()]
            except UnicodeDecodeError:
                raise _NotText(f"input '{name}' holds an element that is not UTF-8 text, which "
                               f"onnxruntime's string tensors need") from None
            out[name] = np.array(text, dtype=object).reshape(arr.shape)
        return out

    def _response(self, r: WorkRequest, results) -> WorkResponse:
        wanted = r.requested_outputs or self.output_names
        by_name = dict(zip(self.output_names, results))
        return WorkResponse(outputs=[(n, self.output_types[n], by_name[n]) for n in wanted])

    def finalize(self) -> None:
        self.session = None


class _NotText(ValueError):
    """A BYTES input that onnxruntime cannot take as a string tensor."""
