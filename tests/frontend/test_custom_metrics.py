"""Python models' custom metrics on /metrics: merged over instances, rendered by
prometheus_client, and never able to break the page."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shmserve.frontend.observability.metrics import CustomCollector, InferenceCollector, _Page, exposition
from shmserve.ipc.messages.common import CustomMetrics, MetricFamilyState, MetricKind, MetricSample

C, G, H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM


def _page(reports):
    custom = CustomCollector()
    custom.reports = reports
    inference = InferenceCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Page([inference], custom))
    text = exposition(registry, custom).decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}


def _worker(instance, *families):
    return CustomMetrics(instance, list(families))


def test_instances_merge_counters_and_histograms_add_a_gauge_takes_the_latest_set():
    # Triton shares one gauge between instances: the latest set() wins, whichever instance is
    # listed last; a gauge that is only incremented adds up
    a = _worker(1, MetricFamilyState("reqs", "requests", C, [MetricSample({"m": "x"}, 3)]),
                MetricFamilyState("temp", "a gauge", G, [MetricSample({}, 1.5, set_ns=200)]),
                MetricFamilyState("level", "incremented", G, [MetricSample({}, 2.0)]),
                MetricFamilyState("lat", "latency", H, [MetricSample(
                    {"m": "x"}, buckets=[0.1, 1.0], counts=[1, 2, 0], sum=1.6)]))
    b = _worker(2, MetricFamilyState("reqs", "other text", C, [MetricSample({"m": "x"}, 4),
                                                              MetricSample({"m": "y"}, 1)]),
                MetricFamilyState("temp", "a gauge", G, [MetricSample({}, 7.0, set_ns=100)]),
                MetricFamilyState("level", "incremented", G, [MetricSample({}, -0.5)]),
                MetricFamilyState("lat", "latency", H, [MetricSample(
                    {"m": "x"}, buckets=[0.1, 1.0], counts=[0, 1, 5], sum=30.5)]))
    text, fams = _page([a, b])
    assert fams["reqs"].type == "counter" and fams["reqs"].documentation == "requests"
    assert _samples(fams["reqs"]) == {("reqs_total", (("m", "x"),)): 7,    # the parser's name
                                      ("reqs_total", (("m", "y"),)): 1}
    assert "reqs{m=\"x\"} 7.0" in text                  # on the page: the model's own name
    assert "# TYPE reqs counter" in text and "# HELP reqs requests" in text
    assert _samples(fams["temp"]) == {("temp", ()): 1.5}
    assert _samples(fams["level"]) == {("level", ()): 1.5}
    # a set() after the other's wins in either order
    later = _worker(3, MetricFamilyState("temp", "a gauge", G, [MetricSample({}, 9.0, set_ns=300)]))
    assert _samples(_page([later, a, b])[1]["temp"]) == {("temp", ()): 9.0}
    assert _samples(fams["lat"]) == {
        ("lat_bucket", (("le", "0.1"), ("m", "x"))): 1, ("lat_bucket", (("le", "1"), ("m", "x"))): 4,
        ("lat_bucket", (("le", "+Inf"), ("m", "x"))): 9, ("lat_count", (("m", "x"),)): 9,
        ("lat_sum", (("m", "x"),)): 32.1}


def test_a_clash_with_a_builtin_name_is_left_out_and_logged_once(caplog):
    clash = _worker(1, MetricFamilyState("nv_inference_count", "mine", G, [MetricSample({}, 5)]),
                    MetricFamilyState("nv_inference_exec", "ok: no clash", C,
                                      [MetricSample({}, 2)]),
                    MetricFamilyState("nv_inference_request_success_total", "clash", G, []))
    custom = CustomCollector()
    custom.reports = [clash]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Page([InferenceCollector()], custom))
    with caplog.at_level(logging.WARNING, logger="shmserve.metrics"):
        for _ in range(3):
            text = exposition(registry, custom).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["nv_inference_count"].type == "counter"
    assert "mine" not in text and "# HELP nv_inference_request_success Number" in text
    assert _samples(fams["nv_inference_exec"]) == {("nv_inference_exec_total", ()): 2}
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 2, left_out


def test_bad_families_are_left_out_and_the_page_stays_valid():
    bad = _worker(1,
                  MetricFamilyState("bad name", "x", G, [MetricSample({}, 1)]),
                  MetricFamilyState("bad_label", "x", G, [MetricSample({"a-b": "1"}, 1)]),
                  MetricFamilyState("bad_hist", "x", H, [MetricSample({}, buckets=[1.0],
                                                                      counts=[1], sum=1)]),
                  MetricFamilyState("good", "x", G, [MetricSample({"v": 'quote " and \\'}, 2)]))
    other_kind = _worker(2, MetricFamilyState("good", "x", C, [MetricSample({}, 1)]))
    text, fams = _page([bad, other_kind])
    assert set(fams) >= {"good"} and not {"bad name", "bad_label", "bad_hist"} & set(fams)
    assert _samples(fams["good"]) == {("good", (("v", 'quote " and \\'),)): 2}


def test_no_reports_no_custom_families():
    text, fams = _page([])
    assert all(name.startswith(("nv_", "shmserve_")) for name in fams)
