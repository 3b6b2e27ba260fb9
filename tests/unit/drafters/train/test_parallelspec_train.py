"""ParallelSpec training: the group-wise parallel layout against a hand-worked example, the
training forward against the serving forward, the loss falling, the registered trainer end to end,
and checkpoints that round-trip and refuse another target."""

from __future__ import annotations

import pytest
import torch
from helpers import draft_view

from specserve.drafters.train import parallelspec as ps
from specserve.drafters.train.parallelspec import (IGNORE, ParallelSpecModule, TrainOptions, build_parallel_layout,
                                                   chain_tau, held_back_ranks, parallel_loss)

X = IGNORE


def test_layout_matches_the_hand_worked_example():
    """T=5 tokens a..e (ids 10..14), k=2, a group at every position, [MASK]_1/[MASK]_2 = ids 100/101.
    Real rows first (causal among themselves), then the groups of anchors 0..4 in order."""
    ids, pos, attn, labels = build_parallel_layout(torch.tensor([10, 11, 12, 13, 14]), [0, 1, 2, 3, 4], 2, 100)
    #              a   b   c   d   e | t=0     | t=1     | t=2     | t=3     | t=4
    assert ids.tolist() == [10, 11, 12, 13, 14, 100, 101, 100, 101, 100, 101, 100, 101, 100, 101]
    # mask i of anchor t sits at position t+i: the position ids repeat across groups
    assert pos.tolist() == [0, 1, 2, 3, 4, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    # real j -> token j+1; mask i of anchor t -> token t+i+1 (c d | d e | e - | - - | - -)
    assert labels.tolist() == [11, 12, 13, 14, X, 12, 13, 13, 14, 14, X, X, X, X, X]
    expected = [
        # a b c d e  0 0  1 1  2 2  3 3  4 4
        "1 0 0 0 0  0 0  0 0  0 0  0 0  0 0",   # a
        "1 1 0 0 0  0 0  0 0  0 0  0 0  0 0",   # b
        "1 1 1 0 0  0 0  0 0  0 0  0 0  0 0",   # c
        "1 1 1 1 0  0 0  0 0  0 0  0 0  0 0",   # d
        "1 1 1 1 1  0 0  0 0  0 0  0 0  0 0",   # e
        "1 0 0 0 0  1 0  0 0  0 0  0 0  0 0",   # t=0 mask 1: a + itself
        "1 0 0 0 0  1 1  0 0  0 0  0 0  0 0",   # t=0 mask 2: a + masks 1..2 of its group
        "1 1 0 0 0  0 0  1 0  0 0  0 0  0 0",   # t=1 mask 1
        "1 1 0 0 0  0 0  1 1  0 0  0 0  0 0",   # t=1 mask 2
        "1 1 1 0 0  0 0  0 0  1 0  0 0  0 0",   # t=2 mask 1
        "1 1 1 0 0  0 0  0 0  1 1  0 0  0 0",   # t=2 mask 2
        "1 1 1 1 0  0 0  0 0  0 0  1 0  0 0",   # t=3 mask 1
        "1 1 1 1 0  0 0  0 0  0 0  1 1  0 0",   # t=3 mask 2
        "1 1 1 1 1  0 0  0 0  0 0  0 0  1 0",   # t=4 mask 1
        "1 1 1 1 1  0 0  0 0  0 0  0 0  1 1",   # t=4 mask 2
    ]
    want = torch.tensor([[int(c) for c in row.split()] for row in expected], dtype=torch.bool)
    assert attn.dtype == torch.bool and torch.equal(attn, want)


def test_layout_with_chosen_anchors_labels_and_answer_mask():
    """Anchors 1 and 3 only, explicit target labels (not the input shifted) and an answer mask
    that drops the label of position 1: every row trained on labels[t+i] loses it too."""
    labels_in = torch.tensor([21, 22, 23, 24, 25, 26])
    answer = torch.tensor([True, False, True, True, True, True])
    ids, pos, attn, labels = build_parallel_layout(torch.arange(6), [1, 3], 3, 50, labels_in, answer)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 50, 51, 52, 50, 51, 52]
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 4, 5, 6]
    assert labels.tolist() == [21, X, 23, 24, 25, 26, 23, 24, 25, 25, 26, X]
    # the group of anchor 3 sees real 0..3 and its own masks, nothing of the group of anchor 1
    assert attn[9].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]
    assert attn[11].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert not attn[:6, 6:].any()          # real tokens never see masks


# ---- the tiny target ------------------------------------------------------------------------------------------------


def greedy_sequences(model, prompts, new_tokens):
    from specserve.drafters.train.target import target_features

    out = []
    for p in prompts:
        seq = list(p)
        for _ in range(new_tokens):
            f = target_features(model, [seq])[0]
            seq.append(int(model.compute_logits(f[-1:]).argmax()))
        out.append(seq)
    return out


def make_batch(model, seqs, answer_from: int = 0):
    """A shard-like batch: features, the target's greedy labels, loss_mask from `answer_from` on."""
    from specserve.drafters.train.target import target_features

    feats = target_features(model, seqs)
    B, T, H = len(seqs), max(map(len, seqs)), feats[0].shape[1]
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.int64), "hidden": torch.zeros(B, T, H),
             "labels": torch.full((B, T), IGNORE), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "lengths": torch.tensor([len(s) for s in seqs])}
    for b, (s, f) in enumerate(zip(seqs, feats)):
        n = len(s)
        batch["input_ids"][b, :n] = torch.tensor(s)
        batch["hidden"][b, :n] = f
        batch["labels"][b, :n] = model.compute_logits(f).argmax(-1)
        batch["loss_mask"][b, answer_from:n] = True
    return batch


@pytest.fixture(scope="module")
def tiny_seqs(tiny_target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 9, 7, 12)]
    return greedy_sequences(tiny_target.model, prompts, 24)


def test_training_forward_equals_the_serving_forward(tiny_target, tiny_seqs):
    """The dense group-wise layout and the serving drafter (paged KV, catch-up over two steps,
    masks after the root) give the same k+1 distributions."""
    from specserve.drafters.base import make_drafter

    model, cfg = tiny_target.model, tiny_target.model_config
    mod = ParallelSpecModule.random(model, cfg, k=3, max_positions=256, seed=1, scale=0.2)
    seq = tiny_seqs[1]
    batch = make_batch(model, [seq])
    drafter = make_drafter("parallelspec", target=model, model_config=cfg, device="cpu", dtype=torch.float32,
                                  max_model_len=128, module=mod, block_size=4)
    fake = draft_view(7, seq[:10])
    drafter.start(fake)
    drafter.observe([fake], [(0, batch["hidden"][0, :9])])          # the root (position 9) has none yet
    for n, fed in ((10, None), (14, (9, 4)), (15, (13, 1))):
        if fed:
            fake = draft_view(7, seq[:n])
            drafter.observe([fake], [(fed[0], batch["hidden"][0, fed[0]:fed[0] + fed[1]])])
        got_idx, got = drafter.draft_logits([fake])
        assert got_idx == [0]
        lay = ps.lay_out_batch(mod, batch["input_ids"][:, :n], batch["hidden"][:, :n], batch["labels"][:, :n], None,
                               [n], [[n - 1]], [1.0] * 4, False)
        with torch.no_grad():
            out = mod.forward_dense(lay.h_in, lay.positions, lay.attn_mask)[0]
            want = (out[[n - 1, n, n + 1, n + 2]] @ model.lm_head_weight.T).float()
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)
    assert drafter.state[7].kv_len == 14
    drafter.finish(fake)
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


def test_grouped_training_forward_equals_the_dense_layout(tiny_target):
    """`forward_grouped` (what training runs: no dense mask) equals `forward_dense` over
    `build_parallel_layout` for a padded batch of sequences with arbitrary anchors; so do the labels."""
    model, cfg = tiny_target.model, tiny_target.model_config
    mod = ParallelSpecModule.random(model, cfg, k=3, max_positions=256, seed=1, scale=0.2)
    g = torch.Generator().manual_seed(0)
    B, T, k = 3, 17, 3
    batch = {"input_ids": torch.randint(0, 320, (B, T), generator=g), "hidden": torch.randn(B, T, 64, generator=g),
             "labels": torch.randint(0, 320, (B, T), generator=g), "lengths": torch.tensor([17, 12, 9])}
    anchors = [[0, 3, 7, 16], [2, 11], [1, 2, 3, 4, 5, 6, 7, 8]]
    gb = ps.group_batch(mod, batch, anchors, [1.0] * (k + 1))
    lay = ps.lay_out_batch(mod, batch["input_ids"], batch["hidden"], batch["labels"], None, [17, 12, 9], anchors,
                           [1.0] * (k + 1), False)
    with torch.no_grad():
        real, masks = mod.forward_grouped(gb.h_real, gb.pos_real, gb.anchors)
        dense = mod.forward_dense(lay.h_in, lay.positions, lay.attn_mask)
    for b, n in enumerate([17, 12, 9]):
        A = len(anchors[b])
        torch.testing.assert_close(real[b, :n], dense[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(masks[b, :A], dense[b, n:n + A * k].view(A, k, -1), atol=1e-5, rtol=1e-5)
        assert torch.equal(gb.labels_real[b, :n], lay.labels[b, :n])
        assert torch.equal(gb.labels_mask[b, :A], lay.labels[b, n:n + A * k].view(A, k))


@pytest.mark.parametrize("variant", ["medusa", "eagle"])
def test_loss_falls(tiny_target, tiny_seqs, variant):
    model, cfg = tiny_target.model, tiny_target.model_config
    torch.manual_seed(0)
    mod = ParallelSpecModule.from_target(model, cfg, k=2, max_positions=256)
    batch = make_batch(model, tiny_seqs, answer_from=4)
    opts = TrainOptions(k=2, variant=variant, loss_vocab="full")
    opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(25):
        loss, logs = parallel_loss(mod, batch, opts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        assert ("reg" in logs) == (variant == "eagle")
    assert losses[-1] < 0.9 * losses[0] and min(losses[-5:]) < min(losses[:5]), losses
    assert mod.embed_weight is model.embed.weight and mod.lm_head_weight is model.lm_head_weight   # shared
    assert model.embed.weight.grad is None
    assert mod.mask_embed.grad is not None and mod.mask_embed.grad.abs().sum() > 0


def test_chunked_head_ce_matches_autograd():
    torch.manual_seed(0)
    h = torch.randn(7, 16, requires_grad=True)
    W = torch.randn(40, 16)
    y = torch.randint(0, 40, (7,))
    w = torch.rand(7)
    ps.head_ce(h, W, y, w, chunk=3).backward()
    g1 = h.grad.clone()
    h.grad = None
    (torch.nn.functional.cross_entropy(h @ W.T, y, reduction="none") * w).sum().backward()
    torch.testing.assert_close(g1, h.grad)


def test_chain_tau_counts_leading_top1_hits():
    ranks = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [2, 0, 0, 0], [0, -1, 0, 0]])
    assert chain_tau(ranks) == 1 + (2 + 4 + 0 + 1) / 4


# ---- the registered trainer -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_target, pool_writer, tmp_path_factory):
    from specserve.drafters.train.pipeline import run_training

    tmp = tmp_path_factory.mktemp("ps_train")
    pool = pool_writer(tmp / "train_prompts.jsonl")
    out = run_training("parallelspec", {
        "data": str(pool), "out": str(tmp / "ckpt"), "epochs": 2, "lr": 3e-3, "max_len": 64, "eval_examples": 4,
        "cache_dir": str(tmp / "cache"), "progress": False, "k": 2, "layout_tokens": 512, "num_negatives": 64,
        "eval_budget": 4, "tuned_nodes": 8, "log_every": 1, "engine_tau_prompts": 2}, target=tiny_target)
    return out


def test_trainer_writes_a_checkpoint_with_a_tuned_tree(trained, tiny_target):
    from specserve.drafters.nets.checkpoint import read_meta
    from specserve.drafters.nets.tree_tuning import is_prefix_closed

    meta = read_meta(trained)
    assert meta.kind == "parallelspec" and meta.target_fingerprint == tiny_target.fingerprint
    assert meta.hyperparams["k"] == 2 and meta.hyperparams["variant"] in ("medusa", "eagle")
    assert meta.hyperparams["steps"] > 0 and meta.tau is not None and meta.tau >= 1.0
    order = meta.tree["choices"]
    assert order and is_prefix_closed(order) and max(len(p) for p in order) <= 3
    assert "tau_chain" in meta.tau_details and meta.tau_details["anchors"] > 0
    assert meta.tau_details["served"]["num_prompts"] == 2 and meta.tau_details["served"]["tau"] >= 1.0


def test_checkpoint_round_trips_and_refuses_another_target(trained, tiny_target, tiny_model_factory, tmp_path):
    from specserve.drafters.nets.checkpoint import CheckpointMismatchError, load_checkpoint
    from specserve.drafters.train.pipeline import prepare_target
    from specserve.engine.loader import load_model

    mod, meta = ps.load_module(trained, tiny_target.model, tiny_target.model_config,
                               fingerprint=tiny_target.fingerprint, max_positions=128)
    tensors, _ = load_checkpoint(trained)
    for name, t in mod.own_tensors().items():
        torch.testing.assert_close(t, tensors[name] if name == "vocab_rank" else tensors[name].float())
    assert set(tensors) == set(mod.own_tensors())            # the target's embedding / LM head are not in it
    assert sorted(mod.vocab_rank.tolist()) == list(range(tiny_target.model_config.vocab_size))  # the label ranking
    assert mod.embed_weight is tiny_target.model.embed.weight

    other = prepare_target(loaded=load_model(str(tiny_model_factory(tmp_path / "other", seed=5))), device="cpu",
                           dtype="float32", max_positions=128)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        ps.load_module(trained, other.model, other.model_config, fingerprint=other.fingerprint, max_positions=128)
    from specserve.drafters.base import make_drafter

    with pytest.raises(CheckpointMismatchError):
        make_drafter("parallelspec", target=other.model, model_config=other.model_config, device="cpu", dtype=torch.float32,
                            max_model_len=64, checkpoint=str(trained))
    with pytest.raises(ValueError, match="specserve train parallelspec"):
        make_drafter("parallelspec", target=other.model, model_config=other.model_config, device="cpu", dtype=torch.float32,
                            max_model_len=64)


def test_held_back_ranks_shape(tiny_target, tiny_seqs):
    mod = ParallelSpecModule.from_target(tiny_target.model, tiny_target.model_config, k=3, max_positions=256)
    batch = make_batch(tiny_target.model, tiny_seqs[:2], answer_from=3)
    ranks = held_back_ranks(mod, [batch])
    # anchors t with labels t..t+3 all inside [3, n): n - 3 - 3 per sequence
    assert ranks.shape == (sum(len(s) - 6 for s in tiny_seqs[:2]), 4)
    assert int(ranks.max()) < 10 and int(ranks.min()) >= -1
