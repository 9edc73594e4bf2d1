"""Optional latency metrics behind --metrics-config, parsed with prometheus_client's parser."""
import subprocess
import sys

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serverproc import Server, infer_ones, wait_for


def _families(srv) -> dict:
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_histogram_and_summaries(example_repo):
    srv = Server(example_repo, "--metrics-config", "histogram_latencies=true",
                 "--metrics-config", "summary_latencies=true",
                 "--metrics-config", "counter_latencies=false")
    try:
        infer_ones(srv, 25)
        labels = {"model": "identity_fp32", "version": "1"}

        def histogram(fams):
            hist = fams["nv_inference_first_response_histogram_ms"]
            samples = [s for s in hist.samples
                       if all(s.labels.get(k) == v for k, v in labels.items())]
            count = next(s.value for s in samples if s.name.endswith("_count"))
            return count, next(s.value for s in samples if s.labels.get("le") == "+Inf")

        def counted():
            """The worker answers the client before the scheduler counts the batch: read the
            metrics once the last answer is counted."""
            fams = _families(srv)
            return fams if histogram(fams)[0] >= 25 else None

        fams = wait_for(counted, 20, "25 requests in the latency histogram")
        count, inf_bucket = histogram(fams)
        assert count == inf_bucket == 25
        summary = fams["nv_inference_request_summary_us"]
        quantiles = [s.value for s in summary.samples
                     if s.labels.get("model") == "identity_fp32" and "quantile" in s.labels]
        assert len(quantiles) == 5 and quantiles == sorted(quantiles) and quantiles[0] > 0
        sum_count = [s.value for s in summary.samples
                     if s.labels.get("model") == "identity_fp32" and s.name.endswith("_count")]
        assert sum_count == [25]
        assert "nv_inference_queue_summary_us" in fams
        assert "nv_inference_request_duration_us" not in fams          # counter_latencies=false
        assert "nv_inference_request_success" in fams
    finally:
        assert srv.stop() == 0


def test_defaults_have_counters_but_no_histogram_or_summary(server):
    fams = _families(server)
    assert "nv_inference_request_duration_us" in fams
    assert "nv_inference_first_response_histogram_ms" not in fams
    assert "nv_inference_request_summary_us" not in fams
    assert fams["nv_inference_request_success"].type == "counter"
    # on the wire: Triton's names, no _total suffix, in the samples and the TYPE line
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="simple",version="1"}' in text
    r = requests.post(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    assert r.status_code == 405


def test_bad_metrics_config_is_refused():
    r = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository", "/tmp",
                        "--metrics-config", "fancy=true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--metrics-config 'fancy=true'" in r.stderr


@pytest.mark.gpu
def test_gpu_gauges_per_device(server):
    import pynvml
    pynvml.nvmlInit()
    uuids = set()
    for i in range(pynvml.nvmlDeviceGetCount()):
        u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        uuids.add(u.decode() if isinstance(u, bytes) else u)
    fams = _families(server)
    for name in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                 "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"):
        assert {s.labels["gpu_uuid"] for s in fams[name].samples} == uuids, name
