"""MCSD+ early-stop decision models (dynamic MCSD, see drafters/draft_model.py): small MLPs that
predict, for a freshly drafted token, the probability that verification accepts it; the drafter
stops growing a sequence's tree when every newest token scores below β (`decision_threshold`,
0.4 in the paper).

Both read features of the draft distribution the token was drawn from, i.e. of the draft model's
forward at the token's *parent* (available as soon as the token is chosen, no extra forward):

* type 1, a 3-layer MLP on the draft model's final hidden state h (after its final norm, the LM
  head's input): `P_T1 = σ(MLP3(h))`;
* type 2, a 2-layer MLP on `concat(top-k probabilities of q, entropy of q)` with q = softmax of the
  draft logits at temperature 1 (the draft model's own confidence, the same whatever the request's
  sampling settings): `P_T2 = σ(MLP2([q_(1), ..., q_(k), H(q)]))`, with H(q) = -Σ q log q in nats.

Labels (drafters/train/mcsd_decision.py): 1 when the token lies on the path verification accepted,
0 otherwise, for both types. The paper writes `max(1, p/q)` for type 1, a typo for the acceptance
probability min(1, p/q); we use the observed accepted bit instead (its expectation under sampled
verification of a chain is that probability times the prefix's acceptance), which is what stopping
needs: the chance that drafting this deep still pays.

Inputs are standardised with the training features' mean and standard deviation (`shift`,
`scale` buffers saved with the weights). A checkpoint is a folder in the format of
drafters/nets/checkpoint.py, kind "mcsd-decision", tied to the target's fingerprint; type 1 also
records the draft model's fingerprint (its hidden states mean nothing to another draft model).
Shipped ones (drafters/checkpoints/mcsd-student-1l/type1|type2, for the default target's shipped
student) are found by `shipped_decision` (the drafter's `decision=type1` / `decision=type2`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from specserve.drafters.nets.checkpoint import (CheckpointMeta, CheckpointMismatchError, SHIPPED_DIR, load_checkpoint,
                                                read_meta, save_checkpoint)

KIND = "mcsd-decision"
DEFAULT_TOP_K = 8
DEFAULT_HIDDEN = 64
TYPES = (1, 2)


def topk_entropy_features(logits: torch.Tensor, top_k: int = DEFAULT_TOP_K) -> torch.Tensor:
    """[N, top_k + 1] float32: the `top_k` largest probabilities of softmax(logits) (descending)
    and its entropy in nats (entries at -inf, e.g. outside a draft vocabulary, count as 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    return torch.cat([p.topk(top_k, dim=-1).values, entropy], dim=-1)


class DecisionModel(nn.Module):
    """Type 1: Linear-ReLU-Linear-ReLU-Linear on the hidden state; type 2: Linear-ReLU-Linear on
    the top-k/entropy features. `forward` gives logits [N], `accept_probability` σ of them."""

    def __init__(self, decision_type: int, in_dim: int, hidden: int = DEFAULT_HIDDEN, top_k: int = DEFAULT_TOP_K):
        super().__init__()
        if decision_type not in TYPES:
            raise ValueError(f"decision type must be 1 or 2, got {decision_type!r}")
        if decision_type == 2 and in_dim != top_k + 1:
            raise ValueError(f"a type-2 decision model reads top_k + 1 = {top_k + 1} features, got in_dim {in_dim}")
        self.decision_type, self.in_dim = int(decision_type), int(in_dim)
        self.hidden, self.top_k = int(hidden), int(top_k)
        if decision_type == 1:
            self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 1))
        else:
            self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.register_buffer("shift", torch.zeros(in_dim))
        self.register_buffer("scale", torch.ones(in_dim))

    def features(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """This type's input for rows of the draft model's final hidden states and their logits."""
        return hidden.float() if self.decision_type == 1 else topk_entropy_features(logits, self.top_k)

    def fit_standardisation(self, x: torch.Tensor) -> None:
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0).clamp_min(1e-6) if len(x) > 1 else torch.ones_like(self.scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp((x.float() - self.shift) / self.scale).squeeze(-1)

    @torch.no_grad()
    def accept_probability(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(x))

    def hyperparams(self) -> dict:
        return {"type": self.decision_type, "in_dim": self.in_dim, "hidden": self.hidden, "top_k": self.top_k}


def save_decision(directory: str | os.PathLike, model: DecisionModel, *, target_name: str, target_fingerprint: str,
                  draft: dict | None = None, data: dict | None = None, extra: dict | None = None) -> Path:
    """Write `model` (fp32) to `directory`; `draft` describes the draft model it was trained on
    (`{"drafter": ..., "fingerprint": ...}`), `data` the logged steps, `extra` held-back figures."""
    meta = CheckpointMeta(kind=KIND, target_name=target_name, target_fingerprint=target_fingerprint,
                          hyperparams={**model.hyperparams(), "draft": draft or {}}, data=data or {},
                          extra=extra or {})
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    return save_checkpoint(directory, tensors, meta, dtype=None)


def load_decision(directory: str | os.PathLike, *, target_fingerprint: str | None = None,
                  draft_fingerprint: str | None = None, hidden_size: int | None = None,
                  device: str | torch.device = "cpu") -> DecisionModel:
    """A decision model from its checkpoint folder, refused (CheckpointMismatchError) for another
    target, and for type 1 for another draft model (fingerprint or hidden size)."""
    directory = Path(directory)
    if not (directory / "meta.json").is_file():
        subs = sorted(p.parent.name for p in directory.glob("*/meta.json")) if directory.is_dir() else []
        hint = f"; it holds {', '.join(subs)}: pass one of those folders" if subs else ""
        raise FileNotFoundError(f"{directory} is not an MCSD decision checkpoint (no meta.json){hint}")
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint, device=device)
    hp = meta.hyperparams
    model = DecisionModel(int(hp["type"]), int(hp["in_dim"]), int(hp.get("hidden", DEFAULT_HIDDEN)),
                          int(hp.get("top_k", DEFAULT_TOP_K)))
    if model.decision_type == 1:
        trained_on = (hp.get("draft") or {}).get("fingerprint")
        if draft_fingerprint is not None and trained_on is not None and trained_on != draft_fingerprint:
            raise CheckpointMismatchError(
                f"{directory}: a type-1 decision model trained on the hidden states of another draft model "
                f"(fingerprint {trained_on}, this one {draft_fingerprint})")
        if hidden_size is not None and model.in_dim != hidden_size:
            raise CheckpointMismatchError(f"{directory}: a type-1 decision model reads hidden states of size "
                                          f"{model.in_dim}, this draft model's are {hidden_size}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.to(device).eval().requires_grad_(False)


def shipped_decision(decision_type: int, target_fingerprint: str, draft_fingerprint: str | None = None,
                     root: str | os.PathLike | None = None) -> Path | None:
    """The shipped `typeN` decision checkpoint (drafters/checkpoints/*/typeN/) for this target — for
    type 1 also trained on this draft model — or None."""
    root = SHIPPED_DIR if root is None else Path(root)
    for meta_file in sorted(root.glob(f"*/type{decision_type}/meta.json")) if root.is_dir() else ():
        try:
            meta = read_meta(meta_file.parent)
        except (OSError, ValueError):
            continue
        trained_on = (meta.hyperparams.get("draft") or {}).get("fingerprint")
        same_draft = decision_type == 2 or draft_fingerprint is None or trained_on == draft_fingerprint
        if meta.kind == KIND and meta.target_fingerprint == target_fingerprint and same_draft \
                and int(meta.hyperparams.get("type", 0)) == decision_type:
            return meta_file.parent
    return None


__all__ = ["KIND", "DEFAULT_TOP_K", "DecisionModel", "topk_entropy_features", "save_decision", "load_decision",
           "shipped_decision"]
