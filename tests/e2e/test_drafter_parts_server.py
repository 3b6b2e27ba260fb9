"""A composite drafter's per-part figures through a real server: the response's `speculative.parts`
(per request, summing to its draft and accepted tokens; absent for drafters without parts) and the
`specserve_spec_decode_{draft,accepted}_part_tokens_total{drafter,part}` series of /metrics."""

from __future__ import annotations

import httpx
from helpers import two_part_drafter
from prometheus_client.parser import text_string_to_metric_families

COMPOSITE = two_part_drafter()
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


def _scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_server_reports_parts_in_usage_and_metrics(serve, make_tiny_engine, idle):
    engine = make_tiny_engine(drafters=(COMPOSITE, "ngram"), draft_budget="fixed")
    with serve(engine, served_model_name="tiny") as server:
        def post(drafter):
            r = httpx.post(f"{server.v1}/completions", timeout=120, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "speculative": {"drafter": drafter}})
            assert r.status_code == 200, r.text
            return r.json()

        body = post(COMPOSITE)
        usage = body["speculative"]
        assert usage["drafter"] == COMPOSITE
        parts = {p["name"]: p for p in usage["parts"]}
        assert set(parts) == {"ngram", "echo"}
        assert sum(p["draft_tokens"] for p in parts.values()) == usage["draft_tokens"] > 0
        assert sum(p["accepted_tokens"] for p in parts.values()) == usage["accepted_tokens"] > 0
        assert body["choices"][0]["text"] == post("none")["choices"][0]["text"]     # lossless
        assert "parts" not in post("ngram")["speculative"]                     # no provenance: no parts
        idle(engine)

        samples = _scrape(server.base_url)
        p = "specserve_spec_decode_"
        stats = engine.get_stats().drafters[COMPOSITE]
        for name in ("ngram", "echo"):
            labels = (("drafter", COMPOSITE), ("part", name))
            assert samples[(p + "draft_part_tokens_total", labels)] == parts[name]["draft_tokens"]
            assert samples[(p + "accepted_part_tokens_total", labels)] == parts[name]["accepted_tokens"]
            assert stats.parts[name].num_draft_tokens == parts[name]["draft_tokens"]
        assert samples[(p + "draft_tokens_total", (("drafter", COMPOSITE),))] == usage["draft_tokens"]
        assert samples[(p + "accepted_tokens_total", (("drafter", COMPOSITE),))] == usage["accepted_tokens"]
        assert not any(dict(labels).get("drafter") == "ngram" for (n, labels) in samples if "_part_" in n)
