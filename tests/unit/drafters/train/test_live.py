"""Training from token ids with the target's rows computed in the loop (drafters/train/live.py):
the batches equal the teacher shards' (same plan, same rows), rows are kept between epochs within
the memory bound and recomputed beyond it, the held-back split is by prompt, and every trainer
trains from it end to end."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.drafters.nets.checkpoint import read_meta
from specserve.drafters.train import get_trainer
from specserve.drafters.train.data import held_back_ids, render_example
from specserve.drafters.train.live import LiveDataset, LiveFeatures

FIELDS = ("input_ids", "hidden", "labels", "topk_ids", "topk_logprobs", "answer_mask")


def assert_same_batches(shard_batches, live_batches):
    assert len(shard_batches) == len(live_batches)
    for s, v in zip(shard_batches, live_batches):
        assert s["ids"] == v["ids"]
        for name in ("input_ids", "valid", "answer_mask", "loss_mask", "positions", "lengths"):
            assert torch.equal(s[name], v[name]), name
        # the same target over the same tokens, batched with other sequences: equal labels, and
        # hidden states equal up to fp16 storage
        assert torch.equal(s["labels"], v["labels"]) and torch.equal(s["topk_ids"], v["topk_ids"])
        torch.testing.assert_close(s["hidden"], v["hidden"], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(s["topk_logprobs"], v["topk_logprobs"], atol=1e-4, rtol=1e-4)


def test_live_batches_equal_the_teacher_shards(tiny_distill, tiny_live):
    _, shards = tiny_distill
    _, live = tiny_live
    assert (live.train.ids, live.held_back.ids) == (shards.train.ids, shards.held_back.ids)
    assert live.train.num_tokens == shards.train.num_tokens and live.manifest["format"] == "live"
    for kwargs in (dict(epoch=1, seed=3), dict(window=16, epoch=0, seed=5), dict(shuffle=False)):
        assert_same_batches(list(shards.train.batches(512, fields=FIELDS, **kwargs)),
                            list(live.train.batches(512, fields=FIELDS, **kwargs)))
    assert_same_batches(list(shards.held_back.batches(256, shuffle=False, fields=FIELDS)),
                        list(live.held_back.batches(256, shuffle=False, fields=FIELDS)))
    for i in (0, 5, len(shards.train) - 1):          # one example at a time (medusa reads them so)
        s, v = shards.train.example(i), live.train.example(i)
        assert torch.equal(s["labels"], v["labels"]) and torch.equal(s["input_ids"].long(), v["input_ids"].long())


def test_rows_are_kept_within_the_memory_bound(tiny_distill):
    target, shards = tiny_distill
    rendered = [render_example(target.tokenizer, ex, max_len=256) for ex in shards.examples]
    tokens = sum(len(r.input_ids) for r in rendered)

    def dataset(memory_bytes):
        features = LiveFeatures(target.model, [r.input_ids for r in rendered], top_k=4, batch_tokens=512,
                                memory_bytes=memory_bytes)
        return features, LiveDataset(features, shards.examples, rendered, manifest={})

    features, ds = dataset(1 << 30)
    first = [b["hidden"] for b in ds.batches(512, epoch=0, fields=("hidden",))]
    assert features.computed_tokens == tokens and features.stats()["held_examples"] == len(ds)
    second = [b["hidden"] for b in ds.batches(512, epoch=0, fields=("hidden",))]
    assert features.computed_tokens == tokens                      # the second epoch computes nothing
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    list(ds.batches(512, epoch=0, fields=("input_ids", "answer_mask")))
    assert features.computed_tokens == tokens                      # token fields need no target

    small, ds = dataset(1)                                         # nothing fits: every epoch recomputes
    again = [b["hidden"] for b in ds.batches(512, epoch=0, fields=("hidden",))]
    list(ds.batches(512, epoch=0, fields=("hidden",)))
    assert small.computed_tokens == 2 * tokens and small.stats()["held_bytes"] == 0
    assert all(torch.allclose(a, b, atol=2e-3) for a, b in zip(first, again))


def test_the_answers_of_one_prompt_are_held_back_together():
    ids = [f"p{i}@t{t}" for i in range(40) for t in ("0", "0.7")] + [f"q{i}" for i in range(10)]
    held = held_back_ids(ids, 12)
    prompts = {i.partition("@")[0] for i in held}
    assert len(prompts) == 12
    assert all(f"{p}@t0" in held and f"{p}@t0.7" in held for p in prompts if p.startswith("p"))
    assert held == held_back_ids(list(reversed(ids)), 12)          # independent of the order


# ---- every trainer from live rows ----------------------------------------------------------------------------------

TRAINERS = {
    "eagle": {"epochs": 1, "lr": 1e-3, "train_batch_tokens": 512, "max_len": 256, "negatives": 32,
              "final_chains": 128, "engine_tau_prompts": 0},
    "medusa": {"epochs": 1, "batch_size": 64, "lr": 3e-3, "num_negatives": 256, "tuned_nodes": 8,
               "engine_tau_prompts": 2},
    "ctc": {"epochs": 1, "lr": 1e-3, "train_batch_tokens": 512, "max_len": 256, "final_positions": 128,
            "engine_tau_prompts": 0, "num_slots": 4, "label_len": 3},
    "falcon": {"epochs": 1, "lr": 3e-3, "train_batch_tokens": 512, "max_len": 256, "negatives": 32,
               "final_chains": 128, "eval_chains": 64, "draft_vocab": 100, "engine_tau_prompts": 0},
    "parallelspec": {"epochs": 1, "lr": 3e-3, "max_len": 256, "k": 2, "layout_tokens": 512, "num_negatives": 64,
                     "eval_budget": 4, "tuned_nodes": 8, "engine_tau_prompts": 0},
    "student": {"num_layers": 1, "epochs": 1, "negatives": 64, "window": 64, "batch_tokens": 2048},
}


@pytest.mark.parametrize("drafter", sorted(TRAINERS))
def test_every_trainer_trains_from_live_rows(drafter, tiny_live, tmp_path):
    target, data = tiny_live
    out = get_trainer(drafter)({"out": str(tmp_path / "ckpt"), "progress": False, "seed": 0, "device": "cpu",
                                **TRAINERS[drafter]}, target, data)
    meta = read_meta(out)
    assert meta.kind == drafter and meta.target_fingerprint == target.fingerprint and meta.device == "cpu"
    assert meta.tau is not None and meta.tau >= 1.0 and meta.train_seconds is not None and meta.train_seconds >= 0
    assert meta.hyperparams["steps"] > 0
    saved = json.loads((out / "meta.json").read_text())["data"]
    assert saved["features"] == "live" and saved["feature_stats"]["computed_tokens"] > 0
    assert saved["num_tokens"] == data.manifest["num_tokens"] and saved["held_back_examples"] == len(data.held_back)
    assert not list(tmp_path.rglob("*.safetensors"))[1:]            # the checkpoint only: no shard was written
