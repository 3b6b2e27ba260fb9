"""Sampling losslessness through the whole engine: with any drafter, the joint law of the first two
generated tokens equals the target's own law, computed exactly with transformers.

A tiny random Llama with large initial weights has peaked, clearly non-uniform next-token
distributions; top_k=3 keeps the joint support at 9 outcomes so a few thousand requests pin the
law down. The draft model is the target's first layer (with its norm and head): its
distributions overlap the target's but differ clearly, so drafts are rejected often and the
residual rule carries the result (max_tokens=5 leaves a budget of 3 draft nodes at the first
verification: three candidates for the second token in the MCSD tree). Each case is run again
with a deliberately wrong residual update: the same bound must then fail, which shows the test
has the power to see the bug. The n-gram case is checked for losslessness only: its one-hot
drafts hit too rarely on a random model for the wrong rule to show in the joint law.

Seeded requests (every request its own seed) take the keyed path instead — plain sampling and
verification with draws keyed by output position, top-k drafts from the draft model — and must
follow the same law; their control is a keyed noise that forgets the key (every seed drawing
alike), which the same bound must catch. (Draws shared between positions are caught by the
sampler's own law test: here the supports of the two positions barely overlap, so sharing them
hardly shows in the joint law.)

A target served with int4 weights is held to its own law (computed from the engine's quantized
forward), with the wrong residual update as its control.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (LAW_ENGINE, empirical_first_two_law, engine_first_two_law, exact_first_two_law, make_llm_engine,
                     total_variation)

from specserve.engine import sampler, verify
from specserve.engine.sampling_params import SamplingParams

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]   # repeats: n-gram matches happen
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 3000
TV_BOUND = 0.045   # E[TV] of 3000 draws over 9 outcomes is about 0.02
# the broken controls move the law far more: TV 0.15-0.29 (wrong residual) and 0.92 (keys forgotten)
# at 1000 draws (measured 2026-11-29), where a correct law's E[TV] is about 0.035; 1000 draws suffice
CONTROL_TRIALS = 1000


@pytest.fixture(scope="module")
def exact_law(peaky_target) -> dict[tuple[int, int], float]:
    return exact_first_two_law(peaky_target, PROMPT, PARAMS)


def empirical_law(target_dir, drafter: str, options: dict, seeded: bool = False, trials: int = TRIALS, **config):
    return empirical_first_two_law(target_dir, drafter, options, PROMPT, PARAMS, trials, seeded=seeded, **config)


EVENS_FIRST = torch.cat([torch.arange(0, 320, 2), torch.arange(1, 320, 2)])   # a ranking: even ids first

CASES = {
    "draft_model chain (SpS)": ("draft_model", {"k_config": "chain:3", "draft_layers": 1}),
    "draft_model MCSD tree, drawn without replacement": ("draft_model", {"k_config": "3,2,1", "draft_layers": 1}),
    "draft_model top-k tree, deterministic": ("draft_model", {"k_config": "3,2,1", "draft_layers": 1,
                                                              "deterministic": True}),
    "ngram deterministic tree": ("ngram", {"max_ngram": 2, "max_matches": 3}),
    "student MCSD tree (its own layers, the target's embedding and head)": (
        "student", {"random_init": True, "num_layers": 1, "k_config": "3,2,1"}),
    "draft_model MCSD tree over a draft vocabulary (q = 0 outside it)": (
        "draft_model", {"k_config": "3,2,1", "draft_layers": 1, "vocab_rank": EVENS_FIRST, "draft_vocab": 160}),
}
POWERFUL = [c for c in CASES if not c.startswith("ngram")]


@pytest.mark.parametrize("case", list(CASES))
def test_first_tokens_follow_the_target_law(case, peaky_target, exact_law):
    drafter, options = CASES[case]
    emp, engine = empirical_law(peaky_target, drafter, options)
    stats = engine.get_stats().drafters[drafter]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_law) < TV_BOUND


@pytest.mark.parametrize("case", POWERFUL)
def test_a_wrong_residual_update_is_caught(case, peaky_target, exact_law, monkeypatch):
    drafter, options = CASES[case]
    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)   # forget the rejected draft's mass
    emp, _ = empirical_law(peaky_target, drafter, options, trials=CONTROL_TRIALS)
    assert total_variation(emp, exact_law) > TV_BOUND


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_first_tokens_follow_the_target_law(case, peaky_target, exact_law):
    drafter, options = CASES[case]
    emp, engine = empirical_law(peaky_target, drafter, options, seeded=True)
    stats = engine.get_stats().drafters[drafter]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_law) < TV_BOUND


@pytest.mark.parametrize("case", ["draft_model MCSD tree, drawn without replacement", "ngram deterministic tree"])
def test_keyed_draws_that_forget_the_key_are_caught(case, peaky_target, exact_law, monkeypatch):
    drafter, options = CASES[case]
    real = sampler.keyed_exponentials

    def forgets_the_key(keys, positions, vocab):
        return real(keys * 0, positions, vocab)

    for module in (sampler, verify):
        monkeypatch.setattr(module, "keyed_exponentials", forgets_the_key)
    emp, _ = empirical_law(peaky_target, drafter, options, seeded=True, trials=CONTROL_TRIALS)
    assert total_variation(emp, exact_law) > TV_BOUND


def test_the_draft_vocabulary_case_drafts_only_some_of_the_support(exact_law):
    """The draft-vocabulary case means something: the target's support has tokens on both sides."""
    support = {t for pair in exact_law for t in pair}
    allowed = set(EVENS_FIRST[:160].tolist())
    assert support & allowed and support - allowed


@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "wrong residual caught"])
def test_a_quantized_target_keeps_its_own_law(peaky_target, broken, monkeypatch):
    drafter, options = CASES["draft_model MCSD tree, drawn without replacement"]   # shares the int4 layers
    law = engine_first_two_law(make_llm_engine(peaky_target, quantization="int4", **LAW_ENGINE), PROMPT, PARAMS)
    if broken:
        monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, engine = empirical_law(peaky_target, drafter, options, quantization="int4",
                                trials=CONTROL_TRIALS if broken else TRIALS)
    assert engine.quantization == "int4"
    if broken:
        assert total_variation(emp, law) > TV_BOUND
    else:
        stats = engine.get_stats().drafters[drafter]
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert total_variation(emp, law) < TV_BOUND
