"""The distilled student draft model (served by drafters/student.py through the draft-model
machinery, trained by drafters/train/student.py) and its checkpoint loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.checkpoint import find_shipped, load_checkpoint, target_fingerprint
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, LlamaModel, rms_norm

KIND = "student"


class StudentModel(nn.Module):
    """Trainable: `layers` and `norm`. Shared, frozen and never saved: the target's embedding, LM
    head and RoPE tables (held outside the module's parameters)."""

    def __init__(self, cfg: ModelConfig, num_layers: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self._shared: dict[str, Any] = {}
        self.vocab_rank: torch.Tensor | None = None   # the training labels' ranking (drafters.draft_vocab)

    @classmethod
    def from_target(cls, target: LlamaModel, num_layers: int) -> "StudentModel":
        """The target's first `num_layers` layers and its final norm, copied (then trained)."""
        if not 1 <= num_layers <= target.num_layers:
            raise ValueError(f"num_layers must be in [1, {target.num_layers}], got {num_layers}")
        student = cls(target.cfg, num_layers)
        ref = target.embed.weight
        student.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            for mine, theirs in zip(student.layers, target.layers):
                for (name, p), (_, q) in zip(mine.named_parameters(), theirs.named_parameters()):
                    p.copy_(q)
            student.norm.copy_(target.norm)
        return student.share(target)

    def share(self, target: LlamaModel) -> "StudentModel":
        self._shared = {"embed": target.embed, "lm_head_weight": target.lm_head_weight,
                        "rope_cos": target.rope_cos, "rope_sin": target.rope_sin}
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._shared["lm_head_weight"]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach() for k, v in self.state_dict().items()}
        if self.vocab_rank is not None:
            out["vocab_rank"] = self.vocab_rank.to(torch.int32)      # half the bytes on disk
        return out

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> "StudentModel":
        tensors = dict(tensors)
        rank = tensors.pop("vocab_rank", None)
        num_layers = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("layers."))
        student = cls(cfg, num_layers)
        student.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        student.vocab_rank = None if rank is None else rank.to(torch.int64)
        return student

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dense causal forward for training: [B, T] ids and positions -> [B, T, H] hidden after the
        norm. Batches are right-padded, so causal attention never lets a real token see padding."""
        h = self._shared["embed"](input_ids).to(self.norm.dtype)
        cos = self._shared["rope_cos"][positions].to(h.dtype)
        sin = self._shared["rope_sin"][positions].to(h.dtype)
        for layer in self.layers:
            h = _dense_layer(layer, h, cos, sin)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def as_draft_model(self, target: LlamaModel, dtype: torch.dtype, device: torch.device) -> LlamaModel:
        """A LlamaModel for serving: these layers and norm, the target's embedding, head and RoPE
        tables by reference."""
        view = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(view)
        view.cfg = target.cfg
        view.embed = target.embed
        view.layers = nn.ModuleList(self.layers).to(device=device, dtype=dtype)
        view.norm = nn.Parameter(self.norm.detach().to(device=device, dtype=dtype), requires_grad=False)
        view.lm_head = target.lm_head
        view.max_positions = target.max_positions
        view.rope_cos, view.rope_sin = target.rope_cos, target.rope_sin
        return view.eval().requires_grad_(False)


def _dense_layer(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DecoderLayer's maths on a dense [B, T, H] batch with causal SDPA (differentiable; the
    serving path runs the same weights over the paged cache)."""
    b, t, _ = h.shape
    q, k, v = layer.dense_qkv(h, cos, sin)                                    # [B, T, heads, D]
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True, scale=layer.scale)
    return layer.dense_finish(h, attn.transpose(1, 2).reshape(b, t, -1))


# ---- checkpoints --------------------------------------------------------------------------------------------------

def shipped_checkpoint(model_config: ModelConfig, target, num_layers: int | None = None) -> Path | None:
    """A student checkpoint under drafters/checkpoints/ made for this target (the given size, or the
    largest shipped)."""
    sizes = [(int(meta.hyperparams.get("num_layers", 0)), path)
             for meta, path in find_shipped(KIND, target_fingerprint(model_config, target))]
    sizes = [(n, path) for n, path in sizes if num_layers is None or n == int(num_layers)]
    return max(sizes)[1] if sizes else None


def load_student(directory, *, model_config: ModelConfig, target) -> tuple[StudentModel, Any]:
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint(model_config, target))
    return StudentModel.from_tensors(model_config, tensors), meta
