"""`specserve bench cpu` (bench/cpu.py): a small real run over HTTP against a server it starts on
the default GGUF (llama-server left out where none is given) beside the engine alone, the in-process
concurrent table, and
the table with llama-server rows; the prompt kinds it sends."""

from __future__ import annotations

import json

import pytest

from specserve.bench import cpu
from specserve.bench.datasets import GROUNDED_KINDS, KINDS, prompt_kinds


def test_a_small_run_over_http_measures_every_method_and_drafters_keep_plain_answers(default_model, tmp_path,
                                                                                   monkeypatch):
    for var in ("SPECSERVE_LLAMA_PYTHON", "SPECSERVE_LLAMA_SERVER", "SPECSERVE_LLAMA_BENCH"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "cpu.json"
    assert cpu.main(["--per-kind", "1", "--max-tokens", "6", "--kinds", "math", "extraction",
                     "--drafters", "ngram", "--streams", "2", "--stream-rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "cpu_compare" and result["command"].startswith("specserve bench cpu")
    assert result["kinds"] == ["math", "extraction"] and result["grounded_kinds"] == ["extraction"]
    assert set(result["batch1_tok_s"]) == {cpu.PLAIN, cpu.ALONE, "specserve ngram"}
    assert all(v > 0 for per in result["batch1_tok_s"].values() for v in per.values())
    assert result["same_as_plain"]["specserve ngram"] == "2/2"          # lossless over HTTP
    assert result["same_as_plain"][cpu.ALONE] == "2/2"                  # the server answers as its engine
    assert result["server_exit_status"] == {"specserve": 0}             # stopped cleanly with SIGTERM
    assert result["streams_same_as_plain"]["specserve ngram"] == "4/4"  # and with two streams, in both rounds
    ratio = result["streams_ratio"]["specserve ngram"]                  # per-round ratios to that round's plain
    assert result["stream_rounds"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    text = out.with_suffix(".md").read_text()
    assert "| specserve ngram |" in text and "2 concurrent requests" in text and "llama-server`)" in text


def test_the_table_compares_with_llama_server_and_our_plain():
    result = {"model": "m", "gguf": "m.gguf", "per_kind": 3, "rounds": 1, "max_tokens": 128, "threads": 2,
              "kinds": ["qa", "extraction"], "grounded_kinds": ["extraction"], "server_command": "serve --model m",
              "llama_server": "version: 0.5.0", "llama_spec": ["ngram-simple"], "streams": 0, "streams_tok_s": {},
              "llama_bench_batch_cost": {"2": 1.4, "9": 4.75}, "llama_bench_depth": 256,
              "batch1_tok_s": {cpu.LLAMA: {"qa": 100.0, "extraction": 100.0},
                               cpu.PLAIN: {"qa": 50.0, "extraction": 70.0},
                               "specserve auto": {"qa": 60.0, "extraction": 140.0}},
              "same_as_plain": {cpu.LLAMA: "1/6", "specserve auto": "6/6"}}
    text = cpu.markdown(result)
    assert "| specserve plain | 50.0 | 70.0 | 60.0 | 0.60× | 1.00× | 70.0 (1.00×) | – |" in text
    assert "| specserve auto | 60.0 | 140.0 | 100.0 | 1.00× | 1.67× | 140.0 (2.00×) | 6/6 |" in text
    assert "| llama-server | 100.0 | 100.0 | 100.0 | 1.00× | 1.67× | 100.0 (1.43×) | 1/6 |" in text
    assert "--spec-type` ngram-simple" in text and "| cost | 1.40× | 4.75× |" in text


def test_the_prompt_kinds_are_fixed_and_the_grounded_ones_carry_their_input():
    kinds = prompt_kinds(3)
    assert list(kinds) == list(KINDS) and all(len(v) == 3 and len(set(v)) == 3 for v in kinds.values())
    assert kinds == prompt_kinds(3)
    assert all(p.startswith("Summarize the following text") and "Answer:" in p for p in kinds["summarization"])
    assert all("Context:\n```python" in p and "def " in p for p in kinds["rag"])
    assert all(len(p) > 300 for k in GROUNDED_KINDS for p in kinds[k])
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        prompt_kinds(1, ("poetry",))
