"""The shared training loop on a tiny module: the loss falls, frozen (shared) parameters stay
untouched, early stopping keeps the best state, the same seed gives the same run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from specserve.drafters.train.loop import TrainConfig, lr_lambda, train

VOCAB, DIM = 40, 16


class Probe(nn.Module):
    """A frozen "target" embedding + LM head shared by reference, and a small trainable adapter."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed
        self.adapter = nn.Linear(DIM, DIM)
        self.norm = nn.Parameter(torch.ones(DIM))

    def forward(self, tokens):
        h = self.embed(tokens)
        return (h + self.adapter(h) * self.norm) @ self.embed.weight.T


def make(seed: int = 0):
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, DIM).requires_grad_(False)
    return Probe(embed)


def loss_fn(module, batch):
    tokens, targets = batch
    logits = module(tokens)
    loss = nn.functional.cross_entropy(logits, targets)
    return loss, {"acc": (logits.argmax(-1) == targets).float().mean()}


def batches(num: int = 8, size: int = 32):
    """Task: predict (t * 7 + 3) % VOCAB. Drawn from torch's global RNG: seeded by the loop."""
    def epoch(_):
        out = []
        for _ in range(num):
            t = torch.randint(0, VOCAB, (size,))
            out.append((t, (t * 7 + 3) % VOCAB))
        return out
    return epoch


def accuracy(module) -> float:
    t = torch.arange(VOCAB)
    return float((module(t).argmax(-1) == (t * 7 + 3) % VOCAB).float().mean())


def test_loss_falls_and_frozen_parameters_are_untouched():
    module = make()
    frozen_before = module.embed.weight.clone()
    shared = module.embed.weight
    config = TrainConfig(epochs=6, lr=5e-2, weight_decay=0.1, warmup_steps=5, log_every=4, progress=False)
    result = train(module, loss_fn, batches(), config=config)
    assert result.steps == 6 * 8 and result.epochs == 6 and result.stop_reason == "done"
    assert len(result.loss_history) == result.steps
    first, last = sum(result.loss_history[:8]) / 8, sum(result.loss_history[-8:]) / 8
    assert last < first / 2
    assert result.log_history and "acc" in result.log_history[-1] and result.log_history[-1]["acc"] > 0.5
    assert torch.equal(module.embed.weight, frozen_before)           # weight decay never reached it
    assert module.embed.weight is shared and not module.embed.weight.requires_grad
    assert module.embed.weight.grad is None
    assert not module.training and result.best_tau is None


def test_early_stopping_keeps_the_best_state():
    module = make()
    taus = iter([1.0, 3.0, 2.0, 2.5, 2.9, 9.0])   # best at the 2nd eval; patience 2 -> stop at the 4th
    snapshots = []

    def eval_fn(m):
        snapshots.append(m.adapter.weight.detach().clone())
        return {"tau": next(taus), "extra": 1}

    config = TrainConfig(epochs=10, lr=1e-2, patience=2, progress=False, eval_every=3)
    result = train(module, loss_fn, batches(), eval_fn=eval_fn, config=config)
    assert result.stopped_early and result.stop_reason == "early_stop"
    assert [e["tau"] for e in result.eval_history] == [1.0, 3.0, 2.0, 2.5]
    assert result.best_tau == 3.0 and result.best_step == 6 and result.steps == 12
    assert result.eval_history[1]["extra"] == 1 and result.eval_history[1]["step"] == 6
    assert torch.equal(module.adapter.weight, snapshots[1])         # restored to the best eval's state
    assert not torch.equal(snapshots[1], snapshots[3])


def test_eval_every_epoch_and_max_steps():
    module = make()
    seen = []

    def eval_fn(m):
        seen.append(accuracy(m))
        return {"tau": 1.0 + seen[-1]}

    result = train(module, loss_fn, batches(), eval_fn=eval_fn,
                   config=TrainConfig(epochs=5, lr=3e-2, max_steps=20, patience=None, progress=False))
    # epochs 1 and 2 end with an eval; the stop at step 20 (mid epoch 3) is measured too
    assert [e["step"] for e in result.eval_history] == [8, 16, 20]
    assert result.stop_reason == "max_steps" and result.steps == 20 and result.epochs == pytest.approx(2.5)
    assert result.best_tau == max(e["tau"] for e in result.eval_history)


def test_same_seed_same_run():
    def run(seed):
        module = make(0)
        result = train(module, loss_fn, batches(), config=TrainConfig(epochs=2, lr=1e-2, seed=seed, progress=False,
                                                                      grad_accum=2))
        return result, module

    (a, ma), (b, mb), (c, _) = run(3), run(3), run(4)
    assert a.steps == 8   # 16 batches, 2 per step
    assert a.loss_history == b.loss_history
    assert all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters()))
    assert a.loss_history != c.loss_history   # the data order follows the seed


def test_module_without_trainable_parameters_is_refused():
    module = make().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        train(module, loss_fn, batches(), config=TrainConfig(progress=False))


def test_non_finite_loss_is_reported():
    def bad_loss(module, batch):
        return module(batch[0]).sum() * float("nan"), {}

    with pytest.raises(FloatingPointError, match="non-finite loss"):
        train(make(), bad_loss, batches(), config=TrainConfig(epochs=1, log_every=1, progress=False))


def test_lr_schedule():
    assert [lr_lambda(s, 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert lr_lambda(12, 4, 20, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_lambda(100, 4, None, 0.1) == 1.0                     # no horizon: flat after warm-up


def test_config_from_options():
    config = TrainConfig.from_options({"epochs": 5, "lr": 2e-4, "betas": "0.9,0.99", "batch_tokens": 4096,
                                       "seed": None}, device="cpu")
    assert (config.epochs, config.lr, config.betas, config.seed, config.device) == (5, 2e-4, (0.9, 0.99), 0, "cpu")


# ---- time caps and resuming ----------------------------------------------------------------------------------------

def seeded_batches(num: int = 6, size: int = 32):
    """The same task, each epoch's batches a function of the epoch alone (as ShardDataset's are)."""
    def epoch(e):
        g = torch.Generator().manual_seed(100 + e)
        out = []
        for _ in range(num):
            t = torch.randint(0, VOCAB, (size,), generator=g)
            out.append((t, (t * 7 + 3) % VOCAB))
        return out
    return epoch


def noisy_loss(module, batch):
    """`loss_fn` with noise from the global generator (as the feature noise of EAGLE training)."""
    tokens, targets = batch
    logits = module(tokens) + 0.3 * torch.randn(tokens.shape[0], VOCAB)
    return nn.functional.cross_entropy(logits, targets), {}


class Killed(Exception):
    pass


def run(config, loss=noisy_loss):
    module = make()
    result = train(module, loss, seeded_batches(), eval_fn=lambda m: {"tau": 1 + accuracy(m)}, config=config)
    return module, result


def assert_same_run(a, b):
    (ma, ra), (mb, rb) = a, b
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert (ra.steps, ra.best_step, ra.best_tau, ra.loss_history) == (rb.steps, rb.best_step, rb.best_tau,
                                                                      rb.loss_history)
    assert [e["tau"] for e in ra.eval_history] == [e["tau"] for e in rb.eval_history]


def test_a_killed_run_resumes_exactly(tmp_path):
    base = dict(epochs=3, lr=0.05, seed=1, progress=False, log_every=1, patience=None)
    straight = run(TrainConfig(**base))
    path = tmp_path / "state.pt"
    calls = 0

    def dies_at_the_tenth_batch(module, batch):
        nonlocal calls
        calls += 1
        if calls == 10:
            raise Killed
        return noisy_loss(module, batch)

    with pytest.raises(Killed):
        run(TrainConfig(**base, state_path=str(path), save_every_seconds=0), dies_at_the_tenth_batch)
    assert path.is_file()
    resumed = run(TrainConfig(**base, state_path=str(path), resume=True))
    assert_same_run(straight, resumed)
    assert resumed[1].stop_reason == "done" and not path.exists()    # finished: nothing left to resume

    # a resumed run that saves nothing from the start: the same as a run from scratch
    assert_same_run(straight, run(TrainConfig(**base, state_path=str(path), resume=True)))
    with pytest.raises(Killed):                                       # killed again ...
        calls = 0
        run(TrainConfig(**base, state_path=str(path), save_every_seconds=0), dies_at_the_tenth_batch)
    with pytest.raises(ValueError, match="another training"):         # ... and resumed with another schedule
        run(TrainConfig(**{**base, "lr": 0.01}, state_path=str(path), resume=True))


def test_a_time_capped_run_continues_where_it_stopped(tmp_path):
    base = dict(epochs=2, lr=0.05, seed=2, progress=False, log_every=1, patience=None)
    straight = run(TrainConfig(**base))
    path = tmp_path / "state.pt"
    capped = run(TrainConfig(**base, state_path=str(path), max_seconds=0))
    assert capped[1].stop_reason == "max_seconds" and capped[1].steps == 1 and path.is_file()
    resumed = run(TrainConfig(**base, state_path=str(path), resume=True))
    assert_same_run(straight, resumed)
    assert resumed[1].wall_seconds >= capped[1].wall_seconds - 1e-6   # the time of both runs
