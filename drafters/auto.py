"""`--drafter auto` (the server's default): the drafters worth loading for a target.

* The lookup drafters, always: `ngram` (prompt lookup) and `mag` (Max-Gram with a bigram fallback)
  need no training, fit every target and cost microseconds when they find nothing.
* Of the trained drafters whose shipped checkpoint fits the target (the same fingerprint, see
  `nets.checkpoint.target_fingerprint`), the one with the best held-back τ (tokens per target
  forward, recorded in its meta.json at training), if it is at least MIN_TAU: below it a drafter's
  network costs about what it saves. On the default model that is eagle3 (τ 3.39; then eagle
  2.05, parallelspec 1.92, medusa 1.61, ctc 1.52, student 1.39, falcon 1.25). For any other
  target, only the lookups.

One trained drafter, not every one above MIN_TAU: each drafter a sequence may choose from is one
more the goodput policy must keep trying, and trying costs steps. In its simulation (a drafter
never right, 600 steps of one sequence, a CPU-like step cost, tests/unit/engine) the policy keeps
0.967x plain decoding's rate with one drafter, 0.951x with three, 0.936x with five; on the default
model served on a 2-core CPU, five (eagle, parallelspec, medusa, ngram, mag) gave 0.86-0.91x plain
at batch 1, where each of them alone keeps about 1.0x (2026-11-27).

The trained drafter comes first, then the lookups: a draft policy that does not choose among a
sequence's drafters (fixed, adaptive) uses the first. The goodput policy chooses every step, per
sequence, the one that pays most, or none (engine/draft_policy/goodput.py, idea 4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specserve.drafters.base import available_drafters
from specserve.drafters.nets.checkpoint import find_shipped, target_fingerprint

LOOKUP_DRAFTERS = ("ngram", "mag")
MIN_TAU = 1.5
MAX_TRAINED = 1


@dataclass(frozen=True)
class AutoDrafter:
    name: str
    reason: str


def auto_drafters(model_config, target, root: str | os.PathLike | None = None) -> list[AutoDrafter]:
    """What `--drafter auto` loads for `target` (a LlamaModel and its config), and why; `root`: the
    folder of shipped checkpoints (default drafters/checkpoints/)."""
    registered = set(available_drafters())
    trained: dict[str, tuple[float, str]] = {}
    for meta, folder in find_shipped(None, target_fingerprint(model_config, target), root):
        if meta.kind not in registered or meta.tau is None or meta.tau < MIN_TAU:
            continue
        if meta.kind not in trained or meta.tau > trained[meta.kind][0]:
            trained[meta.kind] = (float(meta.tau), folder.name)
    best = sorted(trained.items(), key=lambda kv: -kv[1][0])[:MAX_TRAINED]
    out = [AutoDrafter(kind, f"shipped checkpoint {folder}/ fits this model, the best held-back tau: {tau:.2f} "
                             f">= {MIN_TAU}") for kind, (tau, folder) in best]
    return out + [AutoDrafter(name, "lookup drafter: no training, fits every model")
                  for name in LOOKUP_DRAFTERS if name in registered]


__all__ = ["LOOKUP_DRAFTERS", "MAX_TRAINED", "MIN_TAU", "AutoDrafter", "auto_drafters"]
