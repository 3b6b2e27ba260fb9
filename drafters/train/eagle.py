"""EAGLE-style feature-level drafter: the head, its training loss, its offline τ and its trainer.

The head (`EagleHead`) predicts the target's next last-layer feature from the current one:

    row p:   fc([f_p ‖ e(x_{p+1})])  ->  one decoder layer (the target's shape, causal over the
             sequence, its own KV cache and RoPE)  ->  RMSNorm  ->  f̂_{p+1}
    tokens:  softmax(LMHead(f̂_{p+1}))  =  the drafter's distribution of x_{p+2}

`f` are the target's last-layer hidden states **after the final norm** (the LM head's input: what
the engine hands feature-reading drafters, and what the teacher shards hold). The head predicts
those post-norm features and the target's frozen LM head is applied to f̂ directly, as EAGLE
does; unlike EAGLE-1 the head ends with its own RMSNorm (initialised from the target's final
norm), so that -- like the target, whose last layer is followed by its final norm -- its output is
already in the feature space it regresses and the LM head reads. Without it the last layer's
residual stream (RMS in the tens for SmolLM2, against features of RMS ~2 with outlier
dimensions up to ~50) makes the first thousand steps spent on scale alone. `e` is the target's
frozen embedding; the embedding and the LM head are the target's own tensors (never saved).

Only `fc` (2H -> H, with bias), the decoder layer and the output norm are trained. `fc` starts as
[I | I] (the row's input is then f_p + e(x_{p+1})) and the norm as the target's final norm. The
decoder layer starts freshly initialised (`init=random`, the default) or as a copy of the target's
last layer (`init=last`): on SmolLM2-135M the copy was clearly worse (held-back chain τ 1.25 vs
1.38 after the same 84 steps on 51k tokens; a random fc as well: 1.21) -- the last layer is tuned
to a residual stream of quite another scale and content than f_p + e(x_{p+1}).

Training (teacher forced, answer positions only, EAGLE-1):
* input f_p + U(-noise, noise) (noise relative to the features' RMS) and x_{p+1};
* `L = SmoothL1(f̂_{p+1}, f_{p+1}) + 0.1 * CE(target's top-k distribution at p+1, LMHead(f̂_{p+1}))`.
  The CE is computed over a **candidate set** shared by the batch -- the union of the target's
  top-k ids at every position of the batch, `negatives` uniformly drawn ids, and the drafter's own
  full-vocabulary top-16 at 128 random rows of the batch (no grad) -- instead of the full 49k
  vocabulary: on a CPU the LM head's forward and backward over the whole vocabulary costs more
  than the decoder layer, while the union of the batch's top-k ids holds every token the target
  finds plausible there (the hard negatives). The drafter's own top ids are what keeps this
  honest: without them the held-back accuracy stayed at 0.2 % on SmolLM2 while the training
  accuracy rose, because a token the drafter wrongly ranked first everywhere was almost never
  among the uniform draws. The target probabilities are its top-k's, renormalised over the k.
  Dense layer arithmetic runs for every row (keys and values), the output projection, MLP and
  norm only for the trained rows.

Offline τ (held-back shards): chains of `tau_steps` drafts simulated for every answer position
at once, autoregressive on predicted features (step j of chain p reads f̂ of step j-1 and attends
to the real rows 0..p plus the chain's own earlier predicted rows, as serving does), with the
data's tokens as inputs; τ = 1 + mean number of leading drafts equal to the target's greedy labels.
It is exact when the data is the target's own greedy output (self-distillation) and an estimate
otherwise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.nets.checkpoint import CheckpointMeta, describe_device, save_checkpoint
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import draft_vocab_ranking
from specserve.drafters.train.evaluate import as_saved, option, served_tau
from specserve.drafters.nets.eagle import (CHECKPOINTS_DIR, INITS, EagleHead, load_head,  # noqa: F401  (re-exported)
                                           save_head, shipped_checkpoint)
from specserve.drafters.train.loop import train, trainer_batches
from specserve.engine.config import ModelConfig
from specserve.engine.model import DecoderLayer, rms_norm, rope_tables

logger = logging.getLogger("specserve")

KIND = "eagle"
REG_WEIGHT = 1.0          # SmoothL1 on features (EAGLE)
CLS_WEIGHT = 0.1          # distillation through the LM head (EAGLE)


# ---- losses -----------------------------------------------------------------------------------------------------

def add_feature_noise(features: torch.Tensor, noise: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """f + U(-a, a) with a = noise x the features' RMS (EAGLE's uniform noise, scaled to the target's
    feature size so one setting fits any target)."""
    if noise <= 0:
        return features
    rms = features.float().pow(2).mean().sqrt().clamp_min(1e-6)
    u = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    return features + ((u * 2 - 1) * (noise * rms)).to(features.dtype)


def candidate_ids(topk_ids: torch.Tensor, vocab_size: int, negatives: int,
                  generator: torch.Generator | None = None, *, pred: torch.Tensor | None = None,
                  lm_head_weight: torch.Tensor | None = None, probe_rows: int = 128,
                  probe_k: int = 16) -> torch.Tensor:
    """The shared candidate set of a batch (sorted, unique): the union of the target's top-k ids,
    `negatives` uniform draws and -- with `pred` -- the drafter's own full-vocabulary top
    `probe_k` at `probe_rows` random rows (no grad): the tokens it currently over-rates. Without
    those, a token the drafter wrongly puts first everywhere is rarely among the uniform draws
    and never gets pushed down (a sampled softmax's classic failure)."""
    ids = [topk_ids.reshape(-1).long()]
    if negatives > 0:
        ids.append(torch.randint(0, vocab_size, (negatives,), generator=generator, device=topk_ids.device))
    if pred is not None and lm_head_weight is not None and probe_rows > 0 and pred.shape[0]:
        with torch.no_grad():
            rows = torch.randperm(pred.shape[0], generator=generator, device=pred.device)[:probe_rows]
            logits = F.linear(pred.detach()[rows], lm_head_weight.to(pred.dtype))
            ids.append(logits.topk(min(probe_k, logits.shape[-1]), dim=-1).indices.reshape(-1))
    return torch.unique(torch.cat(ids))


def distill_loss(pred: torch.Tensor, lm_head_weight: torch.Tensor, topk_ids: torch.Tensor,
                 topk_logprobs: torch.Tensor, candidates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the target's top-k distribution (renormalised over its k) against the
    drafter's softmax over `candidates` (None = the whole vocabulary). pred [N, H], topk [N, k].
    Returns (loss, drafter argmax == target argmax per row)."""
    w = lm_head_weight if candidates is None else lm_head_weight.index_select(0, candidates)
    logits = F.linear(pred, w.to(pred.dtype)).float()                       # [N, C]
    logp = logits.log_softmax(-1)
    ids = topk_ids.long()
    if candidates is not None:
        ids = torch.searchsorted(candidates, ids)                            # every top-k id is a candidate
    target = torch.softmax(topk_logprobs.float(), dim=-1)
    loss = -(target * logp.gather(1, ids)).sum(-1).mean()
    return loss, logits.argmax(-1) == ids[:, 0]


def eagle_loss(head: EagleHead, batch: dict[str, torch.Tensor], *, embed: nn.Embedding, lm_head_weight: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], noise: float = 0.1, negatives: int | None = 2048,
               generator: torch.Generator | None = None, cls_weight: float = CLS_WEIGHT
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The EAGLE loss of one padded batch (`ShardDataset.batches`): `input_ids` [B, T], `hidden`
    [B, T, H] (the target's post-norm features), `topk_ids`/`topk_logprobs` [B, T, k] (the
    target's next-token top-k after each position, greedy label first), `loss_mask` [B, T]
    (`loss_mask[t]`: the token at t+1 is an answer token). Row p (reading f_p and x_{p+1})
    predicts f_{p+1} and, through the LM head, the token at p+2: it is trained where
    `loss_mask[p+1]` holds. `negatives=None`: the softmax over the whole vocabulary."""
    ids, hidden = batch["input_ids"], batch["hidden"]
    feats = hidden[:, :-1].float()
    target = hidden[:, 1:].float()
    mask = batch["loss_mask"][:, 1:].bool()
    if not bool(mask.any()):
        zero = head.fc.weight.sum() * 0
        return zero, {"reg": 0.0, "cls": 0.0, "acc": 0.0}
    with torch.no_grad():
        emb = embed(ids[:, 1:]).float()
    cos, sin = rope
    t = feats.shape[1]
    p = head.forward_dense(add_feature_noise(feats, noise, generator), emb, cos[:t], sin[:t], select=mask)
    f = target[mask]
    reg = F.smooth_l1_loss(p, f)
    tk_ids, tk_lp = batch["topk_ids"][:, 1:][mask], batch["topk_logprobs"][:, 1:][mask]
    cand = None
    if negatives is not None:
        cand = candidate_ids(tk_ids, lm_head_weight.shape[0], negatives, generator, pred=p,
                             lm_head_weight=lm_head_weight)
    cls, hit = distill_loss(p, lm_head_weight, tk_ids, tk_lp, cand)
    loss = REG_WEIGHT * reg + cls_weight * cls
    return loss, {"reg": reg.detach(), "cls": cls.detach(), "acc": hit.float().mean()}


# ---- offline τ --------------------------------------------------------------------------------------------------

@torch.no_grad()
def chain_matches(head: EagleHead, batch: dict[str, torch.Tensor], *, embed: nn.Embedding,
                  lm_head_weight: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], steps: int = 5,
                  max_chains: int | None = None) -> torch.Tensor:
    """Leading matches (0..steps) of greedy chains drafted after every answer position of a batch.

    Chain p starts after the real row p (root token x_{p+1}); its draft j is argmax LMHead(f̂ of
    step j), the token at p+j+1, compared with the target's greedy label after position p+j
    (`topk_ids[..., 0]`). A chain is used when its first draft is an answer token
    (`loss_mask[p+1]`); a draft whose token is past the answer or the sequence ends the chain.
    Returns one count per used chain (at most `max_chains`, evenly spread)."""
    with torch.autocast(batch["input_ids"].device.type, enabled=False):   # fp32: bf16 logits tie at the argmax
        return _chain_matches(head, batch, embed, lm_head_weight, rope, steps, max_chains)


def _chain_matches(head, batch, embed, lm_head_weight, rope, steps, max_chains) -> torch.Tensor:
    ids = batch["input_ids"]
    labels = batch["topk_ids"][..., 0].long()
    answer = batch["loss_mask"].bool()          # answer[t]: the token at t+1 is an answer token
    b, t = ids.shape
    if t < 2:
        return torch.zeros(0, dtype=torch.long)
    n = t - 1                                        # chains p = 0 .. T-2 (x_{p+1} must exist)
    pad_ids = torch.cat([ids, ids.new_zeros(b, steps)], dim=1)
    embeds = [embed(pad_ids[:, j:j + n]).float() for j in range(1, steps + 1)]   # e(x_{p+j})
    cos, sin = rope
    outs = head.forward_unrolled(head.features_of(batch)[:, :n], embeds, cos, sin)
    use = answer[:, 1:n + 1]
    rows = use.nonzero()
    if max_chains is not None and rows.shape[0] > max_chains:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, max_chains).long()]
    bi, pi = rows[:, 0], rows[:, 1]
    alive = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    count = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
    w = lm_head_weight
    pad_labels = torch.cat([labels, labels.new_full((b, steps + 1), -1)], dim=1)
    pad_answer = torch.cat([answer, answer.new_zeros(b, steps + 1)], dim=1)
    for j, out in enumerate(outs, start=1):
        pos = pi + j                                 # the position whose label draft j must match
        valid = alive & pad_answer[bi, pos] & (pos < t)
        if not bool(valid.any()):
            break
        draft = torch.full_like(count, -2)
        sel = valid.nonzero().flatten()
        draft[sel] = F.linear(out[bi[sel], pi[sel]].float(), w.float()).argmax(-1)
        hit = valid & (draft == pad_labels[bi, pos])
        count += hit.long()
        alive = hit
    return count.cpu()


def estimate_tau(head: EagleHead, batches: Iterable[dict[str, torch.Tensor]], *, embed, lm_head_weight, rope,
                 steps: int = 5, max_chains: int = 4096) -> dict[str, float]:
    """τ = 1 + mean leading matches of `steps`-long chains over held-back batches (see chain_matches)."""
    counts = []
    left = max_chains
    for batch in batches:
        if left <= 0:
            break
        c = chain_matches(head, batch, embed=embed, lm_head_weight=lm_head_weight, rope=rope, steps=steps,
                          max_chains=left)
        counts.append(c)
        left -= c.numel()
    allc = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long)
    if allc.numel() == 0:
        return {"tau": 1.0, "chains": 0, "acc1": 0.0}
    return {"tau": 1.0 + float(allc.float().mean()), "chains": int(allc.numel()),
            "acc1": float((allc >= 1).float().mean())}


# ---- vocabulary ranking -----------------------------------------------------------------------------------------

# ---- the trainer ------------------------------------------------------------------------------------------------

TRAIN_DEFAULTS = {"epochs": 2, "lr": 1e-3, "betas": (0.9, 0.95), "warmup_ratio": 0.03, "min_lr_ratio": 0.1,
                  "grad_clip": 0.5, "patience": 2}
BATCH_TOKENS = 2048        # tokens (rows x padded length) per training batch
EVAL_CHAINS = 2048         # held-back chains per loop eval
FINAL_CHAINS = 8192        # held-back chains of the reported τ
TAU_STEPS = 5
FIELDS = ("input_ids", "hidden", "topk_ids", "topk_logprobs")



@dataclass
class EagleFit:
    head: EagleHead
    result: Any
    rope: tuple[torch.Tensor, torch.Tensor]


def fit_eagle(target_model, train_batches: Callable[[int], Iterable] | Iterable, eval_batches: list | None, *,
              config, noise: float = 0.1, negatives: int | None = 2048, tau_steps: int = TAU_STEPS,
              eval_chains: int = EVAL_CHAINS, max_len: int = 512, seed: int = 0,
              head: EagleHead | None = None, cls_weight: float = CLS_WEIGHT, init: str = "random") -> EagleFit:
    """Train an EagleHead (`EagleHead.from_target(init=...)` unless `head` is given) with the
    shared loop (`config`: a loop.TrainConfig); `eval_batches` (held-back, in memory) give its τ."""
    cfg = target_model.cfg
    device = torch.device(config.device)
    head = (head or EagleHead.from_target(cfg, target_model, init=init, seed=seed)).to(device=device,
                                                                                      dtype=torch.float32)
    rope = rope_tables(cfg, max_len + tau_steps + 2, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    embed, lm_head = target_model.embed, target_model.lm_head_weight

    def loss_fn(module, batch):
        return eagle_loss(module, batch, embed=embed, lm_head_weight=lm_head, rope=rope, noise=noise,
                          negatives=negatives, generator=gen, cls_weight=cls_weight)

    eval_fn = None
    if eval_batches:
        def eval_fn(module):
            return estimate_tau(module, eval_batches, embed=embed, lm_head_weight=lm_head, rope=rope,
                                steps=tau_steps, max_chains=eval_chains)

    result = train(head, loss_fn, train_batches, eval_fn=eval_fn, config=config)
    return EagleFit(head, result, rope)


VOCAB_RANKS = ("data", "keep")


def vocab_rank_option(options: dict, head) -> str:
    """`vocab_rank`: `data` (the default) ranks the draft vocabulary by this training data's labels;
    `keep` keeps the ranking of the checkpoint the head continues (eagle3's `init=eagle3`: a
    fine-tuning set is smaller and narrower than the data the ranking came from)."""
    choice = str(option(options, "vocab_rank", "data"))
    if choice not in VOCAB_RANKS:
        raise ValueError(f"vocab_rank must be one of {', '.join(VOCAB_RANKS)}, got {choice!r}")
    if choice == "keep" and head.vocab_rank is None:
        raise ValueError("vocab_rank=keep keeps the ranking of the checkpoint training continues, and this head "
                         "starts from none (eagle3: init=eagle3)")
    return choice


def save_trained(kind: str, fit: EagleFit, target, data, options: dict, batches, *, tau_steps: int, start: float,
                 hyperparams: dict[str, Any], chains: str) -> Path:
    """What an eagle-family trainer does with its trained head: the training labels' vocabulary
    ranking (for `draft_vocab`), bf16 rounding (what is saved is measured), the held-back chain τ
    and, with `engine_tau_prompts`, τ served through the engine; then the checkpoint, saved to
    `options["out"]` with the head's, the loop's (`batches`: `trainer_batches`) and the trainer's
    own `hyperparams`. `chains`: how the held-back chains draft, for the meta's τ method."""
    head, result, config = fit.head, fit.result, batches.config
    eval_batches = batches.held_back
    source = vocab_rank_option(options, head)
    kept = head.vocab_rank.long() if source == "keep" else None   # the ranking of the checkpoint it continued
    rank, coverage = draft_vocab_ranking(data.train, data.held_back, target.model_config.vocab_size,
                                         batch_tokens=batches.eval_tokens, rank=kept)
    head.set_vocab_rank(rank)
    logger.info("%s: held-back labels covered by the first N tokens of the %s ranking: %s", kind,
                "training labels'" if source == "data" else "continued checkpoint's",
                {n: round(c, 4) for n, c in coverage.items()})
    as_saved(head)
    report = estimate_tau(head, eval_batches, embed=target.model.embed, lm_head_weight=target.model.lm_head_weight,
                          rope=fit.rope, steps=tau_steps, max_chains=int(option(options, "final_chains", FINAL_CHAINS)))
    logger.info("%s: held-back chain tau %.3f over %d chains (%d steps, %.0f s)", kind, report["tau"],
                report["chains"], result.steps, time.time() - start)
    served = None
    n_prompts = int(option(options, "engine_tau_prompts", 0))
    if n_prompts > 0:
        served = served_tau(target, kind, {"head": head}, data.held_back_examples()[:n_prompts])
        logger.info("%s: served tau %.3f on %d held-back prompts", kind, served["tau"], served["num_prompts"])
    meta = CheckpointMeta(
        kind=kind, target_name=target.name, target_fingerprint=target.fingerprint,
        hyperparams={**head.hyperparams(), **hyperparams, "lr": config.lr, "epochs": config.epochs,
                     "train_batch_tokens": batches.batch_tokens, "steps": result.steps,
                     "stop_reason": result.stop_reason},
        data=data.summary(), train_seconds=round(time.time() - start, 1), device=describe_device(target.device),
        tau=report["tau"],
        tau_details={"method": f"offline: greedy chains of {tau_steps} drafts after every held-back answer "
                               f"position, {chains}; teacher-forced tokens; 1 + mean leading matches with the "
                               "target's greedy labels",
                     **report, "served": served, "loop_evals": result.eval_history,
                     "draft_vocab_coverage": coverage})
    return Path(save_checkpoint(options["out"], head.tensors(), meta))


@register_trainer(KIND)
def train_eagle(options: dict, target, data) -> Path:
    """`specserve train eagle`: the head trained on the teacher shards' train split (whole
    examples), early-stopped on the held-back τ, saved in bf16 with the τ of the saved weights
    and the training labels' vocabulary ranking (for `draft_vocab`). Options besides the loop's
    (epochs, lr, max_seconds, eval_every, patience, seed, device, ...): train_batch_tokens (2048
    tokens per batch: small data wants many steps), init (random | last: the decoder layer's
    start; random measured better on SmolLM2), cls_weight (0.1), noise (0.1 x the features' RMS),
    negatives (2048 uniform ids added to the batch's top-k union and the drafter's own top ids;
    `full_vocab=true` for the exact softmax), tau_steps (5), eval_chains (2048 per loop eval),
    final_chains (8192), engine_tau_prompts (0: how many held-back prompts to also run through
    the engine with the trained drafter, for the served τ)."""
    if not options.get("out"):
        raise ValueError("eagle trainer: no output folder (--out)")
    if str(option(options, "vocab_rank", "data")) != "data":
        raise ValueError("eagle trainer: vocab_rank=data only (its head starts from no checkpoint's ranking)")
    start = time.time()
    seed = int(option(options, "seed", 0))
    noise = float(option(options, "noise", 0.1))
    negatives = None if options.get("full_vocab") else int(option(options, "negatives", 2048))
    tau_steps = int(option(options, "tau_steps", TAU_STEPS))
    max_len = int(option(options, "max_len", 512))
    init = str(option(options, "init", "random"))
    cls_weight = float(option(options, "cls_weight", CLS_WEIGHT))
    b = trainer_batches(KIND, options, data, FIELDS, defaults=TRAIN_DEFAULTS, batch_tokens=BATCH_TOKENS,
                        device=target.device, seed=seed)
    config, eval_batches = b.config, b.held_back
    logger.info("eagle: %d train examples (%d tokens), %d held-back examples", len(data.train),
                data.train.num_tokens, len(data.held_back))
    fit = fit_eagle(target.model, b.train, eval_batches, config=config, noise=noise, negatives=negatives,
                    tau_steps=tau_steps, eval_chains=int(option(options, "eval_chains", EVAL_CHAINS)),
                    max_len=max_len, seed=seed, init=init, cls_weight=cls_weight)
    return save_trained(KIND, fit, target, data, options, b, tau_steps=tau_steps, start=start,
                        hyperparams={"noise": noise, "negatives": negatives, "cls_weight": cls_weight,
                                     "init": f"decoder layer: {init}; fc = [I | I]; output norm = the target's "
                                             "final norm"},
                        chains="autoregressive on predicted features")
