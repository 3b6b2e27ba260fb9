"""The drafter protocol and the registry.

A drafter proposes one draft tree per running sequence, in one batched call for the batch.
The engine never branches on drafter names: it looks drafters up here by name and calls the four
hooks below. A drafter that raises or returns a malformed tree does not fail any request: the
engine falls back to plain decoding for those sequences for that step and counts the error.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence as Seq

import torch

import specserve.drafters as drafters_package
from specserve.engine.sequence import DraftRequest  # noqa: F401  (re-exported for drafters)
from specserve.engine.tree import TokenTree
from specserve.engine.verify import VerifyResult


class Drafter(ABC):
    """Hooks, in call order for a sequence: start, (propose, observe?, accept)*, finish.

    `seq` objects are `DraftRequest` views the engine builds for each call (never its own
    sequences): `seq.seq_id`, `seq.token_ids` (prompt + output, the last one being the tree
    root; possibly followed by `seq.hypothetical` tokens when asked to draft from an extended
    prefix), `seq.params`, `seq.sample_key`, `seq.options` (the request's own options),
    `seq.extra_roots`. Budgets are the maximum number of draft nodes (root excluded) the scheduler
    allows for each sequence this step; 0 means "no draft".

    A drafter is one file in this package: a `Drafter` subclass decorated with `@register(name)`
    whose constructor is `__init__(self, ctx: DrafterContext, *, option=default, ...)`. The
    keyword parameters are its options (`--drafter-option name.option=value`), validated by
    `make_drafter`; `request_options` names those a request may also set.

    `model_runs()` (optional) reports the networks a drafter runs, for Cascade Speculative
    Drafting's standardized walltime improvement (SWI = tokens / (target forwards + sum of runs x
    c)): cumulative `{model name: (runs, c)}`, runs counted once per sequence served by a forward
    (a batched forward over B sequences counts B, as a batch-1 measurement would), c the parameters
    that forward uses over the target's. The default `{}` is a drafter running no network (ngram, mag)."""

    name: str = "base"
    needs_features: bool = False   # True: the engine calls `observe` with the target's hidden states
    # with needs_features: intermediate layers whose hidden states the feature store also keeps
    # (k = the residual stream after k decoder layers, 0 = the embeddings; EAGLE-3 style drafters
    # fuse e.g. (2, L // 2, L - 3)); read with `ctx.features.view(seq_id, lo, hi, layer=k)`
    capture_layers: tuple[int, ...] = ()
    # composite drafters: the parts whose names their trees' `sources` index (TokenTree.source_names);
    # per-part draft/accepted counts are kept in stats, responses and /metrics, from zero for these
    part_names: tuple[str, ...] = ()
    # True: it drafts correctly from an extended prefix (`seq.hypothetical`, tokens not yet committed)
    # and keeps no state of such a draft, so the engine may ask it for the tree after a grammar's
    # forced tokens and graft it there (told nothing in `accept` of such a tree)
    drafts_after_uncommitted: bool = False
    # option names a request may set in its `speculative` block (handed on as `seq.options`)
    request_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_request_options(cls, options: dict) -> dict:
        """A request's options, validated: an undeclared key raises DrafterOptionError (the server
        answers 400 naming `speculative.<key>`); override to check values too (raise ValueError)."""
        for key in options:
            if key not in cls.request_options:
                raise DrafterOptionError(unknown_option_message(f"drafter {cls.name!r} (per request)", key,
                                                                cls.request_options))
        return dict(options)

    def __init__(self, ctx: DrafterContext | None = None) -> None:
        """`ctx`: the engine's `DrafterContext`; a drafter's own options follow it as keywords."""

    def start(self, seq) -> None:
        """A sequence joins (after its prompt is known)."""

    @abstractmethod
    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        """One tree per sequence rooted at seq.token_ids[-1], at most budgets[i] draft nodes,
        or None for no draft."""

    def context_of(self, seq) -> int | None:
        """What `seq`'s next tree will be like, told before drafting, cheaply: a small integer naming
        a class of contexts (not a score), or None (the default) when the drafter cannot tell. The
        goodput budget learns acceptance per (drafter, context) and sizes each tree by its context's
        record: an n-gram drafter tells the length of the recurring suffix it will copy from (0: no
        match, so no tree), and a 4-token match is accepted 2-5 tokens deep where a 1-token match
        is accepted 0.3-0.6 (the shared benchmark prompts, SmolLM2-135M, greedy). Called every step
        for every decoding sequence whose budget is chosen, so it must cost far less than
        `propose`; never for an extended prefix."""
        return None

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

    def model_runs(self) -> dict[str, tuple[int, float]]:
        """Cumulative `{model name: (forward runs, cost ratio c)}` of the networks this drafter runs
        (see the class docstring); {} for a drafter that runs none."""
        return {}


def param_count(*modules) -> int:
    """Parameters of `modules` (each tensor once, even when shared between them)."""
    seen: dict[int, int] = {}
    for m in modules:
        if m is None:
            continue
        params = [m] if hasattr(m, "numel") and not hasattr(m, "parameters") else m.parameters()
        for p in params:
            seen[id(p)] = p.numel()
    return sum(seen.values())


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}

# the engine's context, as keyword names: what `make_drafter` takes apart from the drafter's options
CONTEXT_FIELDS = ("tokenizer", "target", "model_config", "device", "dtype", "max_model_len", "max_num_seqs",
                  "features")


@dataclass(frozen=True)
class DrafterContext:
    """What the engine hands every drafter at construction, apart from the drafter's own options.

    `target` is the target `LlamaModel` (its embedding and LM head are shared by reference, never
    copied); `model_config` its `ModelConfig`; `max_model_len` / `max_num_seqs` size a drafter's
    own state (e.g. its paged KV); `features` the engine's feature store of the target's hidden
    states (None where the engine keeps none)."""

    tokenizer: Any = None
    target: Any = None
    model_config: Any = None
    device: Any = "cpu"
    dtype: Any = None
    max_model_len: int = 2048
    max_num_seqs: int = 8
    features: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        if self.dtype is None:
            object.__setattr__(self, "dtype", torch.float32)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.model_config, "vocab_size", 0) or 0)


class DrafterOptionError(ValueError):
    """An option a drafter does not declare (a start-up error naming the valid ones)."""


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory
    return wrap


def available_drafters() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def drafter_class(name: str) -> DrafterFactory:
    _import_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def drafter_options(factory) -> dict[str, Any]:
    """The options a drafter declares: its constructor's keyword parameters (context names and
    `ctx` excluded) -> default (`inspect.Parameter.empty` when required). A subclass constructor
    that forwards `**kwargs` to its parent's also takes the parent's options."""
    inits = [factory]
    if isinstance(factory, type):
        inits = [c.__dict__["__init__"] for c in factory.__mro__
                 if "__init__" in c.__dict__ and c not in (Drafter, object)] or [factory]
    out: dict[str, Any] = {}
    for init in inits:
        forwards = False
        for i, p in enumerate(inspect.signature(init).parameters.values()):
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.kind is p.VAR_POSITIONAL or p.name in ("self", "ctx") or p.name in CONTEXT_FIELDS:
                continue
            else:
                out.setdefault(p.name, p.default)
        if not forwards or init is factory:
            break
    return out


def unknown_option_message(what: str, key: str, valid: Seq[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    names = ", ".join(sorted(valid)) or "none"
    return f"{what} has no option {key!r}{hint}; valid options: {names}"


def check_options(name: str, factory, options: dict) -> None:
    """Raise DrafterOptionError for the first option `factory` does not declare."""
    valid = drafter_options(factory)
    for key in options:
        if key not in valid:
            raise DrafterOptionError(unknown_option_message(f"drafter {name!r}", key, valid))


def make_drafter(name: str, ctx: DrafterContext | None = None, /, **kwargs) -> Drafter:
    """Build a registered drafter from the engine's context and the drafter's own options.

    `kwargs` are options, plus (for callers without a `DrafterContext`) context fields by name
    (`tokenizer=`, `target=`, ...). An option the drafter does not declare raises
    DrafterOptionError naming the valid ones. A drafter constructor takes `ctx` first and its
    options as keywords (`__init__(self, ctx, *, max_ngram=4)`)."""
    factory = drafter_class(name)
    context = {k: kwargs.pop(k) for k in CONTEXT_FIELDS if k in kwargs}
    if ctx is None:
        ctx = DrafterContext(**context)
    elif context:
        ctx = replace(ctx, **context)
    check_options(name, factory, kwargs)
    return factory(ctx, **kwargs)


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


_NOT_DRAFTERS = {"auto", "base", "draft_vocab", "features"}


def _import_builtin() -> None:
    """Import every drafter module of this package (each registers itself): adding a drafter is
    adding its file."""
    for info in pkgutil.iter_modules(drafters_package.__path__):
        if not info.ispkg and info.name not in _NOT_DRAFTERS and not info.name.startswith("_"):
            importlib.import_module(f"{drafters_package.__name__}.{info.name}")
