"""The draft policy protocol: what the scheduler asks (`allocate`) and tells (`observe`).

A policy sees candidates (decoding sequences with a drafter, each with its cap) and the step's
room, and returns each candidate's draft-tree node budget; after the step it is told what came of
it in one `StepReport` (budgets granted, each drafter's call, each verified tree, the step's
seconds, the sequences that left). It keeps whatever state it needs keyed by `seq_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

BUDGET_SIZES = (0, 1, 2, 4, 8, 16, 32)   # node budgets a policy picks from (one CUDA graph per size)


def budget_sizes(max_per_seq: int) -> list[int]:
    """BUDGET_SIZES below `max_per_seq`, and the maximum itself."""
    if max_per_seq <= 0:
        return [0]
    return sorted({s for s in BUDGET_SIZES if s < max_per_seq} | {max_per_seq})


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that may draft this step."""

    seq_id: int
    drafter: str
    cap: int                      # most nodes it may take: num_speculative_tokens, tokens left, context room
    context: int | None = None    # what its drafter tells of its next tree (`Drafter.context_of`)


@dataclass(frozen=True)
class StepCaps:
    """The room of a step for drafts."""

    max_total: int          # draft nodes for all candidates together
    base_tokens: int = 0    # tokens the step carries without drafts (decode tokens, prefill chunks)
    base_commits: int = 0   # tokens it commits without drafts (one per decode or finishing prompt)
    decode_rows: int = 0    # sequences that decode in the steps after this one


@dataclass
class DraftCall:
    """One drafter's `propose` call: its sequences, their budgets, the nodes that came back (0: no tree)."""

    drafter: str
    seq_ids: list[int]
    budgets: list[int]
    nodes: list[int]
    seconds: float


@dataclass
class TreeOutcome:
    """A verified tree: `accepted` of its draft tokens stayed (verification stops at the first
    rejected depth, so depths 1..accepted were accepted and depth accepted + 1 rejected, if any)."""

    seq: Any                # the engine's Sequence (seq_id, drafter)
    nodes: int
    depth: int
    accepted: int
    verify: Any = None      # the engine's VerifyResult, for the drafter's `accept`

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


@dataclass
class StepReport:
    """What one engine step did, for the draft policy and the drafters."""

    granted: dict[int, int] = field(default_factory=dict)   # candidate seq_id -> nodes it got (0: none)
    drafts: list[DraftCall] = field(default_factory=list)
    outcomes: list[TreeOutcome] = field(default_factory=list)
    num_tokens: int = 0        # tokens the step's forward carried, draft nodes included
    num_trees: int = 0
    seconds: float = 0.0       # forward + verification + commit (not drafting); 0 when not timed
    ahead_seconds: float = 0.0  # of which launching the next step ahead (async scheduling): left out of `seconds`
    finished: list[int] = field(default_factory=list)       # seq_ids that left since the last report


class DraftPolicy(Protocol):
    # optional class attributes: `reads_contexts` (the scheduler asks drafters' contexts) and
    # `chooses_drafters` (a sequence with several drafters comes as one candidate per drafter, all
    # with its seq_id; else as one candidate, its first drafter)

    def allocate(self, candidates: list[Candidate], caps: StepCaps) -> list[int]:
        """Each candidate's node budget this step, in order: one of `budget_sizes`, at most its cap,
        at most `caps.max_total` in all; of the candidates sharing a seq_id, one at most above 0."""

    def observe(self, report: StepReport) -> None:
        """What came of the last allocation."""
