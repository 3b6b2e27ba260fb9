"""The falcon drafter through the engine (semi-autoregressive head, k = 2 tokens per forward,
custom decoding tree; the mask and the tree itself: test_falcon_tree.py): greedy output equal to
plain decoding with drafts really accepted, for every tree kind; sampled output following the
target's law; preemption; its KV holding only rows of real features."""

from __future__ import annotations

import pytest
import torch
from helpers import (draft_view, empirical_first_two_law, exact_first_two_law, feature_drafter_engine,
                     run_requests, teacher_batch, total_variation, varied_prompts_and_plain)

from specserve.drafters.base import DrafterContext
from specserve.drafters.falcon import DEFAULT_TREE, FalconDrafter
from specserve.drafters.nets.falcon import FalconHead
from specserve.drafters.train.falcon import fit_falcon
from specserve.drafters.train.loop import TrainConfig
from specserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

# this file's engine: 6 sequences, 300 KV blocks, context 128, 60 draft tokens per step
make_engine = feature_drafter_engine


# ---- through the engine ------------------------------------------------------------------------------------------

def _tiny(model_dir):
    from specserve.drafters.train.pipeline import prepare_target

    t = prepare_target(str(model_dir), device="cpu", dtype="float32", max_positions=256)
    return t.model_config, t.model





def distilled_head(model_dir, prompts, continuations, *, epochs: int = 120, seed: int = 0) -> FalconHead:
    """A head distilled in a few seconds from the target's own continuations of `prompts`."""
    from specserve.drafters.train.data import label_ranking

    cfg, model = _tiny(model_dir)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    batch = teacher_batch(model, seqs, [len(p) for p in prompts])
    config = TrainConfig(epochs=epochs, lr=1e-2, warmup_steps=5, patience=None, progress=False, device="cpu")
    head = fit_falcon(model, [batch], None, config=config, noise=0.02, negatives=None, max_len=160, seed=seed).head
    head.set_vocab_rank(label_ranking([batch], cfg.vocab_size)[0])
    return head


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    """Prompts of different lengths and their plain greedy continuations."""
    return varied_prompts_and_plain(tiny_llama_dir, GREEDY)


@pytest.fixture(scope="module")
def trained_head(tiny_llama_dir, prompts_and_plain) -> FalconHead:
    """Distilled from the tiny target's own greedy continuations of the test prompts (a random tiny
    model continues every prompt differently: only these can be learnt)."""
    prompts, plain = prompts_and_plain
    return distilled_head(tiny_llama_dir, prompts, [plain[f"r{i}"] for i in range(len(prompts))])


@pytest.mark.parametrize("shape", [{}, {"tree": "falcon_kmask2_4layer_tree"}, {"tree": "topk", "top_k": 2},
                                   {"tree": "chain", "depth": 6}, {"draft_vocab": 100}],
                         ids=["default", "4layer", "topk", "chain", "draft_vocab"])
def test_greedy_is_lossless_and_drafts_are_accepted(tiny_llama_dir, prompts_and_plain, trained_head, shape):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"head": trained_head, **shape}})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["falcon"]
    assert stats.num_fallbacks == 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0.3 * sum(len(v) for v in plain.values())
    assert len(stats.accepted_by_depth) >= 3 and stats.accepted_by_depth[2] > 0     # the second block's drafts too
    drafter = engine.drafters["falcon"]
    assert drafter.head is trained_head                     # an in-memory head is used by reference
    if "draft_vocab" in shape:
        assert set(drafter.vocab.ids.tolist()) == set(trained_head.vocab_rank[:100].tolist())
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.state
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert drafter.features is engine.features                  # the engine's feature store is read


def test_untrained_head_is_lossless_too(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"random_init": True}},
                         num_speculative_tokens=30, max_draft_tokens_per_step=120)   # four block levels
    got = run_requests(engine, prompts[:6], GREEDY)
    assert got == {f"r{i}": plain[f"r{i}"] for i in range(6)}
    stats = engine.get_stats().drafters["falcon"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
    # standardized walltime: one run per sequence per block forward (the root block, then one per
    # block level with expansions: at most the plan's levels); cost = head + LM-head rows over the target
    drafter = engine.drafters["falcon"]
    runs, cost = drafter.model_runs()["falcon"]
    levels = drafter.plan(30).num_levels
    assert levels > 1 and stats.num_steps < runs <= stats.num_steps * levels
    hidden = engine.model_config.hidden_size
    vocab = drafter.vocab.size or engine.model_config.vocab_size
    assert cost == pytest.approx((sum(p.numel() for p in drafter.head.parameters()) + vocab * hidden)
                                 / sum(p.numel() for p in engine.model.parameters()))


def test_preemption_restarts_the_drafters_rows(tiny_llama_dir, prompts_and_plain, trained_head):
    """A KV pool too small for every sequence: preempted sequences are recomputed from position 0,
    and the drafter rebuilds its rows from the features delivered again."""
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"head": trained_head}}, num_kv_blocks=40)
    assert run_requests(engine, prompts, GREEDY, stagger=False) == plain
    assert engine.scheduler.num_preemptions > 0
    stats = engine.get_stats().drafters["falcon"]
    assert stats.num_fallbacks == 0 and stats.num_accepted_tokens > 0


def test_kv_holds_only_rows_of_real_features(tiny_llama_dir, prompts_and_plain, trained_head):
    """After many speculative steps the drafter's KV rows equal those of a fresh catch-up over the
    target's real features (computed by transformers): tree rows never stay."""
    import transformers

    engine = make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"head": trained_head}})
    drafter: FalconDrafter = engine.drafters["falcon"]
    prompts = prompts_and_plain[0][:3]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(25):
        engine.step()
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    assert len(seqs) == 3 and all(s.num_output_tokens > 20 for s in seqs)
    assert engine.get_stats().drafters["falcon"].num_accepted_tokens > 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    fresh = FalconDrafter(DrafterContext(target=engine.model, model_config=engine.model_config, max_model_len=128),
                          head=trained_head, block_size=4)
    for seq in seqs:
        n = drafter.state[seq.seq_id].kv_len
        assert n >= len(seq.token_ids) - 20 and n > 30
        with torch.no_grad():
            feats = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states[-1][0]
        fresh.start(seq)
        fresh.observe([seq], [(0, feats)])
        assert fresh.catch_up([draft_view(seq.seq_id, seq.token_ids[:n + 1])]) == [True]   # rows 0 .. n-1
        ours = drafter.cache.kv[:, 0, drafter.blocks.slots(seq.seq_id, 0, n)]
        want = fresh.cache.kv[:, 0, fresh.blocks.slots(seq.seq_id, 0, n)]
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_no_checkpoint_says_how_to_train_one(tiny_llama_dir):
    with pytest.raises(ValueError, match="specserve train falcon"):
        make_engine(tiny_llama_dir, ["falcon"])
    with pytest.raises(ValueError, match="vocab_rank"):                 # draft_vocab needs a trained ranking
        make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"random_init": True, "draft_vocab": 100}})
    with pytest.raises(ValueError, match="falcon tree"):
        make_engine(tiny_llama_dir, ["falcon"], {"falcon": {"random_init": True, "tree": "no_such_tree"}})
    assert DEFAULT_TREE == "falcon_kmask2_8layer_tree"


# ---- sampling ---------------------------------------------------------------------------------

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06    # E[TV] of 1500 draws over 9 outcomes is about 0.03; a forgotten residual gives far more


@pytest.fixture(scope="module")
def sampling_options(peaky_target):
    """A head distilled from the peaky target's greedy continuations of PROMPT-like prompts: its
    depth-1 and depth-2 drafts are the target's likely tokens, so drafts are accepted and rejected."""
    g = torch.Generator().manual_seed(11)
    prompts = [PROMPT] + [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 14, 20, 12)]
    plain = run_requests(make_engine(peaky_target), prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                            ignore_eos=True), stagger=False)
    head = distilled_head(peaky_target, prompts, [plain[f"r{i}"] for i in range(len(prompts))])
    return {"head": head}


def test_sampled_tokens_follow_the_target_law(peaky_target, sampling_options):
    """Deterministic Cartesian/conditional trees (one-hot q) under sampling: the joint law of the
    first two tokens equals the target's, and drafts are both accepted and rejected along the way."""
    emp, engine = empirical_first_two_law(peaky_target, "falcon", sampling_options, PROMPT, SAMPLING, TRIALS)
    stats = engine.get_stats().drafters["falcon"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) < TV_BOUND


def test_the_law_test_sees_a_wrong_residual(peaky_target, sampling_options, monkeypatch):
    """Control: with the rejected draft's mass left in p the same bound fails."""
    from specserve.engine import verify

    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, _ = empirical_first_two_law(peaky_target, "falcon", sampling_options, PROMPT, SAMPLING, TRIALS)
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) > TV_BOUND
