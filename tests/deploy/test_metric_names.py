"""Every metric name that deploy/ uses (dashboard, recording rules, HPA) is one a real server exports, with the
labels it is selected and grouped by; and the exported series follow the Prometheus naming conventions."""

from __future__ import annotations

import re

import httpx
import pytest
from deploy_files import (dashboard_exprs, hpa_metric_names, k8s_name_regexes, metric_names, rule_exprs, rule_list,
                      speculative_traffic)
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.metrics import MAX_POSITION

PROMETHEUS_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}   # added by scrapes


@pytest.fixture(scope="module")
def exposition(spec_server, idle) -> str:
    """/metrics after speculative requests have finished."""
    speculative_traffic(spec_server.base_url)
    idle(spec_server.engine)
    return httpx.get(spec_server.base_url + "/metrics").text


@pytest.fixture(scope="module")
def families(exposition):
    return list(text_string_to_metric_families(exposition))


@pytest.fixture(scope="module")
def sample_labels(families) -> dict[str, set[str]]:
    """Exported sample name -> the label names it carries."""
    labels: dict[str, set[str]] = {}
    for family in families:
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels


def test_deploy_uses_the_expected_metrics():
    exprs = dashboard_exprs() + rule_exprs()
    used = set().union(*(metric_names(e.expr) for e in exprs))
    # the dashboard's core panels are there (a sanity check of the extraction itself)
    assert {"specserve_spec_decode_accepted_tokens_total", "specserve_spec_decode_draft_tokens_total",
            "specserve_spec_decode_accepted_tokens_per_position_total", "specserve_time_to_first_token_seconds_bucket",
            "specserve_inter_token_latency_seconds_bucket", "specserve_num_requests_running",
            "specserve_kv_cache_usage_ratio", "specserve_spec_decode_drafter_fallbacks_total",
            "specserve_requests_total"} <= used
    assert not any(":" in n for n in used)          # recording-rule outputs are not exported names
    assert len(rule_list()) >= 10


def test_every_metric_used_in_deploy_is_exported(sample_labels):
    used: dict[str, list[str]] = {}
    for e in dashboard_exprs() + rule_exprs():
        for name in metric_names(e.expr):
            used.setdefault(name, []).append(e.source)
    for source, name in hpa_metric_names():
        used.setdefault(name, []).append(source)
    missing = {name: sources for name, sources in used.items() if name not in sample_labels}
    assert not missing, f"used in deploy/ but not exported by the server: {missing}"


def test_hpa_metrics_and_adapter_selectors_match_exported_gauges(families):
    gauges = {f.name for f in families if f.type == "gauge"}
    for source, name in hpa_metric_names():
        assert name in gauges, f"{source}: {name} is not an exported gauge"
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    for source, rx in k8s_name_regexes():
        matched = {n for n in exported if re.fullmatch(rx, n)}
        assert matched, f"{source}: __name__=~{rx!r} matches no exported series"


def test_selected_and_grouped_labels_exist(sample_labels):
    """`name{label...}` selectors and `by (labels) (fn(name...))` groupings only name labels the series has."""
    problems = []
    for e in dashboard_exprs() + rule_exprs():
        for name, matchers in re.findall(r"(specserve_[A-Za-z0-9_]+)\{([^}]*)\}", e.expr):
            for label in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
                if label not in sample_labels.get(name, set()):
                    problems.append(f"{e.source}: {name} has no label {label!r}")
        for by, name in re.findall(r"by\s*\(([^)]*)\)\s*\(\s*(?:\w+\()?\s*(specserve_[A-Za-z0-9_]+)", e.expr):
            for label in (x.strip() for x in by.split(",") if x.strip()):
                if label not in sample_labels.get(name, set()) | PROMETHEUS_LABELS:
                    problems.append(f"{e.source}: grouped by {label!r}, which {name} does not carry")
    assert not problems, "\n".join(problems)


def test_exported_metrics_follow_conventions(families, exposition):
    specserve = [f for f in families if f.name.startswith("specserve_")]
    assert len(specserve) >= 20
    for f in specserve:
        assert f.documentation.strip(), f"{f.name} has no HELP text"
        assert f.type in {"counter", "gauge", "histogram"}, (f.name, f.type)
        if f.type == "counter":   # the parser strips _total from a counter family's name; its samples carry it
            assert any(s.name == f.name + "_total" for s in f.samples), f"counter {f.name} has no _total sample"
        if f.type == "histogram":
            assert {f.name + "_bucket", f.name + "_sum", f.name + "_count"} <= {s.name for s in f.samples}
        assert not re.search(r"_(ms|milliseconds|minutes|percent|bytes_total_total)\b", f.name), f.name
        if "time" in f.name or "latency" in f.name:
            assert f.name.endswith("_seconds"), f"{f.name}: durations are in seconds"
    for line in exposition.splitlines():   # the raw exposition: counters' HELP/TYPE lines name the _total series
        if line.startswith("# TYPE specserve_") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line


def test_labels_are_bounded(families, spec_server):
    by_name = {s.name: s for f in families for s in f.samples}
    assert by_name
    positions = {s.labels["position"] for f in families for s in f.samples
                 if "position" in s.labels and f.name.startswith("specserve_")}
    assert positions and all(1 <= int(p) <= MAX_POSITION for p in positions), positions
    vllm_positions = {s.labels["position"] for f in families for s in f.samples
                      if "position" in s.labels and f.name.startswith("vllm:")}     # vLLM's: 0-based
    assert vllm_positions and all(0 <= int(p) < MAX_POSITION for p in vllm_positions), vllm_positions
    drafters = {s.labels["drafter"] for f in families for s in f.samples if "drafter" in s.labels}
    # the loaded drafters, plain decoding and the grammar's forced tokens: nothing per request
    assert drafters == {"none", "ngram", "grammar"}, drafters
    les = {s.labels["le"] for f in families if f.name == "specserve_spec_decode_accepted_length" for s in f.samples
           if "le" in s.labels}
    assert len(les) == MAX_POSITION + 2      # le = 0 .. MAX_POSITION and +Inf
    statuses = {s.labels["status"] for f in families for s in f.samples if "status" in s.labels}
    assert statuses == {"stop", "length", "abort", "rejected", "error"}


def test_metrics_docstring_documents_every_dashboard_metric():
    """server/metrics.py's docstring carries the dashboard's PromQL: every metric a panel uses appears in it."""
    import specserve.server.metrics as metrics

    doc = metrics.__doc__
    for e in dashboard_exprs():
        for name in metric_names(e.expr):
            assert re.sub(r"_bucket$", "", name) in doc, f"{name} ({e.source}) is not in server/metrics.py's docstring"
