"""The CTC drafter through the engine: trees within each sequence's budget from the slots' top-k
(and only once the features right before the root are there), the draft vocabulary, greedy
losslessness with untrained nets (staggered and unstaggered arrivals, a budget of one), sampling
losslessness (joint law of the first two tokens against the exact target law, and a broken
residual rule that must be caught)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (draft_view, empirical_first_two_law, exact_first_two_law, make_llm_engine, run_requests,
                     total_variation)

from specserve.drafters.base import DrafterContext, DrafterOptionError, make_drafter
from specserve.drafters.ctc import BLANK, CTCDrafter, draft_trees
from specserve.drafters.nets.ctc import CTCDraftNet
from specserve.engine import verify
from specserve.engine.features import FeatureStore
from specserve.engine.sampling_params import SamplingParams


# ---------------------------------------------------------------------------------------------- the drafter

def _drafter(model, model_config, **options):
    return make_drafter("ctc", target=model, model_config=model_config, device=torch.device("cpu"),
                        dtype=torch.float32, max_model_len=160, max_num_seqs=4, **options)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    return make_llm_engine(tiny_llama_dir)


def test_propose_respects_budgets_and_needs_the_features_before_the_root(tiny_engine):
    model, cfg = tiny_engine.model, tiny_engine.model_config
    d = _drafter(model, cfg, random_init=True, seed=1, top_k=3, candidates=27)
    seqs = [draft_view(i, [5, 6, 7, 8, 9]) for i in range(4)]
    h = torch.randn(4, 64)
    for s in seqs[:3]:
        d.start(s)
        d.observe([s], [(0, h)])                       # features of positions 0..3: the root is 4
    trees = d.propose(seqs, [0, 1, 3, 5])
    assert trees[0] is None                            # budget 0: no draft
    assert trees[1].num_draft_tokens == 1 and trees[2].num_draft_tokens <= 3
    assert trees[3] is None                            # no features for that sequence
    assert all(t.tokens[0] == 9 and t.draft_probs is None for t in trees[1:3])
    assert d.model_runs()["ctc"][0] == 2               # standardized walltime: one run per sequence drafted for
    # the tree is the trie of the slots' top-k computed by hand
    with torch.no_grad():
        logp = d.slot_log_probs([seqs[2]])
    top = logp.topk(3, dim=-1)
    blank = logp.shape[-1] - 1
    ids = torch.where(top.indices == blank, torch.full_like(top.indices, BLANK), top.indices)
    expect = draft_trees([9], top.values, ids, [3], 27)[0]
    assert (trees[2].tokens, trees[2].parents) == (expect.tokens, expect.parents)
    # a stale feature (not right before the root) gives no tree until the features catch up
    seqs[2] = draft_view(2, [5, 6, 7, 8, 9, 11])
    assert d.propose([seqs[2]], [3]) == [None]
    d.observe([seqs[2]], [(4, torch.randn(1, 64))])
    assert d.propose([seqs[2]], [3])[0] is not None
    # a gap in the features: no draft until they start again from position 0 (a recomputation)
    seqs[2] = draft_view(2, [5, 6, 7, 8, 9, 11, 12, 13])
    d.observe([seqs[2]], [(6, torch.randn(1, 64))])
    assert d.propose([seqs[2]], [3]) == [None]
    d.observe([seqs[2]], [(0, torch.randn(7, 64))])
    assert d.propose([seqs[2]], [3])[0] is not None
    runs, cost = d.model_runs()["ctc"]
    assert runs == 2 + 1 + 1                           # none while the features were stale or had a gap
    rows = d.vocab.size or cfg.vocab_size
    assert cost == pytest.approx((sum(p.numel() for p in d.net.parameters()) + rows * cfg.hidden_size)
                                 / sum(p.numel() for p in model.parameters()))
    d.finish(seqs[2])
    assert seqs[2].seq_id not in d.state


def test_draft_vocab_restricts_tree_tokens_to_the_ranked_ones(tiny_engine):
    model, cfg = tiny_engine.model, tiny_engine.model_config
    net = CTCDraftNet.from_target(cfg, model, num_slots=3, seed=2)
    net.set_vocab_rank(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(3)))
    d = _drafter(model, cfg, net=net, draft_vocab=16, top_k=4, candidates=64)
    allowed = set(net.vocab_rank[:16].tolist())
    seq = draft_view(1, list(range(3, 20)))
    d.observe([seq], [(0, torch.randn(16, 64))])
    tree = d.propose([seq], [12])[0]
    assert tree.num_draft_tokens == 12 and set(tree.tokens[1:]) <= allowed
    with pytest.raises(ValueError, match="vocab_rank"):           # no ranking: an explicit size is refused
        _drafter(model, cfg, random_init=True, draft_vocab=16)


def test_reads_the_engines_feature_store(tiny_engine):
    """Given the engine's feature store, the drafter reads the target's features there (what the
    engine hands `observe` is not read: zeros here): the same trees as a drafter built outside an
    engine and fed through `observe`, and features again from position 0 redo its rows."""
    model, cfg = tiny_engine.model, tiny_engine.model_config
    store = FeatureStore(cfg.hidden_size, torch.float32)
    shared = make_drafter("ctc", DrafterContext(target=model, model_config=cfg, max_model_len=160, features=store),
                          random_init=True, seed=1)
    own = _drafter(model, cfg, random_init=True, seed=1)
    assert shared.features is store and own.features is not store
    g = torch.Generator().manual_seed(0)
    seq = draft_view(7, list(range(5, 15)))                        # root at position 9

    def deliver(start, hidden):
        store.write(seq.seq_id, start, hidden)                         # the engine writes, then tells
        shared.observe([seq], [(start, torch.zeros_like(hidden))])
        own.observe([seq], [(start, hidden)])

    def trees():
        a, b = shared.propose([seq], [6])[0], own.propose([seq], [6])[0]
        assert a is not None and (a.tokens, a.parents) == (b.tokens, b.parents)
        return a.tokens, a.parents

    h = torch.randn(11, 64, generator=g)
    deliver(0, h[:5])
    assert shared.propose([seq], [6]) == [None]                        # features 5..8 still missing
    deliver(5, h[5:9])
    trees()
    seq = draft_view(7, list(range(5, 15)) + [20, 21])                # two tokens more (the closures read `seq`)
    deliver(9, h[9:11])
    before = trees()
    deliver(0, torch.randn(11, 64, generator=g))                       # a recomputation with other features
    assert shared.state[7].kv_len == 0
    assert trees() != before
    shared.finish(seq)
    assert 7 not in shared.state and 7 in store                        # the engine's store is the engine's to free


def test_options_are_declared_keywords(tiny_engine):
    import inspect

    params = list(inspect.signature(CTCDrafter).parameters.values())
    assert params[0].name == "ctx" and not any(p.kind is p.VAR_KEYWORD for p in params)
    with pytest.raises(DrafterOptionError, match=r"'topk' \(did you mean 'top_k'\?\)"):
        _drafter(tiny_engine.model, tiny_engine.model_config, random_init=True, topk=3)


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (6, 19, 11, 33, 4, 25)]
    return prompts, run_requests(engine, prompts, GREEDY)


@pytest.mark.parametrize("options", [{"random_init": True},
                                     {"random_init": True, "seed": 3, "num_slots": 3, "top_k": 5, "candidates": 100}],
                         ids=["default", "3-slots-top5"])
def test_greedy_is_lossless_with_untrained_nets(tiny_llama_dir, prompts_and_plain, options):
    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ("ctc",), {"ctc": options})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["ctc"]
    assert stats.num_steps > 0 and stats.num_draft_tokens > 0 and stats.num_fallbacks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.drafters["ctc"].state                      # finished sequences dropped
    assert engine.drafters["ctc"].features is engine.features    # the engine's feature store is read


def test_greedy_is_lossless_with_a_budget_of_one(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ("ctc",), {"ctc": {"random_init": True}}, num_speculative_tokens=1)
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["ctc"]
    assert 0 < stats.num_draft_tokens <= stats.num_steps


# ---------------------------------------------------------------------------------------------- sampling

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06    # E[TV] of 1500 draws over 9 outcomes is about 0.03 (a wrong residual rule gives about 0.15)


@pytest.fixture(scope="module")
def exact_law(peaky_target) -> dict[tuple[int, int], float]:
    return exact_first_two_law(peaky_target, PROMPT, PARAMS)


@pytest.fixture(scope="module")
def peaky_net(peaky_target, exact_law):
    """A net trained (CTC, one label in two slots) on the law of the 2nd token given the sampled 1st
    one, at the prompt's last position: the drafts after the first token cover the 2nd token's
    support, so they are accepted and rejected often and the residual rule decides the joint law
    (a draft that never matches could not show a wrong rule)."""
    from specserve.drafters.train.ctc import FIELDS, fit_ctc
    from specserve.drafters.train.loop import TrainConfig
    from specserve.drafters.train.target import target_features

    model = make_llm_engine(peaky_target).model
    outcomes = list(exact_law)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor([exact_law[o] for o in outcomes]), 256, replacement=True, generator=g)
    first = sorted({t for t, _ in outcomes})
    feats = {t: target_features(model, [PROMPT + [t, 0]])[0] for t in first}   # the prefix's features only matter
    n = len(PROMPT) + 2
    batch_rows = []
    for i in draws.tolist():
        t, u = outcomes[i]
        labels = torch.full((n,), -100, dtype=torch.long)
        labels[n - 3], labels[n - 2] = t, u                      # after the prompt: t; after t: u
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n - 3] = mask[n - 2] = True                          # t (the root) and u are answer tokens
        batch_rows.append((torch.tensor(PROMPT + [t, u]), feats[t], labels, mask))
    batches = []
    for a in range(0, len(batch_rows), 32):
        rows = batch_rows[a:a + 32]
        batches.append({"input_ids": torch.stack([r[0] for r in rows]), "hidden": torch.stack([r[1] for r in rows]),
                        "labels": torch.stack([r[2] for r in rows]), "loss_mask": torch.stack([r[3] for r in rows])})
    assert set(FIELDS) <= set(batches[0])
    config = TrainConfig(epochs=15, lr=1e-2, warmup_steps=2, patience=None, progress=False)
    return fit_ctc(model, batches, None, config=config, rank=None, vocab=0, num_slots=2, label_len=1,
                   max_len=64).net


def empirical_law(target_dir, net):
    return empirical_first_two_law(target_dir, "ctc", {"net": net, "top_k": 4, "candidates": 16}, PROMPT, PARAMS,
                                   TRIALS)


def test_sampling_follows_the_target_law(peaky_target, peaky_net, exact_law):
    emp, engine = empirical_law(peaky_target, peaky_net)
    stats = engine.get_stats().drafters["ctc"]
    assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_law) < TV_BOUND


def test_a_wrong_residual_update_is_caught(peaky_target, peaky_net, exact_law, monkeypatch):
    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)   # forget the rejected draft's mass
    emp, _ = empirical_law(peaky_target, peaky_net)
    assert total_variation(emp, exact_law) > TV_BOUND


def test_chat_prompts_decode_identically_unstaggered(tiny_llama_dir):
    """Longer chat prompts with EOS allowed, 4 at once, unstaggered: still plain greedy decoding."""
    from specserve.drafters.train.data import render_prompt

    engine = make_llm_engine(tiny_llama_dir, max_model_len=256)
    rng = random.Random(1)
    words = "the quick brown fox jumps over lazy dog hello world capital of France Paris is what".split()
    prompts = [render_prompt(engine.tokenizer, [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))])
               for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = run_requests(engine, prompts, params, stagger=False)
    spec = make_llm_engine(tiny_llama_dir, ("ctc",), {"ctc": {"random_init": True, "seed": 5}}, max_model_len=256)
    assert run_requests(spec, prompts, params, stagger=False) == plain
