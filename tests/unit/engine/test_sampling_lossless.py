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
"""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve.engine import verify
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampler import SamplingTensors, processed_probs
from specserve.engine.sampling_params import SamplingParams

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]   # repeats: n-gram matches happen
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 3000
TV_BOUND = 0.045   # E[TV] of 3000 draws over 9 outcomes is about 0.02


@pytest.fixture(scope="module")
def peaky_target(tiny_model_factory, tmp_path_factory):
    return tiny_model_factory(tmp_path_factory.mktemp("peaky_target"), initializer_range=0.15, seed=3)


@pytest.fixture(scope="module")
def exact_law(peaky_target) -> dict[tuple[int, int], float]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(peaky_target, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([PARAMS], "cpu")
    law = {}
    with torch.no_grad():
        p1 = processed_probs(hf(torch.tensor([PROMPT])).logits[0, -1:], st)[0]
        for t in p1.nonzero().flatten().tolist():
            p2 = processed_probs(hf(torch.tensor([PROMPT + [t]])).logits[0, -1:], st)[0]
            for u in p2.nonzero().flatten().tolist():
                law[(t, u)] = float(p1[t] * p2[u])
    return law


def empirical_law(target_dir, drafter: str, options: dict) -> tuple[dict[tuple[int, int], float], LLMEngine]:
    torch.manual_seed(0)
    engine = LLMEngine(EngineConfig(
        model=str(target_dir), dtype="float32", device="cpu", max_num_seqs=64, block_size=4,
        max_num_batched_tokens=1024, num_kv_blocks=2400, max_model_len=64, drafters=(drafter,),
        drafter_options={drafter: options}, num_speculative_tokens=8, max_draft_tokens_per_step=512))
    counts: dict[tuple[int, int], int] = {}
    for start in range(0, TRIALS, 500):
        for i in range(start, start + 500):
            engine.add_request(f"s{i}", PROMPT, PARAMS)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for d in out.outputs:
                    got.setdefault(out.request_id, []).extend(d.token_ids)
        for toks in got.values():
            counts[(toks[0], toks[1])] = counts.get((toks[0], toks[1]), 0) + 1
    return {k: v / TRIALS for k, v in counts.items()}, engine


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


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
    monkeypatch.setattr(verify, "residual", lambda p, q: p)   # forget the rejected draft's mass
    emp, _ = empirical_law(peaky_target, drafter, options)
    assert total_variation(emp, exact_law) > TV_BOUND


def test_the_draft_vocabulary_case_drafts_only_some_of_the_support(exact_law):
    """The draft-vocabulary case means something: the target's support has tokens on both sides."""
    support = {t for pair in exact_law for t in pair}
    allowed = set(EVENS_FIRST[:160].tolist())
    assert support & allowed and support - allowed
