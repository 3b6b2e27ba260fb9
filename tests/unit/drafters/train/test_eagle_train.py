"""The eagle trainer: its dense training forward is the serving layer's arithmetic, its simulated
chains are the serving drafter's chains, the loss falls on tiny shards, and checkpoints round-trip
(and are refused for another target)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import draft_view

from specserve.drafters.base import make_drafter
from specserve.drafters.nets.checkpoint import CheckpointMismatchError, read_meta
from specserve.drafters.train.eagle import (EagleHead, chain_matches, estimate_tau, fit_eagle, load_head, save_head,
                                            shipped_checkpoint, train_eagle)
from specserve.drafters.train.loop import TrainConfig
from specserve.drafters.train.target import target_features
from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.model import rope_rows, rope_tables


def perturbed_head(target, seed: int = 0, scale: float = 0.05) -> EagleHead:
    """The trainer's starting head plus noise: clearly not the identity, still well-scaled."""
    head = EagleHead.from_target(target.model_config, target.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


def test_dense_training_forward_is_the_serving_layer(tiny_target):
    """forward_dense on a padded batch == fc + the engine's DecoderLayer + norm over a paged cache
    (two chunks per sequence, as prefill and catch-up write them)."""
    head = perturbed_head(tiny_target)
    cfg, model = tiny_target.model_config, tiny_target.model
    g = torch.Generator().manual_seed(1)
    lengths = [13, 7, 20]
    ids = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    feats = [torch.randn(n, cfg.hidden_size, generator=g) for n in lengths]
    cos, sin = rope_tables(cfg, 64, torch.device("cpu"))
    width = max(lengths)
    f = torch.zeros(len(lengths), width, cfg.hidden_size)
    e = torch.zeros(len(lengths), width, cfg.hidden_size)
    for b, (t, x) in enumerate(zip(ids, feats)):
        f[b, :len(t)] = x
        e[b, :len(t)] = model.embed(torch.tensor(t))
    with torch.no_grad():
        dense = head.forward_dense(f, e, cos[:width], sin[:width])
    blocks = BlockManager(64, 4)
    cache = KVCache(1, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    for b, n in enumerate(lengths):
        blocks.grow(b, n)
    paged = [[] for _ in lengths]
    for lo, hi in ((0, 5), (5, None)):
        qlens = [len(t[lo:hi]) for t in ids]
        pos, meta = build_attn_metadata([blocks.block_tables[b] for b in range(3)], 4, [lo] * 3, qlens, None,
                                        torch.device("cpu"))
        h = head.fuse(torch.cat([x[lo:hi] for x in feats]), model.embed(torch.tensor([i for t in ids for i in t[lo:hi]])))
        with torch.no_grad():
            out = head.out(head.layer(h, rope_rows(cos[pos], sin[pos]), *cache.layer(0), meta))
        for b, (a, z) in enumerate(zip(meta.cu_query_lens, meta.cu_query_lens[1:])):
            paged[b].append(out[a:z])
    for b, n in enumerate(lengths):
        torch.testing.assert_close(dense[b, :n], torch.cat(paged[b]), atol=1e-5, rtol=1e-5)
    select = torch.rand(len(lengths), width, generator=g) < 0.5          # training: loss rows only
    with torch.no_grad():
        torch.testing.assert_close(head.forward_dense(f, e, cos[:width], sin[:width], select=select), dense[select])


def test_simulated_chains_are_the_serving_drafters_chains(tiny_target):
    """τ simulation (forward_unrolled) and serving (catch-up, then one tree row per level with
    predicted features) draft the same chain after the same prefix."""
    head = perturbed_head(tiny_target, seed=2, scale=0.1)
    cfg, model = tiny_target.model_config, tiny_target.model
    steps = 5
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, cfg.vocab_size, (17,), generator=g).tolist()      # ... root
    drafter = make_drafter("eagle", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, head=head, depth=steps, top_k=1, width=1, block_size=4)
    seq = draft_view(0, prefix)
    drafter.start(seq)
    feats = target_features(model, [prefix[:-1]])[0]
    drafter.observe([seq], [(0, feats)])
    tree = drafter.propose([seq], [steps])[0]
    chain = tree.tokens[1:]
    assert len(chain) == steps and tree.parents == [-1, 0, 1, 2, 3, 4]
    # teacher-forced simulation over prefix + chain: chain p = len(prefix) - 2 reads the same tokens
    full = prefix + chain
    hidden = target_features(model, [full])[0]
    batch = {"input_ids": torch.tensor([full]), "hidden": hidden[None],
             "topk_ids": torch.full((1, len(full), 1), -100, dtype=torch.int64),
             "loss_mask": torch.zeros(1, len(full), dtype=torch.bool)}
    p = len(prefix) - 2
    batch["topk_ids"][0, p + 1:p + 1 + steps, 0] = torch.tensor(chain)   # "labels" = the served drafts
    batch["loss_mask"][0, p + 1:] = True
    rope = rope_tables(cfg, 64, torch.device("cpu"))
    counts = chain_matches(head, batch, embed=model.embed, lm_head_weight=model.lm_head_weight, rope=rope,
                           steps=steps)
    assert counts[0].item() == steps          # the chain starting after row p matches all its drafts
    assert counts.numel() == len(full) - 1 - p   # one chain per answer position p+1 .. T-1


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory, pool_writer):
    from specserve.drafters.train.pipeline import prepare_data

    tmp = tmp_path_factory.mktemp("eagle_data")
    pool = pool_writer(tmp / "train_prompts.jsonl", {"a": 16, "b": 8})
    return prepare_data(tiny_target, {"data": str(pool), "cache_dir": str(tmp / "cache"), "max_examples": 24,
                                      "max_len": 64, "eval_examples": 4, "top_k": 4, "progress": False})


def test_loss_falls_on_tiny_shards(tiny_target, tiny_data):
    batches = lambda e: tiny_data.train.batches(512, epoch=e, fields=("input_ids", "hidden", "topk_ids",   # noqa: E731
                                                                      "topk_logprobs"))
    held = list(tiny_data.held_back.batches(512, shuffle=False))
    config = TrainConfig(epochs=12, lr=3e-3, warmup_steps=2, patience=None, progress=False, log_every=1)
    fit = fit_eagle(tiny_target.model, batches, held, config=config, negatives=64, max_len=64)
    losses, logs = fit.result.loss_history, fit.result.log_history
    assert len(losses) >= 24
    assert sum(losses[-3:]) < 0.75 * sum(losses[:3])
    assert sum(x["reg"] for x in logs[-3:]) < 0.6 * sum(x["reg"] for x in logs[:3])    # features regress
    assert sum(x["acc"] for x in logs[-3:]) > sum(x["acc"] for x in logs[:3])          # tokens follow
    assert fit.result.eval_history and all(1.0 <= e["tau"] <= 6.0 for e in fit.result.eval_history)


def test_trainer_writes_a_checkpoint_that_round_trips(tiny_target, tiny_data, tmp_path, tiny_model_factory,
                                                      monkeypatch):
    out = train_eagle({"out": tmp_path / "ckpt", "epochs": 1, "lr": 1e-3, "train_batch_tokens": 512, "max_len": 64,
                       "negatives": 32, "progress": False, "final_chains": 256}, tiny_target, tiny_data)
    meta = read_meta(out)
    assert meta.kind == "eagle" and meta.target_fingerprint == tiny_target.fingerprint
    assert meta.tau >= 1.0 and meta.tau_details["chains"] > 0 and meta.hyperparams["hidden_size"] == 64
    assert json.loads((out / "meta.json").read_text())["data"]["held_back_examples"] == 4
    cfg, model = tiny_target.model_config, tiny_target.model
    head, _ = load_head(out, model_config=cfg, target=model)
    # the drafter loads it through the option, and finds it as a shipped checkpoint for this target
    drafter = make_drafter("eagle", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, checkpoint=str(out))
    for name, t in head.state_dict().items():
        assert torch.equal(drafter.head.state_dict()[name], t)
    assert drafter.checkpoint_meta.tau == meta.tau
    rank = head.vocab_rank                                  # the label ranking travels with the head
    assert rank is not None and sorted(rank.tolist()) == list(range(cfg.vocab_size))
    small = make_drafter("eagle", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64, checkpoint=str(out), draft_vocab=50)
    assert torch.equal(small.vocab.ids, rank[:50])
    assert shipped_checkpoint(cfg, model, root=tmp_path) == out
    monkeypatch.setattr("specserve.drafters.nets.eagle.CHECKPOINTS_DIR", tmp_path)
    found = make_drafter("eagle", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64)
    assert found.checkpoint_meta.target_fingerprint == tiny_target.fingerprint
    # another target (same shapes, other weights) refuses it, and finds no shipped one
    from specserve.drafters.train.pipeline import prepare_target

    other = prepare_target(str(tiny_model_factory(tmp_path / "other", seed=7)), device="cpu", dtype="float32",
                           max_positions=128)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        make_drafter("eagle", target=other.model, model_config=other.model_config, device=torch.device("cpu"),
                     dtype=torch.float32, max_model_len=64, checkpoint=str(out))
    assert shipped_checkpoint(other.model_config, other.model, root=tmp_path) is None
    with pytest.raises(ValueError, match="specserve train eagle"):
        make_drafter("eagle", target=other.model, model_config=other.model_config, device=torch.device("cpu"),
                     dtype=torch.float32, max_model_len=64)


def test_save_head_keeps_bf16_weights_and_the_tau_estimate(tiny_target, tiny_data, tmp_path):
    head = perturbed_head(tiny_target)
    held = list(tiny_data.held_back.batches(512, shuffle=False))
    rope = rope_tables(tiny_target.model_config, 80, torch.device("cpu"))
    report = estimate_tau(head, held, embed=tiny_target.model.embed, lm_head_weight=tiny_target.model.lm_head_weight,
                          rope=rope)
    out = save_head(tmp_path / "h", head, model_config=tiny_target.model_config, target=tiny_target.model,
                    target_name="tiny", tau=report["tau"])
    loaded, meta = load_head(out, model_config=tiny_target.model_config, target=tiny_target.model)
    assert meta.tau == report["tau"] and meta.target_name == "tiny"
    for name, t in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t.to(torch.bfloat16).float())
