"""What vLLM's tools read, from a real server through the real `openai` client: after a few
speculative requests, `/metrics` carries vLLM's series (`vllm:spec_decode_*_total` read the way
`vllm bench serve` reads them, the serving series with `model_name`), agreeing with specserve's own
counters and with the responses' per-request `metrics.speculative_decoding`; `--no-vllm-metrics`
leaves only ours."""

from __future__ import annotations

import httpx
import openai
import pytest

from specserve.bench.aiperf import vllm_bench_spec_counters   # the parser `bench aiperf` reads /metrics with

CHAT = [{"role": "user", "content": "Count: one two three one two three one two"}]


def samples(text: str, name: str) -> dict[str, float]:
    """{label string: value} of the samples of `name` in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


@pytest.fixture(scope="module")
def server(serve, make_tiny_engine):
    engine = make_tiny_engine(drafters=("ngram", "draft_model"), draft_budget="fixed",
                              drafter_options={"draft_model": {"draft_layers": 1}})
    with serve(engine, served_model_name="tiny") as live:
        yield live


def test_vllm_counters_agree_with_ours_and_with_the_responses(server):
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
    per_request = []
    for drafter in ("ngram", "draft_model", "none"):
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                           extra_body={"speculative": {"drafter": drafter}, "ignore_eos": True})
        per_request.append(r.model_extra["metrics"]["speculative_decoding"])
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"speculative": {"drafter": "ngram"}, "ignore_eos": True})
    last = [c for c in stream][-1]
    per_request.append(last.model_extra["metrics"]["speculative_decoding"])
    completion = client.completions.create(model="tiny", prompt="one two three one two three one", max_tokens=16,
                                           temperature=0, extra_body={"speculative": {"drafter": "ngram"}})
    per_request.append(completion.model_extra["metrics"]["speculative_decoding"])

    plain = per_request[2]
    assert plain == {"num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0,
                     "draft_acceptance_rate": 0.0, "mean_acceptance_length": 1.0, "acceptance_histogram": []}
    for m in per_request:
        assert sum(m["acceptance_histogram"]) == m["num_spec_steps"]
        assert sum(k * n for k, n in enumerate(m["acceptance_histogram"])) == m["num_accepted_draft_tokens"]
        if m["num_spec_steps"]:
            steps, drafted, accepted = m["num_spec_steps"], m["num_draft_tokens"], m["num_accepted_draft_tokens"]
            assert m["mean_acceptance_length"] == pytest.approx(1 + accepted / steps, abs=1e-6)
            assert m["draft_acceptance_rate"] == pytest.approx(accepted / drafted, abs=1e-6)
    assert sum(m["num_accepted_draft_tokens"] for m in per_request) > 0

    text = httpx.get(server.base_url + "/metrics").text
    totals, per_pos = vllm_bench_spec_counters(text)
    drafts = totals["vllm:spec_decode_num_drafts_total"]
    drafted = totals["vllm:spec_decode_num_draft_tokens_total"]
    accepted = totals["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts == sum(m["num_spec_steps"] for m in per_request)
    assert drafted == sum(m["num_draft_tokens"] for m in per_request)
    assert accepted == sum(m["num_accepted_draft_tokens"] for m in per_request)
    # ours, summed over the drafter label, say the same
    assert drafts == sum(samples(text, "specserve_spec_decode_verification_steps_total").values())
    assert accepted == sum(samples(text, "specserve_spec_decode_accepted_tokens_total").values())
    # positions are 0-based: position 0 counts the drafts that accepted at least one token
    assert min(per_pos) == 0 and sum(per_pos.values()) == accepted
    assert per_pos[0] == sum(sum(m["acceptance_histogram"][1:]) for m in per_request)
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1))

    assert samples(text, "vllm:num_requests_running") == {'{engine="0",model_name="tiny"}': 0.0}
    success = samples(text, "vllm:request_success_total")
    assert success['{engine="0",finished_reason="length",model_name="tiny"}'] == 5
    assert samples(text, "vllm:generation_tokens_total")['{engine="0",model_name="tiny"}'] == 4 * 24 + 16
    ttft = samples(text, "vllm:time_to_first_token_seconds_count")
    assert ttft['{engine="0",model_name="tiny"}'] == 5


def test_no_vllm_metrics_leaves_only_ours(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny", vllm_metrics=False) as live:
        text = httpx.get(live.base_url + "/metrics").text
    assert "specserve_num_requests_running" in text and "vllm:" not in text
