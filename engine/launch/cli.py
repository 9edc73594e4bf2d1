"""``shmserve`` command line: tritonserver's flag names and defaults (docs/triton-compat.md §7)."""
from __future__ import annotations

import argparse
import os
import sys

import msgspec

from shmserve.engine.launch import compat_flags, launcher, restricted
from shmserve.engine.launch.compat_flags import triton_bool
from shmserve.engine.lifecycle import residency
from shmserve.ipc.messages.common import LogFormat
from shmserve.ipc.spawn_args import ServerSettings

# The one place defaults are written is ServerSettings; the flags take theirs from it.
D = {f.name: f.default for f in msgspec.structs.fields(ServerSettings)
     if f.default is not msgspec.NODEFAULT}
VERSION = D["server_version"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmserve", allow_abbrev=False,
        description="Triton-compatible inference server: isolated processes, tensors in shared memory.")
    p.add_argument("--model-repository", "--model-store", dest="model_repository", action="append",
                   required=True, metavar="PATH", help="model repository path (repeatable)")
    p.add_argument("--model-control-mode", default=D["model_control_mode"], type=str.lower,
                   choices=["none", "poll", "explicit", "on_demand"])
    p.add_argument("--repository-poll-secs", type=float, default=D["repository_poll_secs"],
                   help="poll mode: how often the repository is scanned for changes")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="explicit mode: load this model at startup (repeatable; '*' = all)")
    p.add_argument("--model-memory-budget", type=byte_count, default=D["model_memory_budget"],
                   metavar="BYTES",
                   help="on_demand mode: memory (PSS) all loaded models' workers may use "
                        "together, e.g. 512M or 4G; least recently used idle models are "
                        "unloaded to make room (0 = no budget)")
    p.add_argument("--model-idle-unload-secs", type=float, default=D["model_idle_unload_secs"],
                   help="on_demand mode: unload a model that had no request for this long "
                        "(0 = never)")
    p.add_argument("--model-load-wait-secs", type=float, default=D["model_load_wait_secs"],
                   help="on_demand mode: how long a request for a model that is not loaded "
                        "waits for its load before it gets 503 'still loading'")
    p.add_argument("--model-load-thread-count", type=int, default=4,
                   help="accepted for compatibility: every instance loads in its own process, "
                        "so loads always run in parallel")
    p.add_argument("--execution-timeout-secs", type=float, default=D["execution_timeout_secs"],
                   help="a batch that runs longer gets its worker killed and its requests an "
                        "error (0 = never); a model may set parameters execution_timeout_ms")
    p.add_argument("--max-inflight-requests", type=int, default=D["max_inflight_requests"],
                   help="requests a frontend holds at once before refusing more with 503 "
                        "(0 = no limit)")
    p.add_argument("--frontends", type=frontend_count, default="auto",
                   help="frontend processes serving the HTTP and gRPC ports together "
                        "(SO_REUSEPORT: the kernel spreads connections over them); auto: 1 on "
                        "a machine with up to 4 CPUs, else a quarter of the CPUs, at most 8")
    p.add_argument("--frontend-priority", default=D["frontend_priority"], type=str.lower,
                   choices=["auto", "normal", "realtime"],
                   help="auto: a frontend's event loop writes each wake-up's answers at the "
                        "lowest real-time priority (SCHED_FIFO 1) while it holds 8 or more "
                        "requests, so that the clients it wakes do not take its CPU before it "
                        "has written them all; normal: never; realtime: always. Needs "
                        "CAP_SYS_NICE or an RLIMIT_RTPRIO; without, the frontend stays at "
                        "normal priority")
    p.add_argument("--colocate", default=D["colocate"], type=str.lower, choices=["auto", "off"],
                   help="auto: while requests come one at a time, a frontend and the worker "
                        "it sends them to wait on one CPU (its own), so that each hop between "
                        "them is a switch on that CPU, not a wake-up of another, kept only "
                        "where a trial shows their answers come sooner; while requests "
                        "overlap, the worker waits on any CPU but the one the frontend sent "
                        "it from, so that on busy CPUs the kernel does not stack them on one. "
                        "Only the frontend's loop thread is pinned, and a worker's thread "
                        "only while it waits; off: never")
    p.add_argument("--colocate-max-gap-us", type=gap_us, default=D["colocate_max_gap_us"],
                   help="--colocate auto pairs only requests that came at most this many "
                        "microseconds apart on average")
    p.add_argument("--instance-leases", type=triton_bool, default=D["instance_leases"],
                   help="lend an idle instance of a model without dynamic batching to the "
                        "frontend that uses it, which then sends it requests directly (one hop "
                        "fewer while the model's queue is empty); false sends every request "
                        "through the scheduler")
    p.add_argument("--worker-start", default=D["worker_start"], type=str.lower,
                   choices=["fork", "spawn"],
                   help="fork: model instances' workers are forked from a fork server that has "
                        "imported what they need, sharing those pages (a model may ask for a "
                        "fresh interpreter with the config parameter FORK_WORKER: \"false\"); "
                        "spawn: every worker is a fresh interpreter")
    p.add_argument("--disable-auto-complete-config", action="store_true",
                   help="do not fill in model configs from the models (ONNX inputs/outputs, "
                        "python auto_complete_config)")
    p.add_argument("--strict-model-config", type=triton_bool, default=None,
                   help="deprecated: true is --disable-auto-complete-config")
    p.add_argument("--backend-directory", default=D["backend_directory"],
                   help="where python-based backends are found (<dir>/<backend>/model.py), "
                        "before the ones shipped with shmserve; plug-in backends come from "
                        "installed packages (docs/backends.md)")
    p.add_argument("--model-config-name", default=D["model_config_name"],
                   help="use <model>/configs/<name>.pbtxt instead of config.pbtxt where present")
    p.add_argument("--host", default=D["http_address"],
                   help="address for every service unless --http/grpc/metrics-address says otherwise")
    p.add_argument("--http-address", default=None)
    p.add_argument("--http-port", type=int, default=D["http_port"], help="0 lets the OS pick (see --port-file)")
    p.add_argument("--allow-http", type=triton_bool, default=D["allow_http"])
    p.add_argument("--grpc-address", default=None)
    p.add_argument("--grpc-port", type=int, default=D["grpc_port"])
    p.add_argument("--allow-grpc", type=triton_bool, default=D["allow_grpc"])
    p.add_argument("--metrics-address", default=None)
    p.add_argument("--metrics-port", type=int, default=D["metrics_port"])
    p.add_argument("--allow-metrics", type=triton_bool, default=D["allow_metrics"])
    p.add_argument("--allow-cpu-metrics", type=triton_bool, default=D["allow_cpu_metrics"])
    p.add_argument("--allow-gpu-metrics", type=triton_bool, default=D["allow_gpu_metrics"])
    p.add_argument("--metrics-interval-ms", type=int, default=D["metrics_interval_ms"],
                   help="how often CPU, memory and GPU gauges are sampled")
    p.add_argument("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
                   help="counter_latencies=true|false (default true), "
                        "histogram_latencies=true|false, summary_latencies=true|false "
                        "(default false)")
    p.add_argument("--http-max-input-size", type=int, default=D["http_max_input_size"],
                   help="largest JSON part of an HTTP request in bytes")
    p.add_argument("--http-max-header-size", type=int, default=D["http_max_header_size"],
                   help="bytes of request line and headers (431 past it)")
    p.add_argument("--http-max-connections", type=int, default=D["http_max_connections"],
                   help="open HTTP connections per frontend (a new one past it gets 503)")
    p.add_argument("--http-request-timeout-secs", type=float,
                   default=D["http_request_timeout_secs"],
                   help="a request must arrive whole this long after its first byte (408)")
    p.add_argument("--http-idle-timeout-secs", type=float, default=D["http_idle_timeout_secs"],
                   help="an idle keep-alive connection is closed after this long")
    p.add_argument("--http-max-json-elements", type=int, default=D["http_max_json_elements"],
                   help="tensor elements one JSON request may carry, and one output may be "
                        "returned as JSON (past it: 400; ask for binary data instead)")
    p.add_argument("--grpc-server", choices=["loop", "aio"], default=D["grpc_server"],
                   help="what serves gRPC: 'loop' reads HTTP/2 on the frontend's event loop; "
                        "'aio' is grpc.aio (also used when a response-compression or "
                        "client-ping-policing flag is given)")
    p.add_argument("--grpc-max-message-size", type=int, default=D["grpc_max_message_size"],
                   help="bytes of one gRPC message, request or response (RESOURCE_EXHAUSTED past it)")
    p.add_argument("--max-request-tensor-bytes", type=int, default=D["max_request_tensor_bytes"],
                   help="bytes of all input tensors of one request, by their shapes and "
                        "datatypes, checked before anything is allocated (400 past it)")
    p.add_argument("--model-upload-max-bytes", type=int, default=D["model_upload_max_bytes"],
                   help="bytes of model files one load request may upload as 'file:' "
                        "parameters, all together (400 past it; 0 refuses uploads)")
    p.add_argument("--request-deadline-secs", type=float, default=D["request_deadline_secs"],
                   help="the frontend answers every accepted request within this time, with "
                        "an error if nothing else answered it (the last line of defence)")
    p.add_argument("--model-load-timeout-secs", type=float, default=D["model_load_timeout_secs"],
                   help="an instance that is not ready this long after it started (a hung "
                        "initialize) is killed and its load fails")
    p.add_argument("--allow-client-shm", type=triton_bool, default=D["allow_client_shm"],
                   help="serve clients' system/CUDA shared-memory regions (Triton's default is "
                        "false; shmserve serves same-host clients, so it is on)")
    p.add_argument("--http-restricted-api", action="append", default=[],
                   metavar="API[,API]:HEADER=VALUE",
                   help="answer these API groups over HTTP only with this header (403 "
                        "otherwise); groups: " + ", ".join(restricted.GROUPS))
    p.add_argument("--grpc-restricted-protocol", action="append", default=[],
                   metavar="API[,API]:KEY=VALUE",
                   help="the same for gRPC; clients send the header triton-grpc-protocol-KEY")
    p.add_argument("--client-shm-from", default=D["client_shm_from"], type=str.lower,
                   choices=["local", "any"],
                   help="who may register shared-memory regions: 'local' accepts only clients "
                        "on this host (loopback or unix socket peers), 'any' every client")
    p.add_argument("--id", default=D["server_id"], help="server name reported by GET /v2")
    p.add_argument("--log-verbose", type=int, default=D["log_verbose"], metavar="N",
                   help="verbose logging level: 0 disables verbose lines, N >= 1 enables them")
    p.add_argument("--log-info", type=triton_bool, default=D["log_info"])
    p.add_argument("--log-warning", type=triton_bool, default=D["log_warning"])
    p.add_argument("--log-error", type=triton_bool, default=D["log_error"])
    p.add_argument("--log-format", default=D["log_format"].value,
                   choices=[f.value for f in LogFormat],
                   help="default: 'I0520 20:03:25.829575 <pid> <file>:<line>] <message>'; "
                        "ISO8601: '2024-05-20T20:03:25Z I <pid> <file>:<line>] <message>'")
    p.add_argument("--log-file", default=D["log_file"], metavar="PATH",
                   help="append every process's log lines to this file instead of stderr "
                        "(what models print still goes to stdout/stderr)")
    p.add_argument("--exit-timeout-secs", type=float, default=D["exit_timeout_secs"],
                   help="how long shutdown waits for in-flight requests")
    p.add_argument("--exit-grace-secs", type=float, default=D["exit_grace_secs"],
                   help="after a stop signal, answer 'not ready' but keep serving this long "
                        "before refusing new requests: at least a load balancer's health-check "
                        "interval times its failure count (0: refuse at once, as Triton)")
    p.add_argument("--strict-readiness", type=triton_bool, default=D["strict_readiness"],
                   help="ready only when every model is ready")
    p.add_argument("--exit-on-error", type=triton_bool, default=D["exit_on_error"],
                   help="exit when a model fails to load at startup (Triton's default is true)")
    p.add_argument("--port-file", default=D["port_file"],
                   help="write the ports actually bound, as JSON, to this file once listening")
    p.add_argument("--cuda-memory-pool-byte-size", action="append", default=[],
                   metavar="<GPU>:<BYTES>", type=gpu_bytes,
                   help="device memory each worker may keep on that GPU for ensemble tensors "
                        "that go to the next step as CUDA IPC handles (default 64 MiB per GPU; "
                        "0 sends them through host memory); repeatable")
    p.add_argument("--version", action="version", version=f"shmserve {VERSION}")
    compat_flags.add(p)
    compat_flags.add_trace(p)
    compat_flags.add_cache(p)
    compat_flags.add_grpc_tls(p)
    compat_flags.add_header_forward(p)
    compat_flags.add_rate_limit(p)
    compat_flags.add_backend_config(p)
    _show_defaults(p)
    return p


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Every flag's help ends with its default (argparse's own formatter shows it only for
    flags with a help text, and also for those whose default is nothing)."""
    for a in p._actions:
        if a.help == argparse.SUPPRESS or a.default in (None, [], argparse.SUPPRESS) \
                or isinstance(a.default, bool) and a.nargs == 0 \
                or "%(default)" in (a.help or ""):
            continue
        a.help = f"{a.help} (default: %(default)s)" if a.help else "default: %(default)s"


def metrics_config(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, bool]:
    known = {k: D[k] for k in ("counter_latencies", "histogram_latencies", "summary_latencies")}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            parser.error(f"--metrics-config {item!r}: expected counter_latencies, "
                         f"histogram_latencies or summary_latencies=<bool>")
        try:
            known[key] = triton_bool(value)
        except argparse.ArgumentTypeError as e:
            parser.error(f"--metrics-config {item!r}: {e}")
    return known


def gap_us(text: str) -> int:
    """--colocate-max-gap-us: microseconds, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of microseconds, got "
                                         f"{text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def frontend_count(text: str) -> int:
    if text == "auto":
        cpus = len(os.sched_getaffinity(0))
        return 1 if cpus <= 4 else min(8, cpus // 4)
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"must be between 1 and 64, got {n}")
    return n


def gpu_bytes(text: str) -> tuple[int, int]:
    """Triton's <GPU>:<bytes> (--cuda-memory-pool-byte-size)."""
    gpu, sep, count = text.partition(":")
    if not sep or not gpu.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected <GPU index>:<bytes>, got {text!r}")
    return int(gpu), byte_count(count)


def byte_count(text: str) -> int:
    try:
        return residency.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_settings(argv: list[str]) -> tuple[ServerSettings, argparse.Namespace]:
    parser = build_parser()
    a = parser.parse_args(argv)
    mc = metrics_config(parser, a.metrics_config)
    if a.load_model and a.model_control_mode != "explicit":
        parser.error("--load-model needs --model-control-mode=explicit")
    if "*" in a.load_model and len(a.load_model) > 1:
        parser.error("--load-model=* must be the only --load-model")
    if a.repository_poll_secs < 0:
        parser.error("--repository-poll-secs must be >= 0")
    if a.model_control_mode != "on_demand":
        for flag in ("model_memory_budget", "model_idle_unload_secs", "model_load_wait_secs"):
            if getattr(a, flag) != D[flag]:
                parser.error(f"--{flag.replace('_', '-')} needs --model-control-mode=on_demand")
    if not 0 <= a.exit_grace_secs <= 3600:
        parser.error("--exit-grace-secs must be between 0 and 3600")
    if a.model_idle_unload_secs < 0:
        parser.error("--model-idle-unload-secs must be >= 0")
    if a.model_load_wait_secs <= 0:
        parser.error("--model-load-wait-secs must be positive")
    if a.model_upload_max_bytes < 0:
        parser.error("--model-upload-max-bytes must be >= 0")
    if a.metrics_interval_ms <= 0:
        parser.error("--metrics-interval-ms must be positive")
    if a.log_verbose < 0:
        parser.error("--log-verbose must be >= 0")
    if a.log_file:
        a.log_file = os.path.abspath(a.log_file)    # the processes may not share a cwd forever
        try:
            with open(a.log_file, "a"):
                pass
        except OSError as e:
            parser.error(f"--log-file: cannot open '{a.log_file}' for appending: {e.strerror}")
    if a.http_max_input_size <= 0:      # Triton's words (its L0_http greps the log for them)
        parser.error("Error: --http-max-input-size must be greater than 0.")
    for flag in ("http_max_header_size", "http_max_connections", "http_request_timeout_secs",
                 "http_idle_timeout_secs", "http_max_json_elements", "grpc_max_message_size",
                 "max_request_tensor_bytes", "request_deadline_secs", "model_load_timeout_secs"):
        if getattr(a, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    for flag, specs, word in (("--http-restricted-api", a.http_restricted_api, "api"),
                              ("--grpc-restricted-protocol", a.grpc_restricted_protocol, "protocol")):
        try:
            restricted.parse(specs, word)
        except restricted.RestrictionError as e:
            parser.error(f"{flag} {e}")
    a.compat_notes = compat_flags.check(parser, a)
    default_mbs, backend_notes = compat_flags.backend_config(parser, a)
    a.compat_notes += backend_notes
    settings = ServerSettings(
        model_repositories=a.model_repository, run_dir="", segment_prefix="", launcher_pid=0,
        server_id=a.id, server_version=VERSION, model_config_name=a.model_config_name,
        backend_directory=os.path.abspath(a.backend_directory) if a.backend_directory else "",
        http_address=a.http_address or a.host, http_port=a.http_port, allow_http=a.allow_http,
        grpc_address=a.grpc_address or a.host, grpc_port=a.grpc_port, allow_grpc=a.allow_grpc,
        metrics_address=a.metrics_address or a.http_address or a.host,
        metrics_port=a.metrics_port, allow_metrics=a.allow_metrics,
        allow_cpu_metrics=a.allow_cpu_metrics, allow_gpu_metrics=a.allow_gpu_metrics,
        metrics_interval_ms=a.metrics_interval_ms,
        counter_latencies=mc["counter_latencies"], histogram_latencies=mc["histogram_latencies"],
        summary_latencies=mc["summary_latencies"],
        http_max_input_size=a.http_max_input_size, allow_client_shm=a.allow_client_shm,
        http_max_header_size=a.http_max_header_size, http_max_connections=a.http_max_connections,
        http_request_timeout_secs=a.http_request_timeout_secs,
        http_idle_timeout_secs=a.http_idle_timeout_secs,
        http_max_json_elements=a.http_max_json_elements,
        grpc_max_message_size=a.grpc_max_message_size, grpc_server=a.grpc_server,
        max_request_tensor_bytes=a.max_request_tensor_bytes,
        model_upload_max_bytes=a.model_upload_max_bytes,
        request_deadline_secs=a.request_deadline_secs,
        model_load_timeout_secs=a.model_load_timeout_secs,
        client_shm_from=a.client_shm_from, http_restricted_api=a.http_restricted_api,
        grpc_restricted_protocol=a.grpc_restricted_protocol,
        exit_timeout_secs=a.exit_timeout_secs,
        exit_grace_secs=a.exit_grace_secs,
        strict_readiness=a.strict_readiness, exit_on_error=a.exit_on_error,
        log_verbose=a.log_verbose, log_info=a.log_info, log_warning=a.log_warning,
        log_error=a.log_error, log_format=LogFormat(a.log_format), log_file=a.log_file,
        port_file=a.port_file,
        model_control_mode=a.model_control_mode, repository_poll_secs=a.repository_poll_secs,
        model_memory_budget=a.model_memory_budget, model_idle_unload_secs=a.model_idle_unload_secs,
        model_load_wait_secs=a.model_load_wait_secs,
        load_models=a.load_model,
        auto_complete=not (a.disable_auto_complete_config or a.strict_model_config is True),
        execution_timeout_secs=a.execution_timeout_secs,
        max_inflight_requests=a.max_inflight_requests, instance_leases=a.instance_leases,
        worker_start=a.worker_start,
        frontends=a.frontends, frontend_priority=a.frontend_priority, colocate=a.colocate,
        colocate_max_gap_us=a.colocate_max_gap_us,
        cuda_memory_pool=dict(a.cuda_memory_pool_byte_size),
        grpc_options=compat_flags.grpc_options(a), trace=compat_flags.trace_config(parser, a),
        response_cache_bytes=compat_flags.cache_bytes(parser, a),
        grpc_tls=compat_flags.grpc_tls(parser, a))
    settings.http_header_forward_pattern, settings.grpc_header_forward_pattern = \
        compat_flags.header_forward_patterns(parser, a)
    settings.rate_limit = a.rate_limit == "execution_count"
    settings.default_max_batch_size = default_mbs
    settings.rate_limit_resources = list(a.rate_limit_resource)
    return settings, a


def main(argv: list[str] | None = None) -> None:
    settings, a = parse_settings(sys.argv[1:] if argv is None else argv)
    sys.exit(launcher.run(settings, a.compat_notes))


if __name__ == "__main__":
    main()
