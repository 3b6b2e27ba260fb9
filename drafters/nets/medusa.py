"""Medusa-1 heads (served by drafters/medusa.py, trained by drafters/train/medusa.py), the
tree templates of the shared trees.json, and a fallback tree order from a generic prior."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.data_dir import data_dir
from specserve.engine.model import linear  # oneDNN for the few-row serving case

KIND = "medusa"
DEFAULT_NUM_HEADS = 4
DEFAULT_TREE = "medusa_mc_sim_7b_63"


# ---- the module -----------------------------------------------------------------------------------------------------

class MedusaHeads(nn.Module):
    """K residual blocks `h + SiLU(W_k h + b_k)`; the LM head is the target's (not held here)."""

    def __init__(self, num_heads: int, hidden_size: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.num_heads, self.hidden_size = num_heads, hidden_size
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype, device=device))
        self.vocab_rank: torch.Tensor | None = None   # the training labels' ranking (drafters.draft_vocab)

    def forward(self, h: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, H] -> [N, k, H] for the first k = num_heads (default all) heads, one matmul."""
        k = self.num_heads if num_heads is None else min(num_heads, self.num_heads)
        H = self.hidden_size
        w = self.weight[:k].reshape(k * H, H)
        b = self.bias[:k].reshape(k * H)
        h = h.to(w.dtype)
        if torch.is_grad_enabled():
            y = F.linear(h, w, b)
        else:
            y = linear(h, w, b)
        return h.unsqueeze(1) + F.silu(y.view(h.shape[0], k, H))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight.detach(), "bias": self.bias.detach()}
        if self.vocab_rank is not None:
            out["vocab_rank"] = self.vocab_rank.to(torch.int32)      # half the bytes on disk
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, device) -> "MedusaHeads":
        w, b = tensors["weight"], tensors["bias"]
        if w.dim() != 3 or w.shape[1] != w.shape[2] or tuple(b.shape) != tuple(w.shape[:2]):
            raise ValueError(f"medusa checkpoint tensors have shapes {tuple(w.shape)} / {tuple(b.shape)}")
        heads = cls(w.shape[0], w.shape[1], dtype=dtype, device=device)
        with torch.no_grad():
            heads.weight.copy_(w)
            heads.bias.copy_(b)
        if tensors.get("vocab_rank") is not None:
            heads.vocab_rank = tensors["vocab_rank"].to(torch.int64)
        return heads

    def randomize_(self, std: float, seed: int = 0) -> "MedusaHeads":
        """Random weights (tests only: untrained heads that disagree with the target)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * std)
            self.bias.copy_(torch.randn(self.bias.shape, generator=g) * std)
        return self


def load_template(name: str = DEFAULT_TREE) -> list[list[int]] | None:
    """A tree of ../shared/data/trees.json (SPECSERVE_DATA), or None when the file is not there."""
    try:
        trees = json.loads((data_dir() / "trees.json").read_text(encoding="utf-8"))
        return [list(p) for p in trees[name]["paths"]]
    except (OSError, KeyError, ValueError):
        return None
