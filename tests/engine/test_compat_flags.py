"""tritonserver flags taken for compatibility (engine/compat_flags.py): gRPC options reach the
settings, flags of parts shmserve lacks are noted, and a flag that would turn on a missing
feature stops the start with a message naming it."""
import pytest
from triton_line import TRITON_LINE

from shmserve.engine.cli import parse_settings


def test_a_triton_command_line_parses(tmp_path):
    settings, a = parse_settings(["--model-repository", str(tmp_path), *TRITON_LINE])
    assert settings.grpc_options == {
        "grpc.keepalive_time_ms": 10000, "grpc.keepalive_timeout_ms": 5000,
        "grpc.keepalive_permit_without_calls": 1, "grpc.http2.max_pings_without_data": 0,
        "grpc.max_connection_age_ms": 60000, "grpc.default_compression_level": 3}
    flags = {note.split()[0] for note in a.compat_notes}
    assert flags == {"--pinned-memory-pool-byte-size", "--buffer-manager-thread-count",
                     "--backend-directory", "--backend-config", "--http-thread-count",
                     "--reuse-grpc-port", "--host-policy", "--rate-limit-resource"}
    assert all("has no effect: " in note for note in a.compat_notes)


def test_without_them_nothing_changes(tmp_path):
    settings, a = parse_settings(["--model-repository", str(tmp_path)])
    assert settings.grpc_options == {} and a.compat_notes == []


@pytest.mark.parametrize("flag, value, says", [
    ("--rate-limit", "execution_count", "rate limiting (execution_count) is not supported"),
    ("--cache-config", "local,size=1048576", "the response cache is not supported"),
    ("--response-cache-byte-size", "1024", "the response cache is not supported"),
    ("--trace-config", "triton,level=TIMESTAMPS", "tracing is not supported"),
    ("--trace-config", "level=TENSORS", "tracing is not supported"),
    ("--trace-level", "TIMESTAMPS", "tracing is not supported"),
    ("--grpc-use-ssl", "true", "TLS is not supported"),
    ("--grpc-use-ssl-mutual", "1", "TLS is not supported"),
    ("--model-namespacing", "true", "model namespacing is not supported"),
    ("--allow-vertex-ai", "true", "the Vertex AI endpoint is not supported"),
    ("--http-header-forward-pattern", "x-.*", "forwarding HTTP headers to models is not supported"),
])
def test_turning_on_a_missing_feature_stops_the_start(tmp_path, capsys, flag, value, says):
    with pytest.raises(SystemExit) as e:
        parse_settings(["--model-repository", str(tmp_path), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
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
