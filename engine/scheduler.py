"""Continuous batching policy, pure Python (no torch).

Each step gets a token budget shared by running sequences (decode tokens and the next chunk of
prompts still being prefilled) and newly admitted ones. Running sequences go first, oldest first;
when the KV pool cannot hold a running sequence's next tokens the most recently admitted sequence
is preempted (its blocks freed, recomputed later from its tokens). Waiting sequences are admitted
in arrival order while the budget, the sequence cap and the free blocks allow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # new tokens per sequence this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
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

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            while not self.blocks.can_grow(seq.seq_id, target):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self.blocks.grow(seq.seq_id, target)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            # admit only when the whole known sequence fits the free pool, so admission does not thrash
            if self.blocks.blocks_needed(seq.seq_id, len(seq.token_ids) + 1) > self.blocks.num_free_blocks:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            self.blocks.grow(seq.seq_id, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch
