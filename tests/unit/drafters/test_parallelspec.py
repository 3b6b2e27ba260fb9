"""The ParallelSpec drafter through the engine: greedy output equals plain decoding token for
token (a batch of prompts of different lengths arriving at different steps), and sampled output
follows the target's exact law (the joint law of the first two tokens, as in
tests/unit/engine/test_sampling_lossless.py), with a briefly trained drafter loaded from a
checkpoint so that drafts are really accepted (and rejected)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import (draft_view, empirical_first_two_law, exact_first_two_law, make_llm_engine, run_requests,
                     total_variation)

from specserve.drafters import parallelspec as _register  # noqa: F401  (registers "parallelspec")
from specserve.drafters.base import make_drafter
from specserve.drafters.train.parallelspec import IGNORE, ParallelSpecModule, TrainOptions, parallel_loss
from specserve.engine import verify
from specserve.engine.sampling_params import SamplingParams


def train_checkpoint(model_dir, prompts, out_dir, *, new_tokens=40, steps=20, k=4, lr=2e-2, continuations=None,
                     vocab_rank=None):
    """A drafter trained for a few steps on the target's own greedy continuations of `prompts`
    (given, or generated here), memorised, so that its drafts are often right on those prompts;
    saved as a checkpoint."""
    from specserve.drafters.nets.checkpoint import CheckpointMeta, save_checkpoint
    from specserve.drafters.train.pipeline import prepare_target
    from specserve.drafters.train.target import target_features
    from specserve.engine.loader import load_model

    tgt = prepare_target(loaded=load_model(str(model_dir)), device="cpu", dtype="float32", max_positions=256)
    model = tgt.model
    seqs = []
    for i, p in enumerate(prompts):
        seq = list(p) + (list(continuations[i]) if continuations is not None else [])
        for _ in range(new_tokens if continuations is None else 0):
            seq.append(int(model.compute_logits(target_features(model, [seq])[0][-1:]).argmax()))
        seqs.append(seq)
    feats = target_features(model, seqs)
    B, T = len(seqs), max(map(len, seqs))
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.int64), "hidden": torch.zeros(B, T, feats[0].shape[1]),
             "labels": torch.full((B, T), IGNORE), "lengths": torch.tensor([len(s) for s in seqs])}
    for b, (s, f) in enumerate(zip(seqs, feats)):
        batch["input_ids"][b, :len(s)] = torch.tensor(s)
        batch["hidden"][b, :len(s)] = f
        batch["labels"][b, :len(s)] = model.compute_logits(f).argmax(-1)
    torch.manual_seed(0)
    mod = ParallelSpecModule.from_target(model, tgt.model_config, k=k, max_positions=256)
    opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=lr)
    opts = TrainOptions(k=k, variant="medusa", loss_vocab="full")
    for _ in range(steps):
        loss, _ = parallel_loss(mod, batch, opts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    mod.vocab_rank = vocab_rank
    meta = CheckpointMeta(kind="parallelspec", target_name="tiny", target_fingerprint=tgt.fingerprint,
                          hyperparams={"k": k, "hidden_size": tgt.model_config.hidden_size})
    return save_checkpoint(out_dir, mod.own_tensors(), meta)


def engine_with(model_dir, options=None, **kw):
    """This file's engine (context 128, 12 draft tokens per sequence and 48 per step), speculating
    with parallelspec (its `options`) when they are given."""
    drafters, drafter_options = (("parallelspec",), {"parallelspec": options}) if options is not None else ((), {})
    config = dict(max_model_len=128, num_speculative_tokens=12, max_draft_tokens_per_step=48)
    config.update(kw)
    return make_llm_engine(model_dir, drafters, drafter_options, **config)


# requests join every other step, so prefills, plain steps and trees share forwards
run_staggered = partial(run_requests, stagger=True, max_steps=3000)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 19, 11, 33, 4, 25)]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, prompts):
    return run_staggered(engine_with(tiny_llama_dir), prompts,
                         SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir, prompts, plain, tmp_path_factory):
    return train_checkpoint(tiny_llama_dir, prompts, tmp_path_factory.mktemp("ps_ckpt"),
                            continuations=[plain[f"r{i}"] for i in range(len(prompts))])


@pytest.mark.parametrize("tree", ["auto", "chain", "[[0], [1], [0, 0], [2], [0, 0, 0], [0, 1]]"])
def test_greedy_is_lossless_with_a_trained_checkpoint(tiny_llama_dir, prompts, plain, checkpoint, tree):
    engine = engine_with(tiny_llama_dir, {"checkpoint": str(checkpoint), "tree": tree})
    got = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    stats = engine.get_stats().drafters["parallelspec"]
    assert stats.num_fallbacks == 0
    assert stats.num_steps > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    drafter = engine.drafters["parallelspec"]
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.state


def test_greedy_is_lossless_with_a_draft_vocabulary(tiny_llama_dir, prompts, plain, tmp_path):
    """A checkpoint carrying the target's label ranking: drafts come from its first N tokens only
    (checked on the trees), and the output is still plain decoding's."""
    vocab_size = 320
    counts = torch.bincount(torch.tensor([t for v in plain.values() for t in v]), minlength=vocab_size)
    rank = torch.argsort(-counts, stable=True)
    ckpt = train_checkpoint(tiny_llama_dir, prompts, tmp_path / "ps", vocab_rank=rank,
                            continuations=[plain[f"r{i}"] for i in range(len(prompts))])
    engine = engine_with(tiny_llama_dir, {"checkpoint": str(ckpt), "draft_vocab": 24})
    drafter = engine.drafters["parallelspec"]
    assert torch.equal(drafter.module.vocab_rank, rank) and drafter.vocab.size == 24
    allowed = set(rank[:24].tolist())
    proposed = []
    real_propose = drafter.propose

    def spy(seqs, budgets):
        trees = real_propose(seqs, budgets)
        proposed.extend(t.tokens[1:] for t in trees if t is not None)
        return trees

    drafter.propose = spy
    got = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    assert proposed and all(set(p) <= allowed for p in proposed)
    assert engine.get_stats().drafters["parallelspec"].num_accepted_tokens > 0


def test_greedy_is_lossless_with_a_random_drafter_and_chunked_prefill(tiny_llama_dir, prompts, plain):
    """Untrained, k=2 (depth 3), prefill in chunks of 8 tokens, a smaller budget."""
    engine = engine_with(tiny_llama_dir, {"random_init": True, "k": 2, "seed": 3}, max_num_batched_tokens=8,
                         num_speculative_tokens=5)
    got = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    stats = engine.get_stats().drafters["parallelspec"]
    assert stats.num_steps > 0 and stats.num_draft_tokens > 0 and stats.num_fallbacks == 0
    # standardized walltime: at least one drafter forward per verified draft; cost = the module plus
    # the LM-head rows it multiplies, over the target
    d = engine.drafters["parallelspec"]
    runs, cost = d.model_runs()["parallelspec"]
    assert runs >= stats.num_steps
    hidden, vocab = engine.model_config.hidden_size, engine.model_config.vocab_size
    assert cost == pytest.approx((sum(p.numel() for p in d.module.parameters()) + vocab * hidden)
                                 / sum(p.numel() for p in engine.model.parameters()))


# ---- sampling: the joint law of the first two tokens ---------------------------------------------------------------

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 3000
TV_BOUND = 0.045   # E[TV] of 3000 draws over 9 outcomes is about 0.02


@pytest.fixture(scope="module")
def peaky_checkpoint(peaky_target, tmp_path_factory):
    return train_checkpoint(peaky_target, [PROMPT], tmp_path_factory.mktemp("ps_peaky"), new_tokens=12)


@pytest.fixture(scope="module")
def exact_law(peaky_target) -> dict[tuple[int, int], float]:
    return exact_first_two_law(peaky_target, PROMPT, PARAMS)


def empirical_law(target_dir, checkpoint, trials=TRIALS):
    options = {"checkpoint": str(checkpoint), "tree": "[[0], [1], [0, 0], [2]]"}
    return empirical_first_two_law(target_dir, "parallelspec", options, PROMPT, PARAMS, trials)


def test_sampling_follows_the_target_law(peaky_target, peaky_checkpoint, exact_law):
    emp, engine = empirical_law(peaky_target, peaky_checkpoint)
    stats = engine.get_stats().drafters["parallelspec"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_law) < TV_BOUND


def test_a_wrong_residual_update_is_caught(peaky_target, peaky_checkpoint, exact_law, monkeypatch):
    """The same run with a residual that forgets the rejected draft: the bound must then fail
    (the test has the power to see a broken one-hot residual: TV about 0.11 against 0.02; 1000
    trials are enough for that gap)."""
    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, _ = empirical_law(peaky_target, peaky_checkpoint, trials=1000)
    assert total_variation(emp, exact_law) > TV_BOUND


def test_features_follow_the_target_kv_across_steps_and_preemption(tiny_llama_dir):
    """The drafter reads the engine's feature store (no copy of its own); built outside an engine,
    its own store follows `observe` the same way: rewrites from the root on, starts over when a
    preempted sequence is recomputed from 0, never invents missing positions."""
    engine = engine_with(tiny_llama_dir, {"random_init": True, "k": 2})
    assert engine.drafters["parallelspec"].features is engine.features
    d = make_drafter("parallelspec", target=engine.model, model_config=engine.model_config, device="cpu",
                     dtype=torch.float32, max_model_len=64, random_init=True, k=2)
    seq = draft_view(3, list(range(20)))
    rows = torch.arange(20.0)[:, None].expand(20, engine.model_config.hidden_size)
    d.observe([seq, seq], [(0, rows[0:8]), (8, rows[8:12])])        # prefill chunks
    assert torch.equal(d.features.view(3, 3, 12), rows[3:12])
    d.observe([seq], [(11, rows[11:14] + 100)])                     # verification rewrites from the root on
    assert torch.equal(d.features.view(3, 10, 14), torch.cat([rows[10:11], rows[11:14] + 100]))
    d.observe([seq], [(0, rows[0:4])])                              # preempted: recomputed from 0
    assert d.features.length(3) == 4 and d.features.view(3, 10, 14) is None
    d.observe([seq], [(4, rows[4:16])])
    assert torch.equal(d.features.view(3, 10, 16), rows[10:16])
    assert d.features.view(3, 10, 17) is None                       # never invents missing positions
    # standardized walltime: one run per sequence the forward serves (not the one missing features)
    short = draft_view(4, list(range(5)))
    d.observe([short], [(0, rows[0:4])])
    assert d.model_runs()["parallelspec"][0] == 0
    assert d.propose([short, seq], [3, 3])[1] is None
    assert d.model_runs()["parallelspec"][0] == 1


def test_tree_order_cuts_to_the_budget():
    from specserve.drafters.parallelspec import parse_tree, prefix_tree

    order = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]
    assert prefix_tree(order, 3) == [[0], [0, 0], [1]]
    assert parse_tree("chain", 3) == [[0], [0, 0], [0, 0, 0]]
    assert parse_tree("auto", 3) is None
    not_closed = [[0, 0], [0], [1]]                # a parent after its child: level-major cut instead
    assert prefix_tree(not_closed, 2) == [[0], [1]]
