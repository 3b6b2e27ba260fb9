"""The one training loop every trained drafter uses.

    result = train(module, loss_fn, train_batches, eval_fn=eval_fn, config=TrainConfig(epochs=3, lr=1e-3))

* `loss_fn(module, batch) -> (loss, logs)`: a scalar loss tensor and a dict of floats/tensors to log.
* `train_batches`: a callable `epoch -> iterable of batches` (e.g. `lambda e: ds.batches(8192, epoch=e)`),
  or one re-iterable collection used every epoch. When the epoch's iterable has a length the
  learning-rate schedule knows its horizon; otherwise give `max_steps` (or the LR stays flat after warm-up).
* `eval_fn(module) -> {"tau": ..., ...}`: run on the held-back data every epoch (or every
  `eval_every` steps) under `torch.no_grad()` and `module.eval()`; early stopping watches `tau`
  (higher is better) and the module ends with its best state.

Time-capped and resumable: `max_seconds` stops after the step that crosses it; with `state_path`
the loop saves its whole state there (`TrainState`) every `save_every_seconds`, at each epoch's end
and at that stop, and a run with `resume` goes on from it exactly as if it had not stopped.

AdamW (no weight decay on 1-D parameters: norms, biases) over the parameters that require grad
only, so frozen ones (the target's embedding and LM head, shared by reference) are never touched;
linear warm-up then cosine decay to `min_lr_ratio`; grad-norm clipping; bf16 autocast on CUDA,
plain fp32 on the CPU; seeded `random`, numpy and torch.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger("specserve")


@dataclass
class TrainConfig:
    epochs: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int | None = None     # default: warmup_ratio of the planned steps
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1           # the cosine ends at lr * min_lr_ratio
    grad_clip: float | None = 1.0       # max grad norm; None = no clipping
    grad_accum: int = 1                 # batches per optimizer step
    max_steps: int | None = None        # optimizer steps; stops early when reached
    max_seconds: float | None = None    # wall-clock budget; stops after the step that crosses it
    eval_every: int | None = None       # optimizer steps between evals; None = at the end of each epoch
    eval_at_start: bool = False         # measure the untrained module too (it may stay the best)
    patience: int | None = 2            # stop after this many evals in a row without a better tau; None = never
    min_delta: float = 0.0              # a tau must beat the best by more than this to count as better
    seed: int = 0
    device: str | torch.device = "cpu"  # where batches are expected (autocast follows its type)
    amp: bool | None = None             # bf16 autocast; None = on CUDA only
    log_every: int = 10                 # steps between loss syncs (one host sync each)
    progress: bool = True
    state_path: str | None = None       # where the training state is saved (TrainState); None = never
    resume: bool = False                # continue from state_path's state when it exists
    save_every_seconds: float = 300.0   # between saves (and at every epoch's end, and at max_seconds)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], **overrides) -> "TrainConfig":
        """The fields of `options` (a CLI namespace dict or a trainer's options) that name a field
        of TrainConfig; others are ignored. None values keep the default."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in options.items() if k in names and v is not None}
        values.update(overrides)
        if isinstance(values.get("betas"), str):
            values["betas"] = tuple(float(x) for x in values["betas"].split(","))
        return cls(**values)


@dataclass
class TrainerBatches:
    """What a trainer over padded batches of whole examples sets up from its options (`trainer_batches`)."""

    config: TrainConfig
    train: Callable[[int], Iterable]    # epoch -> that epoch's shuffled train batches
    held_back: list                     # the held-back batches, in memory, in order
    batch_tokens: int                   # tokens per train batch
    eval_tokens: int                    # tokens per held-back batch


def trainer_batches(kind: str, options: Mapping[str, Any], data, fields: tuple[str, ...], *,
                    defaults: Mapping[str, Any], batch_tokens: int, device, seed: int) -> TrainerBatches:
    """The loop's config (`defaults` under `options`), the train split's batches of
    `train_batch_tokens` (default `batch_tokens`) tokens per epoch and the held-back split's of
    `batch_tokens` (8192, at least as many), with `fields`; ValueError naming `kind` when the train
    split has no answer position."""
    given = {k: v for k, v in options.items() if v is not None}
    train_tokens = int(given.get("train_batch_tokens", batch_tokens))
    eval_tokens = max(train_tokens, int(given.get("batch_tokens", 8192)))
    config = TrainConfig.from_options({**defaults, **given}, device=str(device))

    def train_batches(epoch: int):
        return data.train.batches(train_tokens, epoch=epoch, seed=seed, fields=fields, device=device)

    held_back = list(data.held_back.batches(eval_tokens, shuffle=False, fields=fields, device=device))
    if not len(train_batches(0)):
        raise ValueError(f"{kind} trainer: the train split has no answer position")
    return TrainerBatches(config, train_batches, held_back, train_tokens, eval_tokens)


@dataclass
class TrainResult:
    best_tau: float | None              # None without eval_fn
    best_step: int                      # optimizer step of the kept state
    steps: int                          # optimizer steps taken
    epochs: float                       # epochs done (fractional when stopped inside one)
    wall_seconds: float
    loss_history: list[float] = field(default_factory=list)       # per batch
    eval_history: list[dict[str, Any]] = field(default_factory=list)   # each eval's dict + "step", "epoch"
    log_history: list[dict[str, float]] = field(default_factory=list)  # mean logs every log_every steps
    stopped_early: bool = False
    stop_reason: str = "done"           # done | early_stop | max_steps | max_seconds


class TrainState:
    """What a run stopped at `max_seconds` (or killed) needs to go on exactly where it was: the
    trainable parameters, the optimizer's and the schedule's state, the position (epoch, next
    batch), the result so far with the best state, and the random generators. Saved atomically
    (temporary file, then rename) to `config.state_path`; loaded by a run with `config.resume` that
    has the same schedule and parameters (else ValueError: start over or choose another path).
    Removed when the run ends otherwise (done, early stop, max_steps): nothing is left to resume."""

    FORMAT = 1

    def __init__(self, config: TrainConfig, module: torch.nn.Module, optimizer, scheduler, total: int | None):
        self.path = Path(config.state_path) if config.state_path else None
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        params = {name: list(p.shape) for name, p in module.named_parameters() if p.requires_grad}
        self.key = json.dumps({"format": self.FORMAT, "params": params, "total": total, "epochs": config.epochs,
                               "lr": config.lr, "betas": list(config.betas), "weight_decay": config.weight_decay,
                               "grad_accum": config.grad_accum, "warmup_steps": config.warmup_steps,
                               "warmup_ratio": config.warmup_ratio, "min_lr_ratio": config.min_lr_ratio,
                               "seed": config.seed}, sort_keys=True)

    def save(self, result: "TrainResult", best_state, bad_evals: int, epoch: int, batch: int) -> None:
        if self.path is None:
            return
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        blob = {"key": self.key, "module": _trainable_state(self.module), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "result": asdict(result), "best_state": best_state,
                "bad_evals": bad_evals, "epoch": epoch, "batch": batch, "rng": rng}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(blob, tmp)
        os.replace(tmp, self.path)

    def load(self) -> dict[str, Any] | None:
        """The saved state, put back into the module, optimizer, schedule and generators; None when
        there is none."""
        if self.path is None or not self.path.is_file():
            if self.path is not None:
                logger.info("no training state in %s: starting from the beginning", self.path)
            return None
        blob = torch.load(self.path, map_location="cpu", weights_only=False)
        if blob.get("key") != self.key:
            raise ValueError(f"{self.path} holds the state of another training (other parameters, schedule or "
                             "seed): start over without resuming, or train into another folder")
        with torch.no_grad():
            params = dict(self.module.named_parameters())
            for name, value in blob["module"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        rng = blob["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        logger.info("resuming training from %s: epoch %d, batch %d, step %d", self.path, blob["epoch"],
                    blob["batch"], blob["result"]["steps"])
        return {"result": TrainResult(**blob["result"]), "best_state": blob["best_state"],
                "bad_evals": blob["bad_evals"], "epoch": blob["epoch"], "batch": blob["batch"]}

    def clear(self) -> None:
        if self.path is not None and self.path.is_file():
            self.path.unlink()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    try:
        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def lr_lambda(step: int, warmup: int, total: int | None, min_ratio: float) -> float:
    """Multiplier of the base LR after `step` optimizer steps: linear warm-up over `warmup` steps,
    then a cosine from 1 down to `min_ratio` at `total` (flat at 1 when total is unknown)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if not total or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the module has no trainable parameter")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def _epoch_iterable(train_batches, epoch: int) -> Iterable:
    return train_batches(epoch) if callable(train_batches) else train_batches


def _planned_steps(train_batches, config: TrainConfig) -> int | None:
    if config.max_steps is not None:
        return config.max_steps
    first = _epoch_iterable(train_batches, 0)
    try:
        per_epoch = len(first)   # type: ignore[arg-type]
    except TypeError:
        return None
    return max(1, math.ceil(per_epoch / config.grad_accum)) * config.epochs


def train(module: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, Mapping[str, Any]]],
          train_batches, *, eval_fn: Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
          config: TrainConfig | None = None) -> TrainResult:
    """Train `module` in place (see the module docstring); returns a TrainResult. With `eval_fn`
    the module ends with the parameters of its best eval (by `tau`)."""
    config = config or TrainConfig()
    if config.grad_accum < 1:
        raise ValueError("grad_accum must be at least 1")
    seed_everything(config.seed)
    device = torch.device(config.device)
    amp = config.amp if config.amp is not None else device.type == "cuda"
    optimizer = torch.optim.AdamW(_param_groups(module, config.weight_decay), lr=config.lr, betas=config.betas,
                                  eps=config.eps, **({"foreach": False} if device.type == "cpu" else {}))
    total = _planned_steps(train_batches, config)
    warmup = config.warmup_steps if config.warmup_steps is not None else int((total or 0) * config.warmup_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup, total, config.min_lr_ratio))

    result = TrainResult(best_tau=None, best_step=0, steps=0, epochs=0.0, wall_seconds=0.0)
    best_state: dict[str, torch.Tensor] | None = None
    bad_evals = 0
    start = time.perf_counter()
    pending_losses: list[torch.Tensor] = []
    pending_logs: list[Mapping[str, Any]] = []

    def flush() -> None:
        if not pending_losses:
            return
        values = torch.stack(pending_losses).float().tolist()
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"non-finite loss {bad[0]} near step {result.steps}; lower the learning "
                                     "rate or check the data")
        result.loss_history.extend(values)
        means: dict[str, float] = {}
        for logs in pending_logs:
            for k, v in logs.items():
                means[k] = means.get(k, 0.0) + float(v.detach().float().item() if isinstance(v, torch.Tensor) else v)
        result.log_history.append({"step": result.steps, "loss": sum(values) / len(values),
                                   **{k: v / len(pending_logs) for k, v in means.items()}})
        pending_losses.clear()
        pending_logs.clear()

    def evaluate(epoch: float) -> bool:
        """Run eval_fn; keep the best state; True when early stopping says stop."""
        nonlocal best_state, bad_evals
        if eval_fn is None:
            return False
        was_training = module.training
        module.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            metrics = dict(eval_fn(module))
        module.train(was_training)
        if "tau" not in metrics:
            raise KeyError("eval_fn must return a dict with 'tau'")
        tau = float(metrics["tau"])
        result.eval_history.append({**metrics, "tau": tau, "step": result.steps, "epoch": epoch})
        if result.best_tau is None or tau > result.best_tau + config.min_delta:
            result.best_tau, result.best_step = tau, result.steps
            best_state = _trainable_state(module)
            bad_evals = 0
        else:
            bad_evals += 1
        bar.set_postfix_str(f"tau={tau:.3f} best={result.best_tau:.3f}", refresh=False)
        return config.patience is not None and bad_evals >= config.patience

    def optimizer_step() -> None:
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        result.steps += 1
        bar.update(1)
        if result.steps % config.log_every == 0:
            flush()
            bar.set_postfix_str(f"loss={result.loss_history[-1]:.4f} lr={scheduler.get_last_lr()[0]:.2e}",
                                refresh=False)

    bar = tqdm(total=total, desc="train", unit="step", disable=not config.progress)
    state = TrainState(config, module, optimizer, scheduler, total)
    first_epoch, first_batch, earlier_seconds = 0, 0, 0.0
    saved = state.load() if config.resume else None
    if saved is not None:
        result, best_state, bad_evals = saved["result"], saved["best_state"], saved["bad_evals"]
        first_epoch, first_batch, earlier_seconds = saved["epoch"], saved["batch"], result.wall_seconds
        bar.update(result.steps)
    last_save = time.perf_counter()

    def save(epoch: int, batch: int) -> None:
        nonlocal last_save
        if config.state_path is None:
            return
        flush()
        result.wall_seconds = earlier_seconds + time.perf_counter() - start
        state.save(result, best_state, bad_evals, epoch, batch)
        last_save = time.perf_counter()

    module.train()
    stop = None
    try:
        if config.eval_at_start and saved is None and evaluate(0.0):
            stop = "early_stop"
        for epoch in range(first_epoch, config.epochs):
            if stop:
                break
            batches = _epoch_iterable(train_batches, epoch)
            try:
                num_batches = len(batches)   # type: ignore[arg-type]
            except TypeError:
                num_batches = None
            skip = first_batch if epoch == first_epoch else 0
            if skip:   # a resumed epoch: the batches done before
                batches = batches.skip(skip) if hasattr(batches, "skip") else itertools.islice(batches, skip, None)
            micro = 0
            optimizer.zero_grad(set_to_none=True)
            for i, batch in enumerate(batches, start=skip):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    loss, logs = loss_fn(module, batch)
                (loss.float() / config.grad_accum).backward()
                pending_losses.append(loss.detach())
                pending_logs.append(logs)
                micro += 1
                if micro < config.grad_accum:
                    continue
                micro = 0
                optimizer_step()
                frac = epoch + ((i + 1) / num_batches if num_batches else 0.0)
                if config.eval_every and result.steps % config.eval_every == 0:
                    flush()
                    if evaluate(frac):
                        stop = "early_stop"
                if config.max_steps is not None and result.steps >= config.max_steps:
                    stop = stop or "max_steps"
                if config.max_seconds is not None and time.perf_counter() - start > config.max_seconds:
                    stop = stop or "max_seconds"
                if stop:
                    result.epochs = frac
                    if stop == "max_seconds":
                        save(epoch, i + 1)   # the next run (resume) continues from here
                    break
                if time.perf_counter() - last_save >= config.save_every_seconds:
                    save(epoch, i + 1)
            if micro:   # the epoch ended inside an accumulation
                optimizer_step()
            flush()
            if stop:
                break
            result.epochs = epoch + 1.0
            if not config.eval_every and evaluate(float(epoch + 1)):
                stop = "early_stop"
            if not stop and epoch + 1 < config.epochs:
                save(epoch + 1, 0)
        flush()
        if eval_fn is not None and (not result.eval_history or result.eval_history[-1]["step"] != result.steps):
            evaluate(result.epochs)   # the final state is measured too (a stop between evals)
    finally:
        bar.close()
    if stop != "max_seconds":
        state.clear()   # finished: nothing to resume
    if best_state is not None:
        with torch.no_grad():
            params = dict(module.named_parameters())
            for name, value in best_state.items():
                params[name].copy_(value)
    module.eval()
    result.stopped_early = stop == "early_stop"
    result.stop_reason = stop or "done"
    result.wall_seconds = earlier_seconds + time.perf_counter() - start
    if eval_fn is None:
        result.best_step = result.steps
    return result
