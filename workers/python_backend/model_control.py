"""The python backend's model loading API: ``pb_utils.load_model``, ``unload_model`` and
``is_model_ready``, for a model that manages the models its BLS requests use.

They go through the worker's BLS client (workers/python_backend/bls.py), which the scheduler knows as a
frontend: a load or unload is the same ``ControlRequest`` a client's repository API call
becomes, answered once it is done, so the server's rules apply as they are (explicit model
control mode, config overrides, dependents). Override files are written into a model
directory of their own under the server's upload directory, with the checks and the size
limit a client's ``file:`` parameters get (engine/lifecycle/upload_files.py).
"""
from __future__ import annotations

from typing import Any

from shmserve.engine.lifecycle.upload_files import FILE_PREFIX, ModelUploads
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.common import ControlAction, ModelState
from shmserve.ipc.messages.to_scheduler import ControlRequest
from shmserve.workers.python_backend import pb_utils

# a load waits for the model's instances to be ready; the scheduler's own load timeout
# (--model-load-timeout-secs, 600 s by default) ends it before this does
CONTROL_WAIT_S = 3600.0


class ModelControl:
    def __init__(self, bls, upload_root: str, upload_max_bytes: int):
        self.bls = bls                      # () -> the worker's BlsClient
        self.uploads = ModelUploads(upload_root, upload_max_bytes) if upload_root else None

    def load(self, model_name: str, config: str = "", files: dict[str, Any] | None = None
             ) -> None:
        if not isinstance(config, str):
            raise pb_utils.TritonModelException(
                f"load_model('{model_name}'): 'config' must be a JSON string, got "
                f"{type(config).__name__}")
        upload_dir = ""
        if files:
            upload_dir = self._write(model_name, config, files)
        try:
            reply = self.bls().control(ControlRequest(0, 0, ControlAction.LOAD, model_name,
                                                      config, upload_dir=upload_dir),
                                       CONTROL_WAIT_S)
        except BaseException:
            if upload_dir and self.uploads is not None:
                self.uploads.discard(upload_dir)        # it never reached the scheduler
            raise
        if reply.error:
            raise pb_utils.TritonModelException(reply.error)

    def unload(self, model_name: str, unload_dependents: bool = False) -> None:
        reply = self.bls().control(ControlRequest(0, 0, ControlAction.UNLOAD, model_name,
                                                  unload_dependents=bool(unload_dependents)),
                                   CONTROL_WAIT_S)
        if reply.error:
            raise pb_utils.TritonModelException(reply.error)

    def is_ready(self, model_name: str, model_version: str = "") -> bool:
        """Whether the model (or that version of it) serves; False for a model the server
        does not know."""
        client = self.bls()
        if not client.table_seen.wait(30.0):
            raise pb_utils.TritonModelException("the scheduler sent no model table")
        view = client.catalog.models.get(model_name)
        if view is None:
            return False
        if model_version:
            try:
                version = int(model_version)
            except ValueError:
                raise pb_utils.TritonModelException(
                    f"is_model_ready('{model_name}'): version '{model_version}' is not a "
                    f"number") from None
            state = view.states.get(version)
            return state is not None and state[0] == ModelState.READY
        return any(s == ModelState.READY for s, _, _ in view.states.values())

    def _write(self, model_name: str, config: str, files: dict[str, Any]) -> str:
        if self.uploads is None:
            raise pb_utils.TritonModelException(
                f"load_model('{model_name}'): override files are not supported here")
        bad = [k for k in files if not isinstance(k, str) or not k.startswith(FILE_PREFIX)]
        if bad:
            raise pb_utils.TritonModelException(
                f"load_model('{model_name}'): file keys must start with '{FILE_PREFIX}' (e.g. "
                f"'file:1/model.onnx'), got {bad[0]!r}")
        try:
            checked = self.uploads.check(model_name, {"config": config, **files}, False)
            return self.uploads.write(model_name, checked, False)
        except InferError as e:
            raise pb_utils.TritonModelException(e.message) from None
