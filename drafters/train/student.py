"""Distilled student draft models: a few Llama decoder layers that share the target's frozen
embedding and LM head, initialised from the target's first layers and its final norm, then
distilled towards the target's next-token distribution.

Served by the `student` drafter (drafters/student.py) through the draft-model machinery: SpS
chains, MCSD trees, target-initialised roots, its own paged KV cache.

Loss, per trained position t (the answer tokens): cross-entropy of the target's top-k next-token
distribution (renormalised over its k; the KL to it up to a constant) against the student's softmax
over a candidate set = the batch's top-k ids plus uniformly drawn negatives. The full 49152-wide
softmax of the default target would cost the LM head's forward and backward for every position;
with k = 8 and 2048 negatives the head's cost falls ~20x and the top-k (which carries the mass that
matters for acceptance) stays exact. `negatives=none` trains on the full vocabulary.

Offline τ (held-back split): for chain drafting of length `gamma` from every trained position,
1 + the number of leading positions where the student's argmax equals the target's greedy token,
counted only while the data itself follows the target's greedy path (where it does not, the
drafter would have been fed different tokens than teacher forcing gives). On self-distilled
greedy data that condition always holds and the estimate is exact.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.train import TrainData, TrainTarget, register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.nets.student import StudentModel, _dense_layer, load_student, shipped_checkpoint  # noqa: F401
from specserve.drafters.train.loop import TrainConfig, train
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, LlamaModel, rms_norm

logger = logging.getLogger("specserve")

KIND = "student"
DEFAULT_NEGATIVES = 2048


# ---- loss and offline τ -----------------------------------------------------------------------------------------

def candidate_set(topk_ids: torch.Tensor, vocab: int, negatives: int | None,
                  generator: torch.Generator | None = None) -> torch.Tensor | None:
    """Sorted unique union of the valid top-k ids and `negatives` uniform draws; None = full vocab."""
    if negatives is None:
        return None
    ids = [topk_ids[topk_ids >= 0].long()]
    if negatives > 0:
        ids.append(torch.randint(0, vocab, (negatives,), generator=generator).to(topk_ids.device))
    return torch.unique(torch.cat(ids))


def student_loss(student: StudentModel, batch: dict[str, Any], *, negatives: int | None = DEFAULT_NEGATIVES,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    hidden = student(batch["input_ids"], batch["positions"])                 # [B, T, H]
    mask = batch["loss_mask"]
    rows = hidden[mask]                                                      # [N, H]
    topk_ids, topk_lp = batch["topk_ids"][mask], batch["topk_logprobs"][mask]
    cands = candidate_set(topk_ids, student.cfg.vocab_size, negatives, generator)
    w = student.lm_head_weight if cands is None else student.lm_head_weight.index_select(0, cands)
    logp = F.linear(rows, w.to(rows.dtype)).float().log_softmax(-1)
    ids = topk_ids.long() if cands is None else torch.searchsorted(cands, topk_ids.long())
    target = torch.softmax(topk_lp.float(), dim=-1)
    loss = -(target * logp.gather(1, ids)).sum(-1).mean()
    top1 = (logp.argmax(-1) == ids[:, 0]).float().mean()
    return loss, {"top1": float(top1)}


@torch.no_grad()
def estimate_tau(student: StudentModel, batches: Iterable[dict[str, Any]], gamma: int = 4) -> dict[str, float]:
    """Offline chain τ (see the module docstring) and top-1 agreement on trained positions."""
    total_tau, count, agree, trained = 0.0, 0, 0, 0
    was_training = student.training
    student.eval()
    for batch in batches:
        hidden = student(batch["input_ids"], batch["positions"])
        pred = F.linear(hidden, student.lm_head_weight.to(hidden.dtype)).argmax(-1)     # [B, T]
        labels, ids, mask = batch["labels"], batch["input_ids"], batch["loss_mask"]
        hit = (pred == labels) & batch["valid"]
        follows = torch.zeros_like(hit)
        follows[:, :-1] = ids[:, 1:] == labels[:, :-1]       # the data continued with the target's own token
        B, T = hit.shape
        run = torch.zeros(B, T, dtype=torch.long)
        alive = torch.ones(B, T, dtype=torch.bool)
        for j in range(gamma):
            shifted = torch.zeros_like(hit)
            shifted[:, :T - j] = hit[:, j:]
            alive &= shifted
            run += alive.long()
            ok = torch.zeros_like(hit)
            ok[:, :T - j] = follows[:, j:]
            alive &= ok
        total_tau += float((1 + run[mask]).sum())
        count += int(mask.sum())
        agree += int(hit[mask].sum())
        trained += int(mask.sum())
    student.train(was_training)
    return {"tau": total_tau / max(1, count), "top1": agree / max(1, trained)}


# ---- the trainer --------------------------------------------------------------------------------------------------

@register_trainer(KIND)
def train_student(options: dict, target: TrainTarget, data: TrainData) -> Path:
    """Options: num_layers (default 4), negatives (default 2048; none = full vocabulary), gamma
    (offline τ chain length, default 4), window (tokens per training row, default 256), plus the
    loop's (epochs, lr, batch_tokens, max_seconds, ...)."""
    num_layers = int(options.get("num_layers") or 4)
    negatives = options.get("negatives", DEFAULT_NEGATIVES)
    negatives = None if negatives in (None, "none") else int(negatives)
    gamma = int(options.get("gamma") or 4)
    window = int(options.get("window") or 256)
    batch_tokens = int(options.get("batch_tokens") or 4096)
    seed = int(options.get("seed") or 0)
    fields = ("input_ids", "labels", "topk_ids", "topk_logprobs")
    device = target.device
    student = StudentModel.from_target(target.model, num_layers).float().share(target.model)
    student.train()
    gen = torch.Generator().manual_seed(seed)

    def epoch_batches(epoch: int):
        return data.train.batches(batch_tokens, window=window, epoch=epoch, seed=seed, fields=fields, device=device)

    eval_batches = list(data.held_back.batches(batch_tokens, window=window, shuffle=False, fields=fields,
                                               device=device))

    def loss_fn(module, batch):
        return student_loss(module, batch, negatives=negatives, generator=gen)

    config = TrainConfig.from_options(options, device=device, seed=seed)
    t0 = time.perf_counter()
    result = train(student, loss_fn, epoch_batches, eval_fn=lambda m: estimate_tau(m, eval_batches, gamma),
                   config=config)
    final = estimate_tau(student, eval_batches, gamma)
    student.vocab_rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size)
    meta = CheckpointMeta(
        kind=KIND, target_name=target.name, target_fingerprint=target.fingerprint,
        hyperparams={"num_layers": num_layers, "init": f"target layers 0..{num_layers - 1} + final norm",
                     "negatives": negatives, "window": window, "lr": config.lr, "epochs": config.epochs,
                     "batch_tokens": batch_tokens, "steps": result.steps, "stop_reason": result.stop_reason},
        data=data.summary(), train_seconds=round(time.perf_counter() - t0, 1), device=describe_device(device),
        tau=round(final["tau"], 4),
        tau_details={"method": f"offline chain of {gamma} on the held-back split (see drafters/train/student.py)",
                     "top1": round(final["top1"], 4), "held_back_examples": len(data.held_back),
                     "draft_vocab_coverage": coverage})
    out = Path(options["out"])
    save_checkpoint(out, student.tensors(), meta)
    logger.info("student (%d layers): held-back τ %.3f, top-1 %.3f -> %s", num_layers, final["tau"], final["top1"], out)
    return out
