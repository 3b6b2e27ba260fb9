"""`specserve bench cpu` (bench/cpu.py): a small real run on the default GGUF (llama.cpp left out
where llama-cpp-python is not installed) and its table with llama.cpp rows."""

from __future__ import annotations

import json

from specserve.bench import cpu


def test_a_small_run_measures_every_method_and_drafters_keep_plain_tokens(default_model, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECSERVE_LLAMA_PYTHON", raising=False)
    out = tmp_path / "cpu.json"
    assert cpu.main(["--num-prompts", "1", "--max-tokens", "6", "--datasets", "gsm8k",
                     "--drafters", "ngram", "--streams", "2", "--stream-rounds", "2", "--no-hf",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "cpu_compare" and result["command"].startswith("specserve bench cpu")
    assert set(result["batch1_tok_s"]) >= {cpu.PLAIN, "specserve ngram"}
    assert all(v > 0 for per in result["batch1_tok_s"].values() for v in per.values())
    assert result["same_as_plain"]["specserve ngram"] == "1/1"          # lossless at batch 1
    assert result["streams_same_as_plain"]["specserve ngram"] == "4/4"  # and with two streams, in both rounds
    ratio = result["streams_ratio"]["specserve ngram"]                  # per-round ratios to that round's plain
    assert result["stream_rounds"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert result["memory_mib"]["weights"] > 0 and result["memory_mib"]["kv_cache"] > 0
    text = cpu.markdown(result)
    assert "| specserve ngram |" in text and "2 concurrent requests" in text and "2 round(s)" in text
    assert f"{ratio['median']:.2f}× ({ratio['min']:.2f}–{ratio['max']:.2f})" in text


def test_the_table_compares_with_llama_cpp_plain():
    result = {"model": "m", "gguf": "m.gguf", "num_prompts": 4, "max_tokens": 128, "threads": 2,
              "datasets": ["mt_bench", "gsm8k"], "quantization": "gguf", "kv_cache_dtype": "float64",
              "memory_mib": {"weights": 500}, "llama_cpp": "0.3.16", "streams": 0, "streams_tok_s": {},
              "batch1_tok_s": {cpu.PLAIN: {"mt_bench": 50.0, "gsm8k": 70.0},
                               cpu.LLAMA: {"mt_bench": 100.0, "gsm8k": 100.0},
                               cpu.LLAMA_LOOKUP: {"mt_bench": 110.0, "gsm8k": 130.0}},
              "same_as_plain": {cpu.LLAMA: "1/8", cpu.LLAMA_LOOKUP: "1/8"}}
    text = cpu.markdown(result)
    assert "| specserve plain | 50.0 | 70.0 | 60.0 | 0.60× | – |" in text
    assert "| llama.cpp prompt lookup | 110.0 | 130.0 | 120.0 | 1.20× | 1/8 |" in text
    assert "llama-cpp-python 0.3.16" in text and "gguf weights, KV cache float64" in text
