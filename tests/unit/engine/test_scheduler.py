"""Scheduler policy on real Sequence objects (no model): budgets, chunked prefill, admission by
free blocks, the sequence cap, preemption; the draft budgets (fixed, adaptive, goodput)."""

from __future__ import annotations

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


def test_draft_length_follows_acceptance():
    """+2 nodes after a fully accepted draft (up to the per-sequence maximum), -1 after a miss (down
    to 1); the budget the scheduler hands out follows; off means the maximum always."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="adaptive")
    seq = make_seq(5)
    seq.drafter = "d"
    sched.add(seq)
    run_step(sched)                                   # prefill
    assert sched.schedule().draft_budgets == [8]
    limits = []
    for accepted, depth in [(0, 8), (2, 7), (1, 6), (0, 5), (0, 4), (0, 3), (0, 2), (1, 2), (1, 1), (2, 2), (3, 3)]:
        sched.observe_acceptance(seq, accepted, depth)
        limits.append(seq.draft_limit)
    assert limits == [7, 6, 5, 4, 3, 2, 1, 1, 3, 5, 7]
    assert seq.draft_pause == 0                       # no miss at one node: never paused
    sched.observe_acceptance(seq, 7, 7)
    assert seq.draft_limit == 8                       # capped at the maximum
    seq.draft_limit = 3
    seq.num_computed_tokens = len(seq.token_ids) - 1  # as after the previous schedule()'s step
    sched.blocks.shrink(seq.seq_id, seq.num_computed_tokens)
    assert sched.schedule().draft_budgets == [3]

    fixed = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="fixed")
    other = make_seq(5)
    fixed.observe_acceptance(other, 0, 8)
    assert other.draft_limit is None


def test_misses_at_one_node_pause_drafting_with_backoff():
    """A miss with a one-node draft means no draft for 2, then 4, 8, ... (at most MAX_DRAFT_PAUSE)
    steps; an accepted draft ends the back-off."""
    from specserve.engine.scheduler import MAX_DRAFT_PAUSE

    sched = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=64, max_draft_per_seq=8,
                      max_draft_tokens_per_step=64, draft_budget="adaptive")
    seq = make_seq(5, max_tokens=1000)
    seq.drafter = "d"
    sched.add(seq)
    run_step(sched)
    seq.draft_limit = 1

    def budgets_until_next_draft() -> list[int]:
        out = []
        while True:
            batch = run_step(sched)
            out.append(batch.draft_budgets[0])
            if out[-1]:
                return out

    pauses = []
    for _ in range(7):
        sched.observe_acceptance(seq, 0, 1)
        pauses.append(len(budgets_until_next_draft()) - 1)
    assert pauses == [2, 4, 8, 16, 32, 32, 32] and MAX_DRAFT_PAUSE == 32
    sched.observe_acceptance(seq, 1, 1)               # a hit: the next miss at one node pauses 2 steps again
    seq.draft_limit = 1
    sched.observe_acceptance(seq, 0, 1)
    assert len(budgets_until_next_draft()) - 1 == 2


def test_the_older_switch_picks_the_budget():
    blocks = BlockManager(8, 4)
    assert Scheduler(blocks, 4, 64, 8, 64, adaptive_draft_length=True).draft_budget == "adaptive"
    assert Scheduler(blocks, 4, 64, 8, 64).draft_budget == "fixed"
    assert Scheduler(blocks, 4, 64, 8, 64, adaptive_draft_length=True, draft_budget="goodput").budget is not None
    import pytest
    with pytest.raises(ValueError):
        Scheduler(blocks, 4, 64, 8, 64, draft_budget="sometimes")


def test_fixed_budget_splits_the_step_cap_evenly():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=128, max_draft_per_seq=8,
                      max_draft_tokens_per_step=12, draft_budget="fixed")
    seqs = [make_seq(5, str(i)) for i in range(4)]
    for s in seqs:
        s.drafter = "d"
        sched.add(s)
    run_step(sched)
    assert sched.schedule().draft_budgets == [3, 3, 3, 3]


def _goodput_scheduler(num_seqs: int, step_seconds, max_draft_tokens_per_step: int = 64):
    """A goodput scheduler over `num_seqs` decoding sequences, its step cost calibrated to `step_seconds(n)`."""
    from specserve.engine.stats import DrafterStats, EngineStats

    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=16, max_num_batched_tokens=512, max_draft_per_seq=8,
                      max_draft_tokens_per_step=max_draft_tokens_per_step, max_model_len=4096, draft_budget="goodput")
    stats, drafter_stats = EngineStats(), {"d": DrafterStats()}
    sched.attach_stats(stats, drafter_stats)
    assert sched.calibrate(step_seconds) and stats.step_cost_tokens[0] == 1
    seqs = [make_seq(5, str(i), max_tokens=1000) for i in range(num_seqs)]
    for s in seqs:
        s.drafter = "d"
        sched.add(s)
    run_step(sched)   # prefill
    return sched, seqs, drafter_stats["d"]


def _goodput_step(sched: Scheduler, accept, step_seconds) -> list[int]:
    """One step as the engine runs it: budgets, drafts of the full budget, `accept(seq, budget)` accepted,
    the step taking `step_seconds(tokens)`."""
    batch = sched.schedule()
    drafting = [(s, b) for s, b in zip(batch.seqs, batch.draft_budgets) if b]
    if drafting:
        sched.observe_draft("d", [s for s, _ in drafting], [b for _, b in drafting], [b for _, b in drafting], 1e-4)
    for seq, n, budget in zip(batch.seqs, batch.num_tokens, batch.draft_budgets):
        accepted = accept(seq, budget) if budget else 0
        if budget:
            sched.observe_acceptance(seq, accepted, budget)
        seq.token_ids.extend([7] * (accepted + 1))
        seq.num_computed_tokens = len(seq.token_ids) - 1
        sched.blocks.shrink(seq.seq_id, seq.num_computed_tokens + 1)
    tokens = batch.total_tokens + sum(batch.draft_budgets)
    sched.observe_step(tokens, step_seconds(tokens), sum(1 for b in batch.draft_budgets if b))
    return batch.draft_budgets


def test_goodput_budget_in_the_scheduler():
    """Batch 1 with everything accepted drafts the most; the budgets handed out are counted per drafter."""
    cost = lambda n: 0.02 + 0.0025 * n   # noqa: E731
    sched, seqs, st = _goodput_scheduler(1, cost)
    budgets = [_goodput_step(sched, lambda s, b: b, cost)[0] for _ in range(10)]
    assert budgets[-1] == 8 and all(b in (0, 1, 2, 4, 8) for b in budgets)
    assert sum(st.budget_counts) == 10 and st.budget_counts[8] >= 5


def test_goodput_budget_stops_drafting_for_a_crowd_on_a_steep_curve():
    cost = lambda n: 0.02 + 0.0025 * n   # noqa: E731
    sched, seqs, st = _goodput_scheduler(16, cost)
    history = [_goodput_step(sched, lambda s, b: b // 2, cost) for _ in range(40)]
    assert sum(b > 0 for step in history[-20:] for b in step) <= 16   # probes only: one per sequence at most
    assert st.budget_counts[0] > 0.8 * sum(st.budget_counts)


def _decoding_with_a_prompt_waiting(draft_budget: str, prompt_len: int | None):
    """4 sequences with a drafter decoding in steps of at most 110 tokens, and (unless `prompt_len` is
    None) a prompt of `prompt_len` tokens arriving. Returns the next step's batch."""
    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=8, max_num_batched_tokens=110, max_draft_per_seq=8,
                      max_draft_tokens_per_step=32, max_model_len=4096, draft_budget=draft_budget)
    if sched.budget is not None:   # a flat step cost: drafting pays wherever it has room
        sched.calibrate(lambda n: 0.01 + 1e-6 * n)
    for i in range(4):
        s = make_seq(5, str(i), max_tokens=1000)
        s.drafter = "d"
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
