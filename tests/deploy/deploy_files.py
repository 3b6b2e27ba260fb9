"""The deploy/ folder seen from the tests: every PromQL expression and metric name it uses (the Grafana
dashboard, the Prometheus recording rules, the Kubernetes HPA), and speculative traffic for a live server.
(A plain module, imported by name: the test folders have no __init__.py.)"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "specserve.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules.yml"
K8S = DEPLOY / "k8s"

# a prompt the ngram drafter can look up, so drafts get accepted even on the random tiny model
REPETITIVE_PROMPT = "one two three four five one two three four five one two three four five one two three"

_NAME_REGEX = re.compile(r'__name__\s*=~\s*"([^"]*)"')
_TOKEN = re.compile(r"(?<![A-Za-z0-9_:\"'])[A-Za-z_:][A-Za-z0-9_:]*")


@dataclass
class Expr:
    source: str          # where it comes from, e.g. "dashboard: Acceptance rate α / A"
    expr: str


def metric_names(expr: str) -> set[str]:
    """specserve metric names in a PromQL expression (recording-rule outputs, which contain ':', excluded;
    ``__name__=~"regex"`` matchers are left to `name_regexes`)."""
    expr = _NAME_REGEX.sub("", expr)
    expr = re.sub(r'"[^"]*"', '""', expr)               # label values are not names
    return {t for t in _TOKEN.findall(expr) if t.startswith("specserve_") and ":" not in t}


def name_regexes(text: str) -> list[str]:
    return _NAME_REGEX.findall(text)


def dashboard_exprs() -> list[Expr]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])] if panel.get("type") == "row" else [panel]:
            for t in p.get("targets", []):
                out.append(Expr(f"dashboard: {p['title']} / {t['refId']}", t["expr"]))
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            assert m, f"unexpected variable query {query!r}"
            out.append(Expr(f"dashboard variable ${var['name']}", m.group(1)))
    return out


def rule_list() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def rule_exprs() -> list[Expr]:
    return [Expr(f"rules.yml: {r.get('record') or r.get('alert')}", r["expr"]) for r in rule_list()]


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted([*K8S.glob("**/*.yaml"), *K8S.glob("**/*.yml")]):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    return docs


def hpa_metric_names() -> list[tuple[str, str]]:
    """(source, metric name) of every Pods / Object / External metric of every HorizontalPodAutoscaler."""
    out = []
    for path, doc in k8s_documents():
        if doc.get("kind") != "HorizontalPodAutoscaler":
            continue
        for m in doc.get("spec", {}).get("metrics", []):
            spec = m.get({"Pods": "pods", "Object": "object", "External": "external"}.get(m.get("type"), ""), {})
            name = spec.get("metric", {}).get("name")
            if name:
                out.append((f"{path.relative_to(ROOT)}: {doc['metadata']['name']}", name))
    return out


def k8s_name_regexes() -> list[tuple[str, str]]:
    """``__name__=~"..."`` series selectors in the k8s folder (e.g. prometheus-adapter's seriesQuery)."""
    out = []
    for path in sorted([*K8S.glob("**/*.yaml"), *K8S.glob("**/*.yml")]):
        out += [(str(path.relative_to(ROOT)), rx) for rx in name_regexes(path.read_text())]
    return out


def speculative_traffic(base_url: str, num_requests: int = 6, drafter: str = "ngram", concurrency: int = 3,
                        max_tokens: int = 48) -> None:
    """Speculative completions (greedy, EOS ignored), one plain request and one rejected request."""

    def one(i: int) -> int:
        body = {"model": "tiny", "prompt": REPETITIVE_PROMPT + f" {i}", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "speculative": {"drafter": drafter}}
        return httpx.post(base_url + "/v1/completions", json=body, timeout=120).status_code

    with ThreadPoolExecutor(concurrency) as pool:
        codes = list(pool.map(one, range(num_requests)))
    assert codes == [200] * num_requests, codes
    plain = {"model": "tiny", "prompt": REPETITIVE_PROMPT, "max_tokens": 8, "speculative": {"drafter": "none"}}
    assert httpx.post(base_url + "/v1/completions", json=plain, timeout=120).status_code == 200
    bad = {"model": "tiny", "prompt": "x", "max_tokens": 8, "speculative": {"drafter": "eagle"}}
    assert httpx.post(base_url + "/v1/completions", json=bad, timeout=120).status_code == 400
