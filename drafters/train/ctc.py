"""The CTC-drafter trainer (`specserve train ctc`): CTC loss against the target's distilled greedy
labels, the held-back τ of the serving drafter's trees, and the checkpoint.

Data: the teacher shards (`labels[t]` = the target's greedy next token after position t; with
self-distillation the answers are the target's own greedy output, so the labels of an answer are
its next tokens). The network is `specserve.drafters.nets.ctc.CTCDraftNet`.

The targets (decision 3 of drafters/ctc.py). A position t is trained when the token after it, the
root x_{t+1}, is an answer token. Its CTC target is

    Y = labels[t+1 .. t+L]        (the L tokens after the root, as the target greedily continues)

cut before the first label that is not an answer token, before the first one outside the training
vocabulary (the N most frequent labels of the train split: the drafter cannot emit it, so it learns
to stop there), and to what the T slots can emit (|Y| + its adjacent repeats <= T). A position whose
span runs past the end of the data before L labels is dropped unless the span ends with EOS (an
answer cut by max tokens has an unknown continuation; one that ended has none).

The loss. With P̂_i the slot distributions over the N tokens and the blank,

    loss = mean over trained positions of  -log Σ_{A : collapse(A) = Y}  Π_i P̂_i(a_i)

by `torch.nn.functional.ctc_loss` (Graves' forward-backward over the T slots; blank = class N).
The softmax is exact over the N + 1 classes (the LM head's N rows, a training-time copy).

Held-back τ. For every held-back answer position the serving drafter's tree (per-slot top-k, raw
candidates, collapse, trie cut to the budget: the same functions, drafters.ctc.draft_trees) is
walked against the target's greedy continuation; τ is the decoding walk over each answer (a step
at t commits accepted + 1 tokens, the next one drafts from there), exact on self-distilled data.
The selection (top_k, candidates) is tuned on half of the held-back answers and τ reported on the
other half; the checkpoint keeps the selection tuned on all of them. At the end the trainer also
measures τ through the engine on held-back prompts (`engine_tau_prompts`), the figure the
checkpoint's `tau` records.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from specserve.drafters.ctc import BLANK, DEFAULT_CANDIDATES, DEFAULT_TOP_K, draft_trees
from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.nets.ctc import DEFAULT_LABELS, DEFAULT_SLOTS, DEFAULT_VOCAB, KIND, CTCDraftNet
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.train.evaluate import as_saved, option, served_tau
from specserve.drafters.train.loop import train, trainer_batches
from specserve.engine.model import rope_tables

logger = logging.getLogger("specserve")

FIELDS = ("input_ids", "hidden", "labels")
BATCH_TOKENS = 2048
EVAL_POSITIONS = 2048              # held-back positions per loop eval
FINAL_POSITIONS = 4096             # held-back positions of the reported figures
EVAL_BUDGET = 8
BUDGETS = (4, 8, 16, 32)
SELECTIONS = ((2, 16), (2, 32), (3, 32), (3, 64), (4, 32), (4, 64), (4, 128), (5, 64), (5, 128))
TRAIN_DEFAULTS = {"epochs": 3, "lr": 1e-3, "betas": (0.9, 0.95), "warmup_ratio": 0.03, "min_lr_ratio": 0.1,
                  "grad_clip": 0.5, "patience": 2}



# ---- targets --------------------------------------------------------------------------------------------------------

def class_table(rank: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: token id -> its class (its index among the first `size` ranked tokens), or -1."""
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    size = min(int(size), rank.numel())
    table[rank[:size].long()] = torch.arange(size)
    return table


def ctc_targets(labels: torch.Tensor, loss_mask: torch.Tensor, class_of: torch.Tensor, *, label_len: int,
                num_slots: int, eos_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CTC targets of a padded batch (see the module docstring).

    labels [B, L] (the target's greedy next token after each position, < 0 on padding),
    loss_mask [B, L] (`loss_mask[t]`: the token at t+1 is an answer token), class_of [V] (token ->
    class or -1). Returns select [B, L] bool (the trained positions), targets [N, label_len] int64
    (classes, padded with 0) and lengths [N] for the N selected positions in row-major order."""
    B, L = labels.shape
    span = label_len
    lab = F.pad(labels.long(), (0, span + 1), value=-1)
    ok = F.pad(loss_mask.bool(), (0, span + 1), value=False)
    future = torch.stack([lab[:, j:j + L] for j in range(1, span + 1)], dim=-1)       # [B, L, span]: labels[t+j]
    answer = torch.stack([ok[:, j:j + L] for j in range(1, span + 1)], dim=-1)        # is labels[t+j] an answer label
    lead = answer.long().cumprod(-1).bool()
    m = lead.sum(-1)                                                                   # leading answer labels
    last = future.gather(-1, (m - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    eos = torch.tensor(list(eos_ids), dtype=torch.int64, device=labels.device)
    ends = (m >= 1) & torch.isin(last, eos) if eos.numel() else torch.zeros_like(m, dtype=torch.bool)
    select = loss_mask.bool() & ((m == span) | ends)
    fut = future[select]                                                               # [N, span]
    classes = class_of.to(labels.device)[fut.clamp(min=0)]
    repeat = torch.zeros_like(fut, dtype=torch.long)
    repeat[:, 1:] = (fut[:, 1:] == fut[:, :-1]).long()
    slots_needed = (1 + repeat).cumsum(-1)                                             # |Y[:j]| + its repeats
    keep = (lead[select] & (classes >= 0) & (slots_needed <= num_slots)).long().cumprod(-1).bool()
    targets = torch.where(keep, classes, torch.zeros_like(classes))
    return select, targets, keep.sum(-1)


# ---- the loss -------------------------------------------------------------------------------------------------------

def next_token_embeds(embed, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] ids -> [B, L, H] with row p = e(x_{p+1}) (zeros at the last position)."""
    with torch.no_grad():
        e = embed(input_ids[:, 1:]).float()
    return F.pad(e, (0, 0, 0, 1))


def ctc_loss(net: CTCDraftNet, batch: dict[str, torch.Tensor], *, embed, vocab_weight: torch.Tensor,
             class_of: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], label_len: int,
             eos_ids: Sequence[int] = (), keep_fraction: float = 1.0,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The CTC loss of one padded batch (`ShardDataset.batches` with input_ids, hidden, labels):
    mean over the trained positions of -log P(Y | context). `keep_fraction` < 1 trains a random
    share of the positions (cheaper steps over more sequences)."""
    select, targets, lengths = ctc_targets(batch["labels"], batch["loss_mask"], class_of, label_len=label_len,
                                           num_slots=net.num_slots, eos_ids=eos_ids)
    if keep_fraction < 1.0:
        draw = torch.rand(select.shape, generator=generator, device=select.device) < keep_fraction
        kept = draw[select]
        select = select & draw
        targets, lengths = targets[kept], lengths[kept]
    if not bool(select.any()):
        return net.blank.sum() * 0, {"positions": 0.0}
    cos, sin = rope
    out = net.forward_dense(batch["hidden"].float(), next_token_embeds(embed, batch["input_ids"]), select, cos, sin)
    logp = net.log_probs(out, vocab_weight)                                            # [N, T, C + 1]
    n = logp.shape[0]
    loss = F.ctc_loss(logp.transpose(0, 1), targets, torch.full((n,), net.num_slots, dtype=torch.long), lengths,
                      blank=logp.shape[-1] - 1, reduction="none", zero_infinity=True)
    return loss.mean(), {"positions": float(n), "target_len": lengths.float().mean().detach()}


# ---- held-back τ ----------------------------------------------------------------------------------------------------

def accepted_in_tree(tree, continuation: Sequence[int]) -> int:
    """Drafts a greedy verification accepts: the longest root-to-node path of `tree` spelling a
    prefix of `continuation` (the target's greedy tokens after the root)."""
    if tree is None:
        return 0
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, tree.num_nodes):
        kids.setdefault(tree.parents[i], {})[tree.tokens[i]] = i
    node, a = 0, 0
    for tok in continuation:
        node = kids.get(node, {}).get(tok, -1)
        if node < 0:
            break
        a += 1
    return a


def walk_tau(rows: Sequence[tuple[Any, int, int]]) -> float:
    """τ of greedy decoding along each sequence: `rows` are (sequence, position, accepted) for
    consecutive answer positions of each sequence; from its first position a step at t commits
    accepted + 1 tokens and the next step drafts from t + accepted + 1."""
    by_seq: dict[Any, dict[int, int]] = {}
    for s, t, a in rows:
        by_seq.setdefault(s, {})[t] = a
    steps = tokens = 0
    for acc in by_seq.values():
        t, end = min(acc), max(acc)
        while t <= end:
            a = acc.get(t, 0)
            steps += 1
            tokens += a + 1
            t += a + 1
    return tokens / steps if steps else 1.0


@torch.no_grad()
def held_back_slots(net: CTCDraftNet, batches: Iterable[dict], *, embed, vocab_weight: torch.Tensor,
                    vocab_ids: torch.Tensor | None, rope, k: int, max_positions: int | None = None) -> dict[str, Any]:
    """Every held-back answer position's slot top-k (what the serving drafter computes) and its
    greedy continuation: {"logp" [N, T, k], "ids" [N, T, k] (BLANK for the blank), "roots" [N],
    "continuations" (lists), "rows" [(sequence, position)]}."""
    logps, idss, roots, conts, rows = [], [], [], [], []
    left = max_positions
    cos, sin = rope
    for batch in batches:
        if left is not None and left <= 0:
            break
        select = batch["loss_mask"].bool().clone()
        if left is not None:
            cut = select.flatten().cumsum(0).view_as(select) > left
            select &= ~cut
        if not bool(select.any()):
            continue
        with torch.autocast(select.device.type, enabled=False):
            out = net.forward_dense(batch["hidden"].float(), next_token_embeds(embed, batch["input_ids"]), select,
                                    cos, sin)
            logp = net.log_probs(out.float(), vocab_weight.float())
        top = logp.topk(k, dim=-1)
        blank = logp.shape[-1] - 1
        idx = top.indices.clamp(max=blank - 1)
        ids = idx if vocab_ids is None else vocab_ids.to(idx.device)[idx]
        ids = torch.where(top.indices == blank, torch.full_like(ids, BLANK), ids)
        logps.append(top.values.cpu())
        idss.append(ids.cpu())
        labels, mask, input_ids = batch["labels"].cpu(), batch["loss_mask"].bool().cpu(), batch["input_ids"].cpu()
        for b, t in select.nonzero().cpu().tolist():
            roots.append(int(input_ids[b, t + 1]))
            cont = []
            for j in range(t + 1, labels.shape[1]):
                if not mask[b, j]:
                    break
                cont.append(int(labels[b, j]))
            conts.append(cont)
            rows.append((batch["ids"][b], t))
        if left is not None:
            left -= int(select.sum())
    if not logps:
        return {"logp": torch.zeros(0, net.num_slots, k), "ids": torch.zeros(0, net.num_slots, k, dtype=torch.long),
                "roots": [], "continuations": [], "rows": []}
    return {"logp": torch.cat(logps), "ids": torch.cat(idss), "roots": roots, "continuations": conts, "rows": rows}


def accepted_lengths(slots: dict[str, Any], *, top_k: int, candidates: int, budget: int) -> list[int]:
    """Greedy accepted drafts at every held-back position for one selection and budget."""
    out = []
    n = len(slots["roots"])
    for a in range(0, n, 1024):
        b = min(n, a + 1024)
        trees = draft_trees(slots["roots"][a:b], slots["logp"][a:b, :, :top_k], slots["ids"][a:b, :, :top_k],
                            [budget] * (b - a), candidates)
        out.extend(accepted_in_tree(tr, c) for tr, c in zip(trees, slots["continuations"][a:b]))
    return out


def selection_tau(slots: dict[str, Any], *, top_k: int, candidates: int, budget: int,
                  keep: Callable[[Any], bool] | None = None, accepted: Sequence[int] | None = None) -> float:
    """The decoding-walk τ of one selection and budget over the held-back positions (those of the
    sequences `keep` accepts); `accepted` reuses `accepted_lengths` already computed for them."""
    acc = accepted if accepted is not None else accepted_lengths(slots, top_k=top_k, candidates=candidates,
                                                                 budget=budget)
    rows = [(s, t, a) for (s, t), a in zip(slots["rows"], acc) if keep is None or keep(s)]
    return walk_tau(rows)


def evaluate(net: CTCDraftNet, batches: list[dict], *, embed, vocab_weight, vocab_ids, rope,
             max_positions: int | None = FINAL_POSITIONS, budget: int = EVAL_BUDGET, budgets=BUDGETS,
             selections=SELECTIONS, seed: int = 0) -> dict[str, Any]:
    """Held-back figures: τ of the default selection at each budget; the selection (top_k,
    candidates) tuned at `budget` on half of the sequences with its τ on the other half; the
    selection tuned on all of them (what a checkpoint keeps)."""
    kmax = max(max(k for k, _ in selections), DEFAULT_TOP_K)
    slots = held_back_slots(net, batches, embed=embed, vocab_weight=vocab_weight, vocab_ids=vocab_ids, rope=rope,
                            k=kmax, max_positions=max_positions)
    seqs = sorted({s for s, _ in slots["rows"]})
    g = torch.Generator().manual_seed(seed)
    fit = {seqs[i] for i in torch.randperm(len(seqs), generator=g)[: len(seqs) // 2].tolist()}
    res: dict[str, Any] = {"positions": len(slots["rows"]), "sequences": len(seqs)}
    res["tau_default"] = {b: round(selection_tau(slots, top_k=DEFAULT_TOP_K, candidates=DEFAULT_CANDIDATES,
                                                 budget=b), 4) for b in budgets}
    grid_fit, grid_check, grid_all = {}, {}, {}
    for k, m in selections:
        acc = accepted_lengths(slots, top_k=k, candidates=m, budget=budget)
        grid_fit[(k, m)] = selection_tau(slots, top_k=k, candidates=m, budget=budget, keep=lambda s: s in fit,
                                         accepted=acc)
        grid_check[(k, m)] = selection_tau(slots, top_k=k, candidates=m, budget=budget,
                                           keep=lambda s: s not in fit, accepted=acc)
        grid_all[(k, m)] = selection_tau(slots, top_k=k, candidates=m, budget=budget, accepted=acc)
    k_half, m_half = max(grid_fit, key=lambda km: (grid_fit[km], -km[0], -km[1]))
    res["tau_tuned_half"] = round(grid_check[(k_half, m_half)], 4)
    res["selection_half"] = {"top_k": k_half, "candidates": m_half}
    k_all, m_all = max(grid_all, key=lambda km: (grid_all[km], -km[0], -km[1]))
    res["selection"] = {"top_k": k_all, "candidates": m_all}
    res["grid"] = {f"{k},{m}": round(v, 4) for (k, m), v in grid_all.items()}
    res["chain_top1"] = round(selection_tau(slots, top_k=1, candidates=1, budget=net.num_slots), 4)
    return res


# ---- fitting --------------------------------------------------------------------------------------------------------

class CTCFit:
    def __init__(self, net, result, rope, vocab_weight, vocab_ids, class_of):
        self.net, self.result, self.rope = net, result, rope
        self.vocab_weight, self.vocab_ids, self.class_of = vocab_weight, vocab_ids, class_of


def fit_ctc(target_model, train_batches, eval_batches: list | None, *, config, rank: torch.Tensor | None,
            vocab: int = DEFAULT_VOCAB, num_slots: int = DEFAULT_SLOTS, label_len: int = DEFAULT_LABELS,
            eos_ids: Sequence[int] = (), max_len: int = 512, seed: int = 0, keep_fraction: float = 1.0,
            eval_positions: int = EVAL_POSITIONS, net: CTCDraftNet | None = None) -> CTCFit:
    """Train a CTCDraftNet (`CTCDraftNet.from_target` unless `net` is given) with the shared loop
    (`config`: a loop.TrainConfig). `rank` orders the vocabulary (the first `vocab` tokens are the
    output classes; None = the whole vocabulary in id order); `eval_batches` (held-back, in
    memory) give the loop's τ: the default selection's greedy decoding walk at budget 8."""
    cfg = target_model.cfg
    device = torch.device(config.device)
    if label_len < 1 or label_len > num_slots:
        raise ValueError(f"ctc: label_len must be in [1, num_slots={num_slots}], got {label_len}")
    net = (net or CTCDraftNet.from_target(cfg, target_model, num_slots=num_slots, seed=seed)).to(
        device=device, dtype=torch.float32)
    if rank is None:
        rank = torch.arange(cfg.vocab_size)
    vocab = min(int(vocab), cfg.vocab_size) if vocab else cfg.vocab_size
    vocab_ids = rank[:vocab].long().to(device)
    class_of = class_table(rank, vocab, cfg.vocab_size).to(device)
    W = target_model.lm_head_weight.detach().index_select(0, vocab_ids).float().contiguous()   # frozen copy of N rows
    rope = rope_tables(cfg, max_len + num_slots + 2, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    embed = target_model.embed

    def loss_fn(module, batch):
        return ctc_loss(module, batch, embed=embed, vocab_weight=W, class_of=class_of, rope=rope, label_len=label_len,
                        eos_ids=eos_ids, keep_fraction=keep_fraction, generator=gen)

    eval_fn = None
    if eval_batches:
        def eval_fn(module):
            slots = held_back_slots(module, eval_batches, embed=embed, vocab_weight=W, vocab_ids=vocab_ids,
                                    rope=rope, k=DEFAULT_TOP_K, max_positions=eval_positions)
            tau = selection_tau(slots, top_k=DEFAULT_TOP_K, candidates=DEFAULT_CANDIDATES, budget=EVAL_BUDGET)
            return {"tau": tau, "positions": len(slots["rows"])}

    result = train(net, loss_fn, train_batches, eval_fn=eval_fn, config=config)
    return CTCFit(net, result, rope, W, vocab_ids, class_of)


# ---- the trainer ----------------------------------------------------------------------------------------------------

@register_trainer(KIND)
def train_ctc(options: dict, target, data) -> Path:
    """`specserve train ctc`: the network trained with the CTC loss on the teacher shards' train
    split (whole examples), early-stopped on the held-back τ, saved in bf16 with its vocabulary
    ranking, the tuned selection and the τ of the saved weights. Options besides the loop's
    (epochs, lr, max_seconds, eval_every, patience, seed, device, ...): num_slots (5), label_len (4),
    vocab (4096 output tokens), train_batch_tokens (2048), keep_fraction (1.0: the share of each
    batch's positions trained), eval_positions (2048 per loop eval), final_positions (4096),
    engine_tau_prompts (8 held-back prompts through the engine at the end; 0 = offline τ only),
    engine_tau_max_tokens (64)."""
    if not options.get("out"):
        raise ValueError("ctc trainer: no output folder (--out)")
    start = time.time()
    seed = int(option(options, "seed", 0))
    num_slots = int(option(options, "num_slots", DEFAULT_SLOTS))
    label_len = int(option(options, "label_len", DEFAULT_LABELS))
    vocab = min(int(option(options, "vocab", DEFAULT_VOCAB)), target.model_config.vocab_size)
    keep_fraction = float(option(options, "keep_fraction", 1.0))
    max_len = int(option(options, "max_len", 512))
    device = target.device
    eos_ids = sorted(int(t) for t in (getattr(target.loaded, "eos_token_ids", None) or
                                      [data.manifest.get("config", {}).get("eos_token_id")]) if t is not None)
    b = trainer_batches(KIND, options, data, FIELDS, defaults=TRAIN_DEFAULTS, batch_tokens=BATCH_TOKENS,
                        device=device, seed=seed)
    config, batch_tokens, eval_tokens, eval_batches = b.config, b.batch_tokens, b.eval_tokens, b.held_back
    rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size,
                                         batch_tokens=eval_tokens)
    logger.info("ctc: %d train examples (%d tokens), %d held-back examples; %d output tokens cover %s of the "
                "held-back labels", len(data.train), data.train.num_tokens, len(data.held_back), vocab,
                coverage.get(vocab))
    fit = fit_ctc(target.model, b.train, eval_batches, config=config, rank=rank, vocab=vocab,
                  num_slots=num_slots, label_len=label_len, eos_ids=eos_ids, max_len=max_len, seed=seed,
                  keep_fraction=keep_fraction, eval_positions=int(option(options, "eval_positions", EVAL_POSITIONS)))
    net, result = fit.net, fit.result
    net.set_vocab_rank(rank)
    as_saved(net)   # measure what is saved: bf16 weights
    report = evaluate(net, eval_batches, embed=target.model.embed, vocab_weight=fit.vocab_weight,
                      vocab_ids=fit.vocab_ids, rope=fit.rope,
                      max_positions=int(option(options, "final_positions", FINAL_POSITIONS)), seed=seed)
    selection = report["selection"]
    tau = report["tau_tuned_half"]
    logger.info("ctc: held-back offline tau %s (default selection by budget), tuned %s -> %.3f; %d steps, %.0f s",
                report["tau_default"], report["selection_half"], tau, result.steps, time.time() - start)
    served = None
    n_prompts = int(option(options, "engine_tau_prompts", 8))
    if n_prompts > 0:
        try:
            served = served_tau(target, KIND, {"net": copy.deepcopy(net), "draft_vocab": vocab, **(selection or {})},
                                data.held_back_examples()[:n_prompts], budget=EVAL_BUDGET,
                                max_tokens=int(option(options, "engine_tau_max_tokens", 64)), max_len=max_len)
            tau = served["tau"]
            logger.info("ctc: held-back engine tau %.3f (budget %d, %d prompts)", tau, EVAL_BUDGET,
                        served["num_prompts"])
        except Exception as exc:   # noqa: BLE001 - the offline figure stands in
            logger.warning("ctc: engine tau not measured: %s", exc)
    meta = CheckpointMeta(
        kind=KIND, target_name=target.name, target_fingerprint=target.fingerprint,
        hyperparams={**net.hyperparams(), "label_len": label_len, "vocab": vocab, "selection": selection,
                     "lr": config.lr, "epochs": config.epochs, "train_batch_tokens": batch_tokens,
                     "keep_fraction": keep_fraction, "grad_clip": config.grad_clip, "steps": result.steps,
                     "stop_reason": result.stop_reason, "loss": "CTC over the slots against the target's greedy "
                     "labels (blank = the extra class)"},
        data=data.summary(), train_seconds=round(time.time() - start, 1), device=describe_device(device), tau=tau,
        tau_details={"method": "tau: through the engine (greedy, budget 8, the tuned selection) on held-back prompts "
                               "when `served` is present; else offline on the held-back half the selection was not "
                               "tuned on. Offline figures: decoding walks over held-back self-distilled answers with "
                               "the serving drafter's trees",
                     "budget": EVAL_BUDGET, **report, "served": served, "loop_evals": result.eval_history,
                     "draft_vocab_coverage": coverage})
    return Path(save_checkpoint(options["out"], net.tensors(), meta))


__all__ = ["ctc_targets", "ctc_loss", "class_table", "evaluate", "fit_ctc", "train_ctc", "walk_tau",
           "accepted_in_tree"]
