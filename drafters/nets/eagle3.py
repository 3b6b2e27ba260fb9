"""The EAGLE-3-style draft head (served by drafters/eagle3.py, trained by drafters/train/eagle3.py)
and its checkpoint loading.

EAGLE-3 (Li et al., 2025) changes two things in EAGLE's head: what the first draft step reads and
how the head is trained. Here the first is this file's; the training is drafters/train/eagle3.py.

* **Fused target features.** Row p of the real rows reads g_p instead of the last-layer feature
  f_p: the target's residual streams after the low, mid and high decoder layers `layers`
  (default (2, L // 2, L - 3) for L layers, as EAGLE-3's code and vLLM choose), each normalised
  by an RMSNorm of its own (their scales differ by an order of magnitude along the stack), then
  concatenated and mapped to the hidden size:

      g_p = lift([norm_1(h^{(l_1)}_p) ‖ norm_2(h^{(l_2)}_p) ‖ norm_3(h^{(l_3)}_p)])      (lift: 3H -> H)

  Everything after g_p is EAGLE's head (`EagleHead`): fc([g_p ‖ e(x_{p+1})]), one decoder layer,
  an output RMSNorm, the target's LM head. Tree rows past the real ones read the head's own output
  f̂ in place of g, as in EAGLE-3 (whose later steps read the draft's own hidden state).
* **Start.** The norms start as the target's final norm and `lift` as [0 | ... | 0 | I], so at
  step 0 g_p is the highest captured layer put through the final norm -- the same space as f_p,
  which EAGLE's head was trained to read; the rest can start from a trained eagle head.

The layers are kept in the checkpoint's hyperparameters (`layers`); the serving drafter declares
them as its `capture_layers`, so the engine's feature store keeps them beside the last layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.drafters.nets import eagle as eagle_net
from specserve.drafters.nets.checkpoint import load_checkpoint, target_fingerprint
from specserve.drafters.nets.eagle import EagleHead
from specserve.engine.config import ModelConfig
from specserve.engine.model import linear

KIND = "eagle3"
INITS = ("random", "eagle")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers (2, L // 2, L - 3) for a target of L >= 8 decoder layers;
    for a smaller one (test models) the embeddings, the middle and the last layer's output."""
    picks = (2, num_layers // 2, num_layers - 3) if num_layers >= 8 else (0, num_layers // 2, num_layers)
    return tuple(sorted(set(picks)))


def parse_layers(value, num_layers: int) -> tuple[int, ...]:
    """`layers` as an option: None (the default), "2,15,27" or a sequence of ints; sorted, each
    once, every one in 0..num_layers."""
    if value is None or value == "":
        return default_layers(num_layers)
    items = value.split(",") if isinstance(value, str) else list(value)
    layers = tuple(sorted({int(k) for k in items}))
    if not layers or layers[0] < 0 or layers[-1] > num_layers:
        raise ValueError(f"eagle3: layers must lie in 0..{num_layers}, got {value!r}")
    return layers


class Eagle3Head(EagleHead):
    """EAGLE's head behind `lift_features`: captured layers [..., len(layers), H] -> g [..., H]."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...]):
        super().__init__(cfg)
        self.layers = tuple(int(k) for k in layers)
        h, n = cfg.hidden_size, len(self.layers)
        self.layer_norms = nn.Parameter(torch.ones(n, h))
        self.lift = nn.Linear(n * h, h, bias=False)

    @classmethod
    def from_target(cls, cfg: ModelConfig, target, init: str = "random", seed: int = 0,
                    layers: tuple[int, ...] | None = None, eagle: EagleHead | None = None) -> "Eagle3Head":
        """The start of training (and the `random_init` head of tests), deterministic: the norms as
        the target's final norm, lift = [0 | ... | I]; fc, the decoder layer and the output norm as
        `EagleHead.from_target(init="random")`, or copied from `eagle` (a trained EagleHead) with
        `init="eagle"`."""
        if init not in INITS:
            raise ValueError(f"eagle3: init must be one of {', '.join(INITS)}, got {init!r}")
        if init == "eagle" and eagle is None:
            raise ValueError("eagle3: init=eagle needs a trained eagle head")
        layers = default_layers(cfg.num_layers) if layers is None else tuple(layers)
        source = eagle if init == "eagle" else EagleHead.from_target(cfg, target, init="random", seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(cfg, layers)
        head.load_state_dict({**{k: v.detach().clone().float() for k, v in source.state_dict().items()
                                 if k != "vocab_rank"},
                              "layer_norms": target.norm.detach().float().expand(len(layers), -1).clone(),
                              "lift.weight": _last_block_identity(cfg.hidden_size, len(layers))}, strict=False)
        return head.float()

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                     layers: tuple[int, ...] = ()) -> "Eagle3Head":
        head = cls(cfg, layers)
        head.load_tensors(tensors, KIND)
        return head

    def hyperparams(self) -> dict[str, Any]:
        return {**super().hyperparams(), "layers": list(self.layers),
                "input": "real rows: fc([lift(RMSNorm_i(target layer l_i) for l_i in layers), token embedding]); "
                         "tree rows: fc([own output, token embedding]); + 1 decoder layer + RMSNorm"}

    def lift_features(self, layers: torch.Tensor) -> torch.Tensor:
        """[..., len(layers), H] (the target's residual streams after `self.layers`) -> g [..., H]."""
        x = layers.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.layer.eps)
        x = (x * self.layer_norms.float()).to(self.lift.weight.dtype)
        return linear(x.flatten(-2), self.lift.weight)

    def features_of(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lift_features(batch["layers"])


def _last_block_identity(h: int, n: int) -> torch.Tensor:
    w = torch.zeros(h, n * h)
    w[:, (n - 1) * h:] = torch.eye(h)
    return w


# ---- checkpoints ------------------------------------------------------------------------------------------------

def save_head(directory, head: Eagle3Head, **kwargs) -> Path:
    """Write `head` as an eagle3 checkpoint (`nets.eagle.save_head`'s arguments)."""
    return eagle_net.save_head(directory, head, kind=KIND, **kwargs)


def load_head(directory, *, model_config: ModelConfig, target) -> tuple[Eagle3Head, Any]:
    """(head in fp32 on the CPU, meta) of the eagle3 checkpoint in `directory` (its layers from the
    meta); CheckpointMismatchError when it was made for another target or is not eagle3."""
    tensors, meta = load_checkpoint(directory, kind=KIND, fingerprint=target_fingerprint(model_config, target))
    layers = parse_layers(meta.hyperparams.get("layers"), model_config.num_layers)
    return Eagle3Head.from_tensors(model_config, tensors, layers), meta


def shipped_checkpoint(model_config: ModelConfig, target, root: Path | None = None) -> Path | None:
    """The eagle3 checkpoint under drafters/checkpoints/ made for this target, if one is shipped."""
    return eagle_net.shipped_checkpoint(model_config, target, root, kind=KIND)
