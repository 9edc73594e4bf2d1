"""What each process is started with: the server's settings (launcher -> scheduler and
frontends) and a worker's arguments (scheduler -> worker). JSON on a command line or in a file,
not inbox messages."""
from __future__ import annotations

import msgspec

from shmserve.ipc.messages.common import LogFormat, LogSettings, TraceConfig


class GrpcTls(msgspec.Struct):
    """--grpc-use-ssl[-mutual]: the PEM files each frontend reads (paths, never the key
    itself: settings travel on command lines)."""
    server_cert: str
    server_key: str
    root_cert: str = ""         # CA certificates for client certificates (and mutual)
    mutual: bool = False        # clients must present a certificate that chains to root_cert


class ServerSettings(msgspec.Struct):
    model_repositories: list[str]
    run_dir: str
    segment_prefix: str
    launcher_pid: int
    server_id: str = "triton"
    server_version: str = "0.1.0"
    model_config_name: str = ""
    backend_directory: str = ""     # python-based backends, searched before the shipped ones
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    allow_http: bool = True
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    allow_grpc: bool = True
    metrics_address: str = ""
    metrics_port: int = 8002
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True
    allow_gpu_metrics: bool = True
    metrics_interval_ms: int = 2000
    counter_latencies: bool = True
    histogram_latencies: bool = False
    summary_latencies: bool = False
    http_max_input_size: int = 1 << 26
    http_max_header_size: int = 64 * 1024
    http_max_connections: int = 4096
    http_request_timeout_secs: float = 60.0
    http_idle_timeout_secs: float = 300.0
    http_max_json_elements: int = 1 << 23     # tensor elements in a JSON request or JSON output
    grpc_max_message_size: int = 2 ** 31 - 1  # bytes of one gRPC message, either way
    max_request_tensor_bytes: int = 1 << 32   # all input tensors of one request together
    model_upload_max_bytes: int = 1 << 30     # all 'file:' parameters of one load together
    model_upload_dir: str = ""                # uploaded models' directories (<run_dir>/uploads)
    request_deadline_secs: float = 3600.0     # the frontend answers every request by then
    model_load_timeout_secs: float = 600.0    # a worker that is not ready by then is killed
    allow_client_shm: bool = True
    client_shm_from: str = "local"         # local (loopback and unix peers only) | any
    http_restricted_api: list[str] = []    # "<api>[,<api>]:<header>=<value>" (frontend/restricted.py)
    grpc_restricted_protocol: list[str] = []
    exit_timeout_secs: float = 30.0
    exit_grace_secs: float = 0.0           # after a stop signal: not ready, still serving
    strict_readiness: bool = True
    exit_on_error: bool = False
    model_control_mode: str = "none"       # none | poll | explicit | on_demand
    model_memory_budget: int = 0           # on_demand: bytes all loaded models may use (0 = any)
    model_idle_unload_secs: float = 0.0    # on_demand: unload a model idle this long (0 = never)
    model_load_wait_secs: float = 120.0    # on_demand: how long a request waits for its load
    repository_poll_secs: float = 15.0
    load_models: list[str] = []
    auto_complete: bool = True
    execution_timeout_secs: float = 300.0
    max_inflight_requests: int = 10000
    instance_leases: bool = True           # lend idle instances to frontends (engine/leases.py)
    worker_start: str = "fork"             # fork (from the fork server, engine/forkserver.py) | spawn
    frontends: int = 1                     # frontend processes sharing the ports (SO_REUSEPORT)
    frontend_priority: str = "auto"        # auto | normal | realtime (frontend/priority.py)
    colocate: str = "auto"                 # auto | off (frontend/colocation.py)
    colocate_max_gap_us: int = 1000        # mean gap between requests, at most, to pair
    log_verbose: int = 0
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: LogFormat = LogFormat.DEFAULT
    log_file: str = ""                     # every process appends its log lines here ("" = stderr)
    port_file: str = ""
    # GPU -> bytes each worker's device arena may take on it (--cuda-memory-pool-byte-size)
    cuda_memory_pool: dict[int, int] = {}
    # gRPC server channel options from tritonserver's keep-alive, connection age and
    # compression flags (engine/compat_flags.py)
    grpc_options: dict[str, int] = {}
    grpc_server: str = "loop"              # loop (frontend/grpc_loop.py) | aio (grpc.aio)
    trace: TraceConfig = TraceConfig()     # --trace-config and the older --trace-* flags
    # --cache-config local,size=N (or --response-cache-byte-size N): the response cache's bytes,
    # shared out between the frontends (frontend/response_cache.py); 0: no cache
    response_cache_bytes: int = 0
    grpc_tls: GrpcTls | None = None        # --grpc-use-ssl and its certificate flags
    # headers / metadata whose names match become request parameters (frontend/header_forward.py)
    http_header_forward_pattern: str = ""
    grpc_header_forward_pattern: str = ""
    rate_limit: bool = False               # --rate-limit execution_count (engine/rate_limiter.py)
    rate_limit_resources: list[str] = []   # --rate-limit-resource <name>:<count>[:<device>]
    # --backend-config [onnxruntime,]default-max-batch-size=N: auto-complete's max_batch_size
    default_max_batch_size: int = 4


class InstanceSpec(msgspec.Struct):
    """What a worker process is told to load."""
    model_name: str
    version: int
    model_dir: str
    config_json: str            # normalized config in Triton's JSON form
    instance_name: str
    kind: str                   # "CPU" or "GPU"
    device_id: int
    backend: str
    auto_complete: bool = False     # fill in the config from the model before loading it
    # what auto-complete gives a model that can batch (--backend-config default-max-batch-size)
    default_max_batch_size: int = 4
    instance_index: int = 0     # among the version's instances (the identity backend's delays)
    # where a backend that is not built in comes from (ipc/backend_catalog.py): a python-based
    # backend's model.py, or a plug-in's entry point "module:attr"
    backend_source: str = ""


class WorkerLabel(msgspec.Struct):
    """What a worker's command line shows (ps, /proc/<pid>/cmdline): which model and instance it
    serves. The full ``WorkerArgs`` travel in a file, since a config can outgrow the kernel's
    limit on one argument (128 KiB)."""
    model_name: str
    version: int
    instance_name: str
    spawn_id: int


class WorkerArgs(msgspec.Struct):
    spawn_id: int               # unique for the server's life; names the worker's sockets
    parent: int
    run_dir: str
    scheduler: str
    segment_prefix: str
    spec: InstanceSpec
    log_verbose: int = 0
    log: LogSettings = LogSettings()    # the scheduler's settings when it spawned the worker
    log_file: str = ""
    # --cuda-memory-pool-byte-size: GPU -> bytes of device memory the worker's device arena may
    # take there (workers/device_arena.py; a GPU not named gets the default)
    cuda_memory_pool: dict[int, int] = {}
    # pb_utils.load_model(files=...): where the worker writes them, and how much one load may
    # carry (the server's --model-upload-max-bytes; 0: refused)
    model_upload_dir: str = ""
    model_upload_max_bytes: int = 0
