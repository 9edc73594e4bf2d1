"""The real perf_analyzer (from the tritonclient 2.51.0 wheel) runs unmodified against shmserve.

Windows are counted in requests, not in time (``count_windows``): on a machine busy with other
work a time window can hold too few requests for perf_analyzer to call it a measurement, and
speed is not what these tests check."""
import csv
import subprocess

import pytest

WINDOW = ["--measurement-mode", "count_windows", "--measurement-request-count", "40",
          "--max-trials", "4", "--stability-percentage", "999"]
CASES = {
    "http": ["-i", "http"],
    "grpc": ["-i", "grpc"],
    "http-system-shm": ["-i", "http", "--shared-memory", "system", "--output-shared-memory-size", "65536"],
    "grpc-system-shm": ["-i", "grpc", "--shared-memory", "system", "--output-shared-memory-size", "65536"],
    "grpc-streaming": ["-i", "grpc", "--streaming"],
}


# perf_analyzer names its system shared-memory regions after the tensors (INPUT0_0_0, OUTPUT0),
# not after itself: two runs at once on one host unlink each other's segments. Every test that
# runs it with --shared-memory system is in this group, which pytest-xdist runs in one process.
SYSTEM_SHM = pytest.mark.xdist_group("perf_analyzer_system_shm")


@pytest.mark.parametrize("case", [pytest.param(c, marks=SYSTEM_SHM) if "system-shm" in c else c
                                  for c in CASES])
def test_perf_analyzer_reports_throughput(server, perf_analyzer, tmp_path, case):
    port = server.grpc_port if "grpc" in case else server.http_port
    report = tmp_path / "report.csv"
    cmd = [perf_analyzer, "-m", "identity_fp32", "-u", f"127.0.0.1:{port}", "--shape", "INPUT0:16",
           "--concurrency-range", "1:2", *WINDOW, "--percentile", "99", "-f", str(report),
           *CASES[case]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "error" not in out.stdout.lower(), out.stdout
    if case == "http":
        # the server-side summary comes from the statistics extension
        assert "Server:" in out.stdout and "Inference count:" in out.stdout, out.stdout
        assert "queue" in out.stdout and "compute infer" in out.stdout, out.stdout
    with open(report) as f:
        rows = list(csv.DictReader(f))
    # perf_analyzer orders the report's rows by throughput, which a busy machine can invert
    assert sorted(r["Concurrency"] for r in rows) == ["1", "2"]
    for r in rows:
        assert float(r["Inferences/Second"]) > 0
        assert float(r["p99 latency"]) > 0


def test_perf_analyzer_streams_a_decoupled_model(server, perf_analyzer, tmp_path):
    """--streaming on repeat_int32 (configs/models): perf_analyzer sees the model is decoupled
    and needs triton_final_response to tell when each request ends."""
    report = tmp_path / "report.csv"
    cmd = [perf_analyzer, "-m", "repeat_int32", "-i", "grpc", "--streaming",
           "-u", f"127.0.0.1:{server.grpc_port}", "--input-data", "zero",
           "--shape", "IN:4", "--shape", "DELAY:4", "--shape", "WAIT:1",
           "--concurrency-range", "2", *WINDOW, "-f", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "Detected decoupled model" in out.stdout, out.stdout
    with open(report) as f:
        rows = list(csv.DictReader(f))
    assert rows and float(rows[0]["Inferences/Second"]) > 0
    # four responses per request (one per element of IN)
    assert "Response Throughput" in out.stdout, out.stdout
