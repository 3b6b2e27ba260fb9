"""Student distillation: the dense training forward equals the served paged forward, the loss falls
on tiny self-distilled shards, the checkpoint round-trips into the
`student` drafter (sharing the target's embedding and head) and is refused for another target."""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.train.loop import TrainConfig, train
from specserve.drafters.train.student import StudentModel, estimate_tau, student_loss, train_student
from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache


def test_dense_training_forward_equals_the_served_model(tiny_distill):
    target, _ = tiny_distill
    student = StudentModel.from_target(target.model, 2)   # all layers: equals the target itself
    ids = torch.tensor([[5, 9, 13, 200, 7, 31, 8]])
    pos = torch.arange(7)[None]
    with torch.no_grad():
        dense = student(ids, pos)[0]
    served = student.as_draft_model(target.model, torch.float32, torch.device("cpu"))
    blocks = BlockManager(4, 4)
    blocks.grow(0, 7)
    cache = KVCache(2, 4, 4, target.model_config.num_kv_heads, target.model_config.head_dim, torch.float32, "cpu")
    positions, meta = build_attn_metadata([blocks.block_tables[0]], 4, [0], [7], None, torch.device("cpu"))
    with torch.inference_mode():
        paged = served(ids[0], positions, cache, meta)
        ref = target.model(ids[0], positions, KVCache(2, 4, 4, target.model_config.num_kv_heads,
                                                      target.model_config.head_dim, torch.float32, "cpu"), meta)
    torch.testing.assert_close(dense, paged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged, ref, atol=1e-5, rtol=1e-5)
    assert served.embed is target.model.embed and served.lm_head_weight is target.model.lm_head_weight


def test_distillation_loss_falls(tiny_distill):
    """The tiny random target's next-token laws are nearly flat (its loss floor is high), so the
    check is on the trend of the loss, over the full vocabulary and with sampled negatives."""
    target, data = tiny_distill
    embed_before = target.model.embed.weight.clone()
    evals = list(data.held_back.batches(2048, window=64, shuffle=False))
    for negatives in (None, 64):
        student = StudentModel.from_target(target.model, 1)
        gen = torch.Generator().manual_seed(0)
        result = train(student, lambda m, b: student_loss(m, b, negatives=negatives, generator=gen),
                       lambda epoch: data.train.batches(256, window=64, epoch=epoch),
                       eval_fn=lambda m: estimate_tau(m, evals),
                       config=TrainConfig(epochs=5, lr=1e-2, progress=False, patience=None))
        first, last = result.loss_history[:10], result.loss_history[-10:]
        assert sum(last) < 0.95 * sum(first), negatives
        assert all(1.0 <= e["tau"] <= 5.0 for e in result.eval_history)
    assert torch.equal(target.model.embed.weight, embed_before)    # the shared embedding stays frozen


def test_checkpoint_round_trip_into_the_drafter_and_refusal(tiny_distill, tmp_path, tiny_model_factory):
    from specserve.drafters.base import make_drafter
    from specserve.drafters.train import get_trainer
    from specserve.drafters.nets.checkpoint import CheckpointMismatchError, load_checkpoint
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    target, data = tiny_distill
    assert get_trainer("student") is train_student
    out = train_student({"out": str(tmp_path / "student"), "num_layers": 1, "epochs": 1, "negatives": 64,
                         "window": 64, "batch_tokens": 2048, "progress": False}, target, data)
    tensors, meta = load_checkpoint(out, kind="student", fingerprint=target.fingerprint)
    assert meta.hyperparams["num_layers"] == 1 and meta.tau >= 1.0 and meta.data["num_examples"] == 60
    assert not any("embed" in k or "lm_head" in k for k in tensors)      # shared weights are not saved
    kwargs = dict(target=target.model, model_config=target.model_config, device=torch.device("cpu"),
                  dtype=torch.float32, max_model_len=256, max_num_seqs=4)
    drafter = make_drafter("student", checkpoint=str(out), **kwargs)
    assert drafter.model.num_layers == 1 and drafter.model.embed is target.model.embed
    torch.testing.assert_close(drafter.model.norm, tensors["norm"].float())
    assert sorted(tensors["vocab_rank"].tolist()) == list(range(target.model_config.vocab_size))
    small = make_drafter("student", checkpoint=str(out), draft_vocab=40, **kwargs)   # the ranking's first 40
    assert torch.equal(small.vocab.ids, tensors["vocab_rank"][:40].long())

    other = tiny_model_factory(tmp_path / "other", seed=7)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        LLMEngine(EngineConfig(model=str(other), dtype="float32", device="cpu", max_model_len=128,
                               drafters=("student",), drafter_options={"student": {"checkpoint": str(out)}}))
    with pytest.raises(ValueError, match="specserve train student"):
        make_drafter("student", **kwargs)
