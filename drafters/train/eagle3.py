"""EAGLE-3-style drafter: its training loss (training-time test) and its trainer.

The head (nets/eagle3.py) is EAGLE's behind a lift of the target's low, mid and high layers. What
EAGLE-3 changes in training, and what this file does:

* **No feature regression.** EAGLE's loss pulls f̂ towards the target's next feature; EAGLE-3
  drops that term and trains the draft distribution only, so the head's output is free to be
  whatever best predicts the next tokens several steps on.
* **Training-time test.** Serving feeds a tree row the head's own output of its parent row, not
  a real feature. Training does the same: for every position p at once, step 1 reads
  (g_p, x_{p+1}); step j >= 2 reads (the output of step j-1, x_{p+j}) at position p+j-1 and attends
  to the real rows 0..p and to its own earlier steps (`EagleHead.forward_unrolled`, the arithmetic
  the held-back τ of eagle already simulates). Step j is trained to give the target's
  distribution of the token at p+j+1 (its top-k after position p+j, renormalised; answer positions
  only), weighted `decay`^(j-1) (EAGLE-3's 0.8):

      L = Σ_j decay^(j-1) · CE(target top-k at p+j, softmax(LMHead(f̂^{(j)}_p)))  /  Σ_j decay^(j-1)

  over the same shared candidate set as eagle's loss (the batch's target top-k ids, uniform
  negatives and the drafter's own top ids at sampled rows of every step), for the CPU's sake.
  Token inputs are the data's (the target's own greedy or sampled answers).

Held-back τ: eagle's chains (`estimate_tau`), which read `head.features_of(batch)` -- the lifted
layers here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from specserve.drafters.nets.eagle import load_head as load_eagle, shipped_checkpoint as shipped_eagle
from specserve.drafters.nets.eagle3 import KIND, Eagle3Head, parse_layers
from specserve.drafters.nets.eagle3 import load_head as load_eagle3, shipped_checkpoint as shipped_eagle3
from specserve.drafters.train import register_trainer
from specserve.drafters.train.data import PAD_LABEL
from specserve.drafters.train.eagle import (BATCH_TOKENS, EVAL_CHAINS, TAU_STEPS, TRAIN_DEFAULTS, EagleFit,
                                            candidate_ids, distill_loss, estimate_tau, save_trained,
                                            vocab_rank_option)
from specserve.drafters.train.evaluate import option
from specserve.drafters.train.loop import TrainConfig, train, trainer_batches
from specserve.engine.model import rope_tables

logger = logging.getLogger("specserve")

TTT_STEPS = 3          # draft steps trained per position (EAGLE-3 trains 7; each costs a forward)
DECAY = 0.8            # step j's weight decay^(j-1) (EAGLE-3)
FIELDS = ("input_ids", "layers", "topk_ids", "topk_logprobs")
INITS = ("auto", "random", "eagle", "eagle3")


def eagle3_loss(head: Eagle3Head, batch: dict[str, torch.Tensor], *, embed, lm_head_weight: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], steps: int = TTT_STEPS, decay: float = DECAY,
                negatives: int | None = 2048, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The training-time-test loss of one padded batch: `input_ids` [B, T], `layers` [B, T, n, H],
    `topk_ids`/`topk_logprobs` [B, T, k] (the target's top-k after each position), `loss_mask`
    [B, T] (`loss_mask[t]`: the token at t+1 is an answer token). Step j of the chain after
    position p predicts the token at p+j+1, trained where `loss_mask[p+j]` holds (see the module
    docstring). `negatives=None`: the softmax over the whole vocabulary."""
    ids, mask = batch["input_ids"], batch["loss_mask"].bool()
    b, t = ids.shape
    if t < 2 or not bool(mask[:, 1:].any()):
        return head.fc.weight.sum() * 0, {"cls": 0.0, "acc": 0.0}
    n = t - 1                                           # chains after positions 0 .. T-2
    pad_ids = torch.cat([ids, ids.new_zeros(b, steps)], dim=1)
    with torch.no_grad():
        embeds = [embed(pad_ids[:, j:j + n]).float() for j in range(1, steps + 1)]   # e(x_{p+j})
    cos, sin = rope
    outs = head.forward_unrolled(head.features_of(batch)[:, :n], embeds, cos, sin)
    k = batch["topk_ids"].shape[-1]
    pad_mask = torch.cat([mask, mask.new_zeros(b, steps)], dim=1)
    pad_ids_k = torch.cat([batch["topk_ids"], batch["topk_ids"].new_full((b, steps, k), PAD_LABEL)], dim=1)
    pad_lp = torch.cat([batch["topk_logprobs"], batch["topk_logprobs"].new_zeros(b, steps, k)], dim=1)
    picks = []
    for j, out in enumerate(outs, start=1):
        m = pad_mask[:, j:j + n]
        if bool(m.any()):
            picks.append((j, out[m], pad_ids_k[:, j:j + n][m], pad_lp[:, j:j + n][m]))
    cand = None
    if negatives is not None:
        cand = candidate_ids(torch.cat([p[2] for p in picks]), lm_head_weight.shape[0], negatives, generator,
                             pred=torch.cat([p[1] for p in picks]), lm_head_weight=lm_head_weight)
    loss, weights, stats = 0.0, 0.0, {}
    for j, pred, tk_ids, tk_lp in picks:
        cls, hit = distill_loss(pred, lm_head_weight, tk_ids, tk_lp, cand)
        w = decay ** (j - 1)
        loss, weights = loss + w * cls, weights + w
        stats[f"acc{j}"] = hit.float().mean()
        if j == 1:
            stats["cls"], stats["acc"] = cls.detach(), stats["acc1"]
    return loss / weights, stats


def fit_eagle3(target_model, train_batches: Callable[[int], Iterable] | Iterable, eval_batches: list | None, *,
               config: TrainConfig, head: Eagle3Head, steps: int = TTT_STEPS, decay: float = DECAY,
               negatives: int | None = 2048, tau_steps: int = TAU_STEPS, eval_chains: int = EVAL_CHAINS,
               max_len: int = 512, seed: int = 0) -> EagleFit:
    """Train `head` (`Eagle3Head.from_target(...)`) with the shared loop; `eval_batches`
    (held-back, in memory, with `layers`) give its τ."""
    device = torch.device(config.device)
    head = head.to(device=device, dtype=torch.float32)
    rope = rope_tables(target_model.cfg, max_len + max(tau_steps, steps) + 2, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    embed, lm_head = target_model.embed, target_model.lm_head_weight

    def loss_fn(module, batch):
        return eagle3_loss(module, batch, embed=embed, lm_head_weight=lm_head, rope=rope, steps=steps, decay=decay,
                           negatives=negatives, generator=gen)

    def eval_fn(module):
        return estimate_tau(module, eval_batches, embed=embed, lm_head_weight=lm_head, rope=rope,
                            steps=tau_steps, max_chains=eval_chains)

    return EagleFit(head, train(head, loss_fn, train_batches, eval_fn=eval_fn if eval_batches else None,
                                config=config), rope)


def _capture_layers(model_config, options: dict) -> tuple[int, ...]:
    return parse_layers(options.get("layers"), model_config.num_layers)


def start_head(options: dict, target, layers: tuple[int, ...], seed: int) -> tuple[Eagle3Head, str]:
    """The head training starts from, and how it was made: `init=eagle` copies fc, the decoder
    layer and the output norm of a trained eagle head (`eagle_checkpoint=PATH`, default the shipped
    one for this target), `init=eagle3` continues a trained eagle3 head (`eagle3_checkpoint=PATH`,
    default the shipped one; its layers must be the data's), `init=random` EAGLE's random start,
    `init=auto` (the default) `eagle` when an eagle checkpoint is at hand, else `random`."""
    init = str(option(options, "init", "auto"))
    if init not in INITS:
        raise ValueError(f"eagle3 trainer: init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "eagle3":
        path = options.get("eagle3_checkpoint") or shipped_eagle3(target.model_config, target.model)
        if path is None:
            raise ValueError("eagle3 trainer: init=eagle3 needs an eagle3 checkpoint for this target "
                             "(eagle3_checkpoint=PATH)")
        head, _ = load_eagle3(path, model_config=target.model_config, target=target.model)
        if head.layers != layers:
            raise ValueError(f"eagle3 trainer: the eagle3 checkpoint {path} reads layers {head.layers}, "
                             f"the data {layers}")
        shown = path if options.get("eagle3_checkpoint") else f"{Path(path).name}/ (shipped)"
        return head, f"the eagle3 checkpoint {shown}, continued"
    path = options.get("eagle_checkpoint") or shipped_eagle(target.model_config, target.model)
    if init == "eagle" and path is None:
        raise ValueError("eagle3 trainer: init=eagle needs an eagle checkpoint for this target (eagle_checkpoint=PATH)")
    if init == "random" or path is None:
        return Eagle3Head.from_target(target.model_config, target.model, layers=layers, seed=seed), \
            "random (EAGLE's start); lift = [0 | .. | I], layer norms = the target's final norm"
    eagle, _ = load_eagle(path, model_config=target.model_config, target=target.model)
    head = Eagle3Head.from_target(target.model_config, target.model, init="eagle", layers=layers, seed=seed,
                                  eagle=eagle)
    shown = path if options.get("eagle_checkpoint") else f"the shipped one ({Path(path).name}/)"
    return head, f"fc, decoder layer and output norm from the eagle checkpoint {shown}; lift = [0 | .. | I]"


@register_trainer(KIND)
def train_eagle3(options: dict, target, data) -> Path:
    """`specserve train eagle3` (from live rows: `--distilled` answers or `--features live`): the
    head trained with training-time test on the train split, early-stopped on the held-back τ,
    saved in bf16 with its layers, the τ of the saved weights and the labels' vocabulary ranking.
    Options besides the loop's: layers ("2,15,27"; default EAGLE-3's (2, L // 2, L - 3)), init
    (auto | random | eagle | eagle3, see `start_head`), eagle_checkpoint, eagle3_checkpoint, ttt_steps
    (3), decay (0.8), train_batch_tokens (2048), negatives (2048; `full_vocab=true` for the exact
    softmax), tau_steps (5), eval_chains, final_chains, engine_tau_prompts (0), vocab_rank (data | keep:
    the draft vocabulary's ranking from this data, or the continued checkpoint's)."""
    if not options.get("out"):
        raise ValueError("eagle3 trainer: no output folder (--out)")
    start = time.time()
    seed = int(option(options, "seed", 0))
    layers = _capture_layers(target.model_config, options)
    if tuple(data.train.capture_layers) != layers:
        raise ValueError(f"eagle3 trainer: the data holds layers {tuple(data.train.capture_layers)}, not {layers}")
    steps = int(option(options, "ttt_steps", TTT_STEPS))
    decay = float(option(options, "decay", DECAY))
    negatives = None if options.get("full_vocab") else int(option(options, "negatives", 2048))
    tau_steps = int(option(options, "tau_steps", TAU_STEPS))
    max_len = int(option(options, "max_len", 512))
    b = trainer_batches(KIND, options, data, FIELDS, defaults=TRAIN_DEFAULTS, batch_tokens=BATCH_TOKENS,
                        device=target.device, seed=seed)
    config, eval_batches = b.config, b.held_back
    head, init = start_head(options, target, layers, seed)
    vocab_rank = vocab_rank_option(options, head)     # refused before training, not after
    logger.info("eagle3: layers %s, %d train examples (%d tokens), %d held-back; start: %s", layers,
                len(data.train), data.train.num_tokens, len(data.held_back), init)
    fit = fit_eagle3(target.model, b.train, eval_batches, config=config, head=head, steps=steps, decay=decay,
                     negatives=negatives, tau_steps=tau_steps,
                     eval_chains=int(option(options, "eval_chains", EVAL_CHAINS)), max_len=max_len, seed=seed)
    return save_trained(KIND, fit, target, data, options, b, tau_steps=tau_steps, start=start,
                        hyperparams={"ttt_steps": steps, "decay": decay, "negatives": negatives, "init": init,
                                     "vocab_rank": vocab_rank},
                        chains="the first from the lifted layers, the rest from the head's own output")


train_eagle3.capture_layers = _capture_layers   # pipeline.run_training: the live rows keep these layers too
