"""`specserve bench activations` (bench/activation_quality.py): the served default model with float
and int8 activations against transformers on the dequantized weights, on a small held set."""

from __future__ import annotations

import json

import pytest

from specserve.bench import activation_quality as aq
from specserve.kernels import cpu as native


def test_windows_are_scored_on_their_second_half_as_llama_perplexity_does():
    assert aq.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    import torch

    logits = torch.full((4, 5), -10.0)
    logits[2, 3] = 10.0                      # position 2 predicts token 3: certain
    logits[1, 0] = 10.0                      # first half: not scored
    got = aq.scores(logits, logits, None, [0, 1, 2, 3])
    assert got["n"] == 1 and got["nll"] == pytest.approx(0.0, abs=1e-6) and got["top1_ref"] == 1
    assert got["kl_ref"] == pytest.approx(0.0, abs=1e-9)


def test_a_small_run_measures_both_activations_against_the_reference(default_model, tmp_path):
    if not native.available():
        pytest.skip("no C compiler: int8 activations need the native CPU kernels")
    out = tmp_path / "aq"
    assert aq.main(["--num-texts", "2", "--ctx", "64", "--threads", "2", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["benchmark"] == "activation_quality" and result["num_windows"] >= 1
    v = result["variants"]
    assert set(v) == {aq.REFERENCE, aq.FLOAT, aq.INT8}
    # float activations compute the file's weights exactly: next to the reference; int8 close to both
    assert v[aq.FLOAT]["top1_ref"] >= 0.95 and v[aq.FLOAT]["kl_ref"] < 0.01
    assert v[aq.INT8]["top1_ref"] >= 0.85 and v[aq.INT8]["top1_float"] >= 0.85
    assert v[aq.INT8]["kl_ref"] > v[aq.FLOAT]["kl_ref"]           # int8 rounds the activations: not free
    for name in v:
        assert abs(v[name]["ppl"] / v[aq.REFERENCE]["ppl"] - 1) < 0.1
    text = aq.markdown(result)
    assert "int8 activations" in text and "llama.cpp's row is left out" in text
