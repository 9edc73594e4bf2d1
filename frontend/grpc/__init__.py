"""gRPC on the event loop: calls, the inference service, streams, the per-connection guard."""
