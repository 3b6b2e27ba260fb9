"""The drafter protocol and the registry.

A drafter proposes one draft tree per running sequence, in one batched call for the batch.
The engine never branches on drafter names: it looks drafters up here by name and calls the four
hooks below. A drafter that raises or returns a malformed tree does not fail any request: the
engine falls back to plain decoding for those sequences for that step and counts the error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Sequence as Seq

if TYPE_CHECKING:
    import torch

from specserve.engine.tree import TokenTree
from specserve.engine.verify import VerifyResult


class Drafter(ABC):
    """Hooks, in call order for a sequence: start, (propose, accept)*, finish.

    `seq` objects are the engine's sequences: `seq.seq_id`, `seq.token_ids` (prompt + output,
    the last one being the tree root), `seq.params`. Budgets are the maximum number of draft
    nodes (root excluded) the scheduler allows for each sequence this step; 0 means "no draft"."""

    name: str = "base"
    needs_features: bool = False   # True: the engine calls `observe` with the target's hidden states

    def start(self, seq) -> None:
        """A sequence joins (after its prompt is known)."""

    @abstractmethod
    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        """One tree per sequence rooted at seq.token_ids[-1], at most budgets[i] draft nodes,
        or None for no draft."""

    def observe(self, seqs: Seq, features: Seq[tuple[int, "torch.Tensor"]]) -> None:
        """Only for `needs_features` drafters, every step a sequence's KV grows (prefill chunks,
        plain decoding, verification): `features[i] = (start, hidden)` with `hidden[j]` the
        target's last-layer hidden state (after the final norm, the LM head's input) at position
        `start + j` of `seqs[i].token_ids`. After a verification these are the root and the
        accepted path; the bonus token has none yet. A preempted sequence starts again at 0."""

    def accept(self, seqs: Seq, results: Seq[VerifyResult]) -> None:
        """What the target accepted for each sequence proposed for this step."""

    def finish(self, seq) -> None:
        """A sequence leaves (finished or aborted); drop its state."""


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory
    return wrap


def available_drafters() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build a registered drafter; kwargs are the drafter's own options plus engine context
    (e.g. `tokenizer`, `target_model`) that a drafter may take or ignore."""
    _import_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


def parse_option_value(text: str):
    """'4' -> 4, '0.5' -> 0.5, 'true'/'false' -> bool, 'none' -> None, anything else stays text."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_drafter_options(items: Seq[str]) -> dict[str, dict]:
    """`["draft_model.k_config=4,2,2,1", "ngram.max_ngram=3"]` -> `{"draft_model": {"k_config": "4,2,2,1"},
    "ngram": {"max_ngram": 3}}`. Values become int, float, bool or None where they read as one."""
    options: dict[str, dict] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        key, eq, value = rest.partition("=")
        if not (name and dot and key and eq):
            raise ValueError(f"drafter option {item!r} is not DRAFTER.KEY=VALUE")
        options.setdefault(name.strip(), {})[key.strip().replace("-", "_")] = parse_option_value(value.strip())
    return options


_NOT_DRAFTERS = {"base", "draft_vocab"}


def _import_builtin() -> None:
    """Import every drafter module of this package (each registers itself): adding a drafter is
    adding its file."""
    import importlib
    import pkgutil

    import specserve.drafters as package

    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg and info.name not in _NOT_DRAFTERS and not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
