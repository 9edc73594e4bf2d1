"""configs/grafana/shmserve.json queries only metrics a real server exports.

Every PromQL expression of the dashboard (panels and template variables) is cut into tokens,
and each metric name it selects must be on /metrics of a real server that has served
requests, with the labels the query filters and groups by, and a counter wherever the query
takes a rate. A renamed metric or a typo in the dashboard fails here instead of showing an
empty panel in Grafana.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import requests
from serverproc import REPO_ROOT, Server, infer_ones, wait_for

DASHBOARD = os.path.join(REPO_ROOT, "configs", "grafana", "shmserve.json")
EXAMPLE_REPO = os.path.join(REPO_ROOT, "configs", "models")

# The only names allowed to be missing from /metrics, each for a reason: the GPU gauges exist
# per GPU that nvidia-ml-py finds (frontend/observability/system_metrics.py), so a host without
# an NVIDIA GPU exports none of them and those panels show "No data". Where a GPU is visible
# they are required like every other name.
GPU_ONLY = {
    "nv_gpu_utilization",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_memory_total_bytes",
    "nv_gpu_power_usage",
    "nv_gpu_power_limit",
}

# Labels Prometheus adds to every series it scrapes: never on the page itself.
TARGET_LABELS = {"instance", "job"}

# PromQL's functions and aggregation operators: an identifier followed by "(" must be one of
# them (so a misspelt function fails instead of being skipped), any other identifier that is
# not a keyword is a metric name.
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "cos", "cosh", "count", "count_over_time", "count_values", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "group",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10", "log2",
    "max", "max_over_time", "min", "min_over_time", "minute", "month", "pi", "predict_linear",
    "present_over_time", "quantile", "quantile_over_time", "rad", "rate", "resets", "round",
    "scalar", "sgn", "sin", "sinh", "sort", "sort_desc", "sqrt", "stddev", "stddev_over_time",
    "stdvar", "stdvar_over_time", "sum", "sum_over_time", "tan", "tanh", "time", "timestamp",
    "topk", "vector", "year",
}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<variable>\$\{[^}]*\}|\$\w+)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>@])
""", re.VERBOSE)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}"
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


class Selector:
    """One metric a query selects: its name, the labels its matchers name, whether it is
    taken over a range (rate, increase: a counter's job), and the labels the query groups by."""

    def __init__(self, name: str, matchers: set[str], ranged: bool, grouping: set[str]):
        self.name, self.matchers, self.ranged, self.grouping = name, matchers, ranged, grouping

    def __repr__(self) -> str:
        return f"{self.name}{{{','.join(sorted(self.matchers))}}}{'[range]' if self.ranged else ''}"


def selectors(expr: str) -> list[Selector]:
    """The metrics a PromQL expression selects."""
    toks = tokens(expr)
    found: list[tuple[str, set[str], bool]] = []
    grouping: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "name" and text in GROUPING and nxt == "(":
            close = next(j for j in range(i + 2, len(toks)) if toks[j][1] == ")")
            # by (model, le): label names, not metrics
            grouping |= {t for k, t in toks[i + 2:close] if k == "name"}
            i = close + 1
            continue
        if text == "[":
            # a range or subquery ([5m], [$__rate_interval]): a duration, no metric
            i = next(j for j in range(i, len(toks)) if toks[j][1] == "]") + 1
            continue
        if kind == "name" and (nxt == "(" or nxt in ("by", "without")):
            # a call, or an aggregation written as sum by (model) (...)
            assert text in FUNCTIONS, f"unknown PromQL function {text!r} in {expr!r}"
            i += 1
            continue
        if kind == "name" and text.lower() in KEYWORDS:
            i += 1
            continue
        if kind == "name":
            matchers: set[str] = set()
            j = i + 1
            if j < len(toks) and toks[j][1] == "{":
                close = next(k for k in range(j, len(toks)) if toks[k][1] == "}")
                # name=~"value": the name is the token before the operator
                matchers = {toks[k - 1][1] for k in range(j + 1, close)
                            if toks[k][1] in ("=", "!=", "=~", "!~")}
                j = close + 1
            ranged = j < len(toks) and toks[j][1] == "["
            found.append((text, matchers, ranged))
            i = j
            continue
        i += 1
    return [Selector(name, matchers, ranged, grouping) for name, matchers, ranged in found]


def test_the_tokenizer_finds_metrics_not_functions_or_labels():
    """What the dashboard test relies on, on expressions shaped like the dashboard's."""
    s = selectors('histogram_quantile(0.99, sum by (model, le) (rate(x_bucket{model=~"$model",'
                  ' instance=~"$instance"}[$__rate_interval])))')
    assert [(a.name, a.matchers, a.ranged, a.grouping) for a in s] == \
        [("x_bucket", {"model", "instance"}, True, {"model", "le"})]
    s = selectors("sum by (model) (rate(a[5m]) - (rate(b[5m]) or rate(a[5m]) * 0)) / max(c) > 0")
    assert [(a.name, a.ranged) for a in s] == [("a", True), ("b", True), ("a", True), ("c", False)]
    assert [a.name for a in selectors('g{quantile="0.99", le="+Inf"} offset 5m')] == ["g"]
    with pytest.raises(AssertionError, match="unknown PromQL function 'rte'"):
        selectors("sum(rte(a[1m]))")


def _panels(items: list[dict]) -> list[dict]:
    """Every panel, the ones inside collapsed rows too."""
    out = []
    for p in items:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = []
    for p in _panels(dashboard["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        # Grafana's label_values(<selector>, <label>): the selector is PromQL, the label is not
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
        assert m, f"variable {v['name']!r}: expected label_values(selector, label), got {q!r}"
        out.append((f"variable {v['name']!r}", m.group(1)))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def test_dashboard_model(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]["query"]["query"]
    assert model.startswith("label_values(nv_inference_request_success") and model.endswith(", model)")
    assert "instance" in variables
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    uses_variable = {"type": "prometheus", "uid": "${datasource}"}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == uses_variable, v["name"]
    for p in _panels(dashboard["panels"]):
        if p["type"] == "row":
            assert not p.get("targets"), f"row {p['title']!r} queries nothing"
            continue
        assert p["title"] and p["targets"], p.get("title")
        assert p["datasource"] == uses_variable, p["title"]
        for t in p["targets"]:
            assert t.get("datasource", uses_variable) == uses_variable, p["title"]
            # every per-model panel follows the model picker, every panel the instance picker
            assert '$instance"' in t["expr"], f"{p['title']!r} ignores $instance"
            if "{{model}}" in t["legendFormat"]:
                assert 'model=~"$model"' in t["expr"], f"{p['title']!r} ignores $model"


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian/Ubuntu: "
                    "apt-get install prometheus); the tokenizer above reads names, not syntax")
def test_every_query_is_valid_promql(dashboard, tmp_path):
    """Prometheus' own parser, through promtool: each query as a recording rule, with
    Grafana's interval variable given a value ($model and $instance sit in label values)."""
    rules = [{"record": f"dashboard:query_{k}", "expr": expr.replace("$__rate_interval", "1m")}
             for k, (_, expr) in enumerate(_queries(dashboard))]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    r = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout + r.stderr


def _scrape(srv: Server) -> dict[str, tuple[str, list[set[str]]]]:
    """sample name -> (type of its family, the label names of each of its samples)."""
    text = requests.get(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).text
    samples: dict[str, tuple[str, list[set[str]]]] = {}
    family_type = "untyped"
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family_type = line.split()[3]       # samples follow their family's TYPE line
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        assert m, f"unreadable sample line {line!r}"
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
        samples.setdefault(m.group(1), (family_type, []))[1].append(labels)
    return samples


def _counter_like(name: str, family_type: str) -> bool:
    """What rate() and increase() can take: a counter's samples, or a histogram's or summary's
    cumulative _bucket/_sum/_count ones (a histogram x is on the page as x_bucket, x_sum and
    x_count; a summary x as x{quantile}, x_sum and x_count)."""
    if family_type == "counter":
        return True
    if family_type == "histogram":
        return name.endswith(("_bucket", "_sum", "_count"))
    if family_type == "summary":
        return name.endswith(("_sum", "_count"))
    return False


def _gpu_visible() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:       # no package, no driver, no device
        return False


def _problems(dashboard: dict, page: dict, allowed_missing: set[str]) -> list[str]:
    problems = []
    for where, expr in _queries(dashboard):
        for s in selectors(expr):
            if s.name not in page:
                if s.name not in allowed_missing:
                    problems.append(f"{where}: {s.name} is not on /metrics")
                continue
            family_type, label_sets = page[s.name]
            if s.ranged and not _counter_like(s.name, family_type):
                problems.append(f"{where}: rate/increase over {s.name}, a {family_type}")
            wanted = (s.matchers | s.grouping) - TARGET_LABELS
            if not any(wanted <= labels for labels in label_sets):
                problems.append(f"{where}: no {s.name} sample has the labels {sorted(wanted)}")
    return problems


def test_every_queried_metric_is_exported(dashboard):
    names = {s.name for _, expr in _queries(dashboard) for s in selectors(expr)}
    # the allowance covers GPU gauges only, and only ones the dashboard queries
    assert GPU_ONLY <= names
    assert all(n.startswith(("nv_gpu_", "nv_energy")) for n in GPU_ONLY)
    allowed_missing = set() if _gpu_visible() else GPU_ONLY
    # Two servers, because no one configuration exports everything the dashboard can show:
    # with a response cache the request summary gives way to the cache's (as in Triton).
    # Both run on_demand (its loads and evictions; models load at their first request).
    full = ("--model-control-mode", "on_demand",
            "--metrics-config", "histogram_latencies=true",
            "--metrics-config", "summary_latencies=true")
    cached = ("--model-control-mode", "on_demand", "--cache-config", "local,size=1048576")
    servers: list[Server] = []
    try:
        for flags in (full, cached):
            servers.append(Server(EXAMPLE_REPO, *flags))
            infer_ones(servers[-1], 5)      # per-model series of a model that has served requests

        def complete():
            # series that come a moment after the requests (the scheduler counts a request
            # after its answer; a loaded model's memory is measured later) come within the
            # timeout; what never comes stays missing and is reported below
            return not _problems(dashboard, _merge([_scrape(s) for s in servers]),
                                 allowed_missing)
        try:
            wait_for(complete, 30, "every queried metric on /metrics")
        except TimeoutError:
            pass
        problems = _problems(dashboard, _merge([_scrape(s) for s in servers]), allowed_missing)
    finally:
        codes = []
        for s in servers:           # each one, even when stopping another failed
            try:
                codes.append(s.stop())
            except subprocess.TimeoutExpired:   # stop() killed it
                codes.append("did not stop in time")
    assert problems == [], "\n".join(problems)
    assert codes == [0, 0]


def _merge(pages: list[dict]) -> dict:
    merged: dict[str, tuple[str, list[set[str]]]] = {}
    for page in pages:
        for name, (family_type, label_sets) in page.items():
            merged.setdefault(name, (family_type, []))[1].extend(label_sets)
    return merged
