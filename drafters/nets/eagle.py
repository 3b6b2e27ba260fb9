"""The EAGLE-style draft head (served by drafters/eagle.py, trained by drafters/train/eagle.py)
and its checkpoint loading; see drafters/eagle.py for the maths of serving and
drafters/train/eagle.py for training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.base import RankedDraftNet
from specserve.drafters.nets.checkpoint import (CheckpointMeta, find_shipped, load_checkpoint, save_checkpoint,
                                                target_fingerprint)
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, linear, rms_norm, rope_tables

KIND = "eagle"
INITS = ("random", "last")


# ---- the head -----------------------------------------------------------------------------------------------------

class EagleHead(RankedDraftNet):
    """fc([feature ‖ token embedding]), one decoder layer of the target's shape, an RMSNorm.

    Serving calls `fuse`, `layer(...)` (the engine's DecoderLayer over a paged KV cache) and `out`;
    training calls `forward_dense` / `forward_unrolled`, the same arithmetic over padded batches
    with autograd-friendly ops (`tests/unit/drafters/train/test_eagle_train.py` checks they agree)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(cfg)
        self.norm = nn.Parameter(torch.ones(h))     # output RMSNorm: f̂ lives where the features live
        self.register_buffer("vocab_rank", None)   # optional: see set_vocab_rank

    # -- construction / state --

    @classmethod
    def from_target(cls, cfg: ModelConfig, target, init: str = "random", seed: int = 0) -> "EagleHead":
        """The starting point of training (and the `random_init` head for tests), deterministic:
        fc = [I | I] with zero bias, the output norm = the target's final norm, and the decoder
        layer either freshly initialised (`init="random"`, torch's default init under `seed`) or
        copied from the target's last layer (`init="last"`)."""
        if init not in INITS:
            raise ValueError(f"eagle: init must be one of {', '.join(INITS)}, got {init!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(cfg)
        with torch.no_grad():
            if init == "last":
                last = target.layers[len(target.layers) - 1]
                head.layer.load_state_dict({k: v.detach().clone().float() for k, v in last.state_dict().items()})
            head.norm.copy_(target.norm.detach().float())
            eye = torch.eye(cfg.hidden_size)
            head.fc.weight.copy_(torch.cat([eye, eye], dim=1))
            head.fc.bias.zero_()
        return head.float()

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> "EagleHead":
        head = cls(cfg)
        head.load_tensors(tensors, "eagle")
        return head

    def hyperparams(self) -> dict[str, Any]:
        c = self.cfg
        return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "attention_bias": c.attention_bias,
                "input": "fc([post-norm feature, token embedding]) + 1 decoder layer + RMSNorm",
                "output": "post-norm feature; LM head applied directly"}

    # -- shared arithmetic --

    def lift_features(self, features: torch.Tensor) -> torch.Tensor:
        """What the engine's feature rows become before `fuse`: EAGLE reads the last-layer feature
        as it is (EAGLE-3's head, nets/eagle3.py, lifts intermediate layers here)."""
        return features

    def features_of(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real rows' input features of a training batch ([B, T, H], fp32)."""
        return batch["hidden"].float()

    def fuse(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[..., H] + [..., H] -> [..., H]: the decoder layer's input."""
        return linear(torch.cat([features, token_embeds], dim=-1), self.fc.weight, self.fc.bias)

    def _qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, H] -> q [B, heads, T, D], k, v [B, kv_heads, T, D] (RoPE applied; cos/sin [T, D] or [B, T, D])."""
        q, k, v = self.layer.dense_qkv(h, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output -> f̂ (the output RMSNorm)."""
        return rms_norm(h, self.norm, self.layer.eps)

    def _finish(self, h: torch.Tensor, attn: torch.Tensor, select: torch.Tensor | None = None) -> torch.Tensor:
        """Residual, output projection, MLP and output norm after attention (attn [B, heads, T, D]).
        `select` [B, T] bool: only those rows (returned flattened [N, H]) -- the others are needed
        as keys and values only, so training skips their projection and MLP."""
        L = self.layer
        b, _, t, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(b, t, L.q_size)
        if select is not None:
            h, attn = h[select], attn[select]
        return self.out(L.dense_finish(h, attn))

    def _group(self) -> int:
        return self.layer.num_heads // self.layer.num_kv_heads

    def forward_dense(self, features: torch.Tensor, token_embeds: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, return_kv: bool = False, select: torch.Tensor | None = None):
        """Teacher-forced rows over padded sequences: features/token_embeds [B, T, H] (row p reads
        f_p and e(x_{p+1})), cos/sin [T, D] for positions 0..T-1 -> f̂ [B, T, H] (row p = f̂_{p+1}),
        or [N, H] for the rows of `select` only. Causal: padding at the end of a row never reaches
        earlier positions."""
        h = self.fuse(features, token_embeds)
        q, k, v = self._qkv(h, cos, sin)
        g = self._group()
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              is_causal=True, scale=self.layer.scale)
        out = self._finish(h, attn, select)
        return (out, (k, v)) if return_kv else out

    def forward_unrolled(self, features: torch.Tensor, token_embeds: list[torch.Tensor], cos: torch.Tensor,
                         sin: torch.Tensor) -> list[torch.Tensor]:
        """Chains of len(token_embeds) steps for every start row at once (training-time test).

        Step 1 is `forward_dense` over the real features. Step j >= 2 of chain p sits at position
        p + j - 1, reads (f̂ of its step j-1, token_embeds[j-1][:, p]) and attends to the real rows
        0..p and to its own rows of steps 2..j -- what the serving drafter sees when it drafts a
        chain after the real row p. `token_embeds[j-1][:, p]` is the embedding of x_{p+j};
        cos/sin [T', D] with T' >= T + steps - 1 (positions 0..). Returns the f̂ of every step,
        each [B, T, H] (row p of step j = the chain's prediction of f_{p+j})."""
        b, t, _ = features.shape
        g, scale = self._group(), self.layer.scale
        out1, (k_real, v_real) = self.forward_dense(features, token_embeds[0], cos[:t], sin[:t], return_kv=True)
        outs = [out1]
        k_real, v_real = k_real.repeat_interleave(g, 1), v_real.repeat_interleave(g, 1)   # [B, heads, T, D]
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril_()
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        for j in range(2, len(token_embeds) + 1):
            h = self.fuse(outs[-1], token_embeds[j - 1])
            q, k, v = self._qkv(h, cos[j - 1:j - 1 + t], sin[j - 1:j - 1 + t])
            own_k.append(k.repeat_interleave(g, 1))
            own_v.append(v.repeat_interleave(g, 1))
            s_real = (q @ k_real.transpose(-1, -2)) * scale                     # [B, heads, T, T]
            s_real = s_real.masked_fill(~causal, float("-inf"))
            s_own = torch.stack([(q * kk).sum(-1) for kk in own_k], dim=-1) * scale   # [B, heads, T, j-1]
            w = torch.softmax(torch.cat([s_real, s_own], dim=-1).float(), dim=-1).to(q.dtype)
            attn = w[..., :t] @ v_real + (w[..., t:, None] * torch.stack(own_v, dim=-2)).sum(-2)
            outs.append(self._finish(h, attn))
        return outs


# ---- checkpoints ------------------------------------------------------------------------------------------------

def save_head(directory, head: EagleHead, *, model_config: ModelConfig, target, target_name: str = "",
              kind: str = KIND, **meta_fields) -> Path:
    """Write `head` as an eagle checkpoint (or, with `kind`, of a head built on eagle's: eagle3)
    for `target` (fingerprinted)."""
    meta = CheckpointMeta(kind=kind, target_name=target_name or getattr(target, "name", "") or "target",
                          target_fingerprint=target_fingerprint(model_config, target),
                          hyperparams=head.hyperparams(), **meta_fields)
    return save_checkpoint(directory, head.tensors(), meta)


def load_head(directory, *, model_config: ModelConfig, target) -> tuple[EagleHead, Any]:
    """(head in fp32 on the CPU, meta) of the eagle checkpoint in `directory`; raises
    CheckpointMismatchError when it was made for another target or is not an eagle checkpoint."""
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint(model_config, target))
    return EagleHead.from_tensors(model_config, tensors), meta


CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_checkpoint(model_config: ModelConfig, target, root: Path | None = None, kind: str = KIND) -> Path | None:
    """The `kind` (eagle) checkpoint under drafters/checkpoints/ (any sub-folder) made for this
    target, if one is shipped."""
    found = find_shipped(kind, target_fingerprint(model_config, target), CHECKPOINTS_DIR if root is None else root)
    return found[0][1] if found else None
