"""The eagle3 trainer: live rows carry the target's intermediate layers exactly, a head started from
eagle is eagle on its real rows, training-time test learns chains, the trainer runs end to end from
live rows (and refuses teacher shards) and its checkpoint serves greedy-identical through the engine."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_llm_engine, run_requests

from specserve.drafters.nets.checkpoint import read_meta
from specserve.drafters.nets.eagle import EagleHead, save_head
from specserve.drafters.nets.eagle3 import Eagle3Head, load_head
from specserve.drafters.train import get_trainer
from specserve.drafters.train.eagle import estimate_tau
from specserve.drafters.train.eagle3 import FIELDS, fit_eagle3, start_head
from specserve.drafters.train.loop import TrainConfig
from specserve.drafters.train.pipeline import live_data, prepare_data
from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.model import rope_tables
from specserve.engine.sampling_params import SamplingParams

LAYERS = (0, 1, 2)   # eagle3's default for the 2-layer tiny target: embeddings, middle, last output


@pytest.fixture(scope="module")
def tiny_live3(tiny_distill):
    """`tiny_live` with the target's layers 0, 1 and 2 kept beside the last-layer rows."""
    target, shards = tiny_distill
    options = dict(max_len=256, top_k=4, eval_examples=12, batch_tokens=512, feature_memory_gb=1.0, distilled=None)
    return target, live_data(target, shards.examples, options, LAYERS)


def captured_alone(model, tokens: list[int]) -> torch.Tensor:
    """The target's layers over one sequence in one prefill: [n, len(LAYERS), H]."""
    cfg, n = model.cfg, len(tokens)
    num_blocks = -(-n // 16) + 1
    cache = KVCache(cfg.num_layers, num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    blocks = BlockManager(num_blocks, 16)
    blocks.grow(0, n)
    positions, meta = build_attn_metadata([blocks.block_tables[0]], 16, [0], [n], None, "cpu")
    with torch.no_grad():
        return model(torch.tensor(tokens), positions, cache, meta, LAYERS)[1]


def test_live_rows_carry_the_targets_layers(tiny_live3, tiny_live):
    target, data = tiny_live3
    _, plain = tiny_live
    assert data.train.capture_layers == LAYERS and plain.train.capture_layers == ()
    with_layers = list(data.train.batches(512, epoch=0, fields=(*FIELDS, "hidden")))
    without = list(plain.train.batches(512, epoch=0, fields=("input_ids", "hidden", "topk_ids")))
    for a, b in zip(with_layers, without):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["topk_ids"], b["topk_ids"])
        assert torch.equal(a["hidden"], b["hidden"])                  # the same last-layer rows
        assert a["layers"].shape == (*a["input_ids"].shape, 3, target.model_config.hidden_size)
    batch = with_layers[0]
    for r in range(2):                                               # each row: that sequence's own layers
        n = int(batch["lengths"][r])
        if int(batch["positions"][r, 0]) != 0:
            continue
        want = captured_alone(target.model, batch["input_ids"][r, :n].tolist())
        torch.testing.assert_close(batch["layers"][r, :n], want, atol=2e-3, rtol=2e-3)   # fp16 storage
        assert not batch["layers"][r, n:].any()                     # padding
    with pytest.raises(ValueError, match="no intermediate layers"):
        next(iter(plain.train.batches(512, fields=FIELDS)))


def test_a_head_started_from_eagle_is_eagle_on_real_rows(tiny_live3):
    """lift = [0 | 0 | I] and the layer norms = the final norm: over a last captured layer equal to the
    target's last output, g is the target's feature, so the copied head gives eagle's outputs."""
    target, data = tiny_live3
    cfg, model = target.model_config, target.model
    eagle = EagleHead.from_target(cfg, model, init="last")
    head = Eagle3Head.from_target(cfg, model, init="eagle", eagle=eagle, layers=LAYERS)
    batch = next(iter(data.train.batches(512, epoch=0, fields=(*FIELDS, "hidden"))))
    cos, sin = rope_tables(cfg, 512, torch.device("cpu"))
    t = batch["input_ids"].shape[1]
    emb = model.embed(batch["input_ids"]).float()
    with torch.no_grad():
        torch.testing.assert_close(head.features_of(batch), batch["hidden"].float(), atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(head.forward_dense(head.features_of(batch), emb, cos[:t], sin[:t]),
                                   eagle.forward_dense(batch["hidden"].float(), emb, cos[:t], sin[:t]),
                                   atol=2e-2, rtol=2e-2)


def test_training_time_test_learns_chains(tiny_live3):
    target, data = tiny_live3
    cfg, model = target.model_config, target.model
    batches = list(data.train.batches(1024, shuffle=False, fields=FIELDS))
    rope = rope_tables(cfg, 512, torch.device("cpu"))
    head = Eagle3Head.from_target(cfg, model, layers=LAYERS)

    def tau(h):
        return estimate_tau(h, batches, embed=model.embed, lm_head_weight=model.lm_head_weight, rope=rope,
                            steps=4)["tau"]

    before = tau(head)
    config = TrainConfig(epochs=40, lr=1e-2, warmup_steps=5, patience=None, progress=False, device="cpu")
    fit = fit_eagle3(model, batches, None, config=config, head=head, steps=3, negatives=None, max_len=256)
    assert fit.result.steps == 40 * len(batches)
    losses = fit.result.loss_history
    assert sum(losses[-len(batches):]) < 0.9 * sum(losses[:len(batches)])
    after = tau(fit.head)
    assert after > before + 0.5, (before, after)                    # 1.58 -> 2.33 when written
    # the same training teacher-forced only (one step per position) drafts shorter chains (2.12)
    one = fit_eagle3(model, batches, None, config=config, head=Eagle3Head.from_target(cfg, model, layers=LAYERS),
                     steps=1, negatives=None, max_len=256)
    assert after > tau(one.head) + 0.1


def test_trainer_end_to_end_from_live_rows(tiny_live3, tiny_llama_dir, tmp_path):
    target, data = tiny_live3
    options = {"out": str(tmp_path / "e3"), "progress": False, "seed": 0, "device": "cpu", "epochs": 2, "lr": 3e-3,
               "train_batch_tokens": 512, "max_len": 256, "negatives": 32, "final_chains": 128, "init": "random",
               "engine_tau_prompts": 0}
    out = get_trainer("eagle3")(options, target, data)
    meta = read_meta(out)
    assert meta.kind == "eagle3" and meta.hyperparams["layers"] == list(LAYERS) and meta.hyperparams["steps"] > 0
    assert meta.tau >= 1.0 and meta.tau_details["chains"] > 0
    # the checkpoint serves: greedy output equal to plain decoding, drafts made
    prompts = [[5 + i, 40, 77, 120 + i, 9] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_requests(make_llm_engine(tiny_llama_dir), prompts, params)
    engine = make_llm_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"checkpoint": str(out)}})
    assert run_requests(engine, prompts, params) == plain
    assert engine.get_stats().drafters["eagle3"].num_draft_tokens > 0
    saved = json.loads((out / "meta.json").read_text())["data"]
    assert saved["features"] == "live" and saved["feature_stats"]["computed_tokens"] > 0
    with pytest.raises(ValueError, match="holds layers"):
        get_trainer("eagle3")({**options, "layers": "0,2"}, target, data)
    with pytest.raises(ValueError, match="init=eagle needs an eagle checkpoint"):
        get_trainer("eagle3")({**options, "init": "eagle"}, target, data)
    # init=eagle3 continues that checkpoint: the start is its head, and its held-back tau before any step
    head, how = start_head({"init": "eagle3", "eagle3_checkpoint": str(out)}, target, LAYERS, seed=1)
    saved_head, _ = load_head(out, model_config=target.model_config, target=target.model)
    assert str(out) in how and head.layers == LAYERS
    for name, tensor in saved_head.state_dict().items():
        assert torch.equal(head.state_dict()[name], tensor), name
    again = get_trainer("eagle3")({**options, "init": "eagle3", "eagle3_checkpoint": str(out), "epochs": 1,
                                   "out": str(tmp_path / "e3b")}, target, data)
    assert read_meta(again).hyperparams["init"] == how
    with pytest.raises(ValueError, match="reads layers"):
        start_head({"init": "eagle3", "eagle3_checkpoint": str(out)}, target, (0, 2), seed=0)
    # vocab_rank=keep: the continued head keeps its checkpoint's draft-vocabulary ranking, not this data's
    flipped = tmp_path / "e3flip"
    saved_head.set_vocab_rank(saved_head.vocab_rank.flip(0))
    save_head(flipped, saved_head, model_config=target.model_config, target=target.model, kind="eagle3")
    for choice, expected in (("keep", saved_head.vocab_rank), ("data", head.vocab_rank)):
        cont = get_trainer("eagle3")({**options, "init": "eagle3", "eagle3_checkpoint": str(flipped), "epochs": 1,
                                      "vocab_rank": choice, "out": str(tmp_path / f"e3-{choice}")}, target, data)
        kept, _ = load_head(cont, model_config=target.model_config, target=target.model)
        assert torch.equal(kept.vocab_rank, expected) and read_meta(cont).hyperparams["vocab_rank"] == choice
    with pytest.raises(ValueError, match="vocab_rank=keep keeps the ranking"):    # init=random: none to keep
        get_trainer("eagle3")({**options, "vocab_rank": "keep", "out": str(tmp_path / "never")}, target, data)
    assert not (tmp_path / "never").exists()


def test_teacher_shards_are_refused_with_the_way_out(tiny_distill, tmp_path):
    target, shards = tiny_distill
    with pytest.raises(ValueError, match="--distilled answers or with --features live"):
        prepare_data(target, {"data": None, "features": "shards", "max_len": 64, "top_k": 3,
                              "cache_dir": str(tmp_path / "cache"), "progress": False}, LAYERS)
