"""Medusa-1 heads over a frozen target: the module, its distillation loss, the held-back τ
estimate, tree tuning and the registered trainer (`specserve train medusa ...`).

The module. K residual heads read the target's last-layer hidden state h_t (after the final norm,
the LM head's input) of the last token that has features, and head k (k = 1..K) predicts the
token at offset t+1+k through the target's own frozen LM head:

    logits_k = LMHead(h_t + SiLU(W_k h_t + b_k))

The target's LM head at h_t itself predicts t+1, which at serving time is the bonus token already
committed (the tree root), so head k drafts tree depth k. W_k and b_k start at zero: every head
starts as the target's next-token prediction. All heads run as ONE matmul ([K*H, H] weight) for
all rows.

The loss. Self-distillation of the target's greedy choices: `labels[j]` = the target's argmax at
position j (the token it would put at j+1) from the teacher shards; head k at position t learns
`labels[t+k]`, only where that label is an answer token:

    L = sum_k 0.8^(k-1) * mean_t CE(head_k(h_t), labels[t+k])

CPU cost. The 49152 x 576 LM head dominates (K rows of it per position, forward and backward).
By default the softmax runs over a *shared candidate set* per batch instead of the whole
vocabulary (sampled softmax): every label of the batch, the target's own top-4 ids at the
position and at each label position (the hard negatives: what the heads predict at
initialisation and what the target itself hesitated over), plus `num_negatives` (2048) uniformly
drawn ids -- a few thousand columns instead of 49152, and on a CPU that computes bf16 natively
(avx512_bf16 / AMX: about 3x the fp32 speed) the product runs in bf16; elsewhere it stays fp32 (an
AVX2 CPU emulates bf16 matmuls some 70x slower than fp32). `full_vocab=true` trains on the exact
softmax. The held-back evaluation always ranks over the full vocabulary in fp32.

τ (held-back). The rank of the right token (labels[t+k]) in head k's full-vocabulary logits at
every held-back position gives, for the chain of top-1 drafts and for any Cartesian tree (the
Medusa template, the tuned tree), the drafts accepted when drafting from that position; τ is the
*decoding walk* over each held-back answer (a step at t commits accepted + 1 tokens and the next
one drafts from there), which on the target's own greedy answers equals the engine's τ (checked
in the tests). The tuned tree is chosen on half of the held-back sequences and walked on the
other half. At the end the trainer also measures τ through the engine on held-back prompts
(`engine_tau_prompts`), the figure the checkpoint's `tau` records.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets import tree_tuning
from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.nets.medusa import DEFAULT_NUM_HEADS, MedusaHeads, load_template  # noqa: F401  (re-exported)
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.train.evaluate import option, served_tau
from specserve.drafters.train.loop import TrainConfig, train
from specserve.engine.quant import native_bf16
from specserve.engine.tree import preference_prefix

logger = logging.getLogger("specserve")

KIND = "medusa"
DEFAULT_DECAY = 0.8
DEFAULT_TREE = "medusa_mc_sim_7b_63"
MAX_RANK = 10                 # candidates per depth considered by tree tuning / the template
TUNED_TREE_NODES = 64         # greedy order length saved in the checkpoint (every prefix is a tree)
HARD_NEGATIVES = 4            # target top-k ids per row used as hard negatives


# ---- examples -------------------------------------------------------------------------------------------------------

@dataclass
class MedusaExamples:
    """Training / evaluation rows: one per position t whose own next token (labels[t], the tree
    root at serving time) and at least head 1's target are answer tokens, in position order.

    hidden [N, H] (fp16 or the target's dtype), targets [N, K] int64 (labels[t+k], -1 = none: past
    the end or not an answer token), hard [N, M] int64 ids to use as hard negatives (-1 = none),
    seq [N] int64 the sequence each row belongs to (its rows are consecutive positions)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    hard: torch.Tensor
    seq: torch.Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def subset(self, idx: torch.Tensor) -> "MedusaExamples":
        return MedusaExamples(self.hidden[idx], self.targets[idx], self.hard[idx], self.seq[idx])

    def head(self, rows: int) -> "MedusaExamples":
        """The first `rows` rows (whole sequences but maybe the last)."""
        return self.subset(torch.arange(min(rows, len(self))))

    @staticmethod
    def cat(parts: Sequence["MedusaExamples"], num_heads: int, hidden_size: int) -> "MedusaExamples":
        if not parts:
            return MedusaExamples(torch.zeros(0, hidden_size, dtype=torch.float16),
                                  torch.zeros(0, num_heads, dtype=torch.int64),
                                  torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        m = max(p.hard.shape[1] for p in parts)
        hard = [F.pad(p.hard, (0, m - p.hard.shape[1]), value=-1) for p in parts]
        seqs, base = [], 0
        for p in parts:
            seqs.append(p.seq + base)
            base += int(p.seq.max()) + 1 if len(p) else 0
        return MedusaExamples(torch.cat([p.hidden for p in parts]), torch.cat([p.targets for p in parts]),
                              torch.cat(hard), torch.cat(seqs))


def sequence_examples(hidden: torch.Tensor, labels: torch.Tensor, num_heads: int,
                      label_mask: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                      hard_negatives: int = HARD_NEGATIVES) -> MedusaExamples:
    """The rows of one sequence of T tokens: `hidden[t]` the target's feature at t, `labels[t]` its
    argmax next token at t (the token it would put at t+1), `label_mask[t]` whether that label is
    an answer token to train on (default all), `topk_ids[t]` the target's top ids at t (optional).

    Row t is kept when labels[t] and labels[t+1] are both trained: at serving time the heads read
    h_t when the token at t+1 (the root) is an answer token already committed."""
    T = hidden.shape[0]
    labels = labels.to(torch.int64).view(-1).cpu()
    ok = torch.ones(T, dtype=torch.bool) if label_mask is None else label_mask.to(torch.bool).view(-1).cpu()
    targets = torch.full((T, num_heads), -1, dtype=torch.int64)
    for k in range(1, num_heads + 1):
        if k < T:
            lab = labels[k:].clone()
            lab[~ok[k:]] = -1
            targets[:T - k, k - 1] = lab
    keep = (ok & (targets[:, 0] >= 0)).nonzero().flatten()
    if topk_ids is not None and hard_negatives > 0:
        top = topk_ids[:, :hard_negatives].to(torch.int64).cpu()
        rows = [top]                             # the position's own alternatives (init predictions)
        for k in range(1, num_heads + 1):        # the alternatives at each label position
            shifted = torch.full_like(top, -1)
            if k < T:
                shifted[:T - k] = top[k:]
            rows.append(shifted)
        hard = torch.cat(rows, dim=1)
    else:
        hard = torch.zeros(T, 0, dtype=torch.int64)
    return MedusaExamples(hidden[keep].cpu(), targets[keep], hard[keep], torch.zeros(len(keep), dtype=torch.int64))


# ---- loss -----------------------------------------------------------------------------------------------------------

def head_weights(num_heads: int, decay: float = DEFAULT_DECAY) -> torch.Tensor:
    return torch.tensor([decay ** k for k in range(num_heads)], dtype=torch.float32)


def candidate_set(targets: torch.Tensor, hard: torch.Tensor, vocab: int, num_negatives: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted unique ids: every target, every hard negative and `num_negatives` uniform draws."""
    parts = [targets[targets >= 0].flatten(), hard[hard >= 0].flatten()]
    if num_negatives > 0:
        parts.append(torch.randint(vocab, (num_negatives,), generator=generator))
    return torch.unique(torch.cat(parts).cpu())


def medusa_loss(heads: MedusaHeads, lm_head_weight: torch.Tensor, batch: MedusaExamples, *,
                decay: float = DEFAULT_DECAY, num_negatives: int | None = 2048,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted CE of every head against its targets. `num_negatives=None`: full-vocabulary softmax;
    otherwise the sampled softmax over `candidate_set` (see the module docstring)."""
    dev = heads.weight.device
    h = batch.hidden.to(device=dev, dtype=torch.float32)
    targets = batch.targets.to(dev)
    K = min(heads.num_heads, targets.shape[1])
    targets = targets[:, :K]
    out = heads(h, K)                                              # [N, K, H]
    W = lm_head_weight.detach()
    # the LM-head product runs in W's dtype when it is a low-precision one (a bf16 copy made by
    # fit_medusa on the CPU: about 3x faster there), the softmax in fp32
    mm_dtype = W.dtype if W.dtype in (torch.bfloat16, torch.float16) else out.dtype
    flat = out.reshape(-1, out.shape[-1]).to(mm_dtype)
    if num_negatives is None:
        logits = (flat @ W.to(mm_dtype).t()).float()
        tgt = targets.reshape(-1).clamp_min(0)
    else:
        cand = candidate_set(batch.targets[:, :K], batch.hard, W.shape[0], num_negatives, generator).to(dev)
        logits = (flat @ W[cand].to(mm_dtype).t()).float()                    # [N*K, C]
        tgt = torch.searchsorted(cand, targets.clamp_min(0).reshape(-1))
    valid = targets.reshape(-1) >= 0
    ce = F.cross_entropy(logits, tgt, reduction="none")
    ce = torch.where(valid, ce, torch.zeros_like(ce)).view(-1, K)
    vmask = valid.view(-1, K).float()
    per_head = ce.sum(0) / vmask.sum(0).clamp_min(1.0)
    w = head_weights(K, decay).to(dev)
    loss = (w * per_head).sum()
    with torch.no_grad():
        top1 = (logits.argmax(-1) == tgt) & valid
        acc = top1.view(-1, K).float().sum(0) / vmask.sum(0).clamp_min(1.0)
    logs = {"loss": float(loss.detach())}
    for k in range(K):
        logs[f"ce{k + 1}"] = float(per_head[k].detach())
        logs[f"acc{k + 1}"] = float(acc[k])
    return loss, logs


# ---- held-back evaluation -------------------------------------------------------------------------------------------

@torch.no_grad()
def head_ranks(heads: MedusaHeads, lm_head_weight: torch.Tensor, examples: MedusaExamples,
               chunk_rows: int = 256) -> torch.Tensor:
    """[N, K] rank of the right token in each head's full-vocabulary logits (0 = top-1;
    ties counted in the token's favour), -1 where the row has no target for that head."""
    dev = heads.weight.device
    K = min(heads.num_heads, examples.targets.shape[1])
    W = lm_head_weight.detach()
    out_ranks = torch.full((len(examples), K), -1, dtype=torch.int64)
    for a in range(0, len(examples), chunk_rows):
        h = examples.hidden[a:a + chunk_rows].to(device=dev, dtype=heads.weight.dtype)
        t = examples.targets[a:a + chunk_rows, :K].to(dev)
        out = heads(h, K)                                          # [n, K, H]
        logits = (out.reshape(-1, out.shape[-1]) @ W.to(out.dtype).t()).float().view(h.shape[0], K, -1)
        right = logits.gather(-1, t.clamp_min(0).unsqueeze(-1))
        rank = (logits > right).sum(-1)
        out_ranks[a:a + chunk_rows] = torch.where(t >= 0, rank, torch.full_like(rank, -1)).cpu()
    return out_ranks


def chain_accepted(ranks: torch.Tensor) -> torch.Tensor:
    """Per row, the drafts a chain of the K heads' top-1 tokens gets accepted (leading hits)."""
    return (ranks == 0).long().cumprod(dim=1).sum(dim=1)


def walk_tau(accepted: torch.Tensor, seq: torch.Tensor) -> float:
    """τ (committed tokens per verification step) of greedy decoding along the held-back
    sequences: from each sequence's first row, a step at row t commits accepted[t] + 1 tokens and
    the next step drafts from row t + accepted[t] + 1. (Averaging 1 + accepted over all rows
    instead overweights easy stretches, which a real walk crosses in few steps.) Exact for the
    target's own greedy answers (self-distillation); an estimate for reference answers."""
    acc = accepted.tolist()
    seq = seq.tolist()
    steps = tokens = 0
    i, n = 0, len(acc)
    while i < n:
        a = acc[i]
        steps += 1
        tokens += a + 1
        j = i + a + 1
        if j < n and seq[j] != seq[i]:            # the walk left this sequence: go to the next one
            j = i + 1
            while j < n and seq[j] == seq[i]:
                j += 1
        i = j
    return tokens / steps if steps else 1.0


def chain_tau(ranks: torch.Tensor, seq: torch.Tensor | None = None) -> float:
    """τ of the chain of the heads' top-1 drafts: a decoding walk over `seq`, or without it the
    per-position mean 1 + leading hits."""
    if ranks.shape[0] == 0:
        return 1.0
    acc = chain_accepted(ranks)
    return walk_tau(acc, seq) if seq is not None else 1.0 + float(acc.double().mean())


def tree_tau(ranks: torch.Tensor, paths: Sequence[Sequence[int]], seq: torch.Tensor | None = None) -> float:
    """τ of the Cartesian tree `paths` (tree_tuning.accepted_lengths): a decoding walk over `seq`,
    or without it the per-position mean."""
    if ranks.shape[0] == 0:
        return 1.0
    acc = tree_tuning.accepted_lengths(ranks, paths)
    return walk_tau(acc, seq) if seq is not None else 1.0 + float(acc.double().mean())


def evaluate(heads: MedusaHeads, lm_head_weight: torch.Tensor, examples: MedusaExamples,
             template: Sequence[Sequence[int]] | None = None, budgets: Sequence[int] = (4, 8, 16, 32, 63),
             tuned_nodes: int = TUNED_TREE_NODES, seed: int = 0) -> dict[str, Any]:
    """Held-back τ (decoding walks, see `walk_tau`): the chain, the template tree cut to each
    budget in its own order, and a tuned tree chosen on half of the sequences and walked on the
    other half; the per-depth acceptance table; and the tuned order chosen on all rows (what a
    checkpoint keeps)."""
    ranks = head_ranks(heads, lm_head_weight, examples)
    seq = examples.seq
    n = ranks.shape[0]
    res: dict[str, Any] = {"positions": n, "sequences": int(seq.unique().numel()) if n else 0,
                           "tau_chain": round(chain_tau(ranks, seq), 4),
                           "tau_chain_per_position": round(chain_tau(ranks), 4),
                           "top1": [round(float((ranks[:, k] == 0).double().mean()), 4) if n else 0.0
                                    for k in range(ranks.shape[1])],
                           "acc": [[round(x, 5) for x in row] for row in tree_tuning.acceptance_table(ranks, MAX_RANK)]}
    if template is not None:
        res["tau_template"] = {b: round(tree_tau(ranks, template_prefix(template, b), seq), 4) for b in budgets}
    ids = seq.unique()
    perm = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    fit_ids = perm[: ids.numel() // 2]
    fit = torch.isin(seq, fit_ids)
    check = ~fit
    order_half = tree_tuning.greedy_tree_order_empirical(ranks[fit], max(budgets), MAX_RANK)
    res["tau_tuned"] = {b: round(tree_tau(ranks[check], order_half[:b], seq[check]), 4) for b in budgets}
    res["tuned_order"] = tree_tuning.greedy_tree_order_empirical(ranks, tuned_nodes, MAX_RANK)
    return res


template_prefix = preference_prefix   # the first `budget` nodes of a preference order (engine.tree)


# ---- the trainer ----------------------------------------------------------------------------------------------------

def label_mask_from_answer(answer_mask: torch.Tensor) -> torch.Tensor:
    """Shard convention: the prediction at t (labels[t], the token at t+1) is trained where the
    token at t+1 is an answer token; the last position predicts nothing."""
    answer_mask = answer_mask.to(torch.bool).view(-1)
    out = torch.zeros_like(answer_mask)
    out[:-1] = answer_mask[1:]
    return out


def dataset_examples(dataset, num_heads: int, *, max_positions: int | None = None, seed: int = 0,
                     hard_negatives: int = HARD_NEGATIVES) -> MedusaExamples:
    """Every trained position of a `ShardDataset` split (whole examples, in a seeded order, until
    `max_positions` rows are collected), hidden states kept in the shards' dtype (fp16)."""
    order = list(range(len(dataset)))
    torch.manual_seed(seed)
    order = [order[i] for i in torch.randperm(len(order)).tolist()]
    parts, total = [], 0
    fields = ("hidden", "labels", "topk_ids", "answer_mask")
    for i in order:
        ex = dataset.example(i, fields)
        part = sequence_examples(ex["hidden"], ex["labels"], num_heads, label_mask_from_answer(ex["answer_mask"]),
                                 ex["topk_ids"], hard_negatives)
        if len(part):
            parts.append(part)
            total += len(part)
        if max_positions is not None and total >= max_positions:
            break
    out = MedusaExamples.cat(parts, num_heads, dataset.hidden_size)
    if max_positions is not None and len(out) > max_positions:
        out = out.subset(torch.arange(max_positions))
    return out


class PositionBatches:
    """An epoch of shuffled minibatches of rows (re-iterable, sized)."""

    def __init__(self, examples: MedusaExamples, batch_size: int, seed: int, epoch: int):
        self.examples, self.batch_size = examples, batch_size
        self.perm = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed * 7919 + epoch))

    def __len__(self) -> int:
        return max(1, math.ceil(len(self.examples) / self.batch_size)) if len(self.examples) else 0

    def __iter__(self) -> Iterable[MedusaExamples]:
        for a in range(0, len(self.examples), self.batch_size):
            yield self.examples.subset(self.perm[a:a + self.batch_size])


def fit_medusa(target_model, train_examples: MedusaExamples, eval_examples: MedusaExamples, *,
               num_heads: int = DEFAULT_NUM_HEADS, decay: float = DEFAULT_DECAY, batch_size: int = 256,
               num_negatives: int | None = 2048, eval_budget: int = 8, template: Sequence[Sequence[int]] | None = None,
               config=None, seed: int = 0, device=None, bf16_matmul: bool | None = None):
    """Train fresh heads on `train_examples`; returns (heads, TrainResult). The loop's τ (early
    stopping, best state) is the held-back τ of the template cut to `eval_budget` nodes (the
    chain τ without a template)."""
    config = config or TrainConfig()
    device = torch.device(device or config.device)
    W = target_model.lm_head_weight
    if bf16_matmul is None:   # only where the CPU computes bf16 natively
        bf16_matmul = native_bf16()
    if bf16_matmul and device.type == "cpu" and W.dtype == torch.float32:
        W = W.detach().to(torch.bfloat16)     # a training-time copy for the loss only (eval uses the real one)
    heads = MedusaHeads(num_heads, W.shape[1], device=device)
    gen = torch.Generator().manual_seed(seed)
    tree = template_prefix(template, eval_budget) if template else None

    def loss_fn(module, batch):
        return medusa_loss(module, W, batch, decay=decay, num_negatives=num_negatives, generator=gen)

    def eval_fn(module):
        ranks = head_ranks(module, target_model.lm_head_weight, eval_examples)
        out = {"tau_chain": chain_tau(ranks, eval_examples.seq)}
        out.update({f"top1_{k + 1}": float((ranks[:, k] == 0).double().mean()) for k in range(ranks.shape[1])})
        out["tau"] = tree_tau(ranks, tree, eval_examples.seq) if tree else out["tau_chain"]
        return out

    result = train(heads, loss_fn, lambda epoch: PositionBatches(train_examples, batch_size, seed, epoch),
                   eval_fn=eval_fn if len(eval_examples) else None, config=config)
    return heads, result


# the loop's defaults for medusa (options override them; `specserve train` passes its own epochs and lr)
TRAIN_DEFAULTS = {"epochs": 2, "lr": 1e-3, "betas": (0.9, 0.999), "warmup_ratio": 0.03, "patience": 3}


@register_trainer(KIND)
def train_medusa(options: dict, target, data) -> Path:
    """`specserve train medusa`: heads trained on the teacher shards' train split, evaluated on the
    held-back split, saved with their tuned tree. Options (besides the loop's: epochs, lr,
    max_seconds, eval_every, seed, device, ...): num_heads (4), decay (0.8), batch_size (256
    positions), num_negatives (2048; `full_vocab=true` for the exact softmax), max_train_positions
    (all), eval_positions (4096 held-back positions), eval_budget (8: the tree size of the τ the loop
    watches and of the engine τ), tuned_nodes (64), bf16_matmul (the LM-head product of the loss in
    bf16 on the CPU; default: where the CPU computes bf16 natively), engine_tau_prompts (8 held-back
    prompts through the engine at the end; 0 = offline τ only), engine_tau_max_tokens (64)."""
    if not options.get("out"):
        raise ValueError("medusa trainer: no output folder (--out)")
    start = time.time()
    num_heads = int(option(options, "num_heads", DEFAULT_NUM_HEADS))
    decay = float(option(options, "decay", DEFAULT_DECAY))
    seed = int(option(options, "seed", 0))
    batch_size = int(option(options, "batch_size", 256))
    num_negatives = None if options.get("full_vocab") else int(option(options, "num_negatives", 2048))
    eval_budget = int(option(options, "eval_budget", 8))
    tuned_nodes = int(option(options, "tuned_nodes", TUNED_TREE_NODES))
    max_train = options.get("max_train_positions")
    train_ex = dataset_examples(data.train, num_heads, max_positions=int(max_train) if max_train else None, seed=seed)
    eval_ex = dataset_examples(data.held_back, num_heads, max_positions=int(option(options, "eval_positions", 4096)),
                               seed=seed + 1)
    if not len(train_ex):
        raise ValueError("medusa trainer: the train split has no answer position")
    logger.info("medusa: %d train positions, %d held-back positions (data loaded in %.1f s)", len(train_ex),
                len(eval_ex), time.time() - start)
    template = load_template()
    config = TrainConfig.from_options({**TRAIN_DEFAULTS, **{k: v for k, v in options.items() if v is not None}},
                                      device=str(target.device))
    loop_eval = eval_ex.head(2048)
    heads, result = fit_medusa(target.model, train_ex, loop_eval, num_heads=num_heads, decay=decay,
                               batch_size=batch_size, num_negatives=num_negatives, eval_budget=eval_budget,
                               template=template, config=config, seed=seed, device=target.device,
                               bf16_matmul=option(options, "bf16_matmul", None))
    with torch.no_grad():   # measure what is saved: bf16 weights
        heads.weight.copy_(heads.weight.to(torch.bfloat16).float())
        heads.bias.copy_(heads.bias.to(torch.bfloat16).float())
    heads.vocab_rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size)
    report = evaluate(heads, target.model.lm_head_weight, eval_ex, template, tuned_nodes=tuned_nodes, seed=seed)
    order = report.pop("tuned_order")
    tau = report["tau_tuned"].get(eval_budget) if eval_budget in report["tau_tuned"] else report["tau_chain"]
    logger.info("medusa: held-back offline tau: chain %.3f, tuned tree %s, template %s", report["tau_chain"],
                report["tau_tuned"], report.get("tau_template"))
    engine_prompts = int(option(options, "engine_tau_prompts", 8))
    if engine_prompts > 0:
        try:
            prompts = data.held_back_examples()[:engine_prompts]
            if not prompts:
                raise ValueError("no held-back prompt")
            report["engine"] = served_tau(target, KIND, {"heads": copy.deepcopy(heads), "tree": order}, prompts,
                                          budget=eval_budget, max_len=int(option(options, "max_len", 512)), seed=seed,
                                          max_tokens=int(option(options, "engine_tau_max_tokens", 64)))
            tau = report["engine"]["tau"]
            logger.info("medusa: held-back engine tau %.3f (budget %d, %d prompts)", tau, eval_budget, engine_prompts)
        except Exception as exc:   # noqa: BLE001 - the offline figure stands in
            logger.warning("medusa: engine tau not measured: %s", exc)
    meta = CheckpointMeta(
        kind=KIND, target_name=target.name, target_fingerprint=target.fingerprint,
        hyperparams={"num_heads": num_heads, "hidden_size": heads.hidden_size, "decay": decay,
                     "batch_size": batch_size, "num_negatives": num_negatives, "lr": config.lr,
                     "epochs": config.epochs, "train_positions": len(train_ex), "steps": result.steps,
                     "stop_reason": result.stop_reason},
        data=data.summary(), train_seconds=round(time.time() - start, 1), device=describe_device(target.device),
        tau=tau,
        tau_details={"method": "tau: through the engine (greedy, the tuned tree, draft budget `budget`) on "
                               "held-back prompts when `engine` is present; else offline. Offline figures: "
                               "decoding walks over held-back teacher-forced answers with the rank of the "
                               "target's greedy token in each head's full-vocabulary logits (tuned tree chosen "
                               "on half of the sequences, walked on the other half)",
                     "budget": eval_budget, **report,
                     "loop_evals": result.eval_history, "draft_vocab_coverage": coverage},
        tree={"choices": order, "order": "greedy expected accepted length (each prefix is a tree)",
              "acc": report["acc"]})
    out = save_checkpoint(options["out"], heads.state_tensors(), meta)
    return Path(out)
