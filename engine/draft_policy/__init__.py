"""Draft policies: how many draft-tree nodes each decoding sequence gets in a step.

The scheduler gathers the candidates (decoding sequences with a drafter, each with its cap) and
the step's room, calls `allocate`, and after the step passes one `StepReport` to `observe`. Three
implementations: "fixed" and "adaptive" (`fixed.py`) and "goodput", the default (`goodput.py`).
docs/draft-policy.md has the maths.
"""

from specserve.engine.draft_policy.base import (BUDGET_SIZES, Candidate, DraftCall, DraftPolicy, StepCaps,
                                                StepReport, TreeOutcome, budget_sizes)
from specserve.engine.draft_policy.fixed import AdaptivePolicy, FixedPolicy
from specserve.engine.draft_policy.goodput import GoodputPolicy

POLICIES = {"goodput": GoodputPolicy, "adaptive": AdaptivePolicy, "fixed": FixedPolicy}


def make_policy(name: str, max_per_seq: int, max_step_tokens: int) -> DraftPolicy:
    """The policy called `name` (one of POLICIES) for `max_per_seq` nodes per sequence and steps of
    at most `max_step_tokens` tokens."""
    if name not in POLICIES:
        raise ValueError(f"draft_budget must be one of {', '.join(POLICIES)}, got {name!r}")
    if name == "goodput":
        return GoodputPolicy(max_per_seq, max_step_tokens)
    return POLICIES[name](max_per_seq)


__all__ = ["BUDGET_SIZES", "POLICIES", "AdaptivePolicy", "Candidate", "DraftCall", "DraftPolicy", "FixedPolicy",
           "GoodputPolicy", "StepCaps", "StepReport", "TreeOutcome", "budget_sizes", "make_policy"]
