"""`specserve bench aiperf` reads AIPerf's JSON export (written here in AIPerf 0.13's shape) into its
table: percentiles, the acceptance pooled from the histogram, the speed-up over plain decoding."""

from __future__ import annotations

import json

from specserve.bench.aiperf import aiperf_command, markdown, read_export, schedule


def export(folder, tok_s: float, hist: dict | None) -> None:
    folder.mkdir(parents=True)
    data = {"time_to_first_token": {"unit": "ms", "avg": 120.0, "p50": 100.0, "p99": 300.0},
            "inter_token_latency": {"unit": "ms", "avg": 8.0, "p50": 7.5, "p99": 20.0},
            "output_token_throughput": {"unit": "tokens/sec", "avg": tok_s},
            "request_throughput": {"unit": "requests/sec", "avg": 1.5},
            "error_summary": [], "was_cancelled": False}
    if hist is not None:
        data["spec_decode_acceptance_length"] = {"unit": "ratio", "avg": 2.5, "p50": 2.0, "p99": 5.0}
        data["spec_decode_draft_acceptance_rate"] = {"unit": "%", "avg": 41.0}
        data["pooled_spec_decode_acceptance_histogram"] = hist
    (folder / "profile_export_aiperf.json").write_text(json.dumps(data))
    (folder / "phases").mkdir()   # AIPerf's per-phase copies are not read
    (folder / "phases" / "profile_export_aiperf.json").write_text(json.dumps({"output_token_throughput": {"avg": 1}}))


def test_export_to_table(tmp_path):
    export(tmp_path / "none-c4", 100.0, None)
    export(tmp_path / "auto-c4", 125.0, {"0": 2, "1": 1, "3": 1})
    plain, auto = read_export(tmp_path / "none-c4"), read_export(tmp_path / "auto-c4")
    assert plain["output_tok_s"]["avg"] == 100.0 and "pooled_acceptance_length" not in plain
    assert auto["ttft_ms"] == {"avg": 120.0, "p50": 100.0, "p99": 300.0, "unit": "ms"}
    assert auto["pooled_acceptance_length"] == 1 + (1 + 3) / 4
    rows = [{"drafter": "none", "concurrency": 4, "requests": 16, **plain},
            {"drafter": "auto", "concurrency": 4, "requests": 16, **auto,
             "metrics_endpoint": {"acceptance_length": 2.0}}]
    text = markdown({"meta": {"aiperf": "0.13.0", "max_tokens": 128}, "runs": rows})
    assert "| auto | 4 | 16 | 125.0 (1.25×) | 1.50 | 100 / 300 | 7.5 / 20.0 | 2.50 / 2.00 | 41% | 2.00 |" in text
    assert "| none | 4 | 16 | 100.0 | 1.50 |" in text


def test_the_command_asks_for_a_stream_of_exactly_the_tokens(tmp_path):
    cmd = aiperf_command("aiperf", "m", "http://h:1", 16, 64, tmp_path / "p.jsonl", tmp_path / "tok", 128, tmp_path)
    assert cmd[:2] == ["aiperf", "profile"] and "--streaming" in cmd
    assert cmd[cmd.index("--concurrency") + 1] == "16" and cmd[cmd.index("--request-count") + 1] == "64"
    extra = json.loads(cmd[cmd.index("--extra-inputs") + 1])
    assert extra == {"max_tokens": 128, "ignore_eos": True, "temperature": 0}


def test_rounds_alternate_the_order_and_pair_within_a_round(tmp_path):
    assert schedule([1, 4], ["none", "auto"], 2) == [(1, 0, "none"), (1, 0, "auto"), (1, 1, "auto"), (1, 1, "none"),
                                                      (4, 0, "none"), (4, 0, "auto"), (4, 1, "auto"), (4, 1, "none")]
    assert schedule([16], ["none", "auto"], 1) == [(16, 0, "none"), (16, 0, "auto")]
    rows = []
    for r, (plain, auto) in enumerate([(100.0, 90.0), (50.0, 55.0), (80.0, 84.0)]):   # a slow second round
        for name, tok in (("none", plain), ("auto", auto)):
            export(tmp_path / f"{name}-c4-r{r}", tok, None)
            rows.append({"drafter": name, "concurrency": 4, "requests": 16, "round": r,
                         **read_export(tmp_path / f"{name}-c4-r{r}")})
    text = markdown({"meta": {"aiperf": "0.13.0", "max_tokens": 128}, "runs": rows})
    assert "| auto | 4 | 1 | 16 | 55.0 (1.10×) |" in text        # against plain of its own round, not the first
    assert "| auto | 4 | 1.05× (0.90–1.10) |" in text            # the median of 0.90, 1.10 and 1.05
    assert "| drafter | concurrency | round | requests |" in text
