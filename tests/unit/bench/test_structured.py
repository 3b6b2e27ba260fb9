"""`specserve bench structured` (bench/structured.py): a small real run on the default model, every
constrained row giving the same tokens, the grammar's forced tokens drafted, and its table."""

from __future__ import annotations

import json

import pytest

from specserve.bench import structured

pytest.importorskip("llguidance")


def test_a_small_run_measures_every_row_and_keeps_the_constrained_tokens(default_model, tmp_path):
    out = tmp_path / "structured.json"
    assert structured.main(["--num-prompts", "1", "--max-tokens", "12", "--streams", "2", "--drafters", "ngram",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "structured" and result["command"].startswith("specserve bench structured")
    for label in ("batch 1", "2 streams"):
        table = result["tables"][label]
        assert set(table) == {structured.UNCONSTRAINED, structured.NO_DRAFTER, structured.GRAMMAR, "grammar + ngram",
                              "grammar + ngram, ngram not after forced tokens"}   # its baseline
        assert all(r["tok_s"] > 0 for r in table.values())
        n = 1 if label == "batch 1" else 2
        assert all(table[k]["same_as_constrained"] == f"{n}/{n}" for k in table if k != structured.UNCONSTRAINED)
        assert table[structured.GRAMMAR]["grammar_share"] > 0 and table[structured.NO_DRAFTER]["grammar_share"] == 0
    cost = result["grammar_cost"]
    assert cost["compile_ms"] > 0 and cost["masks"] > 0 and cost["mask_us_p50"] > 0
    assert "| grammar drafter |" in structured.markdown(result)
