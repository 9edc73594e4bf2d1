"""A tritonserver command line with the flags shmserve takes for compatibility, each with a value
that leaves missing features off (tests/engine/test_compat_flags.py, tests/e2e/test_triton_flags.py)."""

TRITON_LINE = [
    "--pinned-memory-pool-byte-size", "268435456", "--buffer-manager-thread-count", "0",
    "--backend-directory", "/opt/tritonserver/backends",
    "--backend-config", "python,shm-default-byte-size=1048576",
    "--backend-config", "default-max-batch-size=8",
    "--http-thread-count", "8", "--reuse-grpc-port", "true", "--host-policy", "numa,numa-node=0",
    "--rate-limit", "off", "--rate-limit-resource", "R1:10", "--response-cache-byte-size", "0",
    "--trace-config", "level=OFF", "--trace-config", "triton,file=/tmp/trace.json",
    "--trace-config", "rate=100", "--grpc-use-ssl", "false", "--model-namespacing", "false",
    "--allow-sagemaker", "false", "--grpc-keepalive-time", "10000",
    "--grpc-keepalive-timeout", "5000", "--grpc-keepalive-permit-without-calls", "true",
    "--grpc-http2-max-pings-without-data", "0", "--grpc-max-connection-age", "60000",
    "--grpc-infer-response-compression-level", "high",
]
