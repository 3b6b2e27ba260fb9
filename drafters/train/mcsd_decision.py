"""`specserve train mcsd-decision`: MCSD+'s early-stop decision models (drafters/nets/mcsd_decision.py)
trained from logged verification outcomes.

1. Log: the real engine serves prompts of the pool (rendered as the server renders them) with a
   draft-model drafter (`drafter=student`, the default, or `draft_model`) drafting a static fork
   (`k_config`, default fork:4,4: every tree full depth, so every depth gets labels). The drafter's
   `recorder` keeps, per drafted token, the draft model's final hidden state and the top-k
   probabilities + entropy of the draft distribution it was drawn from (the features the serving
   drafter scores), and labels it 1 when verification accepted it (the token lies on the accepted
   path), 0 otherwise.
2. Train: type 1 (3-layer MLP on the hidden state) and/or type 2 (2-layer MLP on top-k + entropy)
   with binary cross-entropy (Adam), inputs standardised on the training rows; the logged
   sequences are split into train and held-back ones, and the held-back figures (loss, accuracy at
   β, base rate, AUC) go into the checkpoint's metadata.
3. Save `OUT/type1` and/or `OUT/type2` (serve with `--drafter-option student.decision=OUT/type2`).

Options (`--option KEY=VALUE`): `drafter` (student), `k_config` (fork:4,4), `prompts` (number of
pool prompts, 200), `max_tokens` (answer length, 64), `types` (1, 2 or "1,2"), `hidden` (64),
`threshold` (β for the reported accuracy, 0.4), `held_back` (fraction of sequences, 0.1),
`batch_size` (1024), and `drafter.NAME=VALUE` for the drafter's own options (e.g.
`drafter.checkpoint=DIR`, `drafter.draft_layers=8`). The command's `--temperature` is the
sampling temperature of the logged generations (0 = greedy), `--top-k` the type-2 top-k,
`--epochs` (default 30) and `--lr` (default 1e-3) the training's. No teacher shards are built.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from specserve.drafters.draft_model import parse_k_config
from specserve.drafters.nets.mcsd_decision import (DEFAULT_TOP_K, KIND, DecisionModel, save_decision,
                                                   topk_entropy_features)
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import load_prompt_pool, render_prompt
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import TreeTemplate

logger = logging.getLogger("specserve")

DEFAULTS = dict(drafter="student", k_config="fork:4,4", prompts=200, max_tokens=64, types="1,2", hidden=64,
                threshold=0.4, held_back=0.1, batch_size=1024, epochs=30, lr=1e-3)


class DecisionLog:
    """Per drafted token: the draft model's final hidden state (fp16), the type-2 features, the
    depth, the sequence, and whether verification accepted it. Set as a drafter's `recorder`."""

    def __init__(self, top_k: int = DEFAULT_TOP_K):
        self.top_k = top_k
        self.pending: dict[int, list[tuple[list[int], int, torch.Tensor, torch.Tensor]]] = {}
        self.hidden: list[torch.Tensor] = []
        self.topk: list[torch.Tensor] = []
        self.labels: list[float] = []
        self.depths: list[int] = []
        self.seq_ids: list[int] = []
        self.tree_ids: list[int] = []     # which labelled tree (verification step of a sequence) a row is from
        self.num_trees = 0

    def record(self, seq_ids: Sequence[int], nodes: Sequence[int], depth: int, hidden: torch.Tensor,
               logits: torch.Tensor) -> None:
        """One level of the drafter's trees: rows in `seq_ids`/`nodes` order."""
        feats = topk_entropy_features(logits, self.top_k).cpu()
        hidden = hidden.to("cpu", torch.float16)
        for sid in set(seq_ids):
            if depth == 1:
                self.pending[sid] = []
            rows = [i for i, s in enumerate(seq_ids) if s == sid]
            self.pending.setdefault(sid, []).append(([nodes[i] for i in rows], depth, hidden[rows], feats[rows]))

    def label(self, seqs, results) -> None:
        """Verification's outcome for the trees last recorded for `seqs`."""
        for seq, res in zip(seqs, results):
            levels = self.pending.pop(seq.seq_id, None)
            if not levels:
                continue
            accepted = set(res.accepted_nodes)
            for nodes, depth, hidden, feats in levels:
                self.hidden.append(hidden)
                self.topk.append(feats)
                self.labels.extend(float(n in accepted) for n in nodes)
                self.depths.extend([depth] * len(nodes))
                self.seq_ids.extend([seq.seq_id] * len(nodes))
                self.tree_ids.extend([self.num_trees] * len(nodes))
            self.num_trees += 1

    def __len__(self) -> int:
        return len(self.labels)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"hidden": torch.cat(self.hidden).float() if self.hidden else torch.empty(0),
                "topk": torch.cat(self.topk) if self.topk else torch.empty(0),
                "labels": torch.tensor(self.labels), "depths": torch.tensor(self.depths),
                "seq_ids": torch.tensor(self.seq_ids), "tree_ids": torch.tensor(self.tree_ids)}


def log_outcomes(engine, drafter: str, prompts: Sequence[list[int]], *, max_tokens: int, temperature: float,
                 seed: int = 0, top_k: int = DEFAULT_TOP_K, progress: bool = False) -> DecisionLog:
    """Serve `prompts` through `engine` with `drafter` recording, one request each; the log. A
    sequence's last tree (the step it finished in) is not labelled: the engine tells a drafter
    nothing about a finished sequence's verification."""
    log = DecisionLog(top_k)
    instance = engine.drafters[drafter]
    instance.recorder = log
    try:
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
            engine.add_request(f"mcsd-{i}", p, params, drafter=drafter)
        steps, t0 = 0, time.time()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if progress and steps % 200 == 0:
                logger.info("mcsd-decision: %d steps, %d tokens logged (%.0f s)", steps, len(log), time.time() - t0)
    finally:
        instance.recorder = None
        log.pending.clear()
    return log


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties half), None with one class only."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if not len(pos) or not len(neg):
        return None
    # each score's rank (1-based) in ascending order, tied scores sharing their group's mean rank
    _, group, counts = scores.unique(return_inverse=True, return_counts=True)
    last = counts.cumsum(0).to(torch.float32)                  # the highest rank in each tie group
    ranks = (last - (counts - 1).to(torch.float32) / 2)[group]
    r = ranks[labels > 0.5].sum() - len(pos) * (len(pos) + 1) / 2
    return float(r / (len(pos) * len(neg)))


def fit_decision(model: DecisionModel, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 30, lr: float = 1e-3,
                 batch_size: int = 1024, seed: int = 0) -> list[float]:
    """Binary cross-entropy training of `model` on rows `x` with labels `y` (standardisation fitted
    first); the mean loss of each epoch."""
    model.fit_standardisation(x)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    history = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        total = 0.0
        for lo in range(0, len(x), batch_size):
            idx = order[lo:lo + batch_size]
            loss = F.binary_cross_entropy_with_logits(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        history.append(total / max(1, len(x)))
    model.eval()
    return history


@torch.no_grad()
def evaluate_decision(model: DecisionModel, x: torch.Tensor, y: torch.Tensor, threshold: float) -> dict[str, Any]:
    if not len(x):
        return {}
    logits = model(x)
    p = torch.sigmoid(logits)
    return {"loss": float(F.binary_cross_entropy_with_logits(logits, y)), "rows": len(x),
            "accuracy": float(((p >= threshold).float() == y).float().mean()), "base_rate": float(y.mean()),
            "mean_prediction": float(p.mean()), "auc": auc(p, y), "threshold": threshold}


def parse_types(value) -> tuple[int, ...]:
    types = tuple(sorted({int(t) for t in str(value).replace(" ", "").split(",") if t}))
    if not types or any(t not in (1, 2) for t in types):
        raise ValueError(f"types must be 1, 2 or 1,2, got {value!r}")
    return types


def drafter_options_of(options: dict) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in options.items() if k.startswith("drafter.")}


@register_trainer(KIND)
def train_mcsd_decision(options: dict, target, data=None) -> Path:
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    types = parse_types(o["types"])
    drafter = str(o["drafter"])
    if drafter not in ("draft_model", "student"):
        raise ValueError(f"drafter must be draft_model or student, got {drafter!r}")
    top_k = int(o.get("top_k") or DEFAULT_TOP_K)
    seed = int(o.get("seed") or 0)
    temperature = float(o.get("temperature") or 0.0)
    out = Path(o["out"]).expanduser()
    t0 = time.time()

    # 1. log verification outcomes of a static fork through the engine

    nodes = TreeTemplate.from_branching(parse_k_config(o["k_config"])).num_nodes - 1
    dopts = {"k_config": o["k_config"], **drafter_options_of(o)}
    max_len = int(o.get("max_len") or 512)
    max_tokens = int(o["max_tokens"])
    engine = LLMEngine(EngineConfig(
        model=str(o.get("model") or "default"), device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."), max_model_len=max_len, max_num_seqs=16,
        max_num_batched_tokens=2048, drafters=(drafter,), drafter_options={drafter: dopts},
        num_speculative_tokens=nodes, max_draft_tokens_per_step=16 * nodes, draft_budget="fixed", quantization="none",
        seed=seed), loaded=target.loaded)
    data_path = o.get("data") if o.get("data") not in (None, "default") else None
    examples = load_prompt_pool(data_path, max_examples=int(o["prompts"]), seed=seed, require_output=False,
                                prompt_field=o.get("prompt_field"), messages_field=o.get("messages_field"))
    prompts = [render_prompt(engine.tokenizer, ex.turns)[-(max_len - max_tokens - 1):] for ex in examples]
    if not prompts:
        raise ValueError("the prompt pool is empty")
    instance = engine.drafters[drafter]
    log = log_outcomes(engine, drafter, prompts, max_tokens=max_tokens, temperature=temperature, seed=seed,
                       top_k=top_k, progress=bool(o.get("progress")))
    if not len(log):
        raise ValueError("no drafted token was logged (no prompt got a draft)")
    rows = log.tensors()
    log_seconds = time.time() - t0
    logger.info("mcsd-decision: %d drafted tokens logged from %d prompts in %.0f s (%.1f%% accepted)", len(log),
                len(prompts), log_seconds, 100 * float(rows["labels"].mean()))

    # 2. train each type on the train sequences, figures on the held-back ones
    seq_ids = rows["seq_ids"].unique()
    g = torch.Generator().manual_seed(seed)
    n_held = int(round(float(o["held_back"]) * len(seq_ids)))
    held = seq_ids[torch.randperm(len(seq_ids), generator=g)[:n_held]]
    is_held = torch.isin(rows["seq_ids"], held)
    y = rows["labels"]
    summary = {"prompts": len(prompts), "max_tokens": max_tokens, "temperature": temperature,
               "k_config": str(o["k_config"]), "drafted_tokens": len(log), "accepted_rate": float(y.mean()),
               "held_back_sequences": n_held,
               "accepted_rate_by_depth": {int(d): float(y[rows["depths"] == d].mean())
                                          for d in rows["depths"].unique()}}
    draft = {"drafter": drafter, "options": {k: str(v) for k, v in dopts.items()},
             "fingerprint": instance.draft_fingerprint()}
    for t in types:
        x = rows["hidden"] if t == 1 else rows["topk"]
        torch.manual_seed(seed)
        model = DecisionModel(t, x.shape[1], int(o["hidden"]), top_k)
        train_x, train_y = x[~is_held], y[~is_held]
        if not len(train_x):
            train_x, train_y = x, y
        history = fit_decision(model, train_x, train_y, epochs=int(o["epochs"]), lr=float(o["lr"]),
                               batch_size=int(o["batch_size"]), seed=seed)
        figures = evaluate_decision(model, x[is_held], y[is_held], float(o["threshold"]))
        logger.info("mcsd-decision type %d: train loss %.4f, held back %s", t, history[-1], figures)
        save_decision(out / f"type{t}", model, target_name=target.name, target_fingerprint=target.fingerprint,
                      draft=draft, data=summary,
                      extra={"held_back": figures, "train_loss": history[-1], "epochs": int(o["epochs"]),
                             "lr": float(o["lr"]), "seconds": time.time() - t0, "log_seconds": log_seconds})
    return out


train_mcsd_decision.needs_teacher_shards = False   # pipeline.run_training: the trainer logs its own data

__all__ = ["DecisionLog", "log_outcomes", "fit_decision", "evaluate_decision", "train_mcsd_decision", "auc"]
