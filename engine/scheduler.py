"""Continuous batching policy, pure Python (no torch).

Each step gets a token budget shared by running sequences (decode tokens and the next chunk of
prompts still being prefilled) and newly admitted ones. Running sequences go first, oldest first;
when the KV pool cannot hold a running sequence's next tokens the most recently admitted sequence
is preempted (its blocks freed, recomputed later from its tokens). Waiting sequences are admitted
in arrival order while the budget, the sequence cap and the free blocks allow.

Speculation budget: a decoding sequence with a drafter may add up to `max_draft_per_seq` draft-tree
nodes, all such sequences together at most `max_draft_tokens_per_step` (and what the step's token
budget leaves once the running sequences' own tokens and the prompts admitted this step are in:
prefill goes before drafts). Within these caps the `draft_budget` policy picks each sequence's budget:

* "goodput" (the engine's default): `engine/budget.py` chooses every sequence's budget from a fixed
  set of sizes (0 included) to maximise the expected committed tokens per second of the whole batch,
  from measured acceptance (per drafter, per sequence) and a measured cost model of a step and of
  each drafter. It stops drafting where drafting does not pay (many sequences on a CPU) and keeps
  drafting where it does (batch 1, good acceptance). It needs the engine's observations:
  `observe_step`, `observe_draft`, `observe_acceptance`, and `calibrate` at start-up.
* "fixed": the per-step cap split evenly, at most `max_draft_per_seq` each. As the batch grows each
  tree shrinks, down to plain decoding.
* "adaptive": "fixed", with each sequence's draft length following its acceptance (below).

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
from typing import Callable, Iterator

from specserve.engine.budget import GoodputBudget
from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence, SeqStatus

MAX_DRAFT_PAUSE = 32   # steps without a draft, at most, after repeated misses at one node
DRAFT_BUDGETS = ("goodput", "adaptive", "fixed")


def draft_length(seq, per_seq: int) -> int:
    """The draft nodes `seq` asks for under the fixed and adaptive budgets, before its caps: 0 while
    its back-off pauses it (counting the pause down), else `per_seq` within its own limit."""
    if seq.draft_pause > 0:
        seq.draft_pause -= 1
        return 0
    return per_seq if seq.draft_limit is None else min(per_seq, seq.draft_limit)


def adapt_draft_length(seq, max_per_seq: int, num_accepted: int, drafted_depth: int) -> None:
    """The adaptive rule (module docstring) after a verification of `seq`'s tree, `drafted_depth`
    deep, that accepted `num_accepted` draft tokens."""
    limit = max_per_seq if seq.draft_limit is None else seq.draft_limit
    if num_accepted >= drafted_depth:
        seq.draft_limit = min(max_per_seq, limit + 2)
    elif limit > 1:
        seq.draft_limit = limit - 1
    if num_accepted > 0:
        seq.draft_backoff = 0
    elif limit <= 1:
        seq.draft_backoff = min(MAX_DRAFT_PAUSE, max(2, 2 * seq.draft_backoff))
        seq.draft_pause = seq.draft_backoff


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
                 adaptive_draft_length: bool = False, draft_budget: str | None = None):
        """`draft_budget`: "goodput", "adaptive" or "fixed"; None = "adaptive" when
        `adaptive_draft_length`, else "fixed" (the older switch)."""
        if draft_budget is None:
            draft_budget = "adaptive" if adaptive_draft_length else "fixed"
        if draft_budget not in DRAFT_BUDGETS:
            raise ValueError(f"draft_budget must be one of {', '.join(DRAFT_BUDGETS)}, got {draft_budget!r}")
        self.draft_budget = draft_budget
        self.adaptive_draft_length = draft_budget == "adaptive"
        self.blocks = blocks
        self.budget: GoodputBudget | None = None
        if draft_budget == "goodput":
            self.budget = GoodputBudget(max_draft_per_seq, max(max_num_batched_tokens,
                                                               max_num_seqs + max_draft_tokens_per_step))
        # seq -> its drafter's context for its next tree (`Drafter.context_of`) or None; set by the engine
        self.context_of: Callable[[Sequence], int | None] | None = None
        self.engine_stats = None     # EngineStats / {drafter: DrafterStats} to count budgets in (`attach_stats`)
        self.drafter_stats: dict | None = None
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
        if self.budget is not None:
            self.budget.forget(seq)

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
        return self._seq_cap(seq, draft_length(seq, per_seq))

    def _seq_cap(self, seq: Sequence, left: int) -> int:
        """`left` capped by the tokens `seq` may still produce (one comes free as the bonus) and by
        its context's room."""
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - len(seq.token_ids) - 1)
        return max(0, left)

    # ---- what the engine observes (the goodput budget learns from it) ----------------------

    def attach_stats(self, engine_stats=None, drafter_stats: dict | None = None) -> None:
        """Count the budgets handed out in `drafter_stats[name]` (DrafterStats) and keep the cost
        model's estimates in `engine_stats` (EngineStats)."""
        self.engine_stats, self.drafter_stats = engine_stats, drafter_stats
        self._export_cost()

    def calibrate(self, profile_forward) -> dict[int, float]:
        """Goodput budget: time a few forwards (`profile_forward(num_tokens) -> seconds`) of up to
        the largest decode step's tokens to set the step cost curve. Returns {tokens: seconds}."""
        if self.budget is None:
            return {}
        largest = min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.max_draft_per_seq),
                      self.max_num_seqs + self.max_draft_tokens_per_step)
        points = self.budget.calibrate(profile_forward, largest)
        self._export_cost()
        return points

    def observe_step(self, num_tokens: int, seconds: float, num_trees: int = 0) -> None:
        """A step of `num_tokens` tokens (draft nodes included) verifying `num_trees` draft trees
        took `seconds` (target forward, verification, commit; not drafting)."""
        if self.budget is not None:
            self.budget.observe_step(num_tokens, seconds, num_trees)
            self._export_cost()

    def observe_draft(self, drafter: str, seqs: list[Sequence], budgets: list[int], nodes: list[int],
                      seconds: float) -> None:
        """`drafter` proposed for `seqs` (with these budgets) in `seconds`; nodes[i] draft nodes
        came back for seqs[i] (0: no tree)."""
        if self.budget is not None:
            self.budget.observe_draft(drafter, seqs, budgets, nodes, seconds)

    def _export_cost(self) -> None:
        if self.budget is not None and self.engine_stats is not None:
            estimates = self.budget.cost.estimates()
            self.engine_stats.step_cost_tokens = [n for n, _ in estimates]
            self.engine_stats.step_cost_seconds = [s for _, s in estimates]

    def observe_acceptance(self, seq: Sequence, num_accepted: int, drafted_depth: int) -> None:
        """A verification accepted `num_accepted` draft tokens of a tree `drafted_depth` deep."""
        if self.budget is not None:
            self.budget.observe_acceptance(seq, num_accepted, drafted_depth)
            return
        if self.adaptive_draft_length:
            adapt_draft_length(seq, self.max_draft_per_seq, num_accepted, drafted_depth)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        speculating = sum(1 for s in self.running if s.drafter is not None and s.num_uncomputed_tokens == 1)
        per_seq = 0
        goodput: dict[int, int] | None = None
        if speculating:
            left = self.max_num_batched_tokens - sum(n for _, n in self._running_tokens())
            admitted, admit_tokens = self._admissions(left)
            room = left - admit_tokens   # draft nodes come after this step's prefill
            if self.budget is not None:
                goodput = self._goodput_budgets(room, admitted, admit_tokens)
            else:
                per_seq = min(self.max_draft_per_seq, self.max_draft_tokens_per_step // speculating,
                              room // speculating)
        decoding: list[Sequence] = []   # decoding sequences with a drafter, as scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            try:
                drafts = seq.drafter is not None and seq.num_uncomputed_tokens == 1
                if not drafts:
                    draft = 0
                elif goodput is not None:
                    draft = goodput.get(seq.seq_id, 0)
                else:
                    draft = self._draft_budget(seq, per_seq)
                scheduled = self._schedule_running(batch, seq, budget, draft)
            except Exception as exc:   # this sequence alone is dropped (the engine fails its request)
                self._drop(batch, seq, exc)
                continue
            if scheduled is None:
                break
            if drafts:
                decoding.append(seq)
            budget -= scheduled
            i += 1
        if decoding:
            self._record_budgets(batch, decoding)

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

    def _running_tokens(self) -> Iterator[tuple[Sequence, int]]:
        """(sequence, its own tokens this step: a decode token, or its prompt's next chunk) for the
        running sequences the step's token budget reaches, in scheduling order."""
        left = self.max_num_batched_tokens
        for seq in self.running:
            n = min(seq.num_uncomputed_tokens, left)
            if n <= 0:
                break
            left -= n
            yield seq, n

    def _admissions(self, left: int) -> tuple[int, int]:
        """(sequences, tokens) the waiting queue would get this step out of `left` tokens, as
        `_admit` takes them (arrival order, the sequence cap, the free pool). Draft nodes are
        granted only from what is left after them: a draft displacing a new request's prefill
        delays its first token and the steps it would decode alongside the others, and a step
        that holds a prefill chunk commits so few tokens per second that any draft would look
        worth its cost there."""
        room, free = self.max_num_seqs - len(self.running), self.blocks.num_free_blocks
        count = tokens = 0
        for seq in self.waiting:
            if room <= 0 or tokens >= left:
                break
            need = self.blocks.blocks_needed(seq.seq_id, len(seq.token_ids) + 1)
            if need > free:
                break
            free -= need
            room -= 1
            count += 1
            tokens += seq.num_uncomputed_tokens
        return count, min(tokens, left)

    def _goodput_budgets(self, room: int, admitted: int, admit_tokens: int) -> dict[int, int]:
        """The goodput budget's choice for the decoding sequences of this step (seq_id -> nodes),
        with at most `room` draft nodes in all, in a step that also admits `admitted` waiting
        sequences (`admit_tokens` tokens of their prompts)."""
        base_tokens, base_commits = admit_tokens, 0
        candidates = []
        for seq, n in self._running_tokens():
            base_tokens += n
            base_commits += n == seq.num_uncomputed_tokens   # a decode, or a prompt's last chunk: one token
            if seq.drafter is not None and seq.num_uncomputed_tokens == 1:
                candidates.append((seq, self._seq_cap(seq, self.max_draft_per_seq)))
        max_total = max(0, min(self.max_draft_tokens_per_step, room))
        contexts = {}
        if self.context_of is not None and max_total > 0:
            for seq, cap in candidates:
                context = self.context_of(seq) if cap > 0 else None
                if context is not None:
                    contexts[seq.seq_id] = context
        return self.budget.allocate(candidates, base_tokens, base_commits, max_total, contexts,
                                    decode_rows=len(self.running) + admitted).budgets

    def _record_budgets(self, batch: ScheduledBatch, decoding: list[Sequence]) -> None:
        """Tell the goodput budget what each decoding sequence got; count the budgets per drafter."""
        granted = {seq.seq_id: d for seq, d in zip(batch.seqs, batch.draft_budgets)}
        for seq in decoding:
            if seq.seq_id not in granted:   # preempted after being scheduled
                continue
            draft = granted[seq.seq_id]
            if self.budget is not None:
                self.budget.record(seq, draft)
            if self.drafter_stats is not None and seq.drafter in self.drafter_stats:
                self.drafter_stats[seq.drafter].observe_budget(draft)

    def _schedule_running(self, batch: ScheduledBatch, seq: Sequence, budget: int, draft: int) -> int | None:
        """Put running `seq` in the batch (with a draft budget of `draft` nodes), preempting the newest
        sequences if the pool is short. Returns the step tokens it takes, or None when it was preempted
        itself (stop scheduling)."""
        n = min(seq.num_uncomputed_tokens, budget)
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
