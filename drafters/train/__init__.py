"""Training infrastructure for trained drafters, and the registry of their trainers.

Modules: `target` (the target as a teacher: hidden states, top-k), `data` (prompt pool, teacher
shards, self-distillation, `ShardDataset`), `live` (the same rows computed in the training loop from
token ids: `LiveDataset`), `loop` (the one training loop), `evaluate` (τ of a
drafter through the engine), `pipeline` (what `specserve train` runs). The checkpoint format, the
target fingerprint and tree tuning are shared with serving: `specserve.drafters.nets`.

A trainer is a function `(options, target, data) -> checkpoint folder`:

    from specserve.drafters.train import register_trainer

    @register_trainer("medusa")
    def train_medusa(options: dict, target: TrainTarget, data: TrainData) -> Path:
        ...   # build the heads, loop.train(...), checkpoint.save_checkpoint(options["out"], ...)

`options` holds the command's options (out, epochs, lr, batch_tokens, seed, device, ...) plus the
drafter's own from ``--option KEY=VALUE``. A trainer lives in ``drafters/train/<name>.py`` (every
module of this package is imported on first lookup) or in any module imported before the lookup.
This module imports neither torch nor the engine, so the command line stays fast.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from specserve.drafters.train.data import Example, ExampleSet
    from specserve.engine.config import ModelConfig
    from specserve.engine.loader import LoadedModel
    from specserve.engine.model import LlamaModel

logger = logging.getLogger("specserve")

INFRA_MODULES = {"target", "data", "live", "loop", "evaluate", "pipeline"}


@dataclass
class TrainTarget:
    """The target a drafter is trained for."""

    loaded: "LoadedModel"             # name, tokenizer, HF config and state dict, EOS ids
    model: "LlamaModel"               # our model on `device`/`dtype`, frozen (embedding and LM head to share)
    model_config: "ModelConfig"
    fingerprint: str                  # checkpoint.target_fingerprint(model_config, model)
    device: "torch.device"
    dtype: "torch.dtype"

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def tokenizer(self):
        return self.loaded.tokenizer


@dataclass
class TrainData:
    """The distillation data and its train / held-back splits: teacher shards (`ShardDataset`), or
    token ids whose target rows are computed in the training loop (`live.LiveDataset`)."""

    shard_dir: Path                   # the teacher shards' folder, or the distilled answers' (live)
    manifest: dict[str, Any]
    train: "ExampleSet"
    held_back: "ExampleSet"
    examples: list["Example"] = field(default_factory=list)   # what the shards were built from

    def held_back_examples(self) -> list["Example"]:
        """The held-back examples (prompts for measuring τ through the engine)."""
        ids = self.held_back.held_back
        return [ex for ex in self.examples if ex.id in ids]

    def summary(self) -> dict[str, Any]:
        """The `data` entry of a checkpoint's metadata."""
        m = self.manifest
        return {"sources": m.get("sources", {}), "num_examples": m.get("num_examples"),
                "num_tokens": m.get("num_tokens"), "num_answer_tokens": m.get("num_answer_tokens"),
                "train_examples": len(self.train), "held_back_examples": len(self.held_back),
                "max_len": m.get("config", {}).get("max_len"), "top_k": m.get("config", {}).get("top_k"),
                "self_distill": m.get("self_distill"), "shards_build_key": m.get("build_key"),
                "distilled": m.get("distilled"), **self.feature_summary()}

    def feature_summary(self) -> dict[str, Any]:
        """Where the target's rows came from: teacher shards, or computed in the loop (with how many
        tokens, in how long)."""
        live = getattr(self.train, "features", None)
        return {"features": "shards"} if live is None else {"features": "live", "feature_stats": live.stats()}


Trainer = Callable[[dict, TrainTarget, TrainData], Path]
_TRAINERS: dict[str, Trainer] = {}
_IMPORT_ERRORS: dict[str, str] = {}
_imported = False


class UnknownTrainerError(ValueError):
    pass


def register_trainer(name: str) -> Callable[[Trainer], Trainer]:
    """Decorator: register `fn` as the trainer of drafter `name` (a later registration replaces it)."""
    def wrap(fn: Trainer) -> Trainer:
        _TRAINERS[name] = fn
        return fn
    return wrap


def unregister_trainer(name: str) -> None:
    _TRAINERS.pop(name, None)


def _import_builtin() -> None:
    """Import every trainer module of this package once (they register themselves)."""
    global _imported
    if _imported:
        return
    _imported = True
    for info in pkgutil.iter_modules(__path__):
        if info.name in INFRA_MODULES or info.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"{__name__}.{info.name}")
        except Exception as exc:   # noqa: BLE001 - one broken trainer must not hide the others
            _IMPORT_ERRORS[info.name] = f"{type(exc).__name__}: {exc}"
            logger.warning("trainer module %s failed to import: %s", info.name, exc)


def available_trainers() -> list[str]:
    _import_builtin()
    return sorted(_TRAINERS)


def get_trainer(name: str) -> Trainer:
    """The trainer registered for `name`; `UnknownTrainerError` listing the available ones otherwise."""
    _import_builtin()
    if name not in _TRAINERS:
        available = ", ".join(sorted(_TRAINERS)) or "none"
        broken = "".join(f"; module {m} failed to import ({e})" for m, e in sorted(_IMPORT_ERRORS.items()))
        raise UnknownTrainerError(f"no trainer for drafter {name!r}; available trainers: {available}{broken}")
    return _TRAINERS[name]


__all__ = ["TrainTarget", "TrainData", "Trainer", "UnknownTrainerError", "register_trainer", "unregister_trainer",
           "available_trainers", "get_trainer"]
