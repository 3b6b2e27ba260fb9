"""The fixed and adaptive draft policies.

* fixed: the step's room split evenly, at most `max_per_seq` each. As the batch grows each tree
  shrinks, down to plain decoding.
* adaptive: fixed, with each sequence's length following its acceptance -- the dynamic rule of
  transformers' assisted generation applied to the node budget of a tree: after each
  verification its limit grows by 2 nodes when the whole drafted path was accepted and shrinks by
  1 otherwise. A miss at 1 node pauses drafting for that sequence for 2, 4, 8, ... up to
  MAX_DRAFT_PAUSE of the policy's decisions, after which one node is tried again; an accepted draft
  ends the back-off.
  So a drafter that cannot predict a sequence costs it little more than plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.draft_policy.base import Candidate, StepCaps, StepReport

MAX_DRAFT_PAUSE = 32   # decisions without a draft, at most, after repeated misses at one node


class FixedPolicy:
    def __init__(self, max_per_seq: int):
        self.max_per_seq = max_per_seq

    def allocate(self, candidates: list[Candidate], caps: StepCaps) -> list[int]:
        if not candidates:
            return []
        per_seq = min(self.max_per_seq, max(0, caps.max_total) // len(candidates))
        return [self._size(c, per_seq) if per_seq > 0 else 0 for c in candidates]

    def _size(self, c: Candidate, per_seq: int) -> int:
        return max(0, min(c.cap, per_seq))

    def observe(self, report: StepReport) -> None:
        pass


@dataclass
class _Length:
    limit: int | None = None   # its own node cap; None = the maximum
    pause: int = 0             # steps left without a draft
    backoff: int = 0           # length of the last pause


class AdaptivePolicy(FixedPolicy):
    def __init__(self, max_per_seq: int):
        super().__init__(max_per_seq)
        self.seqs: dict[int, _Length] = {}

    def _size(self, c: Candidate, per_seq: int) -> int:
        st = self.seqs.setdefault(c.seq_id, _Length())
        if st.pause > 0:
            st.pause -= 1
            return 0
        return max(0, min(c.cap, per_seq if st.limit is None else min(per_seq, st.limit)))

    def limit(self, seq_id: int) -> int:
        """The node cap sequence `seq_id` has now (before the step's room)."""
        st = self.seqs.get(seq_id)
        return self.max_per_seq if st is None or st.limit is None else st.limit

    def observe(self, report: StepReport) -> None:
        for out in report.outcomes:
            st = self.seqs.setdefault(out.seq_id, _Length())
            limit = self.max_per_seq if st.limit is None else st.limit
            if out.accepted >= out.depth:
                st.limit = min(self.max_per_seq, limit + 2)
            elif limit > 1:
                st.limit = limit - 1
            if out.accepted > 0:
                st.backoff = 0
            elif limit <= 1:
                st.backoff = min(MAX_DRAFT_PAUSE, max(2, 2 * st.backoff))
                st.pause = st.backoff
        for seq_id in report.finished:
            self.seqs.pop(seq_id, None)
