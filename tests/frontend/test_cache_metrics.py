"""Triton's response cache counters on the metrics page (frontend/observability/metrics.py): there, per model
version, only when the server has a cache."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shmserve.frontend.observability.metrics import CustomCollector, InferenceCollector, _Page, exposition
from shmserve.ipc.messages.to_frontend import Duration, ModelStatistics

CACHE_FAMILIES = ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model",
                  "nv_cache_hit_duration_per_model", "nv_cache_miss_duration_per_model")


def page(cache: bool) -> tuple[str, dict]:
    inference = InferenceCollector(cache=cache)
    inference.models = [ModelStatistics("m", 1, cache_hit=Duration(3, 45_000),
                                        cache_miss=Duration(2, 7_999)),
                        ModelStatistics("n", 2)]
    registry = CollectorRegistry(auto_describe=False)
    custom = CustomCollector()
    registry.register(_Page([inference], custom))
    text = exposition(registry, custom).decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def test_the_cache_counters_are_there_with_a_cache():
    text, fams = page(cache=True)
    values = {name: {(s.labels["model"], s.labels["version"]): s.value
                     for s in fams[name].samples} for name in CACHE_FAMILIES}
    assert values == {
        "nv_cache_num_hits_per_model": {("m", "1"): 3, ("n", "2"): 0},
        "nv_cache_num_misses_per_model": {("m", "1"): 2, ("n", "2"): 0},
        "nv_cache_hit_duration_per_model": {("m", "1"): 45, ("n", "2"): 0},     # µs
        "nv_cache_miss_duration_per_model": {("m", "1"): 7, ("n", "2"): 0},
    }
    # Triton's names in the HELP and TYPE lines too, without prometheus_client's _total
    assert "# TYPE nv_cache_num_hits_per_model counter" in text
    assert "nv_cache_num_hits_per_model{" in text


@pytest.mark.parametrize("name", CACHE_FAMILIES)
def test_without_a_cache_they_are_not(name):
    text, _ = page(cache=False)
    assert name not in text


def summaries_page(cache: bool) -> str:
    inference = InferenceCollector(cache=cache)
    inference.models = [ModelStatistics("m", 1, cache_hit=Duration(2, 30_000),
                                        success=Duration(2, 90_000),
                                        summaries={k: [1.0, 2.0, 3.0, 4.0, 5.0] for k in (
                                            "request", "queue", "compute_input",
                                            "compute_infer", "compute_output", "cache_hit",
                                            "cache_miss")})]
    registry = CollectorRegistry(auto_describe=False)
    custom = CustomCollector()
    registry.register(_Page([inference], custom))
    return exposition(registry, custom).decode()


def test_with_a_cache_the_summaries_are_triton_s():
    """Triton (DLIS-4762): no request summary with a cache; the cache's own instead."""
    text = summaries_page(cache=True)
    assert "nv_cache_hit_summary_per_model{" in text and "nv_cache_miss_summary_per_model{" in text
    assert "nv_inference_request_summary_us" not in text
    assert "nv_inference_queue_summary_us{" in text
    assert 'nv_cache_hit_summary_per_model_count{model="m",version="1"} 2.0' in text
    plain = summaries_page(cache=False)
    assert "nv_inference_request_summary_us{" in plain and "nv_cache_hit_summary" not in plain


def test_the_pinned_memory_pool_is_shown_empty():
    text, fams = page(cache=False)
    for name in ("nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes"):
        assert [s.value for s in fams[name].samples] == [0]
