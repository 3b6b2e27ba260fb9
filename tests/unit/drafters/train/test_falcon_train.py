"""The falcon trainer: CSGD glances contiguous runs at k-block starts (the inputs k positions
ahead), λ follows its schedule, the simulated walks are the serving drafter's, the loss falls on
tiny self-distilled shards, and checkpoints carry their tree and round-trip (refused for another
target)."""

from __future__ import annotations

import pytest
import torch
from helpers import draft_view

from specserve.drafters.base import make_drafter
from specserve.drafters.nets.falcon import FalconHead, load_head, shipped_checkpoint
from specserve.drafters.nets.checkpoint import CheckpointMismatchError, read_meta
from specserve.drafters.train.falcon import (FIELDS, Rows, chain_tau, distill_terms, falcon_loss, fit_falcon, glance,
                                             glance_lambda, sar_ranks, train_falcon, tree_tau)
from specserve.drafters.train.loop import TrainConfig
from specserve.drafters.train.target import target_features
from specserve.engine.model import rope_tables


def _rows(trained: list[list[int]], valid: list[list[int]], offsets: list[int], hidden_size: int = 4) -> Rows:
    t = torch.tensor(trained, dtype=torch.bool)
    b, r = t.shape
    feats = torch.arange(b * r, dtype=torch.float32).view(b, r, 1).expand(b, r, hidden_size).clone()
    return Rows(feats, torch.arange(1, r + 1).repeat(b, 1), torch.tensor(valid, dtype=torch.bool), t,
                torch.tensor(offsets))


def test_glance_replaces_runs_at_block_starts_with_the_inputs_k_ahead():
    k = 2
    # one sequence of 12 tokens (rows 0..10), answer from row 2 on (targets f_{p+2}), blocks at even rows
    trained = [[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
    valid = [[1] * 11]
    rows = _rows(trained, valid, [0])
    hidden = torch.arange(12, dtype=torch.float32).view(1, 12, 1).expand(1, 12, 4) * 100
    ids = torch.arange(1000, 1012).view(1, 12)
    feats, next_ids, replaced = glance(rows, hidden, ids, k, num=10, generator=torch.Generator().manual_seed(0))
    picked = replaced[0].nonzero().flatten().tolist()
    # block starts r (even) whose block keeps a trained row (r+1) and whose input x_{r+3} exists
    assert picked == [2, 4, 6]                              # [0, 1] and [8, 9] have no trained second row
    for r in picked:
        assert torch.equal(feats[0, r], hidden[0, r + k]) and next_ids[0, r] == ids[0, r + k + 1]
    untouched = [r for r in range(11) if r not in picked]
    assert torch.equal(feats[0, untouched], rows.feats[0, untouched])
    assert torch.equal(next_ids[0, untouched], rows.next_ids[0, untouched])
    # fewer glances than candidates: exactly `num`; odd alignment: starts at odd rows only
    rows = _rows(trained, valid, [1])
    _, _, replaced = glance(rows, hidden, ids, k, num=2, generator=torch.Generator().manual_seed(1))
    picked = replaced[0].nonzero().flatten().tolist()
    assert len(picked) == 2 and all(r % 2 == 1 and r + 1 <= 8 for r in picked)
    assert not glance(rows, hidden, ids, k, num=0)[2].any()
    # k = 3: contiguous runs of 1..2 rows from a block start, never the whole block
    k = 3
    trained = [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    rows = _rows(trained, [[1] * 15], [0])
    hidden = torch.arange(16, dtype=torch.float32).view(1, 16, 1).expand(1, 16, 4) * 100
    ids = torch.arange(2000, 2016).view(1, 16)
    for seed in range(5):
        feats, next_ids, replaced = glance(rows, hidden, ids, k, num=6, generator=torch.Generator().manual_seed(seed))
        picked = replaced[0].nonzero().flatten().tolist()
        assert 0 < len(picked) <= 6
        for r in picked:
            start = r - r % 3
            assert all(replaced[0, start + j] for j in range(r - start + 1))    # the run reaches back to the start
            assert not replaced[0, start + 2]                                     # the block's last row is predicted
            assert torch.equal(feats[0, r], hidden[0, r + 3]) and next_ids[0, r] == ids[0, r + 4]


def test_lambda_schedules():
    assert glance_lambda(0.0) == pytest.approx(0.4) and glance_lambda(0.5) == pytest.approx(0.2)
    assert glance_lambda(1.0) == 0.0
    assert glance_lambda(0.0, "repo") == pytest.approx(0.45) and glance_lambda(1.0, "repo") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lambda_schedule"):
        glance_lambda(0.3, "cosine")


def test_distill_terms_over_all_candidates_are_the_full_softmax():
    g = torch.Generator().manual_seed(0)
    pred, w = torch.randn(5, 8, generator=g), torch.randn(30, 8, generator=g)
    tk = torch.stack([torch.randperm(30, generator=g)[:4] for _ in range(5)])
    lp = torch.randn(5, 4, generator=g).log_softmax(-1)
    full = distill_terms(pred, w, tk, lp)
    sub = distill_terms(pred, w, tk, lp, torch.arange(30))
    for a, b in zip(full, sub):
        torch.testing.assert_close(a, b)
    logp = (pred @ w.T).log_softmax(-1)
    p = lp.softmax(-1)
    kl = (p * (p.log() - logp.gather(1, tk))).sum(-1).mean()
    torch.testing.assert_close(full[0], kl)
    torch.testing.assert_close(full[1], -logp.gather(1, tk[:, :1]).mean())
    assert full[0] >= 0


@pytest.mark.parametrize("prefix_len", [16, 17])
def test_simulated_walks_are_the_serving_drafters_chains(tiny_target, prefix_len):
    """The offline walk (sar_ranks: root block from real rows, later blocks from predicted
    features and the data's tokens) and the serving drafter draft the same chain."""
    cfg, model = tiny_target.model_config, tiny_target.model
    head = FalconHead.from_target(cfg, model, init="random", seed=2).eval()
    depth = 6
    g = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(3, cfg.vocab_size, (prefix_len,), generator=g).tolist()
    drafter = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, head=head, tree="chain", depth=depth, block_size=4)
    seq = draft_view(0, prefix)
    drafter.start(seq)
    drafter.observe([seq], [(0, target_features(model, [prefix[:-1]])[0])])
    tree = drafter.propose([seq], [depth])[0]
    chain = tree.tokens[1:]
    assert len(chain) == depth and tree.parents == [-1, 0, 1, 2, 3, 4, 5]
    full = prefix + chain
    n, t = len(prefix), len(full)
    batch = {"input_ids": torch.tensor([full]), "hidden": target_features(model, [full])[0][None],
             "topk_ids": torch.full((1, t, 1), -100, dtype=torch.int64),
             "loss_mask": torch.zeros(1, t, dtype=torch.bool), "valid": torch.ones(1, t, dtype=torch.bool)}
    batch["topk_ids"][0, n - 1:n - 1 + depth, 0] = torch.tensor(chain)   # "labels" = the served drafts
    batch["loss_mask"][0, n - 1:t - 1] = True
    rope = rope_tables(cfg, 80, torch.device("cpu"))
    ranks = sar_ranks(head, batch, embed=model.embed, vocab_weight=model.lm_head_weight, vocab_ids=None, rope=rope,
                      blocks=3)
    assert ranks.shape == (depth, depth)      # chains a = N-3 .. T-3: their depth-1 token is an answer token
    assert ranks[0].tolist() == [0] * depth   # the chain rooted at the served root matches all its drafts
    assert (ranks[1:, -1] == -1).all()        # later chains run past the answer
    assert chain_tau(ranks[:1]) == 1 + depth
    assert tree_tau(ranks[:1], [[0], [0, 0], [1]], (1, 2, 3)) == {1: 2.0, 2: 3.0, 3: 3.0}


def test_csgd_glances_and_its_loss_falls(tiny_distill):
    target, data = tiny_distill
    batches = lambda e: data.train.batches(512, epoch=e, fields=FIELDS)   # noqa: E731
    held = list(data.held_back.batches(512, shuffle=False, fields=FIELDS))
    config = TrainConfig(epochs=6, lr=3e-3, warmup_steps=2, patience=None, progress=False, log_every=1)
    fit = fit_falcon(target.model, batches, held[:1], config=config, negatives=64, max_len=256, eval_blocks=2)
    losses, logs = fit.result.loss_history, fit.result.log_history
    assert len(losses) >= 24
    assert sum(losses[-3:]) < 0.75 * sum(losses[:3])
    assert sum(x["acc"] for x in logs[-3:]) > sum(x["acc"] for x in logs[:3])
    lams = [x["lambda"] for x in logs]
    assert lams[0] == pytest.approx(0.4, abs=0.02) and lams[-1] < 0.03 and lams == sorted(lams, reverse=True)
    assert logs[0]["glanced"] > 0 and logs[0]["glanced"] <= 0.4 * logs[0]["hamming"] + 1
    assert fit.result.eval_history and all(1.0 <= e["tau"] <= 5.0 for e in fit.result.eval_history)
    # without CSGD nothing is glanced and there is no first pass
    batch = next(iter(batches(0)))
    head = FalconHead.from_target(target.model_config, target.model)
    rope = rope_tables(target.model_config, 300, torch.device("cpu"))
    _, plain = falcon_loss(head, batch, embed=target.model.embed, lm_head_weight=target.model.lm_head_weight,
                           rope=rope, lam=0.0, negatives=64, generator=torch.Generator().manual_seed(0))
    assert plain["glanced"] == 0 and plain["hamming"] == 0
    _, glanced = falcon_loss(head, batch, embed=target.model.embed, lm_head_weight=target.model.lm_head_weight,
                             rope=rope, lam=0.4, negatives=64, generator=torch.Generator().manual_seed(0))
    assert 0 < glanced["glanced"] <= round(0.4 * glanced["hamming"]) + 1


def test_trainer_writes_a_checkpoint_that_round_trips(tiny_distill, tmp_path, tiny_model_factory, monkeypatch):
    target, data = tiny_distill
    out = train_falcon({"out": tmp_path / "ckpt", "epochs": 1, "lr": 3e-3, "train_batch_tokens": 512, "max_len": 256,
                        "negatives": 32, "progress": False, "final_chains": 256, "eval_chains": 128,
                        "draft_vocab": 100}, target, data)
    meta = read_meta(out)
    cfg, model = target.model_config, target.model
    assert meta.kind == "falcon" and meta.target_fingerprint == target.fingerprint
    assert meta.tau >= 1.0 and meta.tau_details["chains"] > 0 and meta.hyperparams["k"] == 2
    assert meta.hyperparams["csgd"] is True and meta.hyperparams["lambda_schedule"] == "paper"
    head, _ = load_head(out, model_config=cfg, target=model)
    rank = head.vocab_rank                                  # the label ranking travels with the head
    assert rank is not None and sorted(rank.tolist()) == list(range(cfg.vocab_size))
    if meta.tree is not None:                               # the shared trees.json was there: tree + measured order
        assert meta.tree["name"] == "falcon_kmask2_8layer_tree" and len(meta.tree["paths"]) == 165
        order = meta.tree["order"]
        assert sorted(map(tuple, order)) == sorted(map(tuple, meta.tree["paths"]))
        assert "falcon_kmask2_4layer_tree" in meta.tree["alternatives"]
        # served without the data folder: the tree and its order come from meta.json
        monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path / "nowhere"))
        drafter = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"),
                               dtype=torch.float32, max_model_len=64, checkpoint=str(out))
        assert drafter.tree_name == "falcon_kmask2_8layer_tree" and drafter.order == order
        alt = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, checkpoint=str(out), tree="falcon_kmask2_4layer_tree")
        assert len(alt.order) == 75
        monkeypatch.delenv("SPECSERVE_DATA")
    drafter = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, checkpoint=str(out))
    for name, t in head.state_dict().items():
        assert torch.equal(drafter.head.state_dict()[name], t)
    assert drafter.checkpoint_meta.tau == meta.tau and torch.equal(drafter.head.vocab_rank, rank)
    small = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64, checkpoint=str(out), draft_vocab=50)
    assert torch.equal(small.vocab.ids, rank[:50])
    assert shipped_checkpoint(cfg, model, root=tmp_path) == out
    monkeypatch.setattr("specserve.drafters.nets.falcon.CHECKPOINTS_DIR", tmp_path)
    found = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64)
    assert found.checkpoint_meta.target_fingerprint == target.fingerprint
    # another target (same shapes, other weights) refuses it, and finds no shipped one
    from specserve.drafters.train.pipeline import prepare_target

    other = prepare_target(str(tiny_model_factory(tmp_path / "other", seed=7)), device="cpu", dtype="float32",
                           max_positions=128)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        make_drafter("falcon", target=other.model, model_config=other.model_config, device=torch.device("cpu"),
                     dtype=torch.float32, max_model_len=64, checkpoint=str(out))
    assert shipped_checkpoint(other.model_config, other.model, root=tmp_path) is None
    # the ablation's checkpoint says it was trained without glancing
    plain = train_falcon({"out": tmp_path / "plain", "epochs": 1, "lr": 3e-3, "train_batch_tokens": 512,
                          "max_len": 256, "negatives": 32, "progress": False, "final_chains": 128, "eval_chains": 64,
                          "csgd": False}, target, data)
    hp = read_meta(plain).hyperparams
    assert hp["csgd"] is False and hp["lambda_schedule"] is None
