"""Falcon training: Coupled Sequential Glancing Distillation (CSGD), the offline τ and tree
order, and `specserve train falcon` (the network: drafters/nets/falcon.py).

Rows and targets (k = 2 by default): row p reads (f_p, x_{p+1}) and predicts f_{p+k}, whose LM
head gives the token x_{p+k+1}. It is trained where that token is an answer token
(`loss_mask[p+k]`). Blocks of the relaxed causal mask start at a random offset per example (drawn
each batch), so every position is trained both as a block's first row and as its last.

CSGD, per batch (Gao et al. §3.2; decisions where the paper is loose are marked):

1. a first pass without gradient over the teacher-forced rows gives the drafter's tokens Ŷ at
   the trained rows; d = their Hamming distance to the target's greedy labels Y^t. [decision]
   Ŷ is the argmax over the batch's candidate set (below), not the whole vocabulary: the
   target's label is always a candidate, so d never counts a right token as wrong.
2. N = round(λ·d) rows are *glanced*: contiguous runs of rows at the start of k-blocks get the
   inputs the target's sequence has k positions later -- row r reads (f_{r+k}, x_{r+k+1}), the
   feature and token of the position the block's first row predicts. The rest of the block then
   predicts its tokens knowing the right earlier ones (the "choices" of the paper's Fig. 2: the
   runs *preceding* the predicted positions, token and feature swapped together). For k = 2 a run
   is the block's first row; for k > 2 its length is drawn in 1..k-1 (the official code's
   random-length runs). [decision] Runs are aligned with the block starts of the mask: the
   official code draws from every k-th loss position, which, when the answer starts on the other
   parity, replaces a block's last row and shows its first row a feature past its own target. A
   glanced row's own target is its input, so it is left out of the loss (GLAT trains the
   non-glanced positions only).
3. the second pass, with gradient, on the glanced inputs:
   `L = SmoothL1(f̂, f) + ω·(α·KL(p ‖ p̂) + (1-α)·CE(t, p̂))`, ω = 0.1, α = 0.9, p = softmax(LMHead(f))
   = the target's distribution, t its greedy token (the paper; the official code's temperature
   0.95 on the KL and Gumbel-sampled hard labels are not used). The shards hold the target's
   top-k log-probabilities; p is their softmax over the k (the KL's other terms are constant),
   and p̂ is the drafter's softmax over a candidate set shared by the batch (the union of the
   target's top-k ids, `negatives` uniform ids and the drafter's own top-16 at 128 rows), as our
   EAGLE trainer does: on a CPU the LM head over the whole vocabulary costs more than the head.
4. uniform noise U(-0.1, 0.1) on the input features (absolute, as the paper; `noise`).

λ schedule: the paper's λ = 0.4·(E - e)/E, with e the **fractional** epoch (step / steps per
epoch), so λ falls linearly from 0.4 to 0 over the run (the official code's
0.35·(E - e)/E + 0.1 never reaches 0, i.e. it trains with glances to the end). `lambda_schedule`
= paper | repo, recorded in meta.json. `csgd=false` trains without glancing (λ = 0): the ablation,
EAGLE-style token-shift training under the same relaxed mask.

Offline evaluation (held-back shards): for every answer position, the serving drafter's walk
along the target's own continuation -- the root block (the k real rows before the root, each
seeing them all), then blocks that read the previous block's predicted features and the data's
tokens, attending to the real rows and the earlier blocks -- gives the rank of the right token
among the drafts at each depth (over the draft vocabulary). From those ranks: the chain τ
(1 + leading top-1 hits, `blocks`·k drafts), and each custom tree's *preference order*: its nodes
by the fraction of positions whose rank prefix is the node's path (`drafters.falcon.order_within`),
whose every prefix is the best subtree of that size. meta.json stores the tree and its order;
the serving drafter cuts it to the scheduler's budget.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.falcon import (DEFAULT_TREE, TREE_NAMES, dedup_paths, empirical_probability, load_tree,
                                       order_within)
from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.nets.falcon import KIND, FalconHead, save_head
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.train.evaluate import as_saved, option, served_tau
from specserve.drafters.train.loop import train, trainer_batches
from specserve.engine.model import rope_tables

logger = logging.getLogger("specserve")

REG_WEIGHT = 1.0          # SmoothL1 on features
DIST_WEIGHT = 0.1         # ω_dist
SOFT_WEIGHT = 0.9         # α: soft (KL) vs hard (CE) labels
LAMBDA_MAX = 0.4          # the paper's λ at the start
SCHEDULES = ("paper", "repo")
MAX_RANK = 20             # drafts per distribution (the official TOPK)
FIELDS = ("input_ids", "hidden", "topk_ids", "topk_logprobs")


def glance_lambda(progress: float, schedule: str = "paper") -> float:
    """λ after `progress` (fractional epochs done / epochs, 0..1)."""
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "paper":
        return LAMBDA_MAX * (1.0 - progress)
    if schedule == "repo":
        return (0.6 - 0.25) * (1.0 - progress) + 0.1
    raise ValueError(f"falcon: lambda_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


# ---- CSGD ------------------------------------------------------------------------------------------------------

@dataclass
class Rows:
    """The rows of one padded batch: row p of sequence b reads (f_p, x_{p+1})."""

    feats: torch.Tensor        # [B, R, H] input features (R = T - 1)
    next_ids: torch.Tensor     # [B, R] x_{p+1}
    valid: torch.Tensor        # [B, R] the row exists (p + 1 < length)
    trained: torch.Tensor      # [B, R] its target f_{p+k} is followed by an answer token
    offsets: torch.Tensor      # [B] block alignment (blocks start at rows ≡ offset mod k)


def batch_rows(batch: dict[str, torch.Tensor], k: int, generator: torch.Generator | None = None,
               offsets: torch.Tensor | None = None) -> Rows:
    ids, hidden = batch["input_ids"], batch["hidden"]
    b, t = ids.shape
    r = t - 1
    valid_tok = batch["valid"] if "valid" in batch else torch.ones_like(ids, dtype=torch.bool)
    trained = torch.zeros(b, r, dtype=torch.bool, device=ids.device)
    if t > k:
        trained[:, :t - k] = batch["loss_mask"][:, k:].bool() & valid_tok[:, k:]
    if offsets is None:
        offsets = torch.randint(0, k, (b,), generator=generator, device=generator.device if generator else "cpu")
    return Rows(hidden[:, :r], ids[:, 1:], valid_tok[:, 1:], trained, offsets.to(ids.device))


def glance(rows: Rows, hidden: torch.Tensor, ids: torch.Tensor, k: int, num: int,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace about `num` rows by glanced ones (step 2 of CSGD in the module docstring).

    Candidates are block starts r (r ≡ offset mod k) whose replacement input exists (x_{r+k+1}
    within the sequence) and whose block keeps a trained row after the run. A run of length ℓ
    (1 for k = 2, else drawn in 1..k-1) makes rows r .. r+ℓ-1 read (f_{r+j+k}, x_{r+j+k+1}).
    Returns (features [B, R, H], next token ids [B, R], replaced [B, R] bool)."""
    feats, next_ids = rows.feats, rows.next_ids
    replaced = torch.zeros_like(rows.valid)
    if num <= 0:
        return feats, next_ids, replaced
    b, r = rows.valid.shape
    t = ids.shape[1]
    pos = torch.arange(r, device=ids.device)
    start = (pos[None, :] - rows.offsets[:, None]) % k == 0
    has_src = torch.zeros_like(rows.valid)
    if t > k + 1:
        has_src[:, :t - k - 1] = rows.valid[:, k:]                           # x_{r+k+1} exists
    cand = (start & has_src).nonzero().tolist()
    if not cand:
        return feats, next_ids, replaced
    order = torch.randperm(len(cand), generator=generator, device=generator.device if generator else "cpu").tolist()
    lengths = torch.randint(1, max(2, k), (len(cand),), generator=generator,
                            device=generator.device if generator else "cpu").tolist()
    rows_b, rows_p = [], []
    used = 0
    for j in order:
        if used >= num:
            break
        bi, ri = cand[j]
        run = 1 if k <= 2 else lengths[j]
        run = min(run, num - used)
        tail = rows.trained[bi, ri + run:ri + k]
        if not bool(tail.any()):
            continue
        for s in range(run):
            if ri + s + k + 1 < t and bool(rows.valid[bi, ri + s + k]):
                rows_b.append(bi)
                rows_p.append(ri + s)
                used += 1
    if not rows_b:
        return feats, next_ids, replaced
    bi = torch.tensor(rows_b, device=ids.device)
    pi = torch.tensor(rows_p, device=ids.device)
    feats, next_ids = feats.clone(), next_ids.clone()
    feats[bi, pi] = hidden[bi, pi + k].to(feats.dtype)
    next_ids[bi, pi] = ids[bi, pi + k + 1]
    replaced[bi, pi] = True
    return feats, next_ids, replaced


def candidate_ids(topk_ids: torch.Tensor, vocab_size: int, negatives: int, generator: torch.Generator | None = None,
                  *, pred: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None,
                  probe_rows: int = 128, probe_k: int = 16) -> torch.Tensor:
    """The batch's candidate set (sorted, unique): the target's top-k ids, `negatives` uniform ids
    and, with `pred`, the drafter's own whole-vocabulary top `probe_k` at `probe_rows` random rows
    (no grad) -- the tokens it currently over-rates, which uniform draws would rarely catch."""
    device = topk_ids.device
    ids = [topk_ids.reshape(-1).long()]
    ids[0] = ids[0][ids[0] >= 0]
    if negatives > 0:
        ids.append(torch.randint(0, vocab_size, (negatives,), generator=generator, device=device))
    if pred is not None and lm_head_weight is not None and probe_rows > 0 and pred.shape[0]:
        with torch.no_grad():
            rows = torch.randperm(pred.shape[0], generator=generator, device=device)[:probe_rows]
            logits = F.linear(pred.detach()[rows], lm_head_weight.to(pred.dtype))
            ids.append(logits.topk(min(probe_k, logits.shape[-1]), dim=-1).indices.reshape(-1))
    return torch.unique(torch.cat(ids))


def add_uniform_noise(features: torch.Tensor, noise: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """f + U(-noise, noise), elementwise."""
    if noise <= 0:
        return features
    u = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    return features + ((u * 2 - 1) * noise).to(features.dtype)


def falcon_loss(head: FalconHead, batch: dict[str, torch.Tensor], *, embed: nn.Embedding,
                lm_head_weight: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lam: float = 0.0,
                noise: float = 0.1, negatives: int | None = 2048, generator: torch.Generator | None = None,
                dist_weight: float = DIST_WEIGHT, soft_weight: float = SOFT_WEIGHT,
                offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The CSGD loss of one padded batch (`ShardDataset.batches`: `input_ids` [B, T], `hidden`
    [B, T, H] post-norm features, `topk_ids`/`topk_logprobs` [B, T, k'] the target's next-token
    top-k', `loss_mask` [B, T], `valid` [B, T]). `lam` = λ (0: no glancing, no first pass).
    `negatives=None`: the softmax over the whole vocabulary. Logs: reg, kl, ce, acc (drafter
    argmax = target label at the trained rows), glanced (rows replaced), hamming (d)."""
    k = head.k
    ids, hidden = batch["input_ids"], batch["hidden"].float()
    rows = batch_rows({**batch, "hidden": hidden}, k, generator, offsets)
    if not bool(rows.trained.any()):
        zero = head.norm.sum() * 0
        return zero, {"reg": 0.0, "kl": 0.0, "ce": 0.0, "acc": 0.0, "glanced": 0.0, "hamming": 0.0}
    r = rows.feats.shape[1]
    cos, sin = rope[0][:r], rope[1][:r]
    target_rows = rows.trained.nonzero(as_tuple=True)
    tk_ids_all = batch["topk_ids"][:, k:].long()
    cand = None
    if negatives is not None:
        tk = tk_ids_all[rows.trained[:, :tk_ids_all.shape[1]]]
        cand = candidate_ids(tk, lm_head_weight.shape[0], negatives, generator)
    num = 0
    hamming = 0
    feats, next_ids, replaced = rows.feats, rows.next_ids, torch.zeros_like(rows.valid)
    if lam > 0:
        with torch.no_grad():
            emb = embed(next_ids).float()
            pred = head.forward_dense(add_uniform_noise(feats, noise, generator), emb, cos, sin, valid=rows.valid,
                                      offsets=rows.offsets, select=rows.trained)
            w = lm_head_weight if cand is None else lm_head_weight.index_select(0, cand)
            guess = F.linear(pred, w.to(pred.dtype)).argmax(-1)
            guess = guess if cand is None else cand[guess]
            labels = batch["topk_ids"][..., 0].long()[target_rows[0], target_rows[1] + k]
            hamming = int((guess != labels).sum())
        num = int(math.floor(lam * hamming + 0.5))
        feats, next_ids, replaced = glance(rows, hidden, ids, k, num, generator)
    loss_rows = rows.trained & ~replaced
    if not bool(loss_rows.any()):
        loss_rows = rows.trained
    with torch.no_grad():
        emb = embed(next_ids).float()
    pred = head.forward_dense(add_uniform_noise(feats, noise, generator), emb, cos, sin, valid=rows.valid,
                              offsets=rows.offsets, select=loss_rows)
    bi, pi = loss_rows.nonzero(as_tuple=True)
    target = hidden[bi, pi + k]
    reg = F.smooth_l1_loss(pred, target)
    tk_ids = batch["topk_ids"][bi, pi + k].long()
    tk_lp = batch["topk_logprobs"][bi, pi + k].float()
    if cand is not None:
        cand = torch.unique(torch.cat([cand, candidate_ids(tk_ids[:, :0], lm_head_weight.shape[0], 0, generator,
                                                           pred=pred, lm_head_weight=lm_head_weight)]))
    kl, ce, hit = distill_terms(pred, lm_head_weight, tk_ids, tk_lp, cand)
    loss = REG_WEIGHT * reg + dist_weight * (soft_weight * kl + (1 - soft_weight) * ce)
    return loss, {"reg": reg.detach(), "kl": kl.detach(), "ce": ce.detach(), "acc": hit.float().mean(),
                  "glanced": float(replaced.sum()), "hamming": float(hamming)}


def distill_terms(pred: torch.Tensor, lm_head_weight: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                  candidates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL(p ‖ p̂), CE(greedy label, p̂), drafter argmax == label) with p the target's top-k
    distribution renormalised over its k and p̂ the drafter's softmax over `candidates` (None:
    the whole vocabulary). pred [N, H], topk [N, k] (label first)."""
    w = lm_head_weight if candidates is None else lm_head_weight.index_select(0, candidates)
    logits = F.linear(pred, w.to(pred.dtype)).float()
    logp = logits.log_softmax(-1)
    idx = topk_ids if candidates is None else torch.searchsorted(candidates, topk_ids)
    p_log = topk_logprobs.log_softmax(-1)
    kl = (p_log.exp() * (p_log - logp.gather(1, idx))).sum(-1).mean()
    ce = -logp.gather(1, idx[:, :1]).mean()
    return kl, ce, logits.argmax(-1) == idx[:, 0]


# ---- offline evaluation: ranks along the target's continuation ---------------------------------------------------

@torch.no_grad()
def sar_ranks(head: FalconHead, batch: dict[str, torch.Tensor], *, embed: nn.Embedding, vocab_weight: torch.Tensor,
              vocab_ids: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor], blocks: int = 4,
              max_rank: int = MAX_RANK, max_chains: int | None = None) -> torch.Tensor:
    """[C, blocks·k] ranks of the right token among the drafts of each depth, for the chains of
    one batch (the walk of the module docstring; -1: not among the `max_rank` best of the draft
    vocabulary, or past the answer).

    Chain a (root block = real rows a .. a+k-1, root token x_{a+k}) is used when its depth-1
    token x_{a+k+1} is an answer token; depth d's right token is the target's greedy label after
    position a+k+d-1. `vocab_weight` [V', H] are the LM head rows the drafter drafts from and
    `vocab_ids` their token ids (None: the whole vocabulary, in order)."""
    with torch.autocast(batch["hidden"].device.type, enabled=False):
        return _sar_ranks(head, batch, embed, vocab_weight, vocab_ids, rope, blocks, max_rank, max_chains)


def _sar_ranks(head, batch, embed, vocab_weight, vocab_ids, rope, blocks, max_rank, max_chains) -> torch.Tensor:
    k, L = head.k, head.layer
    ids, hidden = batch["input_ids"], batch["hidden"].float()
    labels = batch["topk_ids"][..., 0].long()
    answer = batch["loss_mask"].bool()
    valid_tok = batch["valid"].bool() if "valid" in batch else torch.ones_like(answer)
    b, t = ids.shape
    depth = blocks * k
    r = t - 1
    if r < k:
        return torch.zeros(0, depth, dtype=torch.long)
    device = ids.device
    vocab_pos = None
    if vocab_ids is not None:
        vocab_pos = torch.full((int(vocab_ids.max()) + 1 if vocab_ids.numel() else 1,), -1, dtype=torch.long,
                               device=device)
        vocab_pos[vocab_ids.to(device)] = torch.arange(vocab_ids.numel(), device=device)
    cos, sin = rope
    valid_row = valid_tok[:, 1:]
    h_in = head.fuse(hidden[:, :r], embed(ids[:, 1:]).float())
    q_all, k_all, v_all = L.dense_qkv(h_in, cos[:r], sin[:r])                 # [B, R, heads|kvh, D]
    g = L.num_heads // L.num_kv_heads
    pos = torch.arange(r, device=device)
    roots = []                                                               # root block row i: [B, R, H]
    for i in range(k):
        mask = (pos[None, :] <= pos[:, None] + (k - 1 - i))[None] & valid_row[:, None, :]
        mask = mask | torch.eye(r, dtype=torch.bool, device=device)[None]
        roots.append(head.finish(h_in, head.attend(h_in, cos[:r], sin[:r], mask)))
    # chains: a in 0 .. T-1-k whose depth-1 token is an answer token
    use = torch.zeros(b, r, dtype=torch.bool, device=device)
    if t > k:
        use[:, :t - k] = answer[:, k:] & valid_tok[:, k:]
    chains = use.nonzero()
    if max_chains is not None and chains.shape[0] > max_chains:
        chains = chains[torch.linspace(0, chains.shape[0] - 1, max_chains, device=device).long()]
    out = torch.full((chains.shape[0], depth), -1, dtype=torch.long)
    pad_labels = torch.cat([labels, labels.new_full((b, depth + k + 1), -1)], dim=1)
    pad_answer = torch.cat([answer & valid_tok, answer.new_zeros(b, depth + k + 1)], dim=1)
    pad_ids = torch.cat([ids, ids.new_zeros(b, depth + k + 1)], dim=1)
    scale = L.scale
    for bi in chains[:, 0].unique().tolist():
        sel = (chains[:, 0] == bi).nonzero().flatten()
        a = chains[sel, 1]                                                   # [A]
        feats = torch.stack([roots[i][bi, a + i] for i in range(k)], dim=1)  # [A, k, H]
        k_real = k_all[bi].repeat_interleave(g, 1).transpose(0, 1)          # [heads, R, D]
        v_real = v_all[bi].repeat_interleave(g, 1).transpose(0, 1)
        real_mask = (pos[None, :] <= (a + k - 1)[:, None]) & valid_row[bi][None, :]   # [A, R]
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        alive = torch.ones(a.shape[0], dtype=torch.bool, device=device)
        for level in range(blocks):
            if level:
                p = a[:, None] + level * k + torch.arange(k, device=device)[None, :]   # [A, k] row positions
                tok = pad_ids[bi, p + 1]
                h = head.fuse(feats, embed(tok).float())                     # [A, k, H]
                q, kk, vv = L.dense_qkv(h, cos[p], sin[p])                   # [A, k, heads|kvh, D]
                own_k.append(kk.repeat_interleave(g, 2))
                own_v.append(vv.repeat_interleave(g, 2))
                ok_all, ov_all = torch.cat(own_k, 1), torch.cat(own_v, 1)    # [A, level*k, heads, D]
                s_real = torch.einsum("akhd,hrd->ahkr", q, k_real) * scale
                s_real = s_real.masked_fill(~real_mask[:, None, None, :], float("-inf"))
                s_own = torch.einsum("akhd,ajhd->ahkj", q, ok_all) * scale
                w = torch.softmax(torch.cat([s_real, s_own], dim=-1), dim=-1)
                attn = (torch.einsum("ahkr,hrd->akhd", w[..., :r], v_real)
                        + torch.einsum("ahkj,ajhd->akhd", w[..., r:], ov_all))
                feats = head.finish(h, attn.reshape(a.shape[0], k, L.q_size))
            for i in range(k):
                d = level * k + i                                            # 0-based depth
                lab_pos = a + k + d
                lab = pad_labels[bi, lab_pos]
                ok = alive & pad_answer[bi, lab_pos] & (lab >= 0)
                logits = F.linear(feats[:, i], vocab_weight.float())
                if vocab_pos is not None:
                    li = torch.where((lab >= 0) & (lab < vocab_pos.numel()), lab, lab.new_zeros(()))
                    col = vocab_pos[li]
                    ok = ok & (col >= 0) & (lab < vocab_pos.numel())
                else:
                    col = lab.clamp_min(0)
                right = logits.gather(1, col.clamp_min(0)[:, None])
                rank = (logits > right).sum(-1)
                ok = ok & (rank < max_rank)
                out[sel.cpu(), d] = torch.where(ok, rank, rank.new_full((), -1)).cpu()
                alive = alive & pad_answer[bi, lab_pos]
    return out


def collect_ranks(head: FalconHead, batches: Iterable[dict[str, torch.Tensor]], *, max_chains: int = 4096,
                  **kwargs) -> torch.Tensor:
    """`sar_ranks` over held-back batches, at most `max_chains` chains."""
    parts, left = [], max_chains
    for batch in batches:
        if left <= 0:
            break
        part = sar_ranks(head, batch, max_chains=left, **kwargs)
        parts.append(part)
        left -= part.shape[0]
    return torch.cat(parts) if parts else torch.zeros(0, 1, dtype=torch.long)


def chain_tau(ranks: torch.Tensor) -> float:
    """1 + mean number of leading top-1 hits (the greedy chain's accepted length, bonus included)."""
    if ranks.shape[0] == 0:
        return 1.0
    hits = (ranks == 0).long().cumprod(1).sum(1)
    return 1.0 + float(hits.double().mean())


def tree_tau(ranks: torch.Tensor, order: list[list[int]], budgets: Iterable[int]) -> dict[int, float]:
    """1 + expected accepted drafts of the first `budget` nodes of `order`, per budget (empirical)."""
    prob = empirical_probability(ranks)
    p = [prob(path) for path in order]
    return {b: 1.0 + sum(p[:b]) for b in budgets}


def tree_orders(ranks: torch.Tensor, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{name: {"paths", "order"}} for each trees.json tree found: its nodes ordered by the
    measured path probabilities (see the module docstring)."""
    out = {}
    prob = empirical_probability(ranks)
    for name in names:
        paths = load_tree(name)
        if paths is not None:
            out[name] = {"paths": paths, "order": order_within(paths, prob)}
    return out


def evaluate(head: FalconHead, batches: list, *, embed, vocab_weight, vocab_ids, rope, blocks: int,
             max_chains: int) -> dict[str, Any]:
    ranks = collect_ranks(head, batches, embed=embed, vocab_weight=vocab_weight, vocab_ids=vocab_ids, rope=rope,
                          blocks=blocks, max_chains=max_chains)
    acc = [float((ranks[:, d] == 0).double().mean()) if ranks.shape[0] else 0.0 for d in range(ranks.shape[1])]
    return {"tau": chain_tau(ranks), "chains": int(ranks.shape[0]), "top1_by_depth": [round(x, 4) for x in acc]}


# ---- fitting -----------------------------------------------------------------------------------------------------

TRAIN_DEFAULTS = {"epochs": 6, "lr": 3e-3, "betas": (0.9, 0.95), "warmup_ratio": 0.03, "min_lr_ratio": 0.1,
                  "grad_clip": 0.5, "patience": None}
BATCH_TOKENS = 2048        # tokens (rows x padded length) per training batch
EVAL_CHAINS = 2048
FINAL_CHAINS = 8192
EVAL_BLOCKS = 4            # drafter forwards per simulated chain (8 drafts for k = 2: the 8-layer tree's depth)
BUDGETS = (4, 8, 16, 32, 64)



@dataclass
class FalconFit:
    head: FalconHead
    result: Any
    rope: tuple[torch.Tensor, torch.Tensor]


def fit_falcon(target_model, train_batches: Callable[[int], Iterable] | Iterable, eval_batches: list | None, *,
               config, csgd: bool = True, lambda_schedule: str = "paper", noise: float = 0.1,
               negatives: int | None = 2048, max_len: int = 512, seed: int = 0, k: int = 2,
               head: FalconHead | None = None, dist_weight: float = DIST_WEIGHT, init: str = "identity",
               intermediate_size: int | None = None, vocab_rank: torch.Tensor | None = None,
               draft_vocab: int = 8192, eval_blocks: int = EVAL_BLOCKS,
               eval_chains: int = EVAL_CHAINS) -> FalconFit:
    """Train a FalconHead (`FalconHead.from_target(init=...)` unless `head` is given) with the
    shared loop (`config`: a loop.TrainConfig) and CSGD (`csgd=False`: λ = 0); `eval_batches`
    (held-back, in memory) give its chain τ every epoch, drafting from the `draft_vocab` most
    frequent tokens of `vocab_rank` as serving does (the whole vocabulary without a ranking)."""
    glance_lambda(0.0, lambda_schedule)   # validates the schedule's name
    cfg = target_model.cfg
    device = torch.device(config.device)
    head = (head or FalconHead.from_target(cfg, target_model, k=k, init=init, seed=seed,
                                           intermediate_size=intermediate_size)).to(device=device, dtype=torch.float32)
    rope = rope_tables(cfg, max_len + eval_blocks * head.k + 4, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    embed, lm_head = target_model.embed, target_model.lm_head_weight
    try:
        per_epoch = len(train_batches(0) if callable(train_batches) else train_batches)
    except TypeError:
        per_epoch = None
    total = (config.max_steps or (per_epoch or 1) * config.epochs) * max(1, config.grad_accum)
    calls = [0]

    def loss_fn(module, batch):
        lam = glance_lambda(calls[0] / max(1, total), lambda_schedule) if csgd else 0.0
        calls[0] += 1
        loss, logs = falcon_loss(module, batch, embed=embed, lm_head_weight=lm_head, rope=rope, lam=lam,
                                 noise=noise, negatives=negatives, generator=gen, dist_weight=dist_weight)
        return loss, {**logs, "lambda": lam}

    vocab_ids, vocab_weight = None, lm_head
    if vocab_rank is not None and 0 < draft_vocab < lm_head.shape[0]:
        vocab_ids = vocab_rank[:draft_vocab].to(device)
        vocab_weight = lm_head.index_select(0, vocab_ids)
    eval_fn = None
    if eval_batches:
        def eval_fn(module):
            return evaluate(module, eval_batches, embed=embed, vocab_weight=vocab_weight, vocab_ids=vocab_ids,
                            rope=rope, blocks=eval_blocks, max_chains=eval_chains)

    result = train(head, loss_fn, train_batches, eval_fn=eval_fn, config=config)
    return FalconFit(head, result, rope)


@register_trainer(KIND)
def train_falcon(options: dict, target, data) -> Path:
    """`specserve train falcon`: the head trained with CSGD on the teacher shards' train split
    (whole examples), the best held-back chain τ kept, saved in bf16 with the training labels'
    vocabulary ranking, the tree it drafts with and that tree's measured order. Options besides
    the loop's (epochs 6, lr 3e-3, max_seconds, eval_every, seed, device, ...): csgd (true;
    false = the ablation without glancing), lambda_schedule (paper | repo), k (2), init
    (identity | random), intermediate_size (the decoder layer's MLP width; default the target's),
    noise (0.1, absolute), negatives (2048; `full_vocab=true` for the exact softmax), dist_weight
    (0.1), train_batch_tokens (2048), tree (the serving default: falcon_kmask2_8layer_tree),
    eval_blocks (4 drafter forwards per simulated chain), eval_chains (2048), final_chains (8192),
    draft_vocab (8192), engine_tau_prompts (0: held-back prompts to also run through the engine)."""
    if not options.get("out"):
        raise ValueError("falcon trainer: no output folder (--out)")
    start = time.time()
    seed = int(option(options, "seed", 0))
    csgd = bool(option(options, "csgd", True))
    schedule = str(option(options, "lambda_schedule", "paper"))
    k = int(option(options, "k", 2))
    noise = float(option(options, "noise", 0.1))
    negatives = None if options.get("full_vocab") else int(option(options, "negatives", 2048))
    max_len = int(option(options, "max_len", 512))
    init = str(option(options, "init", "identity"))
    dist_weight = float(option(options, "dist_weight", DIST_WEIGHT))
    intermediate = options.get("intermediate_size")
    eval_blocks = int(option(options, "eval_blocks", EVAL_BLOCKS))
    draft_vocab = int(option(options, "draft_vocab", 8192))
    tree_name = str(option(options, "tree", DEFAULT_TREE))
    device = target.device
    b = trainer_batches(KIND, options, data, FIELDS, defaults=TRAIN_DEFAULTS, batch_tokens=BATCH_TOKENS,
                        device=device, seed=seed)
    config, batch_tokens, eval_tokens, eval_batches = b.config, b.batch_tokens, b.eval_tokens, b.held_back
    rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size,
                                         batch_tokens=eval_tokens)
    logger.info("falcon: %d train examples (%d tokens), %d held-back examples; CSGD %s (%s schedule)",
                len(data.train), data.train.num_tokens, len(data.held_back), "on" if csgd else "off", schedule)
    fit = fit_falcon(target.model, b.train, eval_batches, config=config, csgd=csgd, lambda_schedule=schedule,
                     noise=noise, negatives=negatives, max_len=max_len, seed=seed, k=k, dist_weight=dist_weight,
                     init=init, intermediate_size=intermediate, vocab_rank=rank, draft_vocab=draft_vocab,
                     eval_blocks=eval_blocks, eval_chains=int(option(options, "eval_chains", EVAL_CHAINS)))
    head, result = fit.head, fit.result
    head.set_vocab_rank(rank)
    as_saved(head)   # measure what is saved: bf16 weights
    lm_head = target.model.lm_head_weight
    vocab_ids = rank[:draft_vocab].to(lm_head.device) if 0 < draft_vocab < lm_head.shape[0] else None
    vocab_weight = lm_head if vocab_ids is None else lm_head.index_select(0, vocab_ids)
    ranks = collect_ranks(head, eval_batches, embed=target.model.embed, vocab_weight=vocab_weight,
                          vocab_ids=vocab_ids, rope=fit.rope, blocks=eval_blocks,
                          max_chains=int(option(options, "final_chains", FINAL_CHAINS)))
    tau = chain_tau(ranks)
    names = [tree_name] + [n for n in TREE_NAMES if n != tree_name]
    orders = tree_orders(ranks, names)
    tree = None
    if tree_name in orders:
        tree = {"name": tree_name, "k": head.k, **orders[tree_name],
                "source": "trees.json (Bestpay-inc/Falcon models/choices.py), duplicates dropped; order: greedy "
                          "expansion by held-back path probability",
                "alternatives": {n: o for n, o in orders.items() if n != tree_name}}
    elif tree_name not in TREE_NAMES:
        paths = load_tree(tree_name)
        if paths:
            tree = {"name": tree_name, "k": head.k, "paths": dedup_paths(paths)}
    expected = {n: {str(b): round(v, 4) for b, v in tree_tau(ranks, o["order"], (*BUDGETS, len(o["order"]))).items()}
                for n, o in orders.items()}
    logger.info("falcon: held-back chain tau %.3f over %d chains (%d steps, %.0f s); tree tau by budget %s", tau,
                ranks.shape[0], result.steps, time.time() - start, expected)
    served = None
    n_prompts = int(option(options, "engine_tau_prompts", 0))
    if n_prompts > 0:
        served = served_tau(target, KIND, {"head": head}, data.held_back_examples()[:n_prompts])
        logger.info("falcon: served tau %.3f on %d held-back prompts", served["tau"], served["num_prompts"])
    hp = {**head.hyperparams(), "csgd": csgd, "lambda_schedule": schedule if csgd else None,
          "lambda": ("0.4 * (E - e) / E, e = fractional epoch (paper)" if schedule == "paper"
                     else "0.35 * (E - e) / E + 0.1 (official code)") if csgd else "0 (no glancing)",
          "glance": "block-aligned runs at k-block starts; glanced rows read (f_{r+k}, x_{r+k+1}) and leave the loss",
          "loss": f"SmoothL1 + {dist_weight} * (0.9 KL + 0.1 CE(greedy label)) over the batch candidate set",
          "noise": f"U(-{noise}, {noise}) on input features", "negatives": negatives, "lr": config.lr,
          "epochs": config.epochs, "train_batch_tokens": batch_tokens, "steps": result.steps,
          "stop_reason": result.stop_reason, "init": init, "block_offsets": "random per example and batch"}
    meta = CheckpointMeta(
        kind=KIND, target_name=target.name, target_fingerprint=target.fingerprint, hyperparams=hp,
        data=data.summary(), train_seconds=round(time.time() - start, 1), device=describe_device(device),
        tau=tau, tree=tree,
        tau_details={"method": f"offline: greedy SAR chains of {eval_blocks} drafter forwards ({eval_blocks * k} "
                               "drafts) after every held-back answer position, the root block from real features, "
                               "later blocks from predicted features and teacher-forced tokens, drafts from the "
                               f"{draft_vocab} most frequent tokens; 1 + mean leading matches with the target's "
                               "greedy labels",
                     "chains": int(ranks.shape[0]),
                     "top1_by_depth": [round(float((ranks[:, d] == 0).double().mean()), 4) if ranks.shape[0] else 0.0
                                       for d in range(ranks.shape[1])],
                     "tree_tau_by_budget": expected, "served": served, "loop_evals": result.eval_history,
                     "draft_vocab_coverage": coverage})
    return Path(save_checkpoint(options["out"], head.tensors(), meta))


__all__ = ["glance_lambda", "batch_rows", "glance", "falcon_loss", "distill_terms", "sar_ranks", "collect_ranks",
           "chain_tau", "tree_tau", "tree_orders", "fit_falcon", "train_falcon", "Rows"]
