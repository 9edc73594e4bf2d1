"""tritonserver flags that shmserve takes so that a Triton command line starts it unchanged.

Three kinds, one table each:

- ``GRPC_OPTIONS``: gRPC keep-alive, connection age and response compression. They mean the
  same here and go to the gRPC server as its channel options (frontend/grpc/service.py).
- ``NO_EFFECT``: settings of parts shmserve does not have (a pinned memory pool, backend and
  repository-agent directories, thread pools of a threaded server, NUMA host policies). Their
  values are checked as Triton checks them and the launcher logs, for each one given, that it
  has no effect here and why.
- ``OFF_ONLY``: switches for features shmserve does not have (SageMaker/Vertex AI endpoints,
  model namespacing). Their default or "off"
  values are accepted; anything that turns the feature on stops the start with a message that
  says so, rather than a server that silently does less than asked.

The trace, response cache, gRPC TLS, header forwarding and rate limiter flags are Triton's
too, and work (``add_trace``, ``add_cache``, ``add_grpc_tls``, ``add_header_forward``,
``add_rate_limit``).
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from shmserve.ipc.messages.common import TraceConfig
from shmserve.ipc.spawn_args import GrpcTls


def triton_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "on", "1", "yes"):
        return True
    if t in ("false", "off", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false/on/off/1/0), got '{text}'")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None


def _non_negative(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got '{text}'")
    return n


def _compression_level(text: str) -> int:
    levels = {"none": 0, "low": 1, "medium": 2, "high": 3}
    try:
        return levels[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected none, low, medium or high, got '{text}'") from None


def _setting(text: str) -> str:
    """``<backend or mode>,<key>=<value>`` or ``<key>=<value>`` (backend, cache, trace and host
    policy configs)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected [<name>,]<setting>=<value>, got '{text}'")
    return text


# flag -> (gRPC channel argument, type); given only when the flag is
GRPC_OPTIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--grpc-keepalive-time": ("grpc.keepalive_time_ms", _non_negative),
    "--grpc-keepalive-timeout": ("grpc.keepalive_timeout_ms", _non_negative),
    "--grpc-keepalive-permit-without-calls": ("grpc.keepalive_permit_without_calls", triton_bool),
    "--grpc-http2-max-pings-without-data": ("grpc.http2.max_pings_without_data", _non_negative),
    "--grpc-http2-min-recv-ping-interval-without-data":
        ("grpc.http2.min_ping_interval_without_data_ms", _non_negative),
    "--grpc-http2-max-ping-strikes": ("grpc.http2.max_ping_strikes", _non_negative),
    "--grpc-max-connection-age": ("grpc.max_connection_age_ms", _non_negative),
    "--grpc-max-connection-age-grace": ("grpc.max_connection_age_grace_ms", _non_negative),
    "--grpc-infer-response-compression-level": ("grpc.default_compression_level",
                                                _compression_level),
}

# flag -> (type, repeatable, why it does nothing here)
NO_EFFECT: dict[str, tuple[Callable[[str], Any], bool, str]] = {
    "--pinned-memory-pool-byte-size": (_non_negative, False,
                                       "host tensors live in POSIX shared memory, not a pinned pool"),
    "--buffer-manager-thread-count": (_non_negative, False, "there is no buffer manager"),
    "--repoagent-directory": (str, False, "repository agents are not supported"),
    "--min-supported-compute-capability": (float, False,
                                           "onnxruntime and TensorRT check the GPU themselves"),
    "--http-thread-count": (_non_negative, False,
                            "each frontend serves HTTP on one event loop (see --frontends)"),
    "--grpc-infer-thread-count": (_non_negative, False,
                                  "gRPC is served on each frontend's event loop"),
    "--grpc-infer-allocation-pool-size": (_non_negative, False, "no response pool to size"),
    "--grpc-max-response-pool-size": (_non_negative, False, "no response pool to size"),
    "--reuse-http-port": (triton_bool, False, "frontends bind with SO_REUSEPORT when there are several"),
    "--reuse-grpc-port": (triton_bool, False, "frontends bind with SO_REUSEPORT when there are several"),
    "--host-policy": (_setting, True, "processes are not pinned to NUMA nodes or cores"),
    "--enable-peer-access": (triton_bool, False, "CUDA peer access is left as the driver sets it"),
    "--cuda-virtual-address-size": (str, True, "there is no CUDA virtual memory pool"),
    "--model-load-gpu-limit": (str, True, "GPU memory per load is not limited"),
    "--model-load-retry-count": (_non_negative, False, "a failed load is not retried; load it "
                                                       "again through the repository API"),
    "--cache-directory": (str, False, "the response cache is built in (local); no cache "
                                      "libraries are loaded"),
}


@dataclass(frozen=True)
class OffOnly:
    type: Callable[[str], Any]
    repeatable: bool
    off: Callable[[Any], bool]      # whether a value leaves the feature off
    refusal: str                    # the message when it would not


OFF_ONLY: dict[str, OffOnly] = {
    "--model-namespacing": OffOnly(triton_bool, False, lambda v: not v,
                                   "model namespacing is not supported"),
    "--allow-sagemaker": OffOnly(triton_bool, False, lambda v: not v,
                                 "the SageMaker endpoint is not supported"),
    "--allow-vertex-ai": OffOnly(triton_bool, False, lambda v: not v,
                                 "the Vertex AI endpoint is not supported"),
}


def _dest(flag: str) -> str:
    return "compat_" + flag[2:].replace("-", "_")


def add(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tritonserver flags taken for compatibility (docs/triton-compat.md)")
    for flag, (option, kind) in GRPC_OPTIONS.items():
        group.add_argument(flag, dest=_dest(flag), type=kind, default=None,
                           help=f"gRPC server option {option}")
    for flag, (kind, repeatable, why) in NO_EFFECT.items():
        group.add_argument(flag, dest=_dest(flag), type=kind, default=None,
                           action="append" if repeatable else "store",
                           help=f"no effect: {why}")
    for flag, spec in OFF_ONLY.items():
        group.add_argument(flag, dest=_dest(flag), type=spec.type, default=None,
                           action="append" if spec.repeatable else "store",
                           help=f"only its off value: {spec.refusal}")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Refuse a flag that turns on what shmserve lacks (``parser.error``); returns a line for each
    flag given that has no effect, for the launcher to log."""
    for flag, spec in OFF_ONLY.items():
        value = getattr(args, _dest(flag))
        for v in (value if spec.repeatable else [value]) if value is not None else []:
            if not spec.off(v):
                shown = str(v).lower() if isinstance(v, bool) else v
                parser.error(f"{flag} {shown}: {spec.refusal}")
    notes = []
    for flag, (_, _, why) in NO_EFFECT.items():
        if getattr(args, _dest(flag)) is not None:
            notes.append(f"{flag} is accepted for compatibility and has no effect: {why}")
    return notes


def grpc_options(args: argparse.Namespace) -> dict[str, int]:
    """The gRPC channel options the flags given ask for."""
    out = {}
    for flag, (option, _) in GRPC_OPTIONS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            out[option] = int(value)
    return out


TRACE_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")


def add_trace(parser: argparse.ArgumentParser) -> None:
    """Triton's trace flags: ``--trace-config [<mode>,]<setting>=<value>`` and the older
    ``--trace-file``, ``--trace-level``, ``--trace-rate``, ``--trace-count`` and
    ``--trace-log-frequency`` (frontend/observability/trace.py writes the traces)."""
    g = parser.add_argument_group("tracing (the trace extension, frontend/observability/trace.py)")
    g.add_argument("--trace-config", action="append", type=_setting, default=[],
                   help="level=OFF|TIMESTAMPS|TENSORS, rate=N, count=N, mode=triton, "
                        "triton,file=PATH, triton,log-frequency=N (repeatable)")
    g.add_argument("--trace-file", default=None, help="same as --trace-config triton,file=")
    g.add_argument("--trace-level", action="append", default=[], type=str.upper,
                   help="same as --trace-config level=")
    g.add_argument("--trace-rate", type=_int, default=None, help="same as --trace-config rate=")
    g.add_argument("--trace-count", type=_int, default=None, help="same as --trace-config count=")
    g.add_argument("--trace-log-frequency", type=_int, default=None,
                   help="same as --trace-config triton,log-frequency=")


def trace_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TraceConfig:
    """The trace settings at start; a bad one stops the start (``parser.error``)."""
    pairs = [("file", args.trace_file), ("rate", args.trace_rate), ("count", args.trace_count),
             ("log-frequency", args.trace_log_frequency)]
    pairs = [(k, str(v)) for k, v in pairs if v is not None]
    pairs += [("level", v) for v in args.trace_level]
    for text in args.trace_config:
        head, _, value = text.partition("=")
        mode, _, key = head.rpartition(",")
        if mode.strip() == "opentelemetry":
            continue        # settings of a mode that is not in use, as Triton ignores them
        if mode.strip() not in ("", "triton"):
            parser.error(f"--trace-config {text}: unknown trace mode '{mode}' (triton)")
        pairs.append((key.strip().lower().replace("_", "-"), value.strip()))
    fields: dict[str, Any] = {}
    levels: list[str] = []
    for key, value in pairs:
        try:
            if key == "level":
                if value.upper() not in TRACE_LEVELS:
                    raise ValueError(f"expected one of {', '.join(TRACE_LEVELS)}")
                levels = [] if value.upper() == "OFF" else levels + [value.upper()]
            elif key == "mode":
                if value != "triton":
                    raise ValueError("only trace mode 'triton' is supported (traces are written "
                                     "in Triton's own format; OpenTelemetry export is not built)")
            elif key == "file":
                fields["file"] = value
            elif key in ("rate", "count", "log-frequency"):
                n = int(value)
                least = {"rate": 1, "count": -1, "log-frequency": 0}[key]
                if n < least:
                    raise ValueError(f"expected an integer >= {least}")
                fields[key.replace("-", "_")] = n
            else:
                raise ValueError("the settings are level, rate, count, mode, file and "
                                 "log-frequency")
        except ValueError as e:
            parser.error(f"trace setting {key}={value}: {e}")
    fields["level"] = sorted(set(levels), key=TRACE_LEVELS.index) or ["OFF"]
    if fields["level"] != ["OFF"] and not fields.get("file"):
        parser.error("tracing is on (--trace-config level=...) but no trace file is given: add "
                     "--trace-config triton,file=<path>")
    return TraceConfig(**fields)


def add_cache(parser: argparse.ArgumentParser) -> None:
    """Triton's response cache flags (frontend/cache/store.py keeps the answers)."""
    g = parser.add_argument_group("response cache (frontend/cache/store.py)")
    g.add_argument("--cache-config", action="append", type=_setting, default=[],
                   metavar="local,size=<BYTES>",
                   help="turn the response cache on, that many bytes (shared out between the "
                        "frontends); models opt in with response_cache { enable: true }")
    g.add_argument("--response-cache-byte-size", type=_non_negative, default=None,
                   metavar="BYTES", help="deprecated: same as --cache-config local,size=BYTES")


def cache_bytes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The response cache's size in bytes (0: no cache); a bad setting stops the start."""
    if args.response_cache_byte_size is not None:
        if args.cache_config:
            parser.error("--response-cache-byte-size and --cache-config are incompatible flags: "
                         "give --cache-config local,size=<bytes> alone")
        return args.response_cache_byte_size
    kinds: list[str] = []
    size = None
    for text in args.cache_config:
        head, _, value = text.partition("=")
        kind, _, key = head.rpartition(",")
        kind, key = kind.strip(), key.strip()
        if not kind:
            parser.error(f"--cache-config {text}: expected <cache>,<setting>=<value>, e.g. "
                         f"local,size=1048576")
        if kind not in kinds:
            kinds.append(kind)
        if kind != "local":
            continue
        if key != "size":
            parser.error(f"--cache-config {text}: the local cache has one setting, "
                         f"size=<bytes>")
        try:
            size = int(value)
            if size < 0:
                raise ValueError
        except ValueError:
            parser.error(f"--cache-config {text}: size must be an integer >= 0 (bytes)")
    if len(kinds) > 1:
        parser.error(f"--cache-config: multiple cache configurations are not supported "
                     f"({', '.join(kinds)}): configure one cache")
    if kinds and kinds[0] != "local":
        parser.error(f"--cache-config: the '{kinds[0]}' cache is not supported; the response "
                     f"cache is 'local' (local,size=<bytes>)")
    if kinds and size is None:
        parser.error("--cache-config local: give its size, local,size=<bytes>")
    return size or 0


def add_grpc_tls(parser: argparse.ArgumentParser) -> None:
    """Triton's gRPC TLS flags (frontend/grpc/service.py serves TLS through grpc.aio)."""
    g = parser.add_argument_group("gRPC over TLS")
    g.add_argument("--grpc-use-ssl", type=triton_bool, default=False,
                   help="serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)")
    g.add_argument("--grpc-use-ssl-mutual", type=triton_bool, default=False,
                   help="TLS with client certificates signed by --grpc-root-cert (implies "
                        "--grpc-use-ssl)")
    g.add_argument("--grpc-server-cert", default="", metavar="PEM",
                   help="the server's certificate (chain), a PEM file")
    g.add_argument("--grpc-server-key", default="", metavar="PEM",
                   help="the server's private key, a PEM file")
    g.add_argument("--grpc-root-cert", default="", metavar="PEM",
                   help="the CA certificates client certificates must chain to, a PEM file")


def grpc_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GrpcTls | None:
    """The gRPC TLS settings (None: plain gRPC). Each file must be readable now: a typo stops
    the start (exit 2), not the first handshake. The paths travel to the frontends, which read
    them; a private key never appears on a command line."""
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    needed = [("--grpc-server-cert", args.grpc_server_cert),
              ("--grpc-server-key", args.grpc_server_key)]
    if args.grpc_use_ssl_mutual:
        needed.append(("--grpc-root-cert", args.grpc_root_cert))
    elif args.grpc_root_cert:
        needed.append(("--grpc-root-cert", args.grpc_root_cert))
    for flag, path in needed:
        if not path:
            why = "client certificates are checked against it" if flag == "--grpc-root-cert" \
                else "gRPC over TLS needs it"
            parser.error(f"{flag} is not given: {why}")
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:
            parser.error(f"{flag} {path}: {e.strerror}")
        if b"-----BEGIN " not in text:
            parser.error(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return GrpcTls(os.path.abspath(args.grpc_server_cert), os.path.abspath(args.grpc_server_key),
                   os.path.abspath(args.grpc_root_cert) if args.grpc_root_cert else "",
                   bool(args.grpc_use_ssl_mutual))


def add_header_forward(parser: argparse.ArgumentParser) -> None:
    """Triton's header forwarding flags (engine/requests/header_forward.py)."""
    g = parser.add_argument_group("forwarding headers to models as request parameters")
    g.add_argument("--http-header-forward-pattern", default="", metavar="REGEX",
                   help="HTTP headers whose names match (a search, case-insensitive unless it "
                        "starts with (?-i)) reach the model as string parameters")
    g.add_argument("--grpc-header-forward-pattern", default="", metavar="REGEX",
                   help="the same for gRPC metadata")


def header_forward_patterns(parser: argparse.ArgumentParser,
                            args: argparse.Namespace) -> tuple[str, str]:
    """Both patterns, each compiled once here: a bad one stops the start (exit 2)."""
    from shmserve.engine.requests.header_forward import compile_pattern
    for flag, pattern in (("--http-header-forward-pattern", args.http_header_forward_pattern),
                          ("--grpc-header-forward-pattern", args.grpc_header_forward_pattern)):
        try:
            compile_pattern(pattern)
        except re.error as e:
            parser.error(f"{flag} {pattern}: not a regular expression: {e}")
    return args.http_header_forward_pattern, args.grpc_header_forward_pattern


def _rate_limit_resource(text: str) -> str:
    from shmserve.engine.batching.rate_limiter import parse_override
    try:
        parse_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"'{text}': {e}") from None
    return text


def add_rate_limit(parser: argparse.ArgumentParser) -> None:
    """Triton's rate limiter flags (engine/batching/rate_limiter.py)."""
    g = parser.add_argument_group("rate limiter")
    g.add_argument("--rate-limit", type=str.lower, choices=("off", "execution_count"),
                   default="off", help="execution_count: instances execute only while they "
                                       "hold the resources their instance_group's rate_limiter "
                                       "names")
    g.add_argument("--rate-limit-resource", action="append", default=[],
                   type=_rate_limit_resource, metavar="<NAME>:<COUNT>[:<DEVICE>]",
                   help="how much of a resource there is (default: the most any instance asks "
                        "for); repeatable")


def add_backend_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend-config", action="append", type=_setting, default=[],
                        metavar="[<backend>,]<setting>=<value>",
                        help="default-max-batch-size=N (global or onnxruntime,...): the "
                             "max_batch_size auto-complete gives a model that can batch "
                             "(default 4; 0: none). Other settings are logged as having no "
                             "effect; repeatable")


def backend_config(parser: argparse.ArgumentParser, args: argparse.Namespace
                   ) -> tuple[int, list[str]]:
    """``default-max-batch-size`` (Triton's default 4), and a note for each other setting,
    which has no effect here (each backend's settings are its model's config parameters)."""
    size, notes = 4, []
    for text in args.backend_config:
        head, _, value = text.partition("=")
        backend, _, key = head.rpartition(",")
        if key.strip() == "default-max-batch-size" and backend.strip() in ("", "onnxruntime"):
            try:
                size = int(value)
                if size < 0:
                    raise ValueError
            except ValueError:
                parser.error(f"--backend-config {text}: default-max-batch-size must be an "
                             f"integer >= 0")
        else:
            notes.append(f"--backend-config is accepted for compatibility and has no effect: "
                         f"{text} (backend settings other than default-max-batch-size are not "
                         f"read; each backend's settings are its model's config parameters)")
    return size, notes
