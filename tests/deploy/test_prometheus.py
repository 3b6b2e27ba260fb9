"""A real Prometheus scrapes a live server every second with deploy/prometheus/rules.yml loaded; after
speculative traffic every dashboard panel expression and every recording rule returns data, the per-drafter
ones for drafter="ngram".

Needs the `prometheus` binary (Debian: ``apt-get install prometheus``; .ci/run installs it); skipped without."""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path

import pytest
from deploy_files import RULES, dashboard_exprs, rule_list, speculative_traffic

# scripts/dashboard.py: a repository tool beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from dashboard import dashboard_variables, load_dashboard, local_prometheus, panel_queries, substitute  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no `prometheus` on PATH (Debian: apt-get install prometheus)")

RATE_INTERVAL = "30s"      # $__rate_interval: 30 scrapes at 1 s
RANGE = "5m"               # $__range


def finite(result: list[dict]) -> list[dict]:
    return [r for r in result if math.isfinite(float(r["value"][1]))]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def prom(spec_server, idle, tmp_path_factory):
    """Prometheus scraping the server every 1 s, after speculative traffic and a few scrapes and rule runs."""
    target = spec_server.base_url.removeprefix("http://")
    with local_prometheus([target], rules=[RULES], scrape_interval="1s",
                          workdir=tmp_path_factory.mktemp("prometheus")) as prom:
        wait_for(lambda: prom.query('up{job="specserve"} == 1'), 20, "the first scrape")
        time.sleep(2)                                    # baseline samples before the traffic
        speculative_traffic(spec_server.base_url, num_requests=6)
        time.sleep(1)
        speculative_traffic(spec_server.base_url, num_requests=6)
        idle(spec_server.engine)
        # the rules run every second over 1m windows: wait until they have seen the traffic
        wait_for(lambda: finite(prom.query(
            'drafter:specserve_spec_decode_acceptance_rate:ratio_rate1m{drafter="ngram"}')), 20, "the rules")
        wait_for(lambda: finite(prom.query(
            'drafter:specserve_time_to_first_token_seconds:histogram_quantile_rate1m{drafter="ngram"}')), 20,
            "the latency rules")
        yield prom


def test_drafter_variable_lists_the_drafter(prom):
    assert "ngram" in prom.label_values("drafter", "specserve_spec_decode_draft_tokens_total")


@pytest.mark.parametrize("drafter", ["ngram", ".*"])
def test_every_dashboard_panel_returns_data(prom, drafter):
    queries = panel_queries(load_dashboard(), dashboard_variables(drafter, RATE_INTERVAL, RANGE))
    assert len(queries) >= 20
    empty, no_ngram = [], []
    for q in queries:
        assert "$" not in q.expr, f"unsubstituted variable in {q.panel['title']}: {q.expr}"
        result = prom.query(q.expr)
        if not finite(result):
            empty.append(f"{q.panel['title']} / {q.ref_id}: {q.expr} -> {result}")
        elif "drafter" in q.expr and "by (drafter" in q.expr:
            if not any(r["metric"].get("drafter") == "ngram" for r in finite(result)):
                no_ngram.append(f"{q.panel['title']} / {q.ref_id}: {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not no_ngram, "per-drafter panels without drafter=ngram:\n" + "\n".join(no_ngram)


def test_dashboard_values_are_sane(prom):
    """The speculation panels agree with what the server counted."""
    v = dashboard_variables("ngram", RATE_INTERVAL, RANGE)

    def one(expr: str) -> float:
        result = finite(prom.query(substitute(expr, v)))
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    exprs = {e.source: e.expr for e in dashboard_exprs()}
    alpha = one(exprs["dashboard: Acceptance rate α / A"])
    tau = one(exprs["dashboard: Mean accepted length τ / A"])
    assert 0 <= alpha <= 1 and 1 <= tau <= 1 + 8          # at most 8 draft tokens per step by default
    fallbacks = one(exprs["dashboard: Drafter fallbacks / A"])
    assert fallbacks == 0


def test_every_recording_rule_returns_data(prom):
    rules = rule_list()
    problems = []
    for rule in rules:
        name = rule["record"]
        for what, expr in (("record", name), ("expr", rule["expr"])):
            result = finite(prom.query(expr))
            if not result:
                problems.append(f"{name} ({what}): no data")
            elif "drafter" in rule["expr"] and not any(r["metric"].get("drafter") == "ngram" for r in result):
                problems.append(f"{name} ({what}): no drafter=ngram in {result}")
    assert not problems, "\n".join(problems)
    quantiles = {r["metric"]["quantile"] for r in prom.query(
        'drafter:specserve_inter_token_latency_seconds:histogram_quantile_rate1m{drafter="ngram"}')}
    assert quantiles == {"0.5", "0.95", "0.99"}
    positions = finite(prom.query(
        'drafter_position:specserve_spec_decode_position_acceptance:ratio_rate1m{drafter="ngram"}'))
    assert {r["metric"]["position"] for r in positions} >= {"1", "2"}
    assert all(0 <= float(r["value"][1]) <= 1 for r in positions)
