"""ParallelSpec (Xiao et al.): one decoder layer with k learned [MASK] embeddings drafts k+1 tokens
in ONE forward. This file holds the drafter's network (shared by training and serving), the
paper's group-wise parallel training layout, the loss, the offline τ estimate and the trainer
(`specserve train parallelspec`).

Network (`ParallelSpecModule`), for a sequence whose last committed token (the root) sits at
position n-1:

* real position p (0 <= p <= n-1) gets `fc([norm(f_{p-1}) ‖ norm(e(x_p))])`: the target's
  last-layer feature of the previous position (the LM head's input there; zeros for p = 0) next to
  the embedding of the token at p, as EAGLE pairs them, each RMS-normed first (in SmolLM2 the
  feature's RMS is ~20x the embedding's). The root therefore carries the freshest target feature
  f_{n-2}, which every step has (the engine delivers features for every token entering the
  target's KV; only the root itself has none yet);
* k [MASK] embeddings follow the root at positions n .. n+k-1 (the positions of the tokens they
  stand for, so they share RoPE with the real tokens);
* one decoder layer of the target's shape initialised from the target's LAST layer (fc starts as
  the sum of the two normed halves scaled to the RMS of the residual stream that layer was trained
  on, measured on a probe sequence), a final RMS norm (from the target's), then the target's
  frozen LM head (shared by reference): the root's row predicts x_n, mask i's row x_{n+i}.

Variants (`variant=`): "medusa" trains with cross-entropy only (the paper's Medusa-Parallel loss);
"eagle" adds EAGLE's smooth-L1 regression of the normed output onto the target's feature of the
same position (the feature that produces the label). The network is the same, so serving does not
care which variant trained it.

Group-wise parallel training layout (`build_parallel_layout`): the real sequence x_0..x_{T-1}
followed, for every chosen anchor t, by a group of k mask tokens with position ids t+1..t+k
(position ids repeat across groups). Real tokens attend causally to real tokens only; mask i of
the group of anchor t attends to the real tokens 0..t and to masks 1..i of its own group, never to
another group's masks: exactly what inference sees (old masks are never in the drafter's KV).
Labels: a real token at j is trained on the target's greedy next token after j; mask i of anchor
t on the target's greedy token for position t+i+1; -100 where there is none. `forward_dense` runs
the layer over that layout with its dense mask (the reference); training runs `forward_grouped`,
the same computation without materialising the (T + A*k)^2 mask (tested equal).

CPU cost (SmolLM2-135M: the 49152 x 576 LM head and the layer's ~3.5 M weights per row dominate):
the cross-entropy is a sampled softmax over one shared candidate set per batch (every label, the
target's top-8 ids of every position of the batch as hard negatives, `num_negatives` uniform ids)
computed in row chunks by a custom autograd function that never keeps [rows, vocab] logits; the
held-back evaluation always ranks over the full vocabulary. `anchor_frac` < 1 trades mask rows for
speed. Measured figures: see the trainer's checkpoint metadata and the helper report.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets import tree_tuning
from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.nets.medusa import DEFAULT_TREE, load_template
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.train.evaluate import served_tau
from specserve.drafters.nets.parallelspec import (ParallelSpecModule, last_layer_input_rms,  # noqa: F401
                                                  load_module)
from specserve.drafters.train.loop import TrainConfig, train
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, rms_norm, rope_tables
from specserve.engine.tree import preference_prefix

logger = logging.getLogger("specserve")

KIND = "parallelspec"
VARIANTS = ("medusa", "eagle")
IGNORE = -100


# ---- the group-wise parallel layout ----------------------------------------------------------------------------------


@dataclass
class ParallelLayout:
    """One laid-out training sequence (length L = T + len(anchors) * k).

    `src[r]` is the chain position whose next-token label (and, for the EAGLE variant, whose
    target feature) row r is trained on: j for real token j, t+i for mask i of anchor t; -1 when
    that position is past the end. `slot[r]` is 0 for real tokens and i for mask i."""

    input_ids: torch.Tensor   # [L] int64: real tokens, then mask_token_id + i - 1 for mask i
    positions: torch.Tensor   # [L] int64
    attn_mask: torch.Tensor   # [L, L] bool, True = visible
    labels: torch.Tensor      # [L] int64, IGNORE where there is no label
    src: torch.Tensor         # [L] int64
    slot: torch.Tensor        # [L] int64
    is_mask: torch.Tensor     # [L] bool


def parallel_layout(input_ids: torch.Tensor, anchors: Sequence[int] | torch.Tensor, k: int, mask_token_id: int,
                    labels: torch.Tensor | None = None, label_mask: torch.Tensor | None = None) -> ParallelLayout:
    """The full layout (see `build_parallel_layout`), with the bookkeeping the loss needs."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.int64)
    T = input_ids.shape[0]
    anchors = torch.as_tensor(anchors, dtype=torch.int64).reshape(-1)
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= T):
        raise ValueError(f"anchors must lie in [0, {T - 1}]")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if labels is None:
        labels = torch.full((T,), IGNORE, dtype=torch.int64)
        labels[:-1] = input_ids[1:]
    labels = torch.as_tensor(labels, dtype=torch.int64).clone()
    if label_mask is not None:
        labels[~torch.as_tensor(label_mask, dtype=torch.bool)] = IGNORE
    A = anchors.numel()
    slots = torch.arange(1, k + 1)
    # per row: the anchor it belongs to (itself for real tokens), its group (-1 for real), its slot
    row_anchor = torch.cat([torch.arange(T), anchors.repeat_interleave(k)])
    row_group = torch.cat([torch.full((T,), -1), torch.arange(A).repeat_interleave(k)])
    row_slot = torch.cat([torch.zeros(T, dtype=torch.int64), slots.repeat(A)])
    is_mask = row_group >= 0
    positions = row_anchor + row_slot
    src = positions.clone()
    src[src >= T] = -1
    ids = torch.cat([input_ids, mask_token_id + slots.repeat(A) - 1])
    out_labels = torch.full_like(ids, IGNORE)
    ok = src >= 0
    out_labels[ok] = labels[src[ok]]
    # visibility: a real key c is visible to row r when c <= anchor(r) (causal for real rows);
    # a mask key is visible only to the masks of its own group at the same or a later slot
    L = T + A * k
    real_key = torch.arange(L)[None, :] <= row_anchor[:, None]          # real key c visible iff c <= anchor(r)
    own_mask_key = (row_group[:, None] == row_group[None, :]) & (row_slot[None, :] <= row_slot[:, None])
    attn = torch.where(~is_mask[None, :], real_key, own_mask_key & is_mask[:, None])
    return ParallelLayout(ids, positions, attn, out_labels, src, row_slot, is_mask)


def build_parallel_layout(input_ids, anchors, k: int, mask_token_id: int, labels=None, label_mask=None):
    """Group-wise parallel training layout of ParallelSpec for one sequence of length T.

    `anchors`: the real positions t that get a group of k masks; `labels[j]` (default
    `input_ids[j+1]`, -100 at the end) is the target's greedy token after position j;
    `label_mask[j]` False drops labels[j] (outside the answer). Mask i (1-based) of anchor t has
    input id `mask_token_id + i - 1`, position t+i and label labels[t+i] (the token at t+i+1).

    Returns (input_ids [L], position_ids [L], attention_mask [L, L] bool True = may attend,
    labels [L]) with L = T + len(anchors) * k: the real tokens first, then the groups in anchor order.
    """
    lay = parallel_layout(input_ids, anchors, k, mask_token_id, labels, label_mask)
    return lay.input_ids, lay.positions, lay.attn_mask, lay.labels


# ---- batches of layouts ----------------------------------------------------------------------------------------------


@dataclass
class LaidOutBatch:
    h_in: torch.Tensor        # [B, L, H] drafter inputs (real: fc([f_prev ‖ e(x)]); masks: their embedding)
    positions: torch.Tensor   # [B, L]
    attn_mask: torch.Tensor   # [B, L, L]
    labels: torch.Tensor      # [B, L]
    weights: torch.Tensor     # [B, L] float loss weight (0 where no label)
    feat_target: torch.Tensor | None   # [B, L, H] target feature at src (EAGLE regression), or None
    slot: torch.Tensor        # [B, L]


def lay_out_batch(module: ParallelSpecModule, input_ids: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
                  label_mask: torch.Tensor | None, lengths: Sequence[int], anchors: Sequence[Sequence[int]],
                  slot_weights: Sequence[float], with_features: bool) -> LaidOutBatch:
    """Lay out each sequence of a padded batch (input_ids/labels [B, T], hidden [B, T, H] = the
    target's feature at every position) and pad the layouts to one length. Padding rows see only
    themselves and carry no label."""
    B = input_ids.shape[0]
    k = module.k
    mask_id = module.cfg.vocab_size          # mask ids vocab .. vocab+k-1 (never embedded: see below)
    lays = []
    for b in range(B):
        T = int(lengths[b])
        lm = None if label_mask is None else label_mask[b, :T]
        lays.append(parallel_layout(input_ids[b, :T], anchors[b], k, mask_id, labels[b, :T], lm))
    L = max(lay.input_ids.shape[0] for lay in lays)
    H = module.cfg.hidden_size
    dev = module.fc.weight.device
    dtype = module.fc.weight.dtype
    h_in = torch.zeros(B, L, H, device=dev, dtype=dtype)
    positions = torch.zeros(B, L, dtype=torch.int64, device=dev)
    attn = torch.eye(L, dtype=torch.bool, device=dev).repeat(B, 1, 1)
    lab = torch.full((B, L), IGNORE, dtype=torch.int64, device=dev)
    wts = torch.zeros(B, L, device=dev)
    slot = torch.zeros(B, L, dtype=torch.int64, device=dev)
    feat_t = torch.zeros(B, L, H, device=dev, dtype=dtype) if with_features else None
    sw = torch.tensor(list(slot_weights), device=dev, dtype=torch.float32)
    real_parts = []
    for b, lay in enumerate(lays):
        T = int(lengths[b])
        n = lay.input_ids.shape[0]
        f = hidden[b, :T].to(device=dev, dtype=dtype)
        prev = torch.cat([torch.zeros(1, H, device=dev, dtype=dtype), f[:-1]])
        real_parts.append((b, T, input_ids[b, :T].to(dev), prev))
        slots = lay.slot.to(dev)
        h_in[b, T:n] = module.mask_embed[slots[T:] - 1]
        positions[b, :n] = lay.positions.to(dev)
        attn[b, :n, :n] = lay.attn_mask.to(dev)
        lab[b, :n] = lay.labels.to(dev)
        slot[b, :n] = slots
        wts[b, :n] = torch.where(lab[b, :n] != IGNORE, sw[slots], torch.zeros((), device=dev))
        if with_features:
            src = lay.src.to(dev)
            ok = src >= 0
            feat_t[b, :n][ok] = f[src[ok]]
    # the real rows' inputs in one fc call (keeps the autograd graph small)
    ids_cat = torch.cat([p[2] for p in real_parts])
    prev_cat = torch.cat([p[3] for p in real_parts])
    real_h = module.real_inputs(ids_cat, prev_cat)
    off = 0
    rows = []
    for b, T, _, _ in real_parts:
        rows.append((b, off, T))
        off += T
    h_in = h_in.clone()
    for b, o, T in rows:
        h_in[b, :T] = real_h[o:o + T]
    return LaidOutBatch(h_in, positions, attn, lab, wts, feat_t, slot)


@dataclass
class GroupedBatch:
    """A batch in the grouped form `forward_grouped` takes, with labels, loss weights and the
    EAGLE variant's feature targets for every real row and every mask row."""

    h_real: torch.Tensor        # [B, T, H]
    pos_real: torch.Tensor      # [B, T]
    anchors: torch.Tensor       # [B, A] (padding: 0, with zero weights)
    labels_real: torch.Tensor   # [B, T]
    labels_mask: torch.Tensor   # [B, A, k]
    w_real: torch.Tensor        # [B, T] float (0 = no label)
    w_mask: torch.Tensor        # [B, A, k]
    src_mask: torch.Tensor      # [B, A, k] chain position t+i (clamped into the sequence)


def group_batch(module: ParallelSpecModule, batch: dict, anchors: Sequence[Sequence[int]],
                slot_weights: Sequence[float]) -> GroupedBatch:
    """Real inputs fc([f_{p-1} ‖ e(x_p)]) and the groups of `anchors[b]` for a shard batch
    (`input_ids`, `hidden`, `labels` [B, T], optional `loss_mask`, `lengths`, `positions`)."""
    input_ids, hidden, labels = batch["input_ids"], batch["hidden"], batch["labels"]
    dev, dtype = module.fc.weight.device, module.fc.weight.dtype
    B, T = input_ids.shape
    k = module.k
    lengths = batch.get("lengths")
    lengths = torch.full((B,), T) if lengths is None else torch.as_tensor(lengths)
    ok = labels != IGNORE
    if batch.get("loss_mask") is not None:
        ok = ok & batch["loss_mask"].bool()
    ok = ok & (torch.arange(T)[None, :] < lengths[:, None])
    labels_real = torch.where(ok, labels, torch.full_like(labels, IGNORE))
    A = max(1, max(len(a) for a in anchors))
    anc = torch.zeros(B, A, dtype=torch.int64)
    anc_ok = torch.zeros(B, A, dtype=torch.bool)
    for b, a in enumerate(anchors):
        anc[b, :len(a)] = torch.as_tensor(list(a), dtype=torch.int64)
        anc_ok[b, :len(a)] = True
    src = anc[:, :, None] + torch.arange(1, k + 1)                                    # [B, A, k]
    inside = (src < lengths[:, None, None]) & anc_ok[:, :, None]
    src_c = src.clamp(max=T - 1)
    lab_m = torch.gather(labels_real, 1, src_c.view(B, -1)).view(B, A, k)
    lab_m = torch.where(inside, lab_m, torch.full_like(lab_m, IGNORE))
    sw = torch.tensor(list(slot_weights), dtype=torch.float32)
    w_real = (labels_real != IGNORE).float() * sw[0]
    w_mask = (lab_m != IGNORE).float() * sw[1:k + 1]
    feats = hidden.to(device=dev, dtype=dtype)
    prev = torch.cat([torch.zeros(B, 1, feats.shape[-1], device=dev, dtype=dtype), feats[:, :-1]], dim=1)
    h_real = module.real_inputs(input_ids.to(dev), prev)
    pos = batch.get("positions")
    pos = torch.arange(T)[None, :].expand(B, T) if pos is None else pos
    return GroupedBatch(h_real, pos.to(dev), anc.to(dev), labels_real.to(dev), lab_m.to(dev), w_real.to(dev),
                        w_mask.to(dev), src_c.to(dev))


# ---- cross-entropy through a frozen LM head, in row chunks ---------------------------------------------------------


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_r w_r * CE(h_r @ W^T, y_r) without keeping [rows, vocab] logits alive: the backward
    recomputes each chunk's softmax. W (the frozen LM head, or a slice of it) gets no gradient."""

    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = (h[s:s + chunk] @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, labels[s:s + chunk, None]).squeeze(1)
            total += ((lse - tgt) * w[s:s + chunk]).sum()
        ctx.save_for_backward(h, weight, labels, w)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, labels, w = ctx.saved_tensors
        grad = torch.empty_like(h)
        for s in range(0, h.shape[0], ctx.chunk):
            logits = (h[s:s + ctx.chunk] @ weight.T).float()
            p = torch.softmax(logits, dim=-1)
            p[torch.arange(p.shape[0]), labels[s:s + ctx.chunk]] -= 1.0
            p *= (w[s:s + ctx.chunk] * grad_out)[:, None]
            grad[s:s + ctx.chunk] = (p.to(h.dtype) @ weight)
        return grad, None, None, None, None


def head_ce(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, chunk: int = 512):
    return _ChunkedHeadCE.apply(h, weight.detach(), labels, w.float(), chunk)


# ---- options, loss, τ -----------------------------------------------------------------------------------------------


@dataclass
class TrainOptions:
    """The trainer's own options (`specserve train parallelspec --option KEY=VALUE`). The command's
    flags give epochs, lr and seed; the loop's (TrainConfig) options such as max_seconds,
    eval_every, patience, warmup_ratio also pass through --option."""

    k: int = 4                       # [MASK] tokens: k+1 tokens per drafter forward (paper default 4)
    variant: str = "eagle"           # "medusa" (CE only) | "eagle" (CE + feature regression)
    layout_tokens: int = 4096        # laid-out rows (real tokens + masks) per batch; bounds the dense mask
    anchor_frac: float = 1.0         # fraction of labelled positions that get a [MASK] group
    slot_decay: float = 0.8          # λ_i = slot_decay ** i for mask i (the real token: 1)
    reg_weight: float = 1.0          # EAGLE variant: weight of the smooth-L1 feature regression
    cls_weight: float = 1.0          # weight of the cross-entropy terms
    loss_vocab: str = "sampled"      # "full" | "sampled": softmax over the batch's labels ∪ target top-k ∪ negatives
    num_negatives: int = 1024        # uniformly drawn negatives of the sampled softmax
    fc_init: str = "identity"        # "identity" (fc = f + e at start) | "random"
    eval_sequences: int = 64         # held-back sequences for the τ the loop watches
    eval_budget: int = 16            # ... measured as the τ of the default tree cut to this many nodes
    tuned_nodes: int = 64            # length of the tuned tree order saved in the checkpoint
    engine_tau_prompts: int = 0      # held-back prompts also run through the engine for the served τ (0 = none)
    max_train_sequences: int | None = None   # cap on training sequences per epoch (None = all)

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "TrainOptions":
        """The options that name a field (others belong to the pipeline or the loop); checked."""
        options = {k: v for k, v in (options or {}).items() if v is not None}
        known = {f.name for f in fields(cls)}
        opts = cls(**{k: v for k, v in options.items() if k in known})
        if opts.variant not in VARIANTS:
            raise ValueError(f"parallelspec: variant must be one of {VARIANTS}, got {opts.variant!r}")
        if opts.loss_vocab not in ("full", "sampled"):
            raise ValueError(f"parallelspec: loss_vocab must be 'full' or 'sampled', got {opts.loss_vocab!r}")
        if opts.k < 1 or not 0 < opts.anchor_frac <= 1:
            raise ValueError("parallelspec: k >= 1 and 0 < anchor_frac <= 1 are required")
        return opts

    def slot_weights(self) -> list[float]:
        return [self.slot_decay ** i for i in range(self.k + 1)]


def choose_anchors(label_ok: torch.Tensor, length: int, frac: float, generator: torch.Generator | None = None):
    """Positions t whose own label exists (t < length): all of them, or a random fraction."""
    cand = torch.nonzero(label_ok[:length], as_tuple=False).flatten()
    if frac < 1.0 and cand.numel():
        keep = max(1, int(round(frac * cand.numel())))
        perm = torch.randperm(cand.numel(), generator=generator)[:keep]
        cand = cand[perm.sort().values]
    return cand.tolist()


def parallel_loss(module: ParallelSpecModule, batch: dict, opts: TrainOptions,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one shard batch (`input_ids`, `hidden`, `labels` [B, T], + `loss_mask`, `lengths`,
    `topk_ids`) in the group-wise parallel layout: the Medusa-Parallel cross-entropy on every
    labelled row (real rows weight 1, mask i weight λ_i = slot_decay^i), normalised by the total
    weight, plus for the EAGLE variant the smooth-L1 regression of each row's normed output onto
    the target's feature at the position whose label it predicts."""
    labels = batch["labels"]
    B, T = labels.shape
    lengths = batch.get("lengths")
    lengths = [T] * B if lengths is None else [int(x) for x in lengths]
    ok = labels != IGNORE
    if batch.get("loss_mask") is not None:
        ok = ok & batch["loss_mask"].bool()
    anchors = [choose_anchors(ok[b], lengths[b], opts.anchor_frac, generator) for b in range(B)]
    gb = group_batch(module, batch, anchors, opts.slot_weights())
    out_r, out_m = module.forward_grouped(gb.h_real, gb.pos_real, gb.anchors)
    sel_r, sel_m = gb.w_real > 0, gb.w_mask > 0
    h = torch.cat([out_r[sel_r], out_m[sel_m]])
    y = torch.cat([gb.labels_real[sel_r], gb.labels_mask[sel_m]])
    w = torch.cat([gb.w_real[sel_r], gb.w_mask[sel_m]])
    W = module.lm_head_weight
    if opts.loss_vocab == "sampled":
        extra = [y]
        topk = batch.get("topk_ids")
        if topk is not None:
            topk = topk.reshape(-1).to(y.device)
            extra.append(topk[topk >= 0])
        neg = torch.randint(0, W.shape[0], (opts.num_negatives,), generator=generator).to(y.device)
        cand = torch.unique(torch.cat(extra + [neg]))
        y = torch.searchsorted(cand, y)
        W = W[cand]
    norm = w.sum().clamp_min(1e-6)
    ce = head_ce(h, W, y, w) / norm
    loss = opts.cls_weight * ce
    logs = {"ce": float(ce.detach()), "rows": int(y.shape[0])}
    if opts.variant == "eagle":
        feats = batch["hidden"].to(device=h.device, dtype=h.dtype)
        src_r = feats[sel_r.to(feats.device)]
        b_idx = torch.arange(B, device=h.device)[:, None, None].expand_as(gb.src_mask)
        src_m = feats[b_idx[sel_m], gb.src_mask[sel_m]]
        target = torch.cat([src_r, src_m])
        reg = F.smooth_l1_loss(h.float(), target.float(), reduction="none").mean(-1)
        reg = (reg * w).sum() / norm
        loss = loss + opts.reg_weight * reg
        logs["reg"] = float(reg.detach())
    return loss, logs


def eval_anchors(ok: torch.Tensor, length: int, k: int) -> list[int]:
    """Anchors t whose k+1 labels (positions t..t+k) all exist: the held-back τ is measured there."""
    if length <= k:
        return []
    okl = ok[:length].to(torch.int32)
    runs = okl.unfold(0, k + 1, 1).sum(-1)               # [length - k]
    return torch.nonzero(runs == k + 1, as_tuple=False).flatten().tolist()


@torch.no_grad()
def held_back_ranks(module: ParallelSpecModule, batches: Iterable[dict], max_rank: int = 10) -> torch.Tensor:
    """[N, k+1] int64: for every held-back anchor t whose k+1 labels exist, the rank of the target's
    greedy token among the drafter's top `max_rank` candidates at depth d (column 0 = the anchor's
    own output, column i = mask i), teacher-forced; -1 when it is not among them. Full vocabulary."""
    k = module.k
    was_training = module.training
    module.eval()
    out_ranks = []
    for batch in batches:
        labels = batch["labels"]
        B, T = labels.shape
        lengths = [int(x) for x in batch.get("lengths", [T] * B)]
        ok = labels != IGNORE
        if batch.get("loss_mask") is not None:
            ok = ok & batch["loss_mask"].bool()
        anchors = [eval_anchors(ok[b], lengths[b], k) for b in range(B)]
        if not any(anchors):
            continue
        gb = group_batch(module, batch, anchors, [1.0] * (k + 1))
        out_r, out_m = module.forward_grouped(gb.h_real, gb.pos_real, gb.anchors)
        for b in range(B):
            A = len(anchors[b])
            if not A:
                continue
            t = torch.tensor(anchors[b], device=out_r.device)
            hb = torch.cat([out_r[b, t][:, None], out_m[b, :A]], dim=1).reshape(A * (k + 1), -1)
            top = F.linear(hb, module.lm_head_weight).float().topk(max_rank, dim=-1).indices
            top = top.view(A, k + 1, max_rank).cpu()
            y = torch.cat([gb.labels_real[b, t][:, None], gb.labels_mask[b, :A]], dim=1).cpu()
            hit = top == y[..., None]
            out_ranks.append(torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(y, -1)))
    module.train(was_training)
    if not out_ranks:
        return torch.zeros(0, k + 1, dtype=torch.int64)
    return torch.cat(out_ranks)


def chain_tau(ranks: torch.Tensor) -> float:
    """Teacher-forced τ of the top-1 chain: 1 + mean number of leading correct top-1 predictions
    among the k+1 parallel outputs."""
    if ranks.shape[0] == 0:
        return 1.0
    return 1.0 + float(torch.cumprod((ranks == 0).to(torch.int64), dim=1).sum(1).double().mean())


def tree_tau(ranks: torch.Tensor, paths: Sequence[Sequence[int]]) -> float:
    return 1.0 + tree_tuning.empirical_accepted_length(ranks, paths)


def prefix_order(order: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    return preference_prefix(order, budget)


def rank_report(ranks: torch.Tensor, template: Sequence[Sequence[int]] | None, *, budgets=(4, 8, 16, 32, 63),
                tuned_nodes: int = 64, seed: int = 0, max_rank: int = 10) -> dict[str, Any]:
    """Held-back figures: chain τ, per-depth top-1, τ of the template and of a tuned tree at several
    budgets (tuned on one half of the anchors, measured on the other), and the tuned order on all."""
    res: dict[str, Any] = {"anchors": int(ranks.shape[0]), "tau_chain": round(chain_tau(ranks), 4),
                           "top1_by_depth": [round(float((ranks[:, d] == 0).double().mean()), 4)
                                             for d in range(ranks.shape[1])] if ranks.shape[0] else []}
    res["acc"] = tree_tuning.acceptance_table(ranks, max_rank)
    if template:
        res["tau_template"] = {b: round(tree_tau(ranks, prefix_order(template, b)), 4) for b in budgets}
    perm = torch.randperm(ranks.shape[0], generator=torch.Generator().manual_seed(seed))
    half = ranks.shape[0] // 2
    fit, check = ranks[perm[:half]], ranks[perm[half:]]
    order_half = tree_tuning.greedy_tree_order_empirical(fit, max(budgets), max_rank)
    res["tau_tuned"] = {b: round(tree_tau(check, order_half[:b]), 4) for b in budgets}
    res["tuned_order"] = tree_tuning.greedy_tree_order_empirical(ranks, tuned_nodes, max_rank)
    return res


# ---- the trainer ---------------------------------------------------------------------------------------------------


def module_hyperparams(module: ParallelSpecModule, variant: str) -> dict[str, Any]:
    return {"k": module.k, "variant": variant, "hidden_size": module.cfg.hidden_size,
            "intermediate_size": module.cfg.intermediate_size, "num_heads": module.cfg.num_heads,
            "num_kv_heads": module.cfg.num_kv_heads, "head_dim": module.cfg.head_dim,
            "input_pairing": "fc([norm(f_{p-1}) ; norm(e(x_p))])", **module.hyper}


def _trained_dtype_roundtrip(module: ParallelSpecModule) -> None:
    """Make the in-memory weights exactly what a bf16 checkpoint will hold (τ is measured on them)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def fit_parallelspec(target_model, cfg: ModelConfig, train_batches, eval_batches: list[dict], opts: TrainOptions,
                     config, *, template: Sequence[Sequence[int]] | None = None, max_positions: int = 4096):
    """Train a fresh module (layer and norm from the target's last layer); returns (module, TrainResult).
    `train_batches`: epoch -> iterable of shard batches. The loop watches the held-back τ of
    `template` cut to `opts.eval_budget` nodes (the chain τ without a template)."""
    torch.manual_seed(config.seed)
    module = ParallelSpecModule.from_target(target_model, cfg, k=opts.k, max_positions=max_positions,
                                            seed=config.seed, fc_init=opts.fc_init)
    module.train()
    gen = torch.Generator().manual_seed(config.seed)
    tree = prefix_order(template, opts.eval_budget) if template else None

    def loss_fn(mod, batch):
        return parallel_loss(mod, batch, opts, gen)

    def eval_fn(mod):
        ranks = held_back_ranks(mod, eval_batches)
        out = {"tau_chain": chain_tau(ranks), "anchors": int(ranks.shape[0])}
        out.update({f"top1_{d}": float((ranks[:, d] == 0).double().mean()) if ranks.shape[0] else 0.0
                    for d in range(ranks.shape[1])})
        out["tau"] = tree_tau(ranks, tree) if tree else out["tau_chain"]
        return out

    result = train(module, loss_fn, train_batches, eval_fn=eval_fn if eval_batches else None, config=config)
    return module, result


TRAIN_DEFAULTS = {"betas": (0.9, 0.95), "warmup_ratio": 0.03, "patience": None, "weight_decay": 0.0}


def _load_batches(dataset, batch_tokens: int, limit: int | None, *, epoch: int, seed: int, shuffle: bool,
                  device) -> list[dict] | Any:
    fields_ = ("input_ids", "hidden", "labels", "topk_ids", "answer_mask")
    batches = dataset.batches(batch_tokens, shuffle=shuffle, epoch=epoch, seed=seed, fields=fields_, device=device)
    if limit is None:
        return batches
    out, seqs = [], 0
    for b in batches:
        out.append(b)
        seqs += int(b["input_ids"].shape[0])
        if seqs >= limit:
            break
    return out


@register_trainer(KIND)
def train_parallelspec(options: dict, target, data) -> "Path":
    """`specserve train parallelspec`: the module trained on the teacher shards' train split with
    the group-wise parallel layout, evaluated on the held-back split, saved with a tree order
    tuned on held-back rank statistics. Options: see `TrainOptions` (plus the command's epochs,
    lr, seed and the loop's max_seconds, eval_every, patience, warmup_ratio via --option)."""
    if not options.get("out"):
        raise ValueError("parallelspec trainer: no output folder (--out)")
    start = time.time()
    opts = TrainOptions.from_options(options)
    config = TrainConfig.from_options({**TRAIN_DEFAULTS, **{k: v for k, v in options.items() if v is not None}},
                                      device=str(target.device))
    dev = target.device
    real_tokens = max(64, int(opts.layout_tokens / (1 + opts.k * opts.anchor_frac)))
    eval_batches = _load_batches(data.held_back, real_tokens, opts.eval_sequences, epoch=0, seed=config.seed,
                                 shuffle=False, device=dev)
    max_len = int(options.get("max_len") or 512)
    template = load_template(DEFAULT_TREE)

    def train_batches(epoch: int):
        return _load_batches(data.train, real_tokens, opts.max_train_sequences, epoch=epoch, seed=config.seed,
                             shuffle=True, device=dev)

    module, result = fit_parallelspec(target.model, target.model_config, train_batches, eval_batches, opts, config,
                                      template=template, max_positions=max_len + opts.k + 64)
    _trained_dtype_roundtrip(module)
    module.vocab_rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size)
    all_eval = _load_batches(data.held_back, real_tokens, None, epoch=0, seed=config.seed, shuffle=False, device=dev)
    ranks = held_back_ranks(module, all_eval)
    report = rank_report(ranks, template, tuned_nodes=opts.tuned_nodes, seed=config.seed)
    order = report.pop("tuned_order")
    tau = report["tau_tuned"].get(opts.eval_budget, report["tau_chain"])
    logger.info("parallelspec: held-back tau chain %.3f, tuned tree %s, template %s", report["tau_chain"],
                report["tau_tuned"], report.get("tau_template"))
    served = None
    if opts.engine_tau_prompts > 0:
        served = served_tau(target, KIND, {"module": module, "tree": json.dumps(order)},
                            data.held_back_examples()[:opts.engine_tau_prompts], budget=opts.eval_budget)
        logger.info("parallelspec: served tau %.3f on %d held-back prompts (budget %d)", served["tau"],
                    served["num_prompts"], opts.eval_budget)
    meta = CheckpointMeta(
        kind=KIND, target_name=target.name, target_fingerprint=target.fingerprint,
        hyperparams={**module_hyperparams(module, opts.variant), **asdict(opts), "lr": config.lr,
                     "epochs": config.epochs, "steps": result.steps, "stop_reason": result.stop_reason,
                     "train_wall_seconds": round(result.wall_seconds, 1)},
        data=data.summary(), train_seconds=round(time.time() - start, 1), device=describe_device(dev), tau=tau,
        tau_details={"method": "offline, teacher-forced on held-back sequences: rank of the target's greedy token "
                               "among the k+1 parallel outputs' full-vocabulary candidates at every anchor whose "
                               "k+1 labels exist; tau_chain = 1 + mean leading top-1 hits; tree taus = 1 + longest "
                               "matching path (tuned tree chosen on one half of the anchors, measured on the other)",
                     "budget": opts.eval_budget, **report, "served": served, "loop_evals": result.eval_history,
                     "draft_vocab_coverage": coverage},
        tree={"choices": order, "order": "greedy expected accepted length on held-back ranks (each prefix is a tree)"})
    return Path(save_checkpoint(options["out"], module.own_tensors(), meta))
