"""Falcon's semi-autoregressive (SAR) drafter head: the network, its relaxed causal mask, its
checkpoints (Gao et al., "Falcon: Faster and Parallel Inference of LLMs Through Enhanced
Semi-Autoregressive Drafting and Custom-Designed Decoding Tree", AAAI 2025).

Rows, features and the k-step shift
-----------------------------------
`f_p` is the target's last-layer hidden state at position p after the final norm (the LM head's
input: what the engine hands feature-reading drafters and what the teacher shards hold), `x_p`
the token at position p, `e` the target's frozen embedding. Row p of the head reads the fused
pair (f_p, x_{p+1}) -- the feature and the token one step ahead, EAGLE's observation -- and
predicts the feature **k positions ahead**:

    row p:  reduce([f_p ‖ e(x_{p+1})]) -> one decoder layer (relaxed causal mask) -> RMSNorm -> f̂_{p+k}
    token:  softmax(LMHead(f̂_{p+k}))  = the drafter's distribution of x_{p+k+1}

(the target's frozen LM head, shared by reference). This is the paper's worked example for
k = 2 -- features (f1, f2) with tokens (t2, t3) predict (f3, f4), whose LM head gives (t4, t5) --
and the official code's data layout (`target = hidden_state[:, k:]`). Eq. 1 of the paper, read
literally, shifts by one; under a mask that is bidirectional inside a block that would let row p
read its own target f_{p+1} from its block mate, so the k-step shift is the consistent reading.

Relaxed causal mask
-------------------
Rows are grouped in blocks of k consecutive rows: a row sees every row of its own block and of
every earlier block (bidirectional inside a block, causal across blocks). Row i of a block at
rows a..a+k-1 thus sees rows <= a+k-1 and predicts f̂_{a+k+i}: one forward drafts k tokens.
`relaxed_causal_mask` builds it with blocks aligned at any offset; the trainer draws the offset
per example, so every position is trained both as the first and as the second row of a block.

Block alignment in serving (digest §3.8 decision 2): the root block is anchored at the root.
With the committed tokens x_0 .. x_{N-1} (x_{N-1} the tree root, which has no feature yet), the
rows that can be computed from real features are 0 .. N-2 and the **root block** is rows
N-1-k .. N-2 (all real inputs, the root itself being the token half of the last one): its k
outputs give the depth-1 .. depth-k distributions. Earlier rows are "the prefix", all visible.
Because the reduction is position-wise and there is a single decoder layer, the keys and values
of a row depend on that row's input alone, never on the mask: rows computed in earlier steps
stay valid whatever block they fell in, and only the queries of the root block need the relaxed
mask (`root_block_mask`: causal rows, then the last k rows as one block). So the target never
re-verifies committed tokens (the official code's "root holds k tokens" re-feeding is not needed):
the engine hands the drafter the target's features of accepted positions (`observe`), and the
drafter re-runs the queries of the previous root block's rows when they become part of the new
one.

The reduction: decision on "two LSTM layers"
--------------------------------------------
The paper's "hybrid Transformer": two LSTM layers reduce the fused 2H input to H ("retaining
information about past tokens"), then relaxed-causal self-attention and an MLP; the whole is
"equivalent to two Transformer layers". The official code calls `nn.LSTM(2H, H, num_layers=2)`
without `batch_first` on a [batch, seq, 2H] tensor, so the LSTM's time axis is the batch axis:
at batch size 1 (its inference) every position is a sequence of length one, run from a zero
state -- the LSTM is position-wise and carries no information along the sequence. We implement
exactly that computation, and say so: per layer, from a zero state,

    i, g, o = split(W x + b);   c = σ(i) ⊙ tanh(g);   h = σ(o) ⊙ tanh(c)

(the forget gate and the recurrent weights multiply the zero state and are dropped), 2H -> H
then H -> H, dropout between the layers in training. A truly recurrent LSTM would make every
tree node carry its path's state and the drafter's KV depend on the block alignment; information
about past tokens reaches every row through the attention anyway. Then **one** decoder layer of
the target's shape (RMSNorm, RoPE, SwiGLU; the official config also has one) and an output
RMSNorm initialised from the target's final norm (as our EAGLE head: the output lives where the
target's features live, which the LM head reads). About 9·H² reduction + one decoder layer:
"two layers" worth of parameters, 6.5 M for SmolLM2-135M.

Initialisation (`init="identity"`, the default): the candidate gate g of the first layer reads
`s·[I | I]` (s = 0.25), of the second `I`, the input and output gates have bias 2 and small
random weights, so the first rows start as a squashed `s·(f_p + e(x_{p+1}))` -- the counterpart
of our EAGLE head's `fc = [I | I]` start; `init="random"` is torch's LSTM initialisation.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.base import RankedDraftNet
from specserve.drafters.nets.checkpoint import (CheckpointMeta, find_shipped, load_checkpoint, save_checkpoint,
                                                target_fingerprint)
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, rms_norm

logger = logging.getLogger("specserve")

KIND = "falcon"
DEFAULT_K = 2            # tokens per drafter forward (the paper's best)
INITS = ("identity", "random")
IDENTITY_SCALE = 0.25    # first reduction layer's g = s * [I | I]
GATE_BIAS = 2.0          # input and output gates start open (sigmoid(2) = 0.88)
CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


# ---- the relaxed causal mask -----------------------------------------------------------------------------------

def block_ids(n: int, k: int, offset: int = 0, device=None) -> torch.Tensor:
    """[n] block index of each row when blocks of `k` rows start at rows ≡ offset (mod k); rows
    before `offset` form a shorter first block (index -1)."""
    return torch.div(torch.arange(n, device=device) - offset, k, rounding_mode="floor")


def relaxed_causal_mask(n: int, k: int, offset: int = 0, prefix: int = 0, device=None) -> torch.Tensor:
    """[n, prefix + n] bool, True = visible: `prefix` earlier rows all visible, then the relaxed
    causal mask over n rows (a row sees its whole k-block and every earlier block).

    Example, n = 5, k = 2, offset = 0 (blocks {0,1} {2,3} {4}):

        row 0: 1 1 0 0 0
        row 1: 1 1 0 0 0
        row 2: 1 1 1 1 0
        row 3: 1 1 1 1 0
        row 4: 1 1 1 1 1
    """
    b = block_ids(n, k, offset, device)
    mask = b[None, :] <= b[:, None]
    if prefix:
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), mask], dim=1)
    return mask


def root_block_mask(n: int, k: int, device=None) -> torch.Tensor:
    """[n, n] bool: the mask of a serving catch-up chunk of n rows whose last k rows are the
    root block -- causal for the rows before it (their outputs are never read, only their keys
    and values, which do not depend on the mask), and the last k rows as one block (each sees
    all n rows)."""
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    mask[max(0, n - k):, :] = True
    return mask


# ---- the network -----------------------------------------------------------------------------------------------

class GatedReduction(nn.Module):
    """A 2-layer LSTM run one position at a time from a zero state: 2H -> H -> H (see the module
    docstring). weight_l [3H, in] holds the (input, candidate, output) gates, in that order."""

    def __init__(self, in_size: int, hidden: int, num_layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.hidden, self.num_layers, self.dropout = hidden, num_layers, dropout
        sizes = [in_size] + [hidden] * (num_layers - 1)
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(3 * hidden, s)) for s in sizes)
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(3 * hidden)) for _ in sizes)
        bound = hidden ** -0.5   # torch's LSTM initialisation
        with torch.no_grad():
            for w, b in zip(self.weights, self.biases):
                w.uniform_(-bound, bound)
                b.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, (w, b) in enumerate(zip(self.weights, self.biases)):
            if layer and self.training and self.dropout:
                x = F.dropout(x, self.dropout)
            i, g, o = F.linear(x, w.to(x.dtype), b.to(x.dtype)).chunk(3, dim=-1)
            x = torch.sigmoid(o) * torch.tanh(torch.sigmoid(i) * torch.tanh(g))
        return x


class FalconHead(RankedDraftNet):
    """reduce([feature ‖ token embedding]) -> one decoder layer -> RMSNorm, k tokens per forward.

    Serving calls `fuse`, `layer(...)` (the engine's DecoderLayer over a paged KV cache, with the
    relaxed mask given as a tree mask) and `out`; training calls `forward_dense`, the same
    arithmetic over padded batches with SDPA and an explicit relaxed mask."""

    def __init__(self, cfg: ModelConfig, k: int = DEFAULT_K, dropout: float = 0.1):
        super().__init__()
        if k < 1:
            raise ValueError(f"falcon: k must be >= 1, got {k}")
        self.cfg, self.k = cfg, int(k)
        h = cfg.hidden_size
        self.reduce = GatedReduction(2 * h, h, 2, dropout)
        self.layer = DecoderLayer(cfg)
        self.norm = nn.Parameter(torch.ones(h))     # output RMSNorm: f̂ lives where the features live
        self.register_buffer("vocab_rank", None)   # optional: see set_vocab_rank

    # -- construction / state --

    @classmethod
    def from_target(cls, cfg: ModelConfig, target, *, k: int = DEFAULT_K, init: str = "identity", seed: int = 0,
                    intermediate_size: int | None = None, dropout: float = 0.1) -> "FalconHead":
        """The starting point of training (and the `random_init` head of tests), deterministic
        under `seed`: the output norm = the target's final norm, the reduction as `init` says
        (see the module docstring), the decoder layer torch's default initialisation.
        `intermediate_size`: the decoder layer's MLP width (default: the target's)."""
        if init not in INITS:
            raise ValueError(f"falcon: init must be one of {', '.join(INITS)}, got {init!r}")
        if intermediate_size:
            cfg = dataclasses.replace(cfg, intermediate_size=int(intermediate_size))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(cfg, k=k, dropout=dropout)
            if init == "identity":
                h = cfg.hidden_size
                with torch.no_grad():
                    for layer, (w, b) in enumerate(zip(head.reduce.weights, head.reduce.biases)):
                        w.normal_(0.0, 0.002)
                        b.zero_()
                        eye = torch.eye(h)
                        w[h:2 * h] = torch.cat([eye, eye], dim=1) * IDENTITY_SCALE if layer == 0 else eye
                        b[:h] = GATE_BIAS
                        b[2 * h:] = GATE_BIAS
        with torch.no_grad():
            head.norm.copy_(target.norm.detach().float())
        return head.float()

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor], hyperparams: dict | None = None
                     ) -> "FalconHead":
        """The head a checkpoint holds (`hyperparams`: its meta's, for k and the MLP width)."""
        hp = hyperparams or {}
        if "layer.down.weight" in tensors:
            cfg = dataclasses.replace(cfg, intermediate_size=int(tensors["layer.down.weight"].shape[1]))
        head = cls(cfg, k=int(hp.get("k", DEFAULT_K)), dropout=float(hp.get("dropout", 0.1)))
        head.load_tensors(tensors, "falcon")
        return head

    def hyperparams(self) -> dict[str, Any]:
        c = self.cfg
        return {"k": self.k, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "attention_bias": c.attention_bias, "dropout": self.reduce.dropout,
                "parameters": sum(p.numel() for p in self.parameters()),
                "input": "position-wise 2-layer LSTM cell (zero state) over [post-norm feature, embedding of the "
                         "token one step ahead], 2H -> H",
                "body": "1 decoder layer under the relaxed causal mask (k-blocks) + RMSNorm",
                "output": f"post-norm feature {self.k} positions ahead; LM head applied directly"}

    # -- shared arithmetic --

    def fuse(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[..., H] + [..., H] -> [..., H]: the decoder layer's input."""
        return self.reduce(torch.cat([features, token_embeds.to(features.dtype)], dim=-1))

    def out(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output -> f̂ (the output RMSNorm)."""
        return rms_norm(h, self.norm, self.layer.eps)

    def attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Dense attention of the decoder layer: h [B, T, H] (its input), cos/sin [T, D] or [B, T, D],
        mask [B or 1, T, T] bool (True = visible) -> attn [B, T, heads * D] (before the output projection)."""
        L = self.layer
        q, k, v = L.dense_qkv(h, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        g = L.num_heads // L.num_kv_heads
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              attn_mask=mask[:, None], scale=L.scale)
        b, _, t, _ = attn.shape
        return attn.transpose(1, 2).reshape(b, t, L.q_size)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, MLP, residuals and output norm after attention."""
        return self.out(self.layer.dense_finish(h, attn))

    def forward_dense(self, features: torch.Tensor, token_embeds: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, *, valid: torch.Tensor | None = None,
                      offsets: torch.Tensor | list[int] | int = 0, select: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Teacher-forced rows over padded sequences under the relaxed causal mask.

        features/token_embeds [B, T, H]: row p reads f_p and e(x_{p+1}); cos/sin [T, D] for
        positions 0..T-1; `valid` [B, T] bool (False: padding, never seen); `offsets` the block
        alignment of each sequence (an int or [B]). Returns f̂ [B, T, H] (row p = f̂_{p+k}), or
        [N, H] for the rows of `select` [B, T] only."""
        b, t, _ = features.shape
        device = features.device
        offs = torch.as_tensor(offsets, device=device).reshape(-1).expand(b)
        ids = torch.div(torch.arange(t, device=device)[None, :] - offs[:, None], self.k, rounding_mode="floor")
        mask = ids[:, None, :] <= ids[:, :, None]                           # [B, T, T]
        if valid is not None:
            mask = mask & valid[:, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=device)[None]   # a padding row sees itself: no NaN
        h = self.fuse(features, token_embeds)
        attn = self.attend(h, cos, sin, mask)
        if select is not None:
            h, attn = h[select], attn[select]
        return self.finish(h, attn)


# ---- checkpoints -------------------------------------------------------------------------------------------------

def save_head(directory, head: FalconHead, *, model_config: ModelConfig, target, target_name: str = "",
              **meta_fields) -> Path:
    """Write `head` as a falcon checkpoint for `target` (fingerprinted; bf16 weights)."""
    hyperparams = {**head.hyperparams(), **meta_fields.pop("hyperparams", {})}
    meta = CheckpointMeta(kind=KIND, target_name=target_name or getattr(target, "name", "") or "target",
                          target_fingerprint=target_fingerprint(model_config, target), hyperparams=hyperparams,
                          **meta_fields)
    return save_checkpoint(directory, head.tensors(), meta)


def load_head(directory, *, model_config: ModelConfig, target) -> tuple[FalconHead, Any]:
    """(head in fp32 on the CPU, meta) of the falcon checkpoint in `directory`; raises
    CheckpointMismatchError when it was made for another target or is not a falcon checkpoint."""
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint(model_config, target))
    return FalconHead.from_tensors(model_config, tensors, meta.hyperparams), meta


def shipped_checkpoint(model_config: ModelConfig, target, root: Path | None = None) -> Path | None:
    """The falcon checkpoint under drafters/checkpoints/ (any sub-folder) made for this target, if one is shipped."""
    found = find_shipped(KIND, target_fingerprint(model_config, target), CHECKPOINTS_DIR if root is None else root)
    return found[0][1] if found else None


def head_for(head: FalconHead, device: torch.device, dtype: torch.dtype) -> FalconHead:
    """`head` on `device`/`dtype` for serving: by reference when it already is (a trainer's evals
    see its latest weights), else a converted copy."""
    p = next(head.parameters())
    if p.device != torch.device(device) or p.dtype != dtype:
        head = copy.deepcopy(head).to(device=device, dtype=dtype)
    return head


__all__ = ["KIND", "DEFAULT_K", "FalconHead", "GatedReduction", "block_ids", "relaxed_causal_mask",
           "root_block_mask", "save_head", "load_head", "shipped_checkpoint", "head_for"]
