"""Python backend: runs a repository ``model.py`` (Triton's ``TritonPythonModel``) in this process.

Triton runs each python model in a stub process that talks to the server over shared memory; here
the worker process *is* that stub, so a request costs no extra hop and tensors arrive as numpy
views of the shared memory they were written to.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import traceback
import types
from functools import partial

import numpy as np

from shmserve.ipc.errors import BackendLoadError
from shmserve.ipc.gpu.device import DeviceTensor
from shmserve.ipc.messages.common import ErrorCode
from shmserve.workers.backends import autocomplete
from shmserve.workers.backends.base import InstanceSpec, WorkRequest, WorkResponse
from shmserve.workers.python_backend import pb_utils
from shmserve.workers.python_backend.errors import TO_ERROR_CODE
from shmserve.workers.python_backend.model_loop import ModelLoop

log = logging.getLogger("shmserve.python")

sys.modules.setdefault("triton_python_backend_utils", pb_utils)


def raised_at(e: BaseException) -> str:
    """Where a model's code raised, as Triton's stub appends it to the message: the Python
    frames below this module's call, innermost first ("\n\nAt:\n  file(line): function\n")."""
    # an async execute's runners (asyncio, the future that carries it over, our loop)
    skip = (os.sep + "asyncio" + os.sep, os.sep + "concurrent" + os.sep, "model_loop.py")
    frames = [f for f in traceback.extract_tb(e.__traceback__)[1:]
              if not any(s in f.filename for s in skip)]
    if not frames:
        return ""
    return "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n"
                                  for f in reversed(frames))


# said after Triton's words when execute() left a request of a default-mode model unanswered
ANSWER_ONCE = (" A model that is not decoupled answers each request once: in the list execute() "
               "returns, or through the request's response sender (taken before execute() "
               "returns).")


def gpu_inputs(cfg: dict) -> bool:
    """Triton's FORCE_CPU_ONLY_INPUT_TENSORS parameter: "no" gives the model inputs that are in
    GPU memory as GPU tensors (``is_cpu()`` False, read through ``to_dlpack()``); "yes", the
    default, copies them to the host first."""
    value = ((cfg.get("parameters") or {}).get("FORCE_CPU_ONLY_INPUT_TENSORS") or {})
    text = str(value.get("string_value", "yes")).strip().lower()
    if text not in ("yes", "no"):
        raise BackendLoadError(f"parameter FORCE_CPU_ONLY_INPUT_TENSORS must be 'yes' or 'no', "
                               f"got '{value.get('string_value')}'")
    return text == "no"


STUB_NAME_INVALID = frozenset(";|&$`<>()[]{}\\\"'*?~#!")


class PythonBackend:
    device_inputs = False   # set per model: gpu_inputs()
    emits = True            # request.get_response_sender() answers through WorkRequest.emit

    def __init__(self, spec: InstanceSpec, poll_cancelled=None):
        # Triton's python backend refuses these names (it starts its stub through a shell);
        # a model that loads here must load there too
        if any(not name or STUB_NAME_INVALID.intersection(name)
               for name in (spec.model_name, spec.instance_name)):
            raise BackendLoadError("Invalid stub name: contains invalid characters")
        self.spec = spec
        self.poll_cancelled = poll_cancelled
        version_dir = os.path.join(spec.model_dir, str(spec.version))
        cfg = json.loads(spec.config_json)
        if spec.backend_source:     # a python-based backend: its model.py serves this model
            path = spec.backend_source
            code_dir = os.path.dirname(path)
        else:
            path = os.path.join(version_dir, cfg.get("default_model_filename") or "model.py")
            code_dir = version_dir
        # model.py may import modules that sit next to it, as it can under Triton
        if code_dir not in sys.path:
            sys.path.insert(0, code_dir)
        # model.py is a module of a package whose directory is its own: its relative
        # imports (`from . import helper`) work, as under Triton's stub
        package = "_shmserve_model_" + re.sub(r"\W", "_", f"{spec.model_name}_{spec.version}")
        stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_name = f"{package}.{stem}"
        try:
            pkg = types.ModuleType(package)
            pkg.__path__ = [code_dir]
            sys.modules[package] = pkg
            mod_spec = importlib.util.spec_from_file_location(module_name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ImportError("not a python module")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[module_name] = module
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise BackendLoadError(f"failed to import {path}: {type(e).__name__}: {e}") from e
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise BackendLoadError(f"{path} does not define class TritonPythonModel")
        if spec.auto_complete:
            spec.config_json = json.dumps(autocomplete.complete_python(cfg, cls))
            cfg = json.loads(spec.config_json)
        self.model = cls()
        if not callable(getattr(self.model, "execute", None)):
            raise BackendLoadError(f"TritonPythonModel in {path} has no execute method")
        self.is_async = inspect.iscoroutinefunction(self.model.execute)
        # the model decides its own readiness (workers/readiness.py calls it on a thread)
        self.ready_check = self._model_ready if callable(getattr(self.model, "is_ready", None)) \
            else None
        # made at the first coroutine the model hands over (workers/python_backend/model_loop.py)
        self.loop: ModelLoop | None = None
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        # sequence_batching { iterative_sequence: true }: requests may be rescheduled
        self.iterative = bool((cfg.get("sequence_batching") or {}).get("iterative_sequence"))
        self.output_types = {o["name"]: o["data_type"] for o in cfg.get("output", [])}
        self.device_inputs = gpu_inputs(cfg)
        args = {
            "model_config": spec.config_json,
            "model_instance_kind": spec.kind,
            "model_instance_name": spec.instance_name,
            "model_instance_device_id": str(spec.device_id),
            "model_repository": spec.model_dir,
            "model_version": str(spec.version),
            "model_name": spec.model_name,
        }
        if hasattr(self.model, "initialize"):
            pb_utils._bls_refused_in = "initialize"
            try:
                result = self.model.initialize(args)
                if inspect.iscoroutine(result):
                    self._loop().run(result)
            except Exception as e:
                raise BackendLoadError(f"initialize() of model '{spec.model_name}' failed: "
                                       f"{type(e).__name__}: {e}") from e
            finally:
                pb_utils._bls_refused_in = None

    def execute(self, requests: list[WorkRequest]) -> list[WorkResponse | None]:
        """Run the requests; those the model releases with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        (an iterative sequence model: one more step of their work) run again, in the next
        execution, which follows at once, until none is rescheduled."""
        pb_requests = self._pb_requests(requests)
        got, failed = self._execute_once(requests, pb_requests)
        out = list(got)
        pending = self._settle(range(len(requests)), got, failed, pb_requests, out)
        while pending:          # only when the model rescheduled some
            for i in pending:
                pb_requests[i]._release_flags = pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL
            got, failed = self._execute_once([requests[i] for i in pending],
                                             [pb_requests[i] for i in pending])
            pending = self._settle(pending, got, failed, pb_requests, out)
        return out

    def _settle(self, indexes, got: list, failed: bool, pb_requests: list,
                out: list) -> list[int]:
        """Put the answers of one execution in ``out``; returns the requests to run again.
        A failed execution, or a request whose sender is closed, is done, whatever flags the
        model set first."""
        again = []
        reschedule = pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        for i, res in zip(indexes, got):
            pb = pb_requests[i]
            if failed or not pb._release_flags & reschedule or pb._sender_closed():
                out[i] = res
            elif self.iterative:
                again.append(i)
            else:
                out[i] = WorkResponse(error=f"model '{self.spec.model_name}' rescheduled a "
                                            f"request, which needs sequence_batching {{ "
                                            f"iterative_sequence: true }} in its config",
                                      code=ErrorCode.INTERNAL)
        return again

    def _pb_requests(self, requests: list[WorkRequest]) -> list:
        pb_requests = []
        for r in requests:
            tensors = [pb_utils.Tensor._from_device(name, arr, r.datatypes[name])
                       if type(arr) is DeviceTensor else
                       pb_utils.Tensor._from_worker(name, arr, r.datatypes[name])
                       for name, arr in r.inputs.items()]
            pb_req = pb_utils.InferenceRequest._from_worker(
                tensors, r.requested_outputs, r.request_id, r.correlation_id, r.flags,
                json.dumps(r.parameters) if r.parameters else "{}",
                self.spec.model_name, self.spec.version, r.cancel_key, self.poll_cancelled)
            if r.emit is not None:      # made when the model asks for it (no cycle back to
                pb_req._sender = partial(self._sender, r)   # pb_req: its inputs pin mappings)
            pb_requests.append(pb_req)
        return pb_requests

    def _execute_once(self, requests: list[WorkRequest],
                      pb_requests: list) -> tuple[list[WorkResponse | None], bool]:
        """One execute() of the model: each request's answer, and whether it failed as a
        whole (raised, or returned what it must not)."""
        try:
            responses = self.model.execute(pb_requests)
            if self.is_async:
                if self.decoupled:
                    # answered through its senders: the worker goes on to the next batch
                    # while this one runs (Triton runs a decoupled model's async executions
                    # concurrently)
                    self._loop().start(responses, partial(self._async_done, requests,
                                                          pb_requests))
                    return [None] * len(requests), False
                responses = self._loop().run(responses)
        except Exception as e:
            msg = self._raised(e)
            log.error("%s", msg)    # also when every request had its answer already (Triton)
            return self._fail_open(pb_requests, msg), True
        if self.decoupled:
            if responses is not None:
                return self._fail_open(pb_requests, self._not_none()), True
            return [None] * len(requests), False    # answered through the response senders
        if responses is None:
            # the default mode may answer through the response senders (Triton since 24.06);
            # a request whose sender the model never took (nor rescheduled) can never be
            # answered: it fails now with the words Triton gave before, instead of waiting for
            # its deadline
            missing = self._failed("Expected a list in the execute return, found type "
                                   "'<class 'NoneType'>'.") + ANSWER_ONCE
            return [self._answer(req, pb, None, missing)
                    for req, pb in zip(requests, pb_requests)], False
        if not isinstance(responses, (list, tuple)):
            return self._fail_open(pb_requests, self._failed(
                f"Expected a list in the execute return, found type '{type(responses)}'.")), True
        if len(responses) != len(requests):
            return self._fail_open(pb_requests, self._failed(
                f"Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, and "
                f"InferenceResponse(s) size is:{len(responses)}")), True
        return [self._answer(req, pb, resp)
                for req, pb, resp in zip(requests, pb_requests, responses)], False

    def _answer(self, req: WorkRequest, pb, resp, missing: str = "") -> WorkResponse | None:
        """A non-decoupled model's return for one request. A request it rescheduled must
        have None there (Triton's check, word for word); it is answered with the error then,
        not run again. A request its response sender answered has its one answer: what the
        list holds for it is not sent too. None for a request not answered otherwise is an
        error (``missing``, or Triton's words for a list entry of the wrong type)."""
        if pb._release_flags & pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            if resp is None:
                return None
            pb._release_flags = pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL
            return WorkResponse(error="Expected a None object in the execute function return "
                                      "list for reschduled request", code=ErrorCode.INTERNAL)
        if resp is None and isinstance(pb._sender, pb_utils.InferenceResponseSender):
            # the model took the request's response sender: that answers it, before execute()
            # returned or after, from a thread of the model (Triton's default mode allows both)
            return None
        if resp is None or not isinstance(resp, pb_utils.InferenceResponse) \
                or self._sender_answered(pb):
            # closes the sender: a thread of the model cannot answer it after the error
            return self._fail_open([pb], missing or self._failed(
                f"Expected an 'InferenceResponse' object in the execute function return list, "
                f"found type '{type(resp)}'.") + (ANSWER_ONCE if resp is None else ""))[0]
        return self._convert(req, resp)

    @staticmethod
    def _sender_answered(pb) -> bool:
        sender = pb._sender
        return isinstance(sender, pb_utils.InferenceResponseSender) and \
            (sender._answered or sender._closed)

    def _sender(self, req: WorkRequest) -> pb_utils.InferenceResponseSender:
        emit, poll, key = req.emit, self.poll_cancelled, req.cancel_key
        assert emit is not None     # the worker gives every request of a backend that emits one

        def send(response, final: bool) -> None:
            emit(None if response is None else self._convert(req, response), final)
        return pb_utils.InferenceResponseSender(
            send, self.decoupled, lambda: poll is not None and poll(key))

    @staticmethod
    def _fail_open(pb_requests: list, message: str) -> list[WorkResponse | None]:
        """Every request whose sender has not finished gets the error as its last answer; its
        sender is closed, so that a model thread cannot answer it again."""
        out: list[WorkResponse | None] = []
        for r in pb_requests:
            sender = r._sender
            if not isinstance(sender, pb_utils.InferenceResponseSender):
                sender = r._sender = pb_utils.InferenceResponseSender(None, True, bool)
            out.append(None if sender._close() else
                       WorkResponse(error=message, code=ErrorCode.INTERNAL))
        return out

    def _convert(self, req: WorkRequest, resp) -> WorkResponse:
        if resp.has_error():
            err = resp.error()
            return WorkResponse(error=err.message(), code=TO_ERROR_CODE.get(err.code(), ErrorCode.INTERNAL))
        produced = {t.name(): t for t in resp.output_tensors()}
        wanted = req.requested_outputs or list(produced)
        outputs = []
        for name in wanted:
            t = produced.get(name)
            if t is None:
                return WorkResponse(error=f"model '{self.spec.model_name}' did not produce "
                                          f"requested output '{name}'", code=ErrorCode.INTERNAL)
            datatype = t.datatype()
            bf16 = datatype == "UINT16" and self.output_types.get(name) == "TYPE_BF16"
            if t._device is not None and name in req.device_outputs:
                # stays on the GPU: the worker hands it to the next step as a CUDA IPC handle
                arr = t._device
                if bf16:
                    arr = dataclasses.replace(arr, dtype=pb_utils.WIRE_TO_NUMPY["BF16"])
                    datatype = "BF16"
                outputs.append((name, datatype, arr))
                continue
            try:
                arr = t._host()         # a GPU tensor (from_dlpack) is copied out here
            except Exception as e:
                return WorkResponse(error=f"model '{self.spec.model_name}' output '{name}': {e}",
                                    code=ErrorCode.INTERNAL)
            if bf16:
                arr, datatype = arr.view(pb_utils.WIRE_TO_NUMPY["BF16"]), "BF16"  # raw bits
            if not isinstance(arr, np.ndarray):
                arr = np.asarray(arr)
            outputs.append((name, datatype, arr))
        params = resp.parameters()
        return WorkResponse(outputs=outputs, parameters=json.loads(params) if params and params != "{}" else {})

    def _raised(self, e: BaseException) -> str:
        """Triton's words for an execute() that raised, and where it raised."""
        return self._failed(f"{type(e).__name__}: {e}{raised_at(e)}")

    def _failed(self, message: str) -> str:
        """Triton's words for an execution that failed as a whole (the stub's prefix)."""
        return f"Failed to process the request(s) for model '{self.spec.instance_name}', " \
               f"message: {message}"

    def _not_none(self) -> str:
        return f"Python model '{self.spec.instance_name}' is using the decoupled mode and the " \
               f"execute function must return None."

    def _model_ready(self) -> bool:
        """The model's is_ready(), as Triton reads it: ready only when it returns True; an
        exception or another value (logged) is not ready. A coroutine runs on the model's loop."""
        try:
            result = self.model.is_ready()
            if inspect.iscoroutine(result):
                result = self._loop().run(result)
        except Exception as e:
            log.error("is_ready() of model '%s' raised %s: %s", self.spec.model_name,
                      type(e).__name__, e)
            return False
        if not isinstance(result, bool):
            log.error("is_ready() of model '%s' returned %s, not a boolean: the model is not "
                      "ready", self.spec.model_name, type(result).__name__)
            return False
        return result

    def _loop(self) -> ModelLoop:
        if self.loop is None:
            self.loop = ModelLoop()
        return self.loop

    def _async_done(self, requests: list[WorkRequest], pb_requests: list, done) -> None:
        """A decoupled model's async execute() ended (on the loop's thread): if it raised or
        returned something, the requests it left open get the error, and the log says why."""
        e = done.exception() if not done.cancelled() else None
        if e is not None:
            msg = self._raised(e)
        elif not done.cancelled() and done.result() is not None:
            msg = self._not_none()
        else:
            return
        log.error("%s", msg)
        for req, answer in zip(requests, self._fail_open(pb_requests, msg)):
            if answer is not None and req.emit is not None:
                req.emit(answer, True)

    def finalize(self) -> None:
        fin = getattr(self.model, "finalize", None)
        if fin is not None:
            pb_utils._bls_refused_in = "finalize"
            fin()
        if self.loop is not None:
            self.loop.close()
