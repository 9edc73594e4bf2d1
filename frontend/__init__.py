"""shmserve.frontend: HTTP/REST, gRPC and the metrics port, on one uvloop event loop."""
import os

# gRPC's EventEngine listener (its default) reads each request on an event-engine thread that
# hands it to another, which completes it to the completion-queue thread, which wakes the event
# loop: four thread wake-ups before ModelInfer runs. With the legacy listener the
# completion-queue thread reads the socket itself (PA -> cq thread -> loop). On the bare
# grpc.aio server (bench/grpc_floor.py) that is ~+25-30% at c=1; see bench/grpc_ab.py for
# shmserve. grpc reads GRPC_EXPERIMENTS once, when it is imported (tritonclient's generated
# modules import it too): the frontend package's first lines come before any of that. An
# operator's own GRPC_EXPERIMENTS is left as it is.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_listener")
