"""How the gRPC server is set up for speed (bench/grpc_ab.py): every method is served through
one generic handler, and grpc's legacy listener is chosen before grpc is imported."""
import os
import subprocess
import sys
import textwrap

from frontend_fakes import make_service

from shmserve.frontend.grpc.service import RPC_GROUPS, HealthService, InferenceService, _GenericHandlers


def _collect():
    from grpc_health.v1 import health_pb2_grpc
    from tritonclient.grpc import service_pb2_grpc as pb_grpc
    handlers = _GenericHandlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(make_service()), handlers)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(make_service()), handlers)
    return handlers.handlers


class _Details:
    def __init__(self, method):
        self.method = method
        self.invocation_metadata = ()


def test_the_generic_handlers_serve_every_method():
    handlers = _collect()
    assert len(handlers) == 2
    for name in RPC_GROUPS:
        method = f"/inference.GRPCInferenceService/{name}"
        found = [h.service(_Details(method)) for h in handlers]
        assert sum(f is not None for f in found) == 1, method
    for name in ("Check", "Watch"):
        assert any(h.service(_Details(f"/grpc.health.v1.Health/{name}")) for h in handlers)
    assert all(h.service(_Details("/inference.GRPCInferenceService/Nope")) is None
               for h in handlers)


def _experiments_seen_by_grpc_import(env: dict) -> str:
    """GRPC_EXPERIMENTS as it is when ``grpc`` is first imported by the frontend's main module
    (grpc reads it once, then)."""
    code = textwrap.dedent("""
        import importlib.abc, os, sys
        class Spy(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "grpc":
                    print("seen:" + os.environ.get("GRPC_EXPERIMENTS", "<unset>"), flush=True)
                    sys.meta_path.remove(self)
                return None
        sys.meta_path.insert(0, Spy())
        import shmserve.frontend.main
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("seen:")][0][5:]


def test_the_legacy_listener_is_chosen_before_grpc_is_imported():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _experiments_seen_by_grpc_import(env) == "-event_engine_listener"


def test_an_operators_grpc_experiments_is_kept():
    env = dict(os.environ, GRPC_EXPERIMENTS="")
    assert _experiments_seen_by_grpc_import(env) == ""
