"""The CTC-drafter network (Wen et al.): one decoder layer over the target's last-layer features
that emits T slot distributions over the draft vocabulary ∪ {blank}; its checkpoint I/O.

Rows and slots. `f_p` is the target's last-layer feature at position p (after the final norm, the
LM head's input) and `x_p` the token there. Every real position p gives one **row**

    r_p = fc([f_p ‖ e(x_{p+1})])          (e = the target's frozen embedding)

whose keys and values (the decoder layer's input norm, K/V projections, RoPE at p) form the
drafter's context; only keys and values are ever computed for rows. Drafting after row t (the
root, the last committed token, is x_{t+1}) appends T **slot** rows

    u_i = r_t + s_i    at position t + 1 + i,   i = 1..T   (s_i learned slot embeddings)

Each slot row runs through the whole layer (attention over the rows 0..t, output projection,
MLP), an output RMSNorm (initialised from the target's final norm), then

    P̂_i = softmax([LMHead(F̂_i) ‖ w_ε·F̂_i + b_ε])

over the draft vocabulary (the LM head rows of the N tokens the target chose most often in the
training data, `vocab_rank`) and the blank ε. The LM head is the target's, read by reference;
the blank row w_ε (and its bias b_ε) is the only output parameter the drafter owns. P̂_i is the
distribution of the i-th raw slot *after the root*; the slots are conditionally independent given
the context, as CTC assumes. Every slot attends to the same rows; what tells them apart is s_i
and the RoPE position of their query.

Only fc, the decoder layer, the slot embeddings, the output norm and the blank row are trained.
The decoder layer has the target's layer shape (the paper's "Attention Draft Module"), freshly
initialised; fc starts as [I | I] (a row's input is then f_p + e(x_{p+1})), the slot embeddings
small and random.

`forward_dense` is the training arithmetic (all positions of a padded batch at once);
`rows`/`row_kv`/`slot_features` the serving one (rows cached per sequence, the slots of a batch of
sequences); the tests check that they agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.base import RankedDraftNet
from specserve.drafters.nets.checkpoint import find_shipped, load_checkpoint, target_fingerprint
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, apply_rope, linear, rms_norm

KIND = "ctc"
DEFAULT_SLOTS = 5            # T: raw slots after the root
DEFAULT_LABELS = 4           # L: distilled tokens per CTC target (T - L slots of alignment slack)
DEFAULT_VOCAB = 4096         # output tokens besides the blank (the most frequent training labels)
SLOT_INIT_STD = 0.02

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


class CTCDraftNet(RankedDraftNet):
    """fc, one decoder layer of the target's shape, T slot embeddings, an output RMSNorm and the
    blank row (see the module docstring). The target's embedding and LM head are not held here."""

    def __init__(self, cfg: ModelConfig, num_slots: int = DEFAULT_SLOTS):
        super().__init__()
        if num_slots < 1:
            raise ValueError(f"ctc: num_slots must be >= 1, got {num_slots}")
        self.cfg, self.num_slots = cfg, int(num_slots)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(cfg)
        self.slots = nn.Parameter(torch.zeros(self.num_slots, h))
        self.norm = nn.Parameter(torch.ones(h))
        self.blank = nn.Parameter(torch.zeros(1, h))       # the extra output row ...
        self.blank_bias = nn.Parameter(torch.zeros(1))     # ... and its bias: the blank logit
        self.register_buffer("vocab_rank", None)            # training labels by frequency (drafters.draft_vocab)

    # -- construction / state --

    @classmethod
    def from_target(cls, cfg: ModelConfig, target, num_slots: int = DEFAULT_SLOTS, seed: int = 0) -> "CTCDraftNet":
        """The starting point of training (and the `random_init` net of tests), deterministic under
        `seed`: fc = [I | I] with zero bias, the output norm = the target's final norm, the decoder
        layer torch's default init, slot embeddings N(0, 0.02), blank row and bias zero."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = cls(cfg, num_slots)
            with torch.no_grad():
                net.slots.normal_(0.0, SLOT_INIT_STD)
        with torch.no_grad():
            eye = torch.eye(cfg.hidden_size)
            net.fc.weight.copy_(torch.cat([eye, eye], dim=1))
            net.fc.bias.zero_()
            net.norm.copy_(target.norm.detach().float())
        return net.float()

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> "CTCDraftNet":
        if "slots" not in tensors or tensors["slots"].dim() != 2:
            raise ValueError("ctc checkpoint tensors lack the slot embeddings")
        net = cls(cfg, tensors["slots"].shape[0])
        net.load_tensors(tensors, "ctc")
        return net

    def hyperparams(self) -> dict[str, Any]:
        c = self.cfg
        return {"num_slots": self.num_slots, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "attention_bias": c.attention_bias,
                "rows": "fc([post-norm feature f_p, embedding of x_{p+1}]): keys/values only",
                "slots": "row of the last feature + slot embedding at position t+1+i; one decoder layer; RMSNorm",
                "output": "target LM head (draft-vocabulary rows) + one trained blank row"}

    # -- shared arithmetic --

    def rows(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[..., H] features f_p and [..., H] embeddings of x_{p+1} -> [..., H] rows r_p."""
        return linear(torch.cat([features, token_embeds], dim=-1), self.fc.weight, self.fc.bias)

    def row_kv(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [..., T, H] (cos/sin [..., T, D] of their positions) -> k, v [..., T, kv_heads, D], RoPE on k."""
        L = self.layer
        x = rms_norm(rows, L.input_norm, L.eps)
        bias = None if L.qkv.bias is None else L.qkv.bias[L.q_size:]
        k, v = F.linear(x, L.qkv.weight[L.q_size:], bias).split([L.kv_size, L.kv_size], dim=-1)
        lead = rows.shape[:-1]
        k = apply_rope(k.reshape(*lead, L.num_kv_heads, L.head_dim), cos, sin)
        return k, v.reshape(*lead, L.num_kv_heads, L.head_dim)

    def slot_inputs(self, base: torch.Tensor) -> torch.Tensor:
        """[..., H] rows r_t -> [..., T, H] slot inputs r_t + s_i."""
        return base.unsqueeze(-2) + self.slots.to(base.dtype)

    def slot_queries(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """u [..., T, H] -> q [..., T, heads, D] (RoPE with cos/sin [..., T, D])."""
        L = self.layer
        x = rms_norm(u, L.input_norm, L.eps)
        bias = None if L.qkv.bias is None else L.qkv.bias[:L.q_size]
        q = F.linear(x, L.qkv.weight[:L.q_size], bias)
        return apply_rope(q.reshape(*u.shape[:-1], L.num_heads, L.head_dim), cos, sin)

    def finish(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """After attention (attn [..., heads * D]) -> F̂ [..., H]: output projection, MLP, output norm."""
        return rms_norm(self.layer.dense_finish(u, attn), self.norm, self.layer.eps)

    def log_probs(self, out: torch.Tensor, vocab_weight: torch.Tensor) -> torch.Tensor:
        """F̂ [..., H] -> fp32 log-probabilities [..., N + 1] over the N rows of `vocab_weight` (the
        LM head's draft-vocabulary rows) and the blank, last."""
        token = F.linear(out.to(vocab_weight.dtype), vocab_weight).float()
        return self.log_probs_from_logits(out, token)

    def log_probs_from_logits(self, out: torch.Tensor, token_logits: torch.Tensor) -> torch.Tensor:
        """Token logits [..., N] (already computed from F̂ [..., H]) plus the blank -> log-probabilities [..., N + 1]."""
        blank = F.linear(out, self.blank.to(out.dtype), self.blank_bias.to(out.dtype)).float()
        return torch.cat([token_logits.float(), blank], dim=-1).log_softmax(-1)

    def _group(self) -> int:
        return self.layer.num_heads // self.layer.num_kv_heads

    # -- training: every selected position of a padded batch --

    def forward_dense(self, features: torch.Tensor, token_embeds: torch.Tensor, select: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """features [B, L, H] (f_p), token_embeds [B, L, H] (e(x_{p+1}); anything at the last
        position), select [B, L] bool (the positions t to draft after), cos/sin tables [>= L + T + 1, D]
        (positions 0..) -> F̂ [N, T, H] for the N selected positions in row-major order.

        Slot i of position t sits at t + 1 + i and attends to the rows 0..t of its sequence (one
        masked attention over the batch: queries of all selected positions of a sequence against
        its rows)."""
        B, L, _ = features.shape
        T = self.num_slots
        rows = self.rows(features, token_embeds)                              # [B, L, H]
        k, v = self.row_kv(rows, cos[:L], sin[:L])                            # [B, L, kvh, D]
        b_idx, t_idx = select.nonzero(as_tuple=True)
        if b_idx.numel() == 0:
            return rows.new_zeros(0, T, rows.shape[-1])
        j_idx = (select.long().cumsum(1) - 1)[b_idx, t_idx]                  # index among its row's positions
        P = int(select.sum(1).max())
        u = self.slot_inputs(rows[b_idx, t_idx])                              # [N, T, H]
        pos = t_idx.unsqueeze(-1) + 1 + torch.arange(1, T + 1, device=rows.device)   # [N, T]: t + 1 + i
        q_sel = self.slot_queries(u, cos[pos], sin[pos])                      # [N, T, heads, D]
        heads, D = q_sel.shape[-2], q_sel.shape[-1]
        q = q_sel.new_zeros(B, P, T, heads, D)                                # each sequence's queries, padded
        q[b_idx, j_idx] = q_sel
        q = q.reshape(B, P * T, heads, D).transpose(1, 2)                     # [B, heads, P*T, D]
        t_pad = torch.zeros(B, P, dtype=torch.long, device=rows.device)
        t_pad[b_idx, j_idx] = t_idx
        g = self._group()
        kk = k.transpose(1, 2).repeat_interleave(g, 1)                        # [B, heads, L, D]
        vv = v.transpose(1, 2).repeat_interleave(g, 1)
        visible = torch.arange(L, device=rows.device).view(1, 1, L) <= t_pad.unsqueeze(-1)   # [B, P, L]
        mask = visible.unsqueeze(2).expand(B, P, T, L).reshape(B, 1, P * T, L)
        attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=self.layer.scale)
        attn = attn.transpose(1, 2).reshape(B, P, T, heads * D)
        return self.finish(u, attn[b_idx, j_idx])                             # [N, T, H]

    # -- serving: the slots of a batch of sequences over their cached rows --

    def slot_features(self, base: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """base [N, H] (r_t of each sequence), positions [N] (t), cos/sin tables, keys/values[n]
        [t_n + 1, kv_heads, D] (the rows 0..t of sequence n) -> F̂ [N, T, H]."""
        T = self.num_slots
        u = self.slot_inputs(base)                                            # [N, T, H]
        pos = positions.view(-1, 1) + 1 + torch.arange(1, T + 1, device=base.device)   # [N, T]: t + 1 + i
        q = self.slot_queries(u, cos[pos], sin[pos])                          # [N, T, heads, D]
        kvh, g = self.layer.num_kv_heads, self._group()
        D = q.shape[-1]
        outs = []
        for n in range(base.shape[0]):
            qn = q[n].view(T, kvh, g, D).permute(1, 2, 0, 3).reshape(kvh, g * T, D)
            kn, vn = keys[n].transpose(0, 1), values[n].transpose(0, 1)      # [kvh, len, D]
            w = torch.softmax((qn @ kn.transpose(1, 2)).float() * self.layer.scale, dim=-1).to(vn.dtype)
            a = (w @ vn).view(kvh, g, T, D).permute(2, 0, 1, 3).reshape(T, kvh * g * D)
            outs.append(a)
        return self.finish(u, torch.stack(outs))


# ---- checkpoints ----------------------------------------------------------------------------------------------------

def load_net(directory, *, model_config: ModelConfig, target) -> tuple[CTCDraftNet, Any]:
    """(net in fp32 on the CPU, meta) of the ctc checkpoint in `directory`; CheckpointMismatchError
    when it was made for another target or is not a ctc checkpoint."""
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint(model_config, target))
    return CTCDraftNet.from_tensors(model_config, tensors), meta


def shipped_checkpoint(model_config: ModelConfig, target, root: Path | None = None) -> Path | None:
    """The ctc checkpoint under drafters/checkpoints/ (any sub-folder) made for this target, if one is shipped."""
    found = find_shipped(KIND, target_fingerprint(model_config, target), CHECKPOINTS_DIR if root is None else root)
    return found[0][1] if found else None


__all__ = ["KIND", "DEFAULT_SLOTS", "DEFAULT_LABELS", "DEFAULT_VOCAB", "CTCDraftNet", "load_net",
           "shipped_checkpoint"]
