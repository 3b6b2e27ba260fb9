"""The goodput budget as it was before this package (`engine/budget.py`), behind the policy
protocol, for an A/B run against its rewrite. Not in POLICIES."""

from __future__ import annotations

from types import SimpleNamespace

from specserve.engine.budget import GoodputBudget
from specserve.engine.draft_policy.base import Candidate, StepCaps, StepReport


class LegacyGoodput:
    reads_contexts = True   # the scheduler asks each drafter's context (`Drafter.context_of`)
    def __init__(self, max_per_seq: int, max_step_tokens: int):
        self.budget = GoodputBudget(max_per_seq, max_step_tokens)
        self.step_cost = self.budget.cost
        self._seqs: dict[int, SimpleNamespace] = {}

    def calibrate(self, profile_forward, max_tokens: int, **kwargs) -> dict[int, float]:
        return self.budget.calibrate(profile_forward, max_tokens, **kwargs)

    def _seq(self, seq_id: int, drafter: str | None = None) -> SimpleNamespace:
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = SimpleNamespace(seq_id=seq_id, drafter=drafter)
        return seq

    def allocate(self, candidates: list[Candidate], caps: StepCaps) -> list[int]:
        pairs = [(self._seq(c.seq_id, c.drafter), c.cap) for c in candidates]
        contexts = {c.seq_id: c.context for c in candidates if c.context is not None}
        budgets = self.budget.allocate(pairs, caps.base_tokens, caps.base_commits, caps.max_total, contexts,
                                       decode_rows=caps.decode_rows).budgets
        return [budgets[c.seq_id] for c in candidates]

    def observe(self, report: StepReport) -> None:
        for seq_id, granted in report.granted.items():
            self.budget.record(self._seq(seq_id), granted)
        for call in report.drafts:
            self.budget.observe_draft(call.drafter, [self._seq(i) for i in call.seq_ids], call.budgets,
                                      call.nodes, call.seconds)
        for out in report.outcomes:
            self.budget.observe_acceptance(self._seq(out.seq_id), out.accepted, out.depth)
        if report.seconds > 0:
            self.budget.observe_step(report.num_tokens, report.seconds, report.num_trees)
        for seq_id in report.finished:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                self.budget.forget(seq)
