"""Penalties, logit_bias, min_tokens and min_p (engine/logits_processing.py, the sampler's min_p):

* plain decoding follows the OpenAI/vLLM formulas, checked against an independent computation on
  transformers' logits;
* under speculation every drafter (chains, trees, MCSD trees, cascades, heads) gives plain
  decoding's greedy tokens with the same processing, because each tree node is processed with the
  tokens of its own path; processing every node with the committed prefix instead (the control)
  changes the output;
* logit_bias bans and forces tokens, min_tokens holds the stop tokens back along tree paths too;
* the sampling law with penalties and a tree drafter is the processed target's (first three tokens,
  total variation), and the committed-prefix control fails that bound.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_DRAFTERS, empirical_first_two_law, make_llm_engine, run_requests, total_variation

from specserve.engine import logits_processing
from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampler import SamplingTensors, processed_probs
from specserve.engine.sampling_params import SamplingParams

REPEATS = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]   # n-gram matches happen
# penalties under which processing a node with the committed prefix instead of its path changes the
# greedy output with the draft_model's trees (the control below)
PENALISED = dict(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.3, frequency_penalty=0.3,
                 repetition_penalty=1.5)
DRAFTERS = TINY_DRAFTERS


def reference_processing(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The formulas, written out for one row: logit_bias, then repetition (prompt and output), then
    frequency and presence (output)."""
    out = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def hf_greedy(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference_processing(logits, prompt, out, params).argmax()))
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [REPEATS] + [torch.randint(3, 320, (n,), generator=g).tolist() * 2 for n in (5, 9)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_llm_engine(tiny_llama_dir, list(DRAFTERS), DRAFTERS, max_model_len=200, num_kv_blocks=400)


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return run_requests(engine, prompts, SamplingParams(**PENALISED), prefix="plain-")


def test_plain_decoding_follows_the_formulas(tiny_llama_dir, engine, prompts, plain):
    unprocessed = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                               prefix="plain-")
    assert plain != unprocessed      # the processing changes the greedy output here
    params = SamplingParams(**PENALISED, logit_bias={5: 1.0, 17: -2.0})
    got = run_requests(engine, prompts, params)
    assert [got[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(tiny_llama_dir, p, params) for p in prompts]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_every_drafter_gives_plain_decodings_processed_tokens(engine, prompts, plain, drafter):
    got = run_requests(engine, prompts, SamplingParams(**PENALISED), drafter=drafter, prefix="plain-")
    assert got == plain
    stats = engine.get_stats().drafters[drafter]
    # mag without a corpus drafts only from earlier matches of the output's suffix, which penalised
    # outputs avoid; every other drafter drafts here
    assert (stats.num_draft_tokens > 0 or drafter == "mag") and stats.num_fallbacks == 0


def test_processing_nodes_with_the_committed_prefix_is_caught(engine, prompts, plain, monkeypatch):
    engine.drafter_stats["draft_model"].num_accepted_tokens = 0
    monkeypatch.setattr(logits_processing, "path_counts",
                        lambda packed, vocab, trees: torch.zeros(len(trees), packed.tokens.shape[1], vocab))
    got = run_requests(engine, prompts, SamplingParams(**PENALISED), drafter="draft_model", prefix="plain-")
    assert engine.drafter_stats["draft_model"].num_accepted_tokens > 0
    assert got != plain


def test_logit_bias_bans_and_forces_tokens(engine, prompts):
    base = run_requests(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))["r0"]
    banned = run_requests(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                              logit_bias={t: -100 for t in set(base)}),
                          drafter="ngram")["r0"]
    assert not set(banned) & set(base)
    forced = run_requests(engine, prompts[:1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                              logit_bias={123: 100}), drafter="draft_model")["r0"]
    assert forced == [123] * 12


@pytest.mark.parametrize("drafter", [None, "ngram", "draft_model"])
def test_min_tokens_holds_the_stop_tokens_back_along_tree_paths(engine, prompts, drafter):
    # EOS (id 2) is all but forced; min_tokens holds it back for exactly 7 tokens, tree nodes included
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=7, logit_bias={2: 30.0})
    out = run_requests(engine, prompts, params, drafter=drafter)
    assert all(len(toks) == 8 and toks[-1] == 2 and 2 not in toks[:-1] for toks in out.values()), out


def test_min_p_keeps_the_tokens_near_the_top():
    logits = torch.tensor([[2.0, 1.5, 0.0, -3.0]])
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, min_p=0.5)], "cpu")
    probs = processed_probs(logits, st)[0]
    full = logits[0].softmax(-1)
    kept = full >= 0.5 * full.max()           # tokens 0 and 1
    assert torch.equal(probs > 0, kept)
    assert torch.allclose(probs[kept], full[kept] / full[kept].sum())


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(logit_bias={1: 101}), dict(logit_bias={-1: 1})])
def test_out_of_range_settings_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("x", [1, 2, 3], SamplingParams(logit_bias={320: 1.0}))


# ---- the sampling law -------------------------------------------------------------------------------

# the target often repeats its second token here, which the penalties forbid: the law of the third
# token, drawn at a tree node whose path holds the second, shows whether that node saw its path
LAW_PROMPT = [43, 9, 27, 4, 297, 31, 285]
LAW_PARAMS = SamplingParams(temperature=1.0, top_k=2, max_tokens=5, ignore_eos=True, frequency_penalty=2.0,
                            presence_penalty=1.0)
TRIALS = 3000
TV_BOUND = 0.045   # E[TV] of 3000 draws over 8 outcomes is about 0.02
TREE = ("draft_model", {"k_config": "3,2,1", "draft_layers": 1})


@pytest.fixture(scope="module")
def processed_law(peaky_target) -> dict[tuple[int, ...], float]:
    """The exact joint law of the first three tokens under LAW_PARAMS, from transformers' logits
    processed by the reference formulas. (The first token is drawn by the prompt's last row and the
    second at a tree's root, whose path is empty: the third is the first one a path can change.)"""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(peaky_target, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([LAW_PARAMS], "cpu")

    def probs(output: list[int]) -> torch.Tensor:
        logits = hf(torch.tensor([LAW_PROMPT + output])).logits[0, -1]
        return processed_probs(reference_processing(logits, LAW_PROMPT, output, LAW_PARAMS).float()[None], st)[0]

    def law(output: list[int], p: float) -> dict:
        if len(output) == 3:
            return {tuple(output): p}
        q = probs(output)
        return {k: v for t in q.nonzero().flatten().tolist() for k, v in law(output + [t], p * float(q[t])).items()}

    with torch.no_grad():
        return law([], 1.0)


def empirical_law(target_dir):
    return empirical_first_two_law(target_dir, *TREE, LAW_PROMPT, LAW_PARAMS, TRIALS, length=3)


def test_sampling_with_penalties_and_a_tree_follows_the_processed_law(peaky_target, processed_law):
    emp, engine = empirical_law(peaky_target)
    stats = engine.get_stats().drafters["draft_model"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, processed_law) < TV_BOUND


def test_sampling_law_control_committed_prefix_only_is_caught(peaky_target, processed_law, monkeypatch):
    monkeypatch.setattr(logits_processing, "path_counts",
                        lambda packed, vocab, trees: torch.zeros(len(trees), packed.tokens.shape[1], vocab))
    emp, _ = empirical_law(peaky_target)
    assert total_variation(emp, processed_law) > TV_BOUND
