"""Scheduler policy on real Sequence objects (no model): budgets, chunked prefill, admission by
free blocks, the sequence cap, preemption; the draft policies as the scheduler calls them."""

from __future__ import annotations

import pytest

from specserve.engine.draft_policy import POLICIES, StepReport, TreeOutcome
from specserve.engine.kv_cache import BlockManager
from specserve.engine.outputs import RequestMetrics
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Request, Sequence, SeqStatus


def make_seq(prompt_len: int, rid: str = "r", max_tokens: int = 100) -> Sequence:
    req = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), RequestMetrics(0.0))
    seq = Sequence(req, 0, req.prompt_token_ids, detokenizer=None)
    req.seqs.append(seq)
    return seq


def run_step(sched: Scheduler, new_token: int = 7):
    """Apply a step the way the engine does: computed tokens advance; finished chunks sample one token."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(new_token)
    return batch


def test_chunked_prefill_under_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    long, short = make_seq(40, "a"), make_seq(5, "b")
    sched.add(long)
    sched.add(short)
    b1 = run_step(sched)
    assert [s.request.request_id for s in b1.seqs] == ["a"] and b1.num_tokens == [16]
    b2 = run_step(sched)
    assert b2.num_tokens == [16]
    b3 = run_step(sched)   # 8 left for a, the rest of the budget admits b
    assert [s.request.request_id for s in b3.seqs] == ["a", "b"] and b3.num_tokens == [8, 5]
    b4 = run_step(sched)   # both decode
    assert b4.num_tokens == [1, 1] and b4.total_tokens <= 16


def test_max_num_seqs_caps_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(3, str(i)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    b = run_step(sched)
    assert len(b.seqs) == 2 and len(sched.waiting) == 2
    sched.remove(seqs[0])
    b = run_step(sched)
    assert seqs[2] in b.seqs and len(sched.running) == 2


def test_admission_waits_for_free_blocks():
    bm = BlockManager(6, 4)   # 24 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(15, "a"), make_seq(10, "b")
    sched.add(a)
    sched.add(b)
    batch = run_step(sched)
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING   # b needs 3 blocks, 2 are free
    sched.remove(a)
    assert bm.num_free_blocks == 6
    batch = run_step(sched)
    assert batch.seqs == [b]


def test_preemption_frees_the_newest_and_recomputes_it_later():
    bm = BlockManager(4, 4)   # 16 slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(7, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)                  # both prefilled, 2 blocks each: the pool is full
    assert bm.num_free_blocks == 0
    run_step(sched)                  # one decode each still fits (8 tokens in 2 blocks)
    batch = run_step(sched)          # a needs a 3rd block for position 8: b is preempted
    assert batch.seqs == [a] and batch.preempted == [b]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.seq_id not in bm.block_tables
    assert sched.num_preemptions == 1
    sched.remove(a)
    batch = run_step(sched)          # b comes back and recomputes prompt + its 2 generated tokens
    assert batch.seqs == [b] and batch.num_tokens == [9]


def _verified(sched: Scheduler, seq: Sequence, accepted: int, depth: int) -> None:
    """Tell the scheduler's policy that `seq`'s tree, `depth` deep, got `accepted` tokens accepted."""
    sched.observe(StepReport(outcomes=[TreeOutcome(seq, depth, depth, accepted)]))


def test_draft_length_follows_acceptance():
    """+2 nodes after a fully accepted draft (up to the per-sequence maximum), -1 after a miss (down
    to 1); the budget the scheduler hands out follows; the fixed policy ignores acceptance."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="adaptive")
    seq = make_seq(5)
    seq.drafters, seq.drafter = ("d",), "d"
    sched.add(seq)
    run_step(sched)                                   # prefill
    assert sched.schedule().draft_budgets == [8]
    limits = []
    for accepted, depth in [(0, 8), (2, 7), (1, 6), (0, 5), (0, 4), (0, 3), (0, 2), (1, 2), (1, 1), (2, 2), (3, 3)]:
        _verified(sched, seq, accepted, depth)
        limits.append(sched.policy.limit(seq.seq_id))
    assert limits == [7, 6, 5, 4, 3, 2, 1, 1, 3, 5, 7]
    _verified(sched, seq, 7, 7)
    assert sched.policy.limit(seq.seq_id) == 8        # capped at the maximum
    for accepted, depth in [(0, 8)] * 5:
        _verified(sched, seq, accepted, depth)        # 8 -> 3
    seq.num_computed_tokens = len(seq.token_ids) - 1  # as after the previous schedule()'s step
    sched.blocks.shrink(seq.seq_id, seq.num_computed_tokens)
    assert sched.schedule().draft_budgets == [3]

    fixed = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="fixed")
    other = make_seq(5)
    other.drafters, other.drafter = ("d",), "d"
    fixed.add(other)
    run_step(fixed)
    _verified(fixed, other, 0, 8)
    assert fixed.schedule().draft_budgets == [8]


def test_misses_at_one_node_pause_drafting_with_backoff():
    """A miss with a one-node draft means no draft for 2, then 4, 8, ... (at most MAX_DRAFT_PAUSE)
    of the policy's decisions; an accepted draft ends the back-off. (While it grants nothing the
    scheduler asks it less often than every step: the steps between decisions decode plainly.)"""
    from specserve.engine.draft_policy.fixed import MAX_DRAFT_PAUSE

    sched = Scheduler(BlockManager(2048, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="adaptive")
    seq = make_seq(5, max_tokens=8000)
    seq.drafters, seq.drafter = ("d",), "d"
    sched.add(seq)
    run_step(sched)
    for _ in range(7):
        _verified(sched, seq, 0, 8)                   # the limit falls to 1
    assert sched.policy.limit(seq.seq_id) == 1

    def budgets_until_next_draft() -> list[int]:
        """The budgets of the policy's decisions up to its next grant (`granted`: it decided)."""
        out = []
        while True:
            batch = run_step(sched)
            if batch.granted:
                out.append(batch.draft_budgets[0])
            else:
                assert batch.draft_budgets == [0]
            if out and out[-1]:
                return out

    pauses = []
    for _ in range(7):
        _verified(sched, seq, 0, 1)
        pauses.append(len(budgets_until_next_draft()) - 1)
    assert pauses == [2, 4, 8, 16, 32, 32, 32] and MAX_DRAFT_PAUSE == 32
    _verified(sched, seq, 1, 1)                       # a hit: the next miss at one node pauses 2 steps again
    _verified(sched, seq, 0, 2)                       # 3 -> 2 -> 1 nodes, then a miss at one node
    _verified(sched, seq, 0, 2)
    _verified(sched, seq, 0, 1)
    assert len(budgets_until_next_draft()) - 1 == 2


def test_a_policy_is_picked_by_name():
    blocks = BlockManager(8, 4)
    for name, cls in POLICIES.items():
        assert isinstance(Scheduler(blocks, 4, 64, 8, 64, draft_budget=name).policy, cls)
    assert isinstance(Scheduler(blocks, 4, 64, 8, 64).policy, POLICIES["fixed"])
    with pytest.raises(ValueError):
        Scheduler(blocks, 4, 64, 8, 64, draft_budget="sometimes")


def test_fixed_budget_splits_the_step_cap_evenly():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=128, max_draft_per_seq=8,
                      max_draft_tokens_per_step=12, draft_budget="fixed")
    seqs = [make_seq(5, str(i)) for i in range(4)]
    for s in seqs:
        s.drafters, s.drafter = ("d",), "d"
        sched.add(s)
    run_step(sched)
    assert sched.schedule().draft_budgets == [3, 3, 3, 3]


def test_finished_sequences_are_reported_to_the_policy_once():
    sched = Scheduler(BlockManager(64, 4), 4, 64, 8, 64, draft_budget="adaptive")
    seq = make_seq(5)
    seq.drafters, seq.drafter = ("d",), "d"
    sched.add(seq)
    run_step(sched)
    _verified(sched, seq, 0, 8)
    assert sched.policy.limit(seq.seq_id) == 7
    sched.remove(seq)
    report = StepReport()
    sched.observe(report)
    assert report.finished == [seq.seq_id] and sched.policy.limit(seq.seq_id) == 8
    later = StepReport()
    sched.observe(later)
    assert later.finished == []


def _decoding_with_a_prompt_waiting(draft_budget: str, prompt_len: int | None):
    """4 sequences with a drafter decoding in steps of at most 110 tokens, and (unless `prompt_len` is
    None) a prompt of `prompt_len` tokens arriving. Returns the next step's batch."""
    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=8, max_num_batched_tokens=110, max_draft_per_seq=8,
                      max_draft_tokens_per_step=32, max_model_len=4096, draft_budget=draft_budget)
    if hasattr(sched.policy, "calibrate"):   # a flat step cost: drafting pays wherever it has room
        sched.policy.calibrate(lambda n: 0.01 + 1e-6 * n, sched.max_step_tokens)
    for i in range(4):
        s = make_seq(5, str(i), max_tokens=1000)
        s.drafters, s.drafter = ("d",), "d"
        sched.add(s)
    run_step(sched)   # prefill
    if prompt_len is not None:
        sched.add(make_seq(prompt_len, "new"))
    return sched.schedule()


def test_prefill_goes_before_drafts():
    """A prompt arriving while sequences draft gets its whole prefill in the step (all 100 of its
    tokens); the drafts share what is left (6 nodes), under the fixed budget as under goodput. The
    control without the prompt: the drafts take the step's draft cap (8 each, 32 in all)."""
    for policy in ("fixed", "goodput"):
        alone = _decoding_with_a_prompt_waiting(policy, None)
        assert sum(alone.draft_budgets) == 32, policy
        batch = _decoding_with_a_prompt_waiting(policy, 100)
        assert [s.request.request_id for s in batch.seqs][-1] == "new" and batch.num_tokens[-1] == 100, policy
        assert 0 < sum(batch.draft_budgets) <= 110 - 4 - 100, policy


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "goodput"])
def test_a_sequence_with_several_drafters_drafts_with_one_per_step(policy):
    """A sequence that may draft with "x" or "y" (drafter auto): the goodput policy is asked about
    both and picks one each step, the other policies draft with the first; the chosen one is the
    sequence's drafter for the step, and its budget the sequence's."""
    from specserve.engine.draft_policy import DraftCall

    asked = []
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget=policy)
    sched.context_of = lambda seq, names: {name: asked.append(name) or 0 for name in names}
    seq = make_seq(5, max_tokens=1000)
    seq.drafters, seq.drafter = ("x", "y"), "x"
    sched.add(seq)
    run_step(sched)                                   # prefill
    drafted = []
    for _ in range(40):
        batch = sched.schedule()
        budget = batch.draft_budgets[0]
        # a step without a decision (the policy granted nothing lately: `granted` empty) drafts nothing
        assert batch.granted.get(seq.seq_id, 0) == budget and seq.drafter in ("x", "y")
        report = StepReport(granted=dict(batch.granted))
        if budget:
            drafted.append(seq.drafter)
            report.drafts.append(DraftCall(seq.drafter, [seq.seq_id], [budget], [budget], 0.0))
            report.outcomes.append(TreeOutcome(seq, budget, budget, 0))   # neither is ever right
        sched.observe(report)
        sched.blocks.shrink(seq.seq_id, seq.num_computed_tokens)          # as if nothing was accepted
    if policy == "goodput":
        assert set(asked) == {"x", "y"} and set(drafted) == {"x", "y"}  # it tried both, then neither
    else:
        assert asked == [] and set(drafted) == {"x"}


def test_the_policy_is_asked_less_often_while_it_grants_nothing():
    """After its k-th decision in a row that grants nothing, drafter sequences decode the next
    min(2^(k-1), MAX_QUIET_STEPS) steps without asking the policy ("-"); a grant starts the count
    over, and a sequence's first decode is always decided ("D")."""
    from specserve.engine.draft_policy.fixed import FixedPolicy
    from specserve.engine.scheduler import MAX_QUIET_STEPS

    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=4,
                      max_draft_tokens_per_step=64, draft_budget=FixedPolicy(0))
    seq = make_seq(5, max_tokens=1000)
    seq.drafters, seq.drafter = ("d",), "d"
    sched.add(seq)
    run_step(sched)                                   # prefill

    def kinds(n: int) -> str:
        out = ""
        for _ in range(n):
            batch = run_step(sched)
            out += "D" if batch.granted else "-"
            sched.blocks.shrink(seq.seq_id, seq.num_computed_tokens)   # drafts, if any, all rejected
        return out

    quiet = "D-" + "D--" + "D----" + ("D" + "-" * MAX_QUIET_STEPS) * 2
    assert kinds(len(quiet)) == quiet
    sched.policy = FixedPolicy(4)                     # grants every step
    assert kinds(3) == "DDD"
    sched.policy = FixedPolicy(0)
    assert kinds(4) == "D-D-"                         # one step left to ride along
    other = make_seq(5, "o", max_tokens=1000)         # a new sequence's first decode is decided at once
    other.drafters, other.drafter = ("d",), "d"
    sched.add(other)
    assert kinds(3) == "-D-"                          # its prefill rides along; its first decode is decided
