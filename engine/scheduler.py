"""Continuous batching policy, pure Python (no torch).

Each step gets a token budget shared by running sequences (decode tokens and the next chunk of
prompts still being prefilled) and newly admitted ones. Running sequences go first, oldest first;
when the KV pool cannot hold a running sequence's next tokens the most recently admitted sequence
is preempted (its blocks freed, recomputed later from its tokens). Waiting sequences are admitted
in arrival order while the budget, the sequence cap and the free blocks allow.

Speculation budget: a decoding sequence with a drafter may add up to `max_draft_per_seq` draft-tree
nodes, all such sequences together at most `max_draft_tokens_per_step` (and what the step's token
budget leaves once the running sequences' own tokens and the prompts admitted this step are in:
prefill goes before drafts). Within these caps the draft policy (`engine/draft_policy/`: goodput,
adaptive or fixed) picks each sequence's budget: the scheduler calls its `allocate` while
scheduling and its `observe` with the step's `StepReport`, and nothing else of it.

After a step, `postprocess` applies what the runner computed: sequence lengths, and blocks
reserved for draft nodes that did not stay go back to the pool. The scheduler is the one owner of
that state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence as Seq

if TYPE_CHECKING:
    from specserve.engine.model_runner import StepResult

from specserve.engine.draft_policy import Candidate, DraftPolicy, StepCaps, StepReport, make_policy
from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # new tokens per sequence this step (tree root: 1)
    draft_budgets: list[int] = field(default_factory=list)  # max draft nodes per sequence (0 = none)
    granted: dict[int, int] = field(default_factory=dict)   # decoding seq_id -> draft nodes it got (0 = none)
    # of those, the seq_ids drafting their grammar's forced tokens -> how many (the first nodes of their
    # tree: the grammar's chain, then, within the budget, their drafter's tree after it)
    forced: dict[int, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)   # raised while being scheduled

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


# after the k-th decision in a row that grants drafter sequences nothing, the policy is not asked for
# the next min(2^(k-1), MAX_QUIET_STEPS) steps (`Scheduler._decided`)
MAX_QUIET_STEPS = 8


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_draft_per_seq: int = 0, max_draft_tokens_per_step: int = 0, max_model_len: int | None = None,
                 draft_budget: str | DraftPolicy = "fixed", grammar_drafts: bool = True):
        """`draft_budget`: a policy's name ("goodput", "adaptive", "fixed") or a policy;
        `grammar_drafts`: draft the tokens a sequence's grammar forces (EngineConfig.grammar_drafts)."""
        if isinstance(draft_budget, str):
            draft_budget = make_policy(draft_budget, max_draft_per_seq,
                                       max(max_num_batched_tokens, max_num_seqs + max_draft_tokens_per_step))
        self.policy: DraftPolicy = draft_budget
        self.blocks = blocks
        # (seq, drafters) -> {drafter: its context for the sequence's next tree} (`Drafter.context_of`;
        # a drafter that tells none left out); set by the engine, asked only for a policy that reads contexts
        self.context_of: Callable[[Sequence, Seq[str]], dict[str, int]] | None = None
        # the drafters that can draft after a grammar's forced tokens (tokens not yet committed:
        # `Drafter.drafts_after_uncommitted`); set by the engine
        self.drafts_after: frozenset[str] = frozenset()
        self.max_draft_per_seq = max_draft_per_seq
        self.grammar_drafts = grammar_drafts
        self.max_draft_tokens_per_step = max_draft_tokens_per_step
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._left: list[int] = []   # seq_ids removed since the last report
        self._quiet = 0         # the policy's decisions in a row that granted drafter sequences nothing
        self._quiet_steps = 0   # steps they may still decode without asking it again (`ride_along`)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a decode step can hold (the goodput policy's calibration range)."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.max_draft_per_seq),
                   self.max_num_seqs + self.max_draft_tokens_per_step)

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
        self._left.append(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _seq_cap(self, seq: Sequence, left: int) -> int:
        """`left` capped by the tokens `seq` may still produce (one comes free as the bonus) and by
        its context's room."""
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - len(seq.token_ids) - 1)
        return max(0, left)

    # ---- after a step ---------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, result: "StepResult") -> None:
        """Apply a step's outcome: each sequence's computed length (`result.num_computed`, per
        batch entry); blocks reserved for tree nodes that did not stay, or for a draft that did
        not come, return to the pool."""
        verified = {id(r.seq) for r in result.results if r.tree is not None}
        for seq, n, draft in zip(batch.seqs, result.num_computed, batch.draft_budgets):
            seq.num_computed_tokens = n
            if id(seq) in verified:
                self.blocks.shrink(seq.seq_id, n)
            elif draft:
                self.blocks.shrink(seq.seq_id, n + 1)

    def observe(self, report: StepReport) -> None:
        """Tell the draft policy what came of its allocation (and which sequences left)."""
        report.finished, self._left = self._left, []
        self.policy.observe(report)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        drafts: dict[int, int] = {}
        forced: dict[int, int] = {}
        deciding = [s for s in self.running
                    if (s.drafter is not None or s.grammar is not None) and s.num_uncomputed_tokens == 1]
        # the policy is asked every step while a decoding sequence has a grammar, at each such
        # sequence's first decode, and otherwise unless its sequences ride along (`_decided`)
        if deciding and (any(s.grammar is not None or s.num_output_tokens <= 1 for s in deciding)
                         or not self.ride_along()):
            drafts, forced = self._allocate()
            self._decided(any(drafts.values()))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            try:
                scheduled = self._schedule_running(batch, seq, budget, drafts.get(seq.seq_id, 0))
            except Exception as exc:   # this sequence alone is dropped (the engine fails its request)
                self._drop(batch, seq, exc)
                continue
            if scheduled is None:
                break
            if seq.seq_id in drafts:
                batch.granted[seq.seq_id] = batch.draft_budgets[-1]
                if seq.seq_id in forced:
                    batch.forced[seq.seq_id] = min(forced[seq.seq_id], batch.draft_budgets[-1])
            budget -= scheduled
            i += 1
        for seq in batch.preempted:   # preempted after being scheduled
            batch.granted.pop(seq.seq_id, None)

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

    def _decided(self, granted: bool) -> None:
        """After the k-th decision in a row that granted nothing, drafter sequences decode the next
        min(2^(k-1), MAX_QUIET_STEPS) steps without asking the policy (`ride_along`); a grant
        starts the count over. So a crowd the policy keeps from drafting pays for its decisions
        on one step in MAX_QUIET_STEPS + 1 at most, and the policy still looks that often, and at
        each sequence's first decode."""
        if granted:
            self._quiet = self._quiet_steps = 0
        else:
            self._quiet = min(self._quiet + 1, MAX_QUIET_STEPS.bit_length())
            self._quiet_steps = min(1 << (self._quiet - 1), MAX_QUIET_STEPS)

    def ride_along(self) -> bool:
        """Whether the next step's drafter sequences decode without asking the policy (`_decided`);
        a step that does uses one of the steps left. The engine asks too for a step it launches
        ahead (async scheduling), so that both kinds of step count alike."""
        if self._quiet_steps <= 0:
            return False
        self._quiet_steps -= 1
        return True

    def _allocate(self) -> tuple[dict[int, int], dict[int, int]]:
        """The draft budgets of the decoding sequences (seq_id -> nodes), and how many of them are
        their grammar's forced tokens (granted first, outside the policy); the draft policy's for
        those with a drafter, with what the step's token budget leaves after the running sequences'
        own tokens, the prompts admitted this step and the forced tokens. A sequence with forced
        tokens is a candidate too, for the nodes after them, with the drafters that can draft after
        tokens not yet committed (`drafts_after`); its budget is both together."""
        left = self.max_num_batched_tokens - sum(n for _, n in self._running_tokens())
        admitted, admit_tokens = self._admissions(left)
        room = left - admit_tokens   # draft nodes come after this step's prefill
        base_tokens, base_commits = admit_tokens, 0
        decoding = []
        forced: dict[int, int] = {}   # sequences whose grammar forces tokens: drafted for free, no policy
        spare = max(0, min(self.max_draft_tokens_per_step, room))
        for seq, n in self._running_tokens():
            base_tokens += n
            base_commits += n == seq.num_uncomputed_tokens   # a decode, or a prompt's last chunk: one token
            if seq.num_uncomputed_tokens != 1:
                continue
            if self.grammar_drafts and seq.grammar is not None and seq.grammar.forced():
                forced[seq.seq_id] = min(len(seq.grammar.forced()), self._seq_cap(seq, self.max_draft_per_seq), spare)
                spare -= forced[seq.seq_id]
                if any(name in self.drafts_after for name in seq.drafters):
                    decoding.append(seq)
            elif seq.drafter is not None:
                decoding.append(seq)
        room -= sum(forced.values())
        caps = StepCaps(max(0, min(self.max_draft_tokens_per_step, room)), base_tokens + sum(forced.values()),
                        base_commits, len(self.running) + admitted)
        ask = self.context_of is not None and caps.max_total > 0 and getattr(self.policy, "reads_contexts", False)
        choose = getattr(self.policy, "chooses_drafters", False)
        candidates, seqs = [], []
        for seq in decoding:
            cap = self._seq_cap(seq, self.max_draft_per_seq)
            names = seq.drafters if choose else seq.drafters[:1]
            if seq.seq_id in forced:   # after the forced tokens; its context would be of the committed prefix
                cap -= forced[seq.seq_id]
                names = [name for name in names if name in self.drafts_after]
            contexts = self.context_of(seq, names) if ask and cap > 0 and seq.seq_id not in forced else {}
            for name in names:
                candidates.append(Candidate(seq.seq_id, name, cap, contexts.get(name)))
                seqs.append(seq)
        sizes = self.policy.allocate(candidates, caps)
        budgets: dict[int, int] = {}
        for seq, c, size in zip(seqs, candidates, sizes):
            if size > 0 or seq.seq_id not in budgets:   # the drafter that got the budget drafts this step
                budgets[seq.seq_id] = size
                seq.drafter = c.drafter
        for seq_id, k in forced.items():
            budgets[seq_id] = k + budgets.get(seq_id, 0)
        return budgets, forced

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
