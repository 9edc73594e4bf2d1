"""What a backend returned, made into the answer a frontend reads: outputs reshaped and checked
against the config (a datatype that is not the config's is an error; another shape passes and is
logged once), classified when asked, and placed: in a client's region (system or CUDA), in the
worker's output arena, inline, or left on the GPU for an ensemble's next step.
"""
from __future__ import annotations

import logging

from shmserve.ipc.gpu import cuda_ipc
from shmserve.ipc.gpu.cuda_ipc import CudaHandles
from shmserve.ipc.gpu.device import CudaError, DeviceTensor
from shmserve.ipc.gpu.device_arena import DeviceArena
from shmserve.ipc.gpu.device_arena import to_host as device_to_host
from shmserve.ipc.messages.common import CudaRef, ErrorCode, Tensor, parameter_problem
from shmserve.ipc.messages.to_frontend import InferResult
from shmserve.ipc.shm import ShmArena, ShmError, ShmFull, ShmMapCache
from shmserve.workers import classification, tensors

log = logging.getLogger("shmserve.worker")


class Answers:
    def __init__(self, model: str, version: int, address: str, arena: ShmArena,
                 maps: ShmMapCache, device_arena: DeviceArena, cuda_handles: CudaHandles):
        self.model = model
        self.version = version
        self.address = address          # the worker's inbox: where slots of ours are released
        self.arena = arena
        self.maps = maps
        self.device_arena = device_arena
        self.cuda_handles = cuda_handles
        self.labels: dict[str, list[bytes]] = {}    # output -> class labels (label_filename)
        self.reshapes = tensors.Reshapes({})
        self.checks = tensors.OutputChecks({})
        self.shapes_noted: set[str] = set()     # outputs whose shape broke the config, logged

    def use_config(self, config: dict) -> None:
        self.reshapes = tensors.Reshapes(config)
        self.checks = tensors.OutputChecks(config)
        self.shapes_noted = set()

    def error(self, req_id: int, message: str, code: ErrorCode) -> InferResult:
        return InferResult(req_id, self.model, self.version, error=message, code=code)

    def result(self, req_id: int, resp, targets: dict, top: dict,
               device: frozenset = frozenset()) -> InferResult:
        """``targets``: outputs to write into clients' regions; ``top``: outputs to return as
        their top K classes (the classification extension), with the labels the request brings
        (None: the model's own); ``device``: outputs that may stay on the GPU (in the device
        arena) when the model left them there."""
        if resp.error:
            return self.error(req_id, resp.error, resp.code or ErrorCode.INTERNAL)
        outs: list[Tensor] = []
        uses_shm = False                # slots of ours, given back later
        try:
            for name, datatype, arr in resp.outputs:
                arr = self.reshapes.client_output(name, arr)
                if type(arr) is DeviceTensor:
                    ref = self.device_arena.keep(arr) if name in device and not \
                        self.checks.problem(name, datatype, arr.shape) else None
                    if ref is not None:
                        outs.append(Tensor(name, datatype, list(arr.shape), None, None, ref))
                        uses_shm = True
                        continue
                    arr = device_to_host(arr)   # full, or a tensor that must change first
                datatype, arr = self.checks.fit(name, datatype, arr)
                problem = self.checks.datatype_problem(name, datatype)
                if problem:
                    self.free_outputs(outs, targets)
                    return self.error(req_id, problem, ErrorCode.INTERNAL)
                if name not in self.shapes_noted:
                    self.note_shape(name, arr.shape)
                if top and name in top:
                    k, labels = top[name]       # an ensemble's own labels first, then the model's
                    arr = classification.classify(arr, datatype, k, self.checks.batching,
                                                  self.labels.get(name, ()) if labels is None else labels)
                    datatype = "BYTES"
                target = targets.get(name)
                if type(target) is CudaRef:
                    outs.append(cuda_ipc.write_output(name, datatype, arr, target,
                                                      self.cuda_handles, tensors.OutputTooLarge))
                    continue
                if target is not None:
                    outs.append(tensors.into_region(name, datatype, arr, target, self.maps))
                    continue
                t = tensors.from_numpy(name, datatype, arr, self.arena)
                uses_shm |= t.shm is not None
                outs.append(t)
        except (tensors.OutputTooLarge, classification.ClassificationError) as e:
            self.free_outputs(outs, targets)
            return self.error(req_id, str(e), ErrorCode.INVALID_ARG)
        except ShmFull as e:            # /dev/shm is full: this request fails, we carry on
            self.free_outputs(outs, targets)
            return self.error(req_id, f"failed to return outputs: {e}",
                              ErrorCode.RESOURCE_EXHAUSTED)
        except (ShmError, CudaError, ValueError, TypeError) as e:
            self.free_outputs(outs, targets)
            return self.error(req_id, f"failed to return outputs: {e}", ErrorCode.INTERNAL)
        bad = parameter_problem(resp.parameters)
        if bad:
            self.free_outputs(outs, targets)
            return self.error(req_id, f"response parameter {bad}", ErrorCode.INTERNAL)
        return InferResult(req_id, self.model, self.version, outs,
                           worker=self.address if uses_shm else "",
                           parameters=resp.parameters)

    def note_shape(self, name: str, shape: tuple) -> None:
        """An output whose shape is not the config's passes, as in Triton; said once per output."""
        problem = self.checks.shape_problem(name, shape)
        if problem:
            self.shapes_noted.add(name)
            log.warning("%s (passed on as it is; logged once)", problem)

    def free_outputs(self, outs, targets: dict) -> None:
        for t in outs:
            if t.shm is not None and t.name not in targets:
                self.arena.free(t.shm)
            elif t.cuda is not None and t.name not in targets:
                self.device_arena.free(t.cuda)
