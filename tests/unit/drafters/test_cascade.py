"""Cascade Speculative Drafting (`cascade`): draft models reviewing the drafts of smaller levels
down to Max-Gram. Greedy output equals plain decoding for two and three levels; a drafted chain
equals an independent re-computation of the recursion (Max-Gram rounds reviewed by a fresh
forward of the draft model, then Max-Gram's tail) and the K thresholds split the positions
among the levels as documented; per-part counts add up to the drafter's totals; options are
validated; sampled output follows the target's law (with leniency > 1 inside), and the law test
sees a wrong residual update."""

from __future__ import annotations

import pytest
import torch
from helpers import empirical_first_two_law, exact_first_two_law, make_llm_engine, run_requests, total_variation

from specserve.drafters.base import DrafterContext, DrafterOptionError, make_drafter
from specserve.drafters.cascade import parse_k
from specserve.drafters.mag import max_gram
from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import DraftRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
MAG = {"bigram": False, "max_tokens": 4}
TWO = {"levels": "draft_model,mag", "k": "3,5", "level_options": [{"draft_layers": 1}, MAG]}
THREE = {"levels": "draft_model,draft_model,mag", "k": "3,5,7;2",
         "level_options": [{"draft_layers": 2}, {"draft_layers": 1}, MAG], "leniency": "1,2"}


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts.append([7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100])   # Max-Gram matches
    return prompts, run_requests(make_llm_engine(tiny_llama_dir), prompts, GREEDY)


@pytest.mark.parametrize("options", [TWO, THREE], ids=["two levels", "three levels"])
def test_greedy_is_lossless_and_parts_add_up(tiny_llama_dir, prompts_and_plain, options):
    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ["cascade"], {"cascade": options})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["cascade"]
    assert stats.num_fallbacks == 0 and stats.num_accepted_tokens > 0
    drafter = engine.drafters["cascade"]
    assert set(stats.parts) == set(drafter.part_names)
    assert sum(p.num_draft_tokens for p in stats.parts.values()) == stats.num_draft_tokens
    assert sum(p.num_accepted_tokens for p in stats.parts.values()) == stats.num_accepted_tokens
    top = stats.parts[drafter.part_names[0]]
    assert top.num_draft_tokens > 0
    if options is THREE:   # the top level is the whole target: every token of its segment is accepted
        assert drafter.part_names == ("draft_model@0", "draft_model@1", "mag")
        assert top.num_accepted_tokens == top.num_draft_tokens
    for level in drafter.levels[:-1]:   # the draft caches are freed with the sequences
        assert level.blocks.num_free_blocks == level.blocks.num_blocks


# ---- the recursion against an independent re-computation --------------------------------------------

def _greedy_logits(model, tokens: list[int]) -> torch.Tensor:
    """The draft model's logits after every token of `tokens`, from a fresh cache: [len, vocab]."""
    n = len(tokens)
    blocks = BlockManager(-(-n // 4), 4)
    blocks.grow(0, n)
    cache = KVCache(model.num_layers, blocks.num_blocks, 4, model.cfg.num_kv_heads, model.cfg.head_dim,
                    torch.float32, torch.device("cpu"))
    positions, meta = build_attn_metadata([blocks.block_tables[0]], 4, [0], [n], None, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), positions, cache, meta))


def _review(model, prefix: list[int], proposal: list[int]) -> list[int]:
    """Greedy review (leniency 1) by a full forward: the accepted proposal tokens + the argmax after them."""
    arg = _greedy_logits(model, prefix + proposal)[len(prefix) - 1:].argmax(-1).tolist()
    a = next((i for i, t in enumerate(proposal) if arg[i] != t), len(proposal))
    return proposal[:a] + [arg[a]]


def _reference_two_levels(model, prefix: list[int], k1: int, k2: int, mag_tokens: int, budget: int):
    """Row 0 of a (draft model, mag) cascade: rounds of `mag_tokens` Max-Gram tokens reviewed by the
    model while the draft is shorter than k1, then Max-Gram's tail up to k2 -> (tokens, sources,
    review rounds)."""
    gen, src, rounds = [], [], 0
    while len(gen) < min(k1, budget):
        rounds += 1
        ctx = prefix + gen
        got = _review(model, ctx, max_gram(torch.tensor(ctx).numpy(), mag_tokens, max_match=64))[:budget - len(gen)]
        gen, src = gen + got, src + [0] * len(got)
    while len(gen) < min(k2, budget):     # Max-Gram's calls of at most mag_tokens each
        want = min(k2, budget, len(gen) + mag_tokens) - len(gen)
        tail = max_gram(torch.tensor(prefix + gen).numpy(), want, max_match=64)
        if not tail:
            break
        gen, src = gen + tail, src + [1] * len(tail)
    return gen, src, rounds


@pytest.fixture(scope="module")
def every_token_prompt():
    """Every token of the vocabulary once, then the first again: Max-Gram always finds a match."""
    perm = torch.randperm(320, generator=torch.Generator().manual_seed(5)).tolist()
    return perm + [perm[0]]


@pytest.mark.parametrize("k,budget", [("2,5", 10), ("4,9", 10), ("1,1", 10), ("0,6", 10), ("3,8", 4)])
def test_chain_equals_the_recursion_and_the_thresholds_split_it(tiny_llama_dir, every_token_prompt, k, budget):
    """Level 0's segment is whole review rounds, the first starting at position 0, running until the
    draft reaches k1 (possibly past it); Max-Gram fills exactly up to k2; the budget cuts both."""
    engine = make_llm_engine(tiny_llama_dir, ["cascade"], {"cascade": {**TWO, "k": k}}, max_model_len=400,
                             num_kv_blocks=120)
    drafter = engine.drafters["cascade"]
    model = drafter.levels[0].model
    k1, k2 = parse_k(k, 2)[0]
    prompt = list(every_token_prompt)
    for step in range(4):
        seq = DraftRequest(500 + step, tuple(prompt), len(every_token_prompt), GREEDY)
        drafter.start(seq)
        before = dict(drafter.calls)
        tree = drafter.propose([seq], [budget])[0]
        drafter.finish(seq)
        tokens, sources, rounds = _reference_two_levels(model, prompt, k1, k2, MAG["max_tokens"], budget)
        assert drafter.calls["draft_model"] - before["draft_model"] == rounds   # one review forward a round
        assert tree.tokens == [prompt[-1], *tokens] and tree.parents == [-1, *range(len(tokens))]
        assert tree.sources[1:] == sources and tree.source_names == ("draft_model", "mag")
        n0 = sources.count(0)
        assert (n0 == 0) == (min(k1, budget) == 0) and (n0 >= min(k1, budget))
        assert len(tokens) == min(max(n0, k2), budget)                   # mag fills up to k2 exactly
        prompt += tokens[:2] + [int(_greedy_logits(model, prompt)[-1].argmax())]   # move on somewhere else


def test_three_levels_split_in_order(tiny_llama_dir, every_token_prompt):
    """Three levels, k = 3,5,7: segments in level order, each reaching its threshold, mag's tail exact."""
    engine = make_llm_engine(tiny_llama_dir, ["cascade"], {"cascade": THREE}, max_model_len=400, num_kv_blocks=120)
    drafter = engine.drafters["cascade"]
    counts = [0, 0, 0]
    prompt = list(every_token_prompt)
    for step in range(4):
        seq = DraftRequest(600 + step, tuple(prompt), len(every_token_prompt), GREEDY)
        drafter.start(seq)
        tree = drafter.propose([seq], [12])[0]
        drafter.finish(seq)
        src = tree.sources[1:]
        assert src == sorted(src)
        ends = [src.count(0), src.count(0) + src.count(1), len(src)]
        assert ends[0] >= 3 and (src.count(1) == 0 or ends[0] < 5) and ends[1] >= 5
        assert ends[2] == max(ends[1], 7)
        for j in range(3):
            counts[j] += src.count(j)
        prompt += tree.tokens[1:4]
    assert all(c > 0 for c in counts[:2])


# ---- options ----------------------------------------------------------------------------------------

def test_parse_k():
    assert parse_k("7,10;1", 3) == ((7, 10, 10), (1, 1))
    assert parse_k("4,6", 2) == ((4, 6),)
    assert parse_k(9, 2) == ((9, 9),)
    assert parse_k(None, 3) == ((4, 6, 8), (1, 1))
    for bad in ("5,3", "1,2,3,4", "1;1;1", "a,b", "0", 4.5, True):
        with pytest.raises(ValueError, match="cascade k"):
            parse_k(bad, 3)


def test_bad_options_fail_clearly(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir)
    ctx = DrafterContext(tokenizer=engine.tokenizer, target=engine.model, model_config=engine.model_config,
                         max_model_len=64, max_num_seqs=2)
    with pytest.raises(DrafterOptionError, match="did you mean 'levels'"):
        make_drafter("cascade", ctx, level="draft_model,mag")
    with pytest.raises(ValueError, match="ending in 'mag'"):
        make_drafter("cascade", ctx, levels="draft_model,ngram")
    with pytest.raises(ValueError, match="ending in 'mag'"):
        make_drafter("cascade", ctx, levels="mag")
    with pytest.raises(ValueError, match="only as the last level"):
        make_drafter("cascade", ctx, levels="mag,mag")
    with pytest.raises(ValueError, match="cannot review"):
        make_drafter("cascade", ctx, levels="ngram,mag")
    with pytest.raises(DrafterOptionError, match="cascade level 'draft_model'.*draft_layers"):
        make_drafter("cascade", ctx, levels="draft_model,mag", level_options='[{"draft_layer": 1}, {}]')
    with pytest.raises(ValueError, match="names no level 'student'"):
        make_drafter("cascade", ctx, levels="draft_model,mag", level_options={"student": {}})
    with pytest.raises(ValueError, match="leniency"):
        make_drafter("cascade", ctx, levels="draft_model,mag", leniency=0.5)
    with pytest.raises(ValueError, match="leniency"):
        make_drafter("cascade", ctx, levels="draft_model,mag", leniency="1,2")
    ok = make_drafter("cascade", ctx, levels="draft_model,mag", level_options={"mag": {"bigram": False}})
    assert ok.part_names == ("draft_model", "mag") and ok.leniency == (1.0,)


# ---- sampling -------------------------------------------------------------------------------------

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06    # E[TV] of 1500 draws over 9 outcomes is about 0.03; a forgotten residual gives far more
# the target's first layer reviews Max-Gram with leniency 3: inner reviews accept non-argmax tokens
LAW_OPTIONS = {"levels": "draft_model,mag", "k": "2,3", "leniency": 3,
               "level_options": [{"draft_layers": 1}, {"bigram": False, "max_tokens": 3}]}


def test_sampled_tokens_follow_the_target_law(peaky_target):
    """Deterministic cascade chains (one-hot q) under sampling, leniency 3 inside: the joint law of
    the first two tokens equals the target's, and drafts are both accepted and rejected."""
    emp, engine = empirical_first_two_law(peaky_target, "cascade", LAW_OPTIONS, PROMPT, SAMPLING, TRIALS)
    stats = engine.get_stats().drafters["cascade"]
    assert stats.num_fallbacks == 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) < TV_BOUND


def test_the_law_test_sees_a_wrong_residual(peaky_target, monkeypatch):
    """Control: with the rejected draft's mass left in p the same bound fails."""
    from specserve.engine import verify

    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, _ = empirical_first_two_law(peaky_target, "cascade", LAW_OPTIONS, PROMPT, SAMPLING, TRIALS)
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) > TV_BOUND


def test_model_runs_per_level_are_its_calls_at_batch_one(tiny_llama_dir):
    """Standardized walltime: decoding one request at a time, each level's runs are its calls (one
    review forward or one Max-Gram call each, serving one sequence); the reviewing level costs
    its draft model's parameter share, Max-Gram nothing. Two sequences drafted together count
    twice per call that serves both."""
    engine = make_llm_engine(tiny_llama_dir, ["cascade"], {"cascade": TWO})
    drafter = engine.drafters["cascade"]
    assert drafter.model_runs() == {"draft_model": (0, drafter.levels[0].cost), "mag": (0, 0.0)}
    assert 0 < drafter.levels[0].cost < 1
    run_requests(engine, [[5, 9, 13, 200, 7, 31]], GREEDY)
    runs = drafter.model_runs()
    assert runs["draft_model"][0] == drafter.calls["draft_model"] > 0
    assert runs["mag"][0] == drafter.calls["mag"] > 0
    before, calls = {k: v[0] for k, v in drafter.model_runs().items()}, dict(drafter.calls)
    seqs = [DraftRequest(700 + i, tuple(p), len(p), GREEDY) for i, p in enumerate([[5, 9, 13, 200], [7, 31, 44]])]
    for s in seqs:
        drafter.start(s)
    drafter.propose(seqs, [1, 1])        # budget 1: one review round of both, Max-Gram's draft for it
    assert drafter.calls["draft_model"] - calls["draft_model"] == 1
    assert drafter.model_runs()["draft_model"][0] - before["draft_model"] == 2
