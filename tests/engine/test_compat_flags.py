"""tritonserver flags taken for compatibility (engine/launch/compat_flags.py): gRPC options reach the
settings, flags of parts shmserve lacks are noted, and a flag that would turn on a missing
feature stops the start with a message naming it."""
import pytest
from triton_line import TRITON_LINE

from shmserve.engine.launch.cli import parse_settings
from shmserve.ipc.messages.common import TraceConfig
from shmserve.ipc.spawn_args import GrpcTls


def refused(tmp_path, capsys, flags) -> str:
    """Starting with ``flags`` stops with exit code 2: what it said on stderr."""
    with pytest.raises(SystemExit) as e:
        parse_settings(["--model-repository", str(tmp_path), *flags])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_triton_command_line_parses(tmp_path):
    settings, a = parse_settings(["--model-repository", str(tmp_path), *TRITON_LINE])
    assert settings.grpc_options == {
        "grpc.keepalive_time_ms": 10000, "grpc.keepalive_timeout_ms": 5000,
        "grpc.keepalive_permit_without_calls": 1, "grpc.http2.max_pings_without_data": 0,
        "grpc.max_connection_age_ms": 60000, "grpc.default_compression_level": 3}
    flags = {note.split()[0] for note in a.compat_notes}
    assert flags == {"--pinned-memory-pool-byte-size", "--buffer-manager-thread-count",
                     "--backend-config", "--http-thread-count",
                     "--reuse-grpc-port", "--host-policy"}
    # where python-based backends are looked for (docs/backends.md)
    assert settings.backend_directory == "/opt/tritonserver/backends"
    assert all("has no effect: " in note for note in a.compat_notes)
    assert settings.trace == TraceConfig(["OFF"], 100, -1, 0, "/tmp/trace.json", "triton")
    assert settings.response_cache_bytes == 0       # --response-cache-byte-size 0: no cache
    assert not settings.rate_limit and settings.rate_limit_resources == ["R1:10"]
    # default-max-batch-size is read; the python backend's setting has no effect (a note)
    assert settings.default_max_batch_size == 8
    assert [n for n in a.compat_notes if n.startswith("--backend-config")] == [
        "--backend-config is accepted for compatibility and has no effect: "
        "python,shm-default-byte-size=1048576 (backend settings other than "
        "default-max-batch-size are not read; each backend's settings are its model's config "
        "parameters)"]


def test_without_them_nothing_changes(tmp_path):
    settings, a = parse_settings(["--model-repository", str(tmp_path)])
    assert settings.grpc_options == {} and a.compat_notes == []


@pytest.mark.parametrize("flag, value, says", [
    ("--model-namespacing", "true", "model namespacing is not supported"),
    ("--allow-vertex-ai", "true", "the Vertex AI endpoint is not supported"),
])
def test_turning_on_a_missing_feature_stops_the_start(tmp_path, capsys, flag, value, says):
    err = refused(tmp_path, capsys, [flag, value])
    assert f"error: {flag} " in err and says in err, err


@pytest.mark.parametrize("flag, value", [
    ("--grpc-keepalive-time", "abc"), ("--grpc-keepalive-timeout", "-1"),
    ("--grpc-infer-response-compression-level", "max"), ("--pinned-memory-pool-byte-size", "x"),
    ("--backend-config", "python"), ("--reuse-http-port", "maybe"),
])
def test_bad_values_are_refused_naming_the_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository", str(tmp_path), flag, value])
    assert f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    (["--trace-config", "triton,file=/tmp/t.json", "--trace-config", "level=TIMESTAMPS",
      "--trace-config", "rate=1", "--trace-config", "count=5",
      "--trace-config", "triton,log-frequency=2", "--trace-config", "mode=triton"],
     TraceConfig(["TIMESTAMPS"], 1, 5, 2, "/tmp/t.json", "triton")),
    # the older flags, and levels that add up
    (["--trace-file", "/tmp/t.json", "--trace-level", "TENSORS", "--trace-level", "timestamps",
      "--trace-rate", "10", "--trace-count", "-1", "--trace-log-frequency", "0"],
     TraceConfig(["TIMESTAMPS", "TENSORS"], 10, -1, 0, "/tmp/t.json", "triton")),
    # OFF clears the levels before it; another mode's settings are ignored, as Triton does
    (["--trace-config", "level=TIMESTAMPS", "--trace-config", "level=OFF",
      "--trace-config", "opentelemetry,url=localhost:4318"], TraceConfig()),
])
def test_trace_flags_set_the_trace_settings(tmp_path, flags, expected):
    settings, _ = parse_settings(["--model-repository", str(tmp_path), *flags])
    assert settings.trace == expected


@pytest.mark.parametrize("flags, says", [
    (["--trace-config", "level=TIMESTAMPS"], "no trace file is given"),
    (["--trace-config", "level=LOUD"], "trace setting level=LOUD: expected one of OFF"),
    (["--trace-config", "rate=0"], "trace setting rate=0: expected an integer >= 1"),
    (["--trace-config", "count=-2"], "trace setting count=-2: expected an integer >= -1"),
    (["--trace-config", "mode=opentelemetry"], "only trace mode 'triton' is supported"),
    (["--trace-config", "jaeger,file=/x"], "unknown trace mode 'jaeger'"),
    (["--trace-config", "volume=3"], "the settings are level, rate, count"),
])
def test_bad_trace_flags_stop_the_start(tmp_path, capsys, flags, says):
    assert says in refused(tmp_path, capsys, flags)


@pytest.mark.parametrize("flags, size", [
    ([], 0),
    (["--cache-config", "local,size=1048576"], 1048576),
    (["--cache-config=local,size=0"], 0),
    (["--response-cache-byte-size", "8192"], 8192),      # the deprecated form
])
def test_cache_flags_set_the_response_cache_size(tmp_path, flags, size):
    settings, _ = parse_settings(["--model-repository", str(tmp_path), *flags])
    assert settings.response_cache_bytes == size


@pytest.mark.parametrize("flags, says", [
    # both of Triton's refusals, in its words
    (["--cache-config", "local,size=8192", "--cache-config", "redis,host=localhost"],
     "multiple cache configurations are not supported (local, redis)"),
    (["--response-cache-byte-size", "12345", "--cache-config", "local,size=67890"],
     "--response-cache-byte-size and --cache-config are incompatible flags"),
    (["--cache-config", "redis,host=localhost"], "the 'redis' cache is not supported"),
    (["--cache-config", "size=100"], "expected <cache>,<setting>=<value>"),
    (["--cache-config", "local,bytes=100"], "the local cache has one setting, size=<bytes>"),
    (["--cache-config", "local,size=lots"], "size must be an integer >= 0"),
    (["--cache-config", "local,size=-1"], "size must be an integer >= 0"),
    (["--cache-config", "local"], "expected [<name>,]<setting>=<value>"),
    (["--response-cache-byte-size", "-5"], "expected an integer >= 0"),
])
def test_bad_cache_flags_stop_the_start(tmp_path, capsys, flags, says):
    err = refused(tmp_path, capsys, flags)
    assert says in err, err


@pytest.fixture
def pems(tmp_path):
    paths = {}
    for name in ("cert", "key", "ca"):
        p = tmp_path / f"{name}.pem"
        p.write_text(f"-----BEGIN {name.upper()}-----\nAAAA\n-----END {name.upper()}-----\n")
        paths[name] = str(p)
    (tmp_path / "plain.txt").write_text("not a certificate\n")
    paths["plain"] = str(tmp_path / "plain.txt")
    return paths


def test_grpc_tls_flags(tmp_path, pems):
    base = ["--model-repository", str(tmp_path), "--grpc-server-cert", pems["cert"],
            "--grpc-server-key", pems["key"]]
    settings, _ = parse_settings(base)
    assert settings.grpc_tls is None            # certificates alone do not turn TLS on
    settings, _ = parse_settings([*base, "--grpc-use-ssl", "true"])
    assert settings.grpc_tls == GrpcTls(pems["cert"], pems["key"], "", False)
    # mutual implies TLS, as in Triton
    settings, _ = parse_settings([*base, "--grpc-use-ssl-mutual", "1", "--grpc-root-cert",
                                  pems["ca"]])
    assert settings.grpc_tls == GrpcTls(pems["cert"], pems["key"], pems["ca"], True)


@pytest.mark.parametrize("flags, says", [
    (["--grpc-use-ssl", "true"], "--grpc-server-cert is not given: gRPC over TLS needs it"),
    (["--grpc-use-ssl", "true", "--grpc-server-cert", "{cert}"], "--grpc-server-key is not given"),
    (["--grpc-use-ssl-mutual", "true", "--grpc-server-cert", "{cert}", "--grpc-server-key",
      "{key}"], "--grpc-root-cert is not given: client certificates are checked against it"),
    (["--grpc-use-ssl", "true", "--grpc-server-cert", "/nonexistent/cert.pem",
      "--grpc-server-key", "{key}"], "--grpc-server-cert /nonexistent/cert.pem: No such file"),
    (["--grpc-use-ssl", "true", "--grpc-server-cert", "{cert}", "--grpc-server-key",
      "{plain}"], "not a PEM file (no '-----BEGIN' line)"),
    (["--grpc-use-ssl", "maybe"], "argument --grpc-use-ssl: expected a boolean"),
])
def test_bad_grpc_tls_flags_stop_the_start(tmp_path, capsys, pems, flags, says):
    err = refused(tmp_path, capsys, [f.format(**pems) for f in flags])
    assert says in err, err


def test_header_forward_patterns(tmp_path, capsys):
    settings, _ = parse_settings(["--model-repository", str(tmp_path),
                                  "--http-header-forward-pattern", "x-.*",
                                  "--grpc-header-forward-pattern", "(?-i)PREFIX_.*"])
    assert settings.http_header_forward_pattern == "x-.*"
    assert settings.grpc_header_forward_pattern == "(?-i)PREFIX_.*"
    assert "--grpc-header-forward-pattern x-([: not a regular expression" in \
        refused(tmp_path, capsys, ["--grpc-header-forward-pattern", "x-(["])


def test_rate_limit_flags(tmp_path):
    settings, _ = parse_settings(["--model-repository", str(tmp_path), "--rate-limit",
                                  "EXECUTION_COUNT", "--rate-limit-resource", "R1:4",
                                  "--rate-limit-resource", "R2:1:0"])
    assert settings.rate_limit and settings.rate_limit_resources == ["R1:4", "R2:1:0"]
    settings, _ = parse_settings(["--model-repository", str(tmp_path)])
    assert not settings.rate_limit


@pytest.mark.parametrize("flags, says", [
    (["--rate-limit", "always"], "argument --rate-limit: invalid choice: 'always'"),
    (["--rate-limit-resource", "R1"], "'R1': expected <name>:<count>[:<device>]"),
    (["--rate-limit-resource", "R1:x"], "argument --rate-limit-resource: 'R1:x'"),
    (["--rate-limit-resource", "R1:-1"], "the count must be >= 0"),
    (["--rate-limit-resource", "R1:2:-3"], "the device must be >= 0"),
])
def test_bad_rate_limit_flags_stop_the_start(tmp_path, capsys, flags, says):
    err = refused(tmp_path, capsys, flags)
    assert says in err, err


@pytest.mark.parametrize("value", ["default-max-batch-size=-1", "default-max-batch-size=x",
                                   "onnxruntime,default-max-batch-size=2.5"])
def test_a_bad_default_max_batch_size_stops_the_start(tmp_path, capsys, value):
    assert "default-max-batch-size must be an integer >= 0" in \
        refused(tmp_path, capsys, ["--backend-config", value])
