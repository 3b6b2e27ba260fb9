"""The ParallelSpec drafter network (served by drafters/parallelspec.py, trained by
drafters/train/parallelspec.py) and its checkpoint loading; see drafters/train/parallelspec.py for
the training layout and drafters/parallelspec.py for serving."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.checkpoint import load_checkpoint
from specserve.engine.attention import build_attn_metadata
from specserve.engine.config import ModelConfig
from specserve.engine.kv_cache import KVCache
from specserve.engine.model import DecoderLayer, linear, rms_norm, rope_at, rope_tables

KIND = "parallelspec"


# ---- the network -----------------------------------------------------------------------------------------------------


@torch.no_grad()
def last_layer_input_rms(target, num_tokens: int = 64) -> float:
    """Median RMS of the residual stream entering the target's last layer over a probe sequence
    of spread-out token ids (position 0, often an attention sink, left out)."""
    cfg = target.cfg
    dev = target.embed.weight.device
    num_tokens = max(2, min(num_tokens, target.rope_cos.shape[0]))
    ids = (torch.arange(num_tokens) * 7919 + 1000) % cfg.vocab_size
    block = 16
    nb = -(-num_tokens // block)
    cache = KVCache(len(target.layers), nb, block, cfg.num_kv_heads, cfg.head_dim, target.embed.weight.dtype, dev)
    positions, meta = build_attn_metadata([list(range(nb))], block, [0], [num_tokens], None, dev)
    h = target.embed(ids.to(dev))
    rope = rope_at(target.rope_cos, target.rope_sin, positions, h.dtype)
    for i, layer in enumerate(target.layers[:-1]):
        h = layer(h, rope, *cache.layer(i), meta)
    return float(h.float().pow(2).mean(-1).sqrt()[1:].median())


class ParallelSpecModule(nn.Module):
    """fc([f_prev ‖ e(x)]) for real tokens, learned [MASK] embeddings, one decoder layer, a final
    norm; the target's embedding and LM head are used by reference (never parameters here)."""

    def __init__(self, cfg: ModelConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *, k: int = 4,
                 max_positions: int = 4096):
        super().__init__()
        if k < 1:
            raise ValueError(f"k (number of [MASK] tokens) must be >= 1, got {k}")
        self.cfg, self.k = cfg, k
        H = cfg.hidden_size
        self.norm_f = nn.Parameter(torch.ones(H))     # RMS norms of the two fc inputs: the feature's and the
        self.norm_e = nn.Parameter(torch.ones(H))     # embedding's scales differ by ~20x in SmolLM2
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.mask_embed = nn.Parameter(torch.zeros(k, H))
        self.layer = DecoderLayer(cfg)
        self.norm = nn.Parameter(torch.ones(H))
        # frozen target tensors, shared by reference (plain attributes: not in state_dict, never copied)
        self.__dict__["embed_weight"] = embed_weight
        self.__dict__["lm_head_weight"] = lm_head_weight
        self.max_positions = max_positions
        self.hyper: dict[str, Any] = {}              # facts about the init, for checkpoint metadata
        self.vocab_rank: torch.Tensor | None = None  # the training labels' ranking (drafters.draft_vocab)
        # fp32 RoPE tables kept out of .to(dtype) (plain attributes, like the frozen tensors)
        self.__dict__["rope_cos"], self.__dict__["rope_sin"] = rope_tables(cfg, max_positions, embed_weight.device)

    # -- construction --

    @classmethod
    def from_target(cls, target, cfg: ModelConfig, *, k: int = 4, max_positions: int = 4096, seed: int = 0,
                    fc_init: str = "identity") -> "ParallelSpecModule":
        """A fresh module whose layer and final norm copy the target's last layer and final norm.
        "identity": fc starts as s * (norm(f) + norm(e)) / sqrt(2), s = the RMS of the residual
        stream entering the target's last layer (measured on a probe sequence), so the copied
        layer sees inputs of the scale it was trained on; the masks start as the normed mean
        embedding at that scale. "random": fc at random (EAGLE's init)."""
        g = torch.Generator().manual_seed(seed)
        w = target.embed.weight
        mod = cls(cfg, target.embed.weight, target.lm_head_weight, k=k, max_positions=max_positions)
        mod.to(device=w.device, dtype=w.dtype)
        last = target.layers[len(target.layers) - 1]
        H = cfg.hidden_size
        scale = last_layer_input_rms(target)
        with torch.no_grad():
            mod.layer.load_state_dict({n: t.detach().clone() for n, t in last.state_dict().items()})
            mod.norm.copy_(target.norm.detach())
            if fc_init == "identity":
                eye = torch.eye(H) * (scale / math.sqrt(2))
                noise = torch.randn(H, 2 * H, generator=g) * (0.02 * scale / math.sqrt(H))
                mod.fc.weight.copy_(torch.cat([eye, eye], dim=1) + noise)
                mod.fc.bias.zero_()
            elif fc_init == "random":
                bound = 1 / math.sqrt(2 * H)
                mod.fc.weight.copy_(torch.empty(H, 2 * H).uniform_(-bound, bound, generator=g))
                mod.fc.bias.copy_(torch.empty(H).uniform_(-bound, bound, generator=g))
            else:
                raise ValueError(f"fc_init must be 'identity' or 'random', got {fc_init!r}")
            mean = w.detach().float().mean(0).cpu()
            mean = mean / mean.pow(2).mean().sqrt().clamp_min(1e-6)
            masks = mean[None, :] * (scale / math.sqrt(2)) + torch.randn(k, H, generator=g) * (0.1 * scale)
            mod.mask_embed.copy_(masks)
        mod.hyper = {"input_scale": scale}
        return mod

    @classmethod
    def random(cls, target, cfg: ModelConfig, *, k: int = 4, max_positions: int = 4096, seed: int = 0,
               scale: float = 0.02) -> "ParallelSpecModule":
        """Random weights (tests): the target's last layer perturbed, random masks."""
        mod = cls.from_target(target, cfg, k=k, max_positions=max_positions, seed=seed, fc_init="random")
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in mod.layer.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p) * scale)
        return mod

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores (the frozen target tensors are not in it)."""
        out = {n: t.detach() for n, t in self.state_dict().items()}
        if self.vocab_rank is not None:
            out["vocab_rank"] = self.vocab_rank.to(torch.int32)      # half the bytes on disk
        return out

    # -- pieces shared by training and serving --

    def real_inputs(self, token_ids: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """[..., H] inputs of real positions: fc([norm(f_{p-1}) ‖ norm(e(x_p))]) (f = 0 stays 0)."""
        eps = self.cfg.rms_norm_eps
        e = rms_norm(F.embedding(token_ids, self.embed_weight).to(self.fc.weight.dtype), self.norm_e, eps)
        f = rms_norm(prev_features.to(e.dtype), self.norm_f, eps)
        return linear(torch.cat([f, e], dim=-1), self.fc.weight, self.fc.bias)

    def out_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Layer output -> the LM head's input (the EAGLE variant regresses this onto f)."""
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    # -- serving: paged KV (engine DecoderLayer) --

    def forward_paged(self, h: torch.Tensor, positions: torch.Tensor, k_cache, v_cache, meta) -> torch.Tensor:
        rope = rope_at(self.rope_cos, self.rope_sin, positions, h.dtype)
        return self.out_hidden(self.layer(h, rope, k_cache, v_cache, meta))

    # -- training: a dense custom mask --

    def forward_dense(self, h: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """h [B, L, H], positions [B, L], attn_mask [B, L, L] bool -> normed output [B, L, H].
        The same math as DecoderLayer.forward with SDPA over an explicit mask."""
        layer = self.layer
        B, L, _ = h.shape
        cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        q, k, v = (t.transpose(1, 2) for t in layer.dense_qkv(h, cos, sin))       # [B, heads, L, D]
        group = layer.num_heads // layer.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None], scale=layer.scale)
        return self.out_hidden(layer.dense_finish(h, o.transpose(1, 2).reshape(B, L, layer.q_size)))

    def forward_grouped(self, h_real: torch.Tensor, pos_real: torch.Tensor, anchors: torch.Tensor) -> tuple:
        """The group-wise parallel layout without its dense [L, L] mask, for training: h_real
        [B, T, H] (real rows, causal; padding at the end), pos_real [B, T], anchors [B, A] (padded
        anyhow: those rows are simply not used). Mask i of the group of anchor t sits at position
        t+i and attends to the real keys 0..t and to masks 1..i of its own group: attention costs
        O(T^2 + A*k*T) instead of O((T + A*k)^2). Returns the normed outputs (real [B, T, H],
        masks [B, A, k, H]); equal to `forward_dense` over `build_parallel_layout` (tested)."""
        layer, k = self.layer, self.k
        B, T, H = h_real.shape
        A = anchors.shape[1]
        nh, nkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        slots = torch.arange(1, k + 1, device=anchors.device)
        pos_mask = anchors[:, :, None] + slots                                    # [B, A, k]
        h = torch.cat([h_real.reshape(B * T, H),
                       self.mask_embed.to(h_real.dtype)[None].expand(B * A, k, H).reshape(B * A * k, H)])
        pos = torch.cat([pos_real.reshape(-1), pos_mask.reshape(-1)])
        cos, sin = self.rope_cos[pos].to(h.dtype), self.rope_sin[pos].to(h.dtype)
        q, kk, v = layer.dense_qkv(h, cos, sin)                                   # [N, heads, D]
        g = nh // nkv
        if g > 1:
            kk, v = kk.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        n_real = B * T
        q_r, k_r, v_r = (t[:n_real].view(B, T, nh, D).transpose(1, 2) for t in (q, kk, v))      # [B, nh, T, D]
        q_m, k_m, v_m = (t[n_real:].view(B, A, k, nh, D).permute(0, 3, 1, 2, 4) for t in (q, kk, v))  # [B,nh,A,k,D]
        o_r = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True, scale=layer.scale)
        s_real = (q_m.reshape(B, nh, A * k, D) @ k_r.transpose(-1, -2)).view(B, nh, A, k, T) * layer.scale
        see_real = torch.arange(T, device=anchors.device)[None, None, :] <= anchors[:, :, None]   # [B, A, T]
        s_real = s_real.masked_fill(~see_real[:, None, :, None, :], float("-inf"))
        s_own = (q_m @ k_m.transpose(-1, -2)) * layer.scale                                      # [B, nh, A, k, k]
        own = torch.ones(k, k, dtype=torch.bool, device=anchors.device).tril()
        s_own = s_own.masked_fill(~own, float("-inf"))
        p = torch.softmax(torch.cat([s_real, s_own], dim=-1).float(), dim=-1).to(q.dtype)
        o_m = (p[..., :T].reshape(B, nh, A * k, T) @ v_r).view(B, nh, A, k, D) + p[..., T:] @ v_m
        o = torch.cat([o_r.transpose(1, 2).reshape(n_real, nh * D),
                       o_m.permute(0, 2, 3, 1, 4).reshape(B * A * k, nh * D)])
        h = self.out_hidden(layer.dense_finish(h, o))
        return h[:n_real].view(B, T, H), h[n_real:].view(B, A, k, H)


def load_module(checkpoint_dir, target, cfg: ModelConfig, *, fingerprint: str | None, max_positions: int,
                device=None, dtype=None) -> tuple[ParallelSpecModule, Any]:
    """(module, meta) from a checkpoint folder; refuses one made for another target."""
    tensors, meta = load_checkpoint(checkpoint_dir, kind=KIND, fingerprint=fingerprint)
    rank = tensors.pop("vocab_rank", None)
    hp = meta.hyperparams
    if hp.get("hidden_size", cfg.hidden_size) != cfg.hidden_size:
        raise ValueError(f"{checkpoint_dir}: hidden size {hp.get('hidden_size')} does not match the target's "
                         f"{cfg.hidden_size}")
    mod = ParallelSpecModule(cfg, target.embed.weight, target.lm_head_weight, k=int(hp.get("k", 4)),
                             max_positions=max_positions)
    dev = device if device is not None else target.embed.weight.device
    dt = dtype if dtype is not None else target.embed.weight.dtype
    mod.load_state_dict({n: t.to(dev, dt) for n, t in tensors.items()}, strict=True)
    mod.to(device=dev, dtype=dt)
    mod.vocab_rank = None if rank is None else rank.to(torch.int64)
    return mod.eval().requires_grad_(False), meta
