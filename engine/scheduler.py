"""Continuous batching policy, pure Python (no torch).

Each step gets a token budget shared by running sequences (decode tokens and the next chunk of
prompts still being prefilled) and newly admitted ones. Running sequences go first, oldest first;
when the KV pool cannot hold a running sequence's next tokens the most recently admitted sequence
is preempted (its blocks freed, recomputed later from its tokens). Waiting sequences are admitted
in arrival order while the budget, the sequence cap and the free blocks allow.

Speculation budget (adaptive): a decoding sequence with a drafter may add up to
`max_draft_per_seq` draft-tree nodes, but all such sequences together get at most
`max_draft_tokens_per_step`, split evenly. As the batch grows each tree shrinks, down to plain
decoding, so speculation never turns a loaded step into a much larger forward.

Draft length (adaptive, per sequence): a sequence whose drafts keep failing should not pay for
long ones. After each verification its cap grows by 2 nodes when the whole drafted path was
accepted and shrinks by 1 otherwise -- the dynamic rule of transformers' assisted generation,
applied to the node budget of a tree. A miss at 1 node pauses drafting for that sequence (plain
decoding) for 2, 4, 8, ... up to MAX_DRAFT_PAUSE steps, after which one node is tried again; an
accepted draft ends the back-off. So a drafter that cannot predict a sequence (a poor draft
model, a prompt with nothing to look up) costs it little more than plain decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence, SeqStatus

MAX_DRAFT_PAUSE = 32   # steps without a draft, at most, after repeated misses at one node


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # new tokens per sequence this step (tree root: 1)
    draft_budgets: list[int] = field(default_factory=list)  # max draft nodes per sequence (0 = none)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)   # raised while being scheduled

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_draft_per_seq: int = 0, max_draft_tokens_per_step: int = 0, max_model_len: int | None = None,
                 adaptive_draft_length: bool = False):
        self.blocks = blocks
        self.adaptive_draft_length = adaptive_draft_length
        self.max_draft_per_seq = max_draft_per_seq
        self.max_draft_tokens_per_step = max_draft_tokens_per_step
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: drop it from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _draft_budget(self, seq: Sequence, per_seq: int) -> int:
        """Draft nodes worth proposing for a decoding sequence: no more than the tokens it may
        still produce (one comes free as the bonus) and than its context has room for."""
        if seq.drafter is None or per_seq <= 0:
            return 0
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            return 0
        left = per_seq if seq.draft_limit is None else min(per_seq, seq.draft_limit)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - len(seq.token_ids) - 1)
        return max(0, left)

    def observe_acceptance(self, seq: Sequence, num_accepted: int, drafted_depth: int) -> None:
        """A verification accepted `num_accepted` draft tokens of a tree `drafted_depth` deep."""
        if not self.adaptive_draft_length:
            return
        limit = self.max_draft_per_seq if seq.draft_limit is None else seq.draft_limit
        if num_accepted >= drafted_depth:
            seq.draft_limit = min(self.max_draft_per_seq, limit + 2)
        elif limit > 1:
            seq.draft_limit = limit - 1
        if num_accepted > 0:
            seq.draft_backoff = 0
        elif limit <= 1:
            seq.draft_backoff = min(MAX_DRAFT_PAUSE, max(2, 2 * seq.draft_backoff))
            seq.draft_pause = seq.draft_backoff

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        speculating = sum(1 for s in self.running if s.drafter is not None and s.num_uncomputed_tokens == 1)
        per_seq = 0
        if speculating:
            per_seq = min(self.max_draft_per_seq, self.max_draft_tokens_per_step // speculating,
                          max(0, budget - len(self.running)) // speculating)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            try:
                scheduled = self._schedule_running(batch, seq, budget, per_seq)
            except Exception as exc:   # this sequence alone is dropped (the engine fails its request)
                self._drop(batch, seq, exc)
                continue
            if scheduled is None:
                break
            budget -= scheduled
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            try:
                scheduled = self._admit(batch, seq, budget)
            except Exception as exc:
                self._drop(batch, seq, exc)
                continue
            if scheduled is None:
                break
            budget -= scheduled
        return batch

    def _schedule_running(self, batch: ScheduledBatch, seq: Sequence, budget: int, per_seq: int) -> int | None:
        """Put running `seq` in the batch, preempting the newest sequences if the pool is short.
        Returns the step tokens it takes, or None when it was preempted itself (stop scheduling)."""
        n = min(seq.num_uncomputed_tokens, budget)
        draft = self._draft_budget(seq, per_seq) if seq.num_uncomputed_tokens == 1 else 0
        if draft and not self.blocks.can_grow(seq.seq_id, seq.num_computed_tokens + 1 + draft):
            draft = 0   # the pool is short: decode plainly rather than preempt for a draft
        target = seq.num_computed_tokens + n + draft
        while not self.blocks.can_grow(seq.seq_id, target):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                break
        if seq.status is not SeqStatus.RUNNING:
            return None
        self.blocks.grow(seq.seq_id, target)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.draft_budgets.append(draft)
        return n + draft

    def _admit(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int | None:
        """Move the first waiting `seq` into the batch; None when the free pool cannot hold it yet."""
        # admit only when the whole known sequence fits the free pool, so admission does not thrash
        if self.blocks.blocks_needed(seq.seq_id, len(seq.token_ids) + 1) > self.blocks.num_free_blocks:
            return None
        n = min(seq.num_uncomputed_tokens, budget)
        self.blocks.grow(seq.seq_id, seq.num_computed_tokens + n)
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.draft_budgets.append(0)
        return n

    def _drop(self, batch: ScheduledBatch, seq: Sequence, exc: Exception) -> None:
        """Scheduling `seq` raised: take it out of the queues and of the batch, free its blocks."""
        for k, other in enumerate(batch.seqs):
            if other is seq:
                del batch.seqs[k], batch.num_tokens[k], batch.draft_budgets[k]
                break
        self.remove(seq)
        batch.failed.append((seq, exc))
