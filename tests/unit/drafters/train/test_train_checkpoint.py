"""The checkpoint format: round trip, a checkpoint refused for another target or another drafter
kind, and the target fingerprint (stable across fp32/bf16 loads, changed by a fine-tune)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.drafters.nets.checkpoint import (FORMAT_VERSION, CheckpointMeta, CheckpointMismatchError,
                                                 load_checkpoint, read_meta, resolve_checkpoint, save_checkpoint,
                                                 target_fingerprint)
from specserve.engine.config import ModelConfig
from specserve.engine.model import LlamaModel


def tiny_state(seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    kwargs.update(overrides)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    return ModelConfig.from_hf(hf.config), hf.state_dict()


def our_model(cfg, sd, dtype=torch.float32):
    return LlamaModel.from_state_dict(cfg, sd, max_positions=64, dtype=dtype, device=torch.device("cpu"))


def meta(**kw):
    base = dict(kind="medusa", target_name="tiny", target_fingerprint="0123456789abcdef",
                hyperparams={"num_heads": 3, "hidden_size": 32}, data={"sources": {"a": 3}, "num_examples": 3,
                                                                       "num_tokens": 120},
                train_seconds=1.5, device="cpu", tau=2.25,
                tree={"parents": [-1, 0, 0, 1], "choices": [[0], [1], [0, 0]]})
    base.update(kw)
    return CheckpointMeta(**base)


def test_round_trip(tmp_path):
    tensors = {"heads.weight": torch.randn(3, 32, 32), "heads.bias": torch.randn(3, 32),
               "tree_parents": torch.tensor([-1, 0, 0, 1], dtype=torch.int64)}
    out = save_checkpoint(tmp_path / "ckpt", tensors, meta())
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "model.safetensors"]   # no temporary files left
    loaded, m = load_checkpoint(out, kind="medusa", fingerprint="0123456789abcdef")
    assert loaded["heads.weight"].dtype == torch.bfloat16       # small on disk
    assert torch.equal(loaded["heads.weight"], tensors["heads.weight"].to(torch.bfloat16))
    assert torch.equal(loaded["tree_parents"], tensors["tree_parents"])   # integers kept as they are
    assert m == read_meta(out)
    assert (m.kind, m.target_name, m.hyperparams, m.tau, m.tree, m.format_version) == (
        "medusa", "tiny", {"num_heads": 3, "hidden_size": 32}, 2.25, meta().tree, FORMAT_VERSION)
    assert m.data["num_tokens"] == 120 and m.created   # the date is filled in
    raw = json.loads((out / "meta.json").read_text())
    assert raw["target_fingerprint"] == "0123456789abcdef" and raw["device"] == "cpu"
    fp32, _ = load_checkpoint(out, dtype=torch.float32)
    assert fp32["heads.bias"].dtype == torch.float32
    kept = save_checkpoint(tmp_path / "fp32", tensors, meta(), dtype=None)
    assert load_checkpoint(kept)[0]["heads.weight"].dtype == torch.float32


def test_other_target_is_refused_naming_both(tmp_path):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, meta(target_name="SmolLM2-135M-Instruct"))
    with pytest.raises(CheckpointMismatchError) as exc:
        load_checkpoint(tmp_path, kind="medusa", fingerprint="fedcba9876543210")
    message = str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert "SmolLM2-135M-Instruct" in message and "0123456789abcdef" in message and "fedcba9876543210" in message


def test_other_kind_is_refused(tmp_path):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, meta(kind="eagle"))
    with pytest.raises(CheckpointMismatchError, match="'eagle' checkpoint, not a 'medusa' one"):
        load_checkpoint(tmp_path, kind="medusa", fingerprint="0123456789abcdef")


def test_missing_and_future_checkpoints_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a drafter checkpoint"):
        load_checkpoint(tmp_path / "nowhere")
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, meta(format_version=FORMAT_VERSION + 1))
    with pytest.raises(CheckpointMismatchError, match="newer"):
        load_checkpoint(tmp_path)


def test_unknown_meta_fields_are_kept(tmp_path):
    save_checkpoint(tmp_path, {"w": torch.ones(2)}, {**meta().to_dict(), "future_field": 7})
    assert read_meta(tmp_path).extra["future_field"] == 7


def test_fingerprint_is_stable_across_dtypes_and_sources():
    cfg, sd = tiny_state()
    fp = target_fingerprint(cfg, our_model(cfg, sd))
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert target_fingerprint(cfg, our_model(cfg, sd, torch.bfloat16)) == fp
    assert target_fingerprint(cfg, sd) == fp                        # from the HF state dict
    assert target_fingerprint(cfg, our_model(cfg, sd)) == fp        # deterministic


def test_fingerprint_tells_targets_apart():
    cfg, sd = tiny_state()
    fp = target_fingerprint(cfg, sd)
    _, other_weights = tiny_state(seed=1)
    assert target_fingerprint(cfg, other_weights) != fp             # same config, other weights
    tuned = {k: v.clone() for k, v in sd.items()}
    tuned["model.embed_tokens.weight"][0] += 0.01                   # a fine-tune touching the embedding
    assert target_fingerprint(cfg, tuned) != fp
    cfg_rope, sd_rope = tiny_state(rope_theta=50000.0)
    assert target_fingerprint(cfg_rope, sd) != fp                   # same weights, other RoPE
    cfg_tied, _ = tiny_state(tie_word_embeddings=True)
    assert target_fingerprint(cfg_tied, sd) != fp


def test_resolve_checkpoint_prefers_the_given_one_then_the_shipped_one(tmp_path):
    save_checkpoint(tmp_path / "b-medusa", {"w": torch.ones(2)}, meta())
    save_checkpoint(tmp_path / "a-eagle", {"w": torch.ones(2)}, meta(kind="eagle"))
    save_checkpoint(tmp_path / "c-other", {"w": torch.ones(2)}, meta(target_fingerprint="fedcba9876543210"))
    assert resolve_checkpoint("medusa", "0123456789abcdef", None, tmp_path) == str(tmp_path / "b-medusa")
    assert resolve_checkpoint("medusa", "0123456789abcdef", "mine", tmp_path) == "mine"
    with pytest.raises(ValueError, match="specserve train parallelspec .*parallelspec.checkpoint=DIR"):
        resolve_checkpoint("parallelspec", "0123456789abcdef", None, tmp_path)
