"""The draft policies through their public surface (`allocate`, `observe`) on simulated
populations: sequences whose trees accept each next depth with a known probability, a step cost
curve and a drafter cost, run step by step as the engine runs them. Seconds are simulated, so the
figures are exact and the same on every machine."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from specserve.engine.draft_policy import (Candidate, DraftCall, FixedPolicy, GoodputPolicy, StepCaps, StepReport,
                                           TreeOutcome, make_policy)


def FLAT(n: float) -> float:    # a step of a few rows costs little more than one (batch 1)
    return 0.020 + 0.0005 * n


def STEEP(n: float) -> float:   # every row costs (a crowd on a CPU)
    return 0.020 + 0.0025 * n


def MID(n: float) -> float:     # a crowd where a tree accepting half its depths would pay
    return 0.020 + 0.001 * n


def simulate(policy, num_seqs: int, rate, step_seconds, steps: int = 300, seed: int = 0,
             context=None, draft_seconds: float = 0.001, on_outcome=None, tree_seconds: float = 0.0,
             drafter: str = "d", first_id: int = 0) -> dict:
    """Run `policy` for `steps` steps over `num_seqs` decoding sequences (ids from `first_id`) of
    `drafter` (cap 8).
    A tree of b nodes is a chain of b tokens; depth k + 1 is accepted with probability
    `rate(seq_id, step, context)` given the ones above it. `context(seq_id, step)`: what the drafter
    tells (None: nothing); `on_outcome(outcome)`: called for every verified tree; `tree_seconds`: what
    a step with any tree costs beyond `step_seconds` (verification work no calibration forward does). Returns
    committed tokens, seconds, their ratio and the budgets per step."""
    rng = random.Random(seed)
    if hasattr(policy, "calibrate"):
        policy.calibrate(step_seconds, num_seqs * 9)
    tokens = seconds = 0.0
    history = []
    seqs = [SimpleNamespace(seq_id=first_id + i, drafter=drafter) for i in range(num_seqs)]
    for step in range(steps):
        ctx = {s.seq_id: context(s.seq_id, step) if context else None for s in seqs}
        cands = [Candidate(s.seq_id, drafter, 8, ctx[s.seq_id]) for s in seqs]
        sizes = policy.allocate(cands, StepCaps(64, num_seqs, num_seqs, num_seqs))
        history.append(sizes)
        report = StepReport(granted={s.seq_id: b for s, b in zip(seqs, sizes)})
        drafted = [(s, b) for s, b in zip(seqs, sizes) if b]
        if drafted:
            report.drafts.append(DraftCall(drafter, [s.seq_id for s, _ in drafted], [b for _, b in drafted],
                                           [b for _, b in drafted], draft_seconds))
        for s, b in drafted:
            p = rate(s.seq_id, step, ctx[s.seq_id])
            accepted = 0
            while accepted < b and rng.random() < p:
                accepted += 1
            out = TreeOutcome(s, b, b, accepted)
            report.outcomes.append(out)
            if on_outcome:
                on_outcome(out)
            tokens += accepted
        report.num_tokens = num_seqs + sum(sizes)
        report.num_trees = len(drafted)
        report.seconds = step_seconds(report.num_tokens) + (tree_seconds if drafted else 0.0)
        seconds += report.seconds + (draft_seconds if drafted else 0.0)
        tokens += num_seqs
        policy.observe(report)
    return {"tokens": tokens, "seconds": seconds, "rate": tokens / seconds, "history": history}


def best_fixed(num_seqs: int, rate, step_seconds, **kwargs) -> float:
    """The best fixed size's rate, chosen in hindsight."""
    return max(simulate(FixedPolicy(b), num_seqs, rate, step_seconds, **kwargs)["rate"] for b in (1, 2, 4, 8))


def plain_rate(num_seqs: int, step_seconds) -> float:
    return num_seqs / step_seconds(num_seqs)


def test_every_budget_is_a_size_within_the_caps():
    policy = make_policy("goodput", 8, 64)
    cands = [Candidate(i, "d", cap) for i, cap in enumerate([0, 1, 3, 8, 8])]
    for _ in range(20):
        sizes = policy.allocate(cands, StepCaps(10, 5, 5, 5))
        assert all(s in (0, 1, 2, 4, 8) and s <= c.cap for s, c in zip(sizes, cands)) and sum(sizes) <= 10
        policy.observe(StepReport(granted={c.seq_id: s for c, s in zip(cands, sizes)}))
    assert make_policy("goodput", 8, 64).allocate(cands, StepCaps(0, 5, 5, 5)) == [0] * 5


def test_batch_one_on_a_flat_curve_drafts_deep_where_drafts_are_accepted():
    """Acceptance 0.9 per depth at batch 1: the policy settles on the largest trees and is within
    5 % of the best fixed size."""
    good = simulate(GoodputPolicy(8, 64), 1, lambda *_: 0.9, FLAT)
    assert good["rate"] >= 0.95 * best_fixed(1, lambda *_: 0.9, FLAT)
    assert sum(h[0] == 8 for h in good["history"][-100:]) >= 80


def test_a_crowd_on_a_steep_curve_stops_drafting():
    """16 sequences accepting 0.3 per depth where every row costs: drafting loses, and the policy
    keeps within 3 % of plain decoding (its exploration included), where fixed sizes lose more."""
    good = simulate(GoodputPolicy(8, 160), 16, lambda *_: 0.3, STEEP)
    plain = plain_rate(16, STEEP)
    assert good["rate"] >= 0.97 * plain
    assert simulate(FixedPolicy(8), 16, lambda *_: 0.3, STEEP)["rate"] < 0.8 * plain
    late = [b for h in good["history"][-100:] for b in h]
    assert sum(b > 0 for b in late) <= 0.05 * len(late)


def test_a_crowd_remembers_what_a_tree_costs():
    """16 sequences whose trees would pay on the calibrated curve alone, but a step with any tree
    costs 30 ms more (a CPU's verification path): once a few tree steps have shown it, the crowd
    stays at plain decoding for a long run, though no tree shows that cost again."""
    rate = lambda *_: 0.5
    out = simulate(GoodputPolicy(8, 64), 16, rate, MID, steps=1500, tree_seconds=0.030)
    assert out["rate"] >= 0.97 * plain_rate(16, MID)
    assert not any(any(sizes) for sizes in out["history"][300:])   # no tree step after the first few


def test_a_drafter_idle_while_another_serves_keeps_what_it_learnt():
    """Per-request drafters: a crowd learns that drafter a's trees do not pay, then drafter b serves
    for a long while; when a comes back, its evidence has not aged with b's steps, so it does not
    explore all over again."""
    policy = GoodputPolicy(8, 64)
    never = lambda *_: 0.0
    first = simulate(policy, 16, never, MID, steps=300, drafter="a")
    assert sum(map(sum, first["history"])) > 0       # it did explore a's trees
    simulate(policy, 16, never, MID, steps=1000, drafter="b", first_id=100)
    back = simulate(policy, 16, never, MID, steps=50, drafter="a", first_id=200)
    assert sum(map(sum, back["history"])) == 0


def test_a_drafter_that_is_never_right_costs_little_at_batch_one():
    good = simulate(GoodputPolicy(8, 64), 1, lambda *_: 0.0, FLAT)
    assert good["rate"] >= 0.95 * plain_rate(1, FLAT)


def test_acceptance_that_changes_is_followed():
    """Acceptance jumps from 0.05 to 0.9 per depth at step 150: the policy, drafting little by
    then, finds out (optimism as its evidence fades) and drafts deep trees again."""
    good = simulate(GoodputPolicy(8, 64), 1, lambda i, step, c: 0.05 if step < 150 else 0.9, FLAT, steps=450)
    early, late = good["history"][100:150], good["history"][-100:]
    assert sum(h[0] for h in early) < sum(h[0] for h in late)
    assert sum(h[0] >= 4 for h in late) >= 80


def test_a_drafter_context_sizes_each_tree():
    """The drafter tells a context before each tree: in context 4 its trees accept 0.9 per depth,
    in context 1 0.1. The policy drafts deep in the first and little in the second, and beats the
    same policy not told the contexts."""
    def ctx(i, step):
        return 4 if (step // 5) % 2 else 1

    def rate(i, step, c):
        return 0.9 if c == 4 else 0.1

    told = simulate(GoodputPolicy(8, 64), 1, rate, FLAT, context=ctx, steps=400)
    sizes = {1: [], 4: []}
    for step, h in enumerate(told["history"][100:], start=100):
        sizes[ctx(0, step)].append(h[0])
    assert sum(sizes[4]) / len(sizes[4]) >= 6 and sum(sizes[1]) / len(sizes[1]) <= 2
    untold = simulate(GoodputPolicy(8, 64), 1, lambda i, step, c: rate(i, step, ctx(i, step)), FLAT, steps=400)
    assert told["rate"] > 1.03 * untold["rate"]


def test_the_last_outcome_carries_what_follows():
    """Acceptance in streaks: after a tree accepted whole the next accepts 0.95 per depth, after
    any other 0.2. Keyed by the last outcome, the policy keeps up with the best fixed size chosen
    in hindsight (2 nodes) and far ahead of the larger ones."""
    def streaks():
        state = {"whole": False}

        def on_outcome(out):
            state["whole"] = out.accepted >= out.depth
        return (lambda i, step, c: 0.95 if state["whole"] else 0.2), on_outcome

    rate, seen = streaks()
    good = simulate(GoodputPolicy(8, 64), 1, rate, FLAT, steps=400, on_outcome=seen)
    best = 0.0
    for b in (1, 2, 4, 8):
        rate, seen = streaks()
        fixed = simulate(FixedPolicy(b), 1, rate, FLAT, steps=400, on_outcome=seen)["rate"]
        best = max(best, fixed)
        if b == 8:
            assert good["rate"] > 1.3 * fixed
    assert good["rate"] >= 0.97 * best


def test_the_policy_is_deterministic():
    runs = [simulate(GoodputPolicy(8, 160), 4, lambda i, *_: 0.2 * i, STEEP, steps=100)["history"] for _ in range(2)]
    assert runs[0] == runs[1]


def test_prefill_steps_draft_only_what_earns_the_decode_rate():
    """A step holding a 200-token prefill chunk commits few tokens in many seconds, so against its
    own rate any draft looks worth it; the drafts must earn a decode step's rate, which on a steep
    curve they do not."""
    policy = GoodputPolicy(8, 512)
    simulate(policy, 4, lambda *_: 0.3, STEEP, steps=50)   # trees accept 0.3 per depth
    cands = [Candidate(i, "d", 8) for i in range(4)]
    assert policy.allocate(cands, StepCaps(64, 204, 4, 5)) == [0, 0, 0, 0]
    assert sum(policy.allocate(cands, StepCaps(64, 204, 4, 0))) > 0   # the step's own rate alone


@pytest.mark.parametrize("name", ["fixed", "adaptive", "goodput"])
def test_finished_sequences_are_forgotten(name):
    policy = make_policy(name, 8, 64)
    cands = [Candidate(i, "d", 8) for i in range(3)]
    for _ in range(5):
        sizes = policy.allocate(cands, StepCaps(64, 3, 3, 3))
        policy.observe(StepReport(granted=dict(enumerate(sizes))))
    policy.observe(StepReport(finished=[0, 1, 2]))
    assert not getattr(policy, "seqs", {})


def test_one_optimist_per_drafter_and_step():
    """Sixteen new sequences of one drafter in four contexts (four keys), where a tree pays only if
    acceptance is better than the prior's even odds: one sequence reads its key optimistically and
    drafts (to find out), the others read their keys' means and do not, whatever their keys; with
    two drafters, one of each. At batch 1 the one sequence is the optimist."""
    policy = GoodputPolicy(8, 160)
    policy.calibrate(STEEP, 160)
    crowd = policy.allocate([Candidate(i, "d", 8, i % 4) for i in range(16)], StepCaps(64, 16, 16, 16))
    assert crowd[0] > 0 and crowd[1:] == [0] * 15
    mixed = GoodputPolicy(8, 160)
    mixed.calibrate(STEEP, 160)
    sizes = mixed.allocate([Candidate(i, "de"[i % 2], 8, i % 4) for i in range(16)], StepCaps(64, 16, 16, 16))
    assert [i for i, b in enumerate(sizes) if b] == [0, 1]
    alone = GoodputPolicy(8, 160)
    alone.calibrate(STEEP, 160)
    assert alone.allocate([Candidate(0, "d", 8)], StepCaps(64, 1, 1, 1))[0] > 0


def test_the_optimist_is_the_least_tried_key():
    """Once a key has evidence, the optimism goes to a sequence whose key has none, though it
    comes later in the step."""
    policy = GoodputPolicy(8, 160)
    policy.calibrate(STEEP, 160)
    crowd = [Candidate(i, "d", 8, 0 if i == 0 else 1) for i in range(16)]
    sizes = policy.allocate(crowd, StepCaps(64, 16, 16, 16))
    assert sizes[0] > 0 and sizes[1:] == [0] * 15
    seq = SimpleNamespace(seq_id=0, drafter="d")
    policy.observe(StepReport(granted=dict(enumerate(sizes)),
                              drafts=[DraftCall("d", [0], [sizes[0]], [sizes[0]], 0.0)],
                              outcomes=[TreeOutcome(seq, sizes[0], sizes[0], 0)], num_tokens=16 + sizes[0],
                              num_trees=1, seconds=STEEP(16 + sizes[0]), finished=[0]))
    # a new sequence in the tried key (context 0, first tree) comes first; the untried key's next
    crowd = [Candidate(16, "d", 8, 0)] + crowd[1:]
    again = policy.allocate(crowd, StepCaps(64, 16, 16, 16))
    assert again[0] == 0 and again[1] > 0 and again[2:] == [0] * 14


def simulate_choice(policy, drafters: tuple[str, ...], rate, step_seconds, steps: int = 400, seed: int = 0,
                    num_seqs: int = 1) -> dict:
    """`simulate` for sequences that may draft with any of `drafters` (one candidate per drafter, as
    the scheduler presents them to a policy that `chooses_drafters`): `rate(drafter, context)` is the
    per-depth acceptance, each step's context (1 or 2, told by every drafter) drawn at random.
    Returns the committed tokens per second and, per step, the drafter that got a budget (None)."""
    rng = random.Random(seed)
    policy.calibrate(step_seconds, num_seqs * 9)
    tokens = seconds = 0.0
    chosen = []
    seqs = [SimpleNamespace(seq_id=i) for i in range(num_seqs)]
    for _ in range(steps):
        context = rng.choice((1, 2))
        cands = [Candidate(s.seq_id, d, 8, context) for s in seqs for d in drafters]
        sizes = policy.allocate(cands, StepCaps(64, num_seqs, num_seqs, num_seqs))
        granted = {s.seq_id: 0 for s in seqs}
        picks = {}
        for c, b in zip(cands, sizes):
            if b:
                assert granted[c.seq_id] == 0, "two drafters for one sequence"
                granted[c.seq_id], picks[c.seq_id] = b, c.drafter
        chosen.append(picks.get(0))
        report = StepReport(granted=granted)
        for d in drafters:
            mine = [s for s in seqs if picks.get(s.seq_id) == d]
            if mine:
                report.drafts.append(DraftCall(d, [s.seq_id for s in mine], [granted[s.seq_id] for s in mine],
                                               [granted[s.seq_id] for s in mine], 0.001))
        for s in seqs:
            b = granted[s.seq_id]
            if b:
                accepted = 0
                while accepted < b and rng.random() < rate(picks[s.seq_id], context):
                    accepted += 1
                report.outcomes.append(TreeOutcome(s, b, b, accepted))
                tokens += accepted
        report.num_tokens = num_seqs + sum(granted.values())
        report.num_trees = sum(1 for b in granted.values() if b)
        report.seconds = step_seconds(report.num_tokens)
        seconds += report.seconds + (0.001 if picks else 0.0)
        tokens += num_seqs
        policy.observe(report)
    return {"rate": tokens / seconds, "chosen": chosen}


def test_a_sequence_with_several_drafters_drafts_with_the_one_that_pays():
    """One drafter accepts 0.9 per depth, the other 0.1: offered both, the policy drafts with the
    good one nearly always and keeps within 5 % of being given the good one alone."""
    rate = lambda d, _: 0.9 if d == "good" else 0.1
    both = simulate_choice(GoodputPolicy(8, 64), ("bad", "good"), rate, FLAT)
    alone = simulate_choice(GoodputPolicy(8, 64), ("good",), rate, FLAT)
    assert both["rate"] >= 0.95 * alone["rate"]
    assert both["chosen"][-100:].count("good") >= 90


def test_the_choice_among_drafters_is_renewed_every_step():
    """Each drafter is right in one context only (0.9 per depth there, 0.05 elsewhere), the context
    changing at random from step to step: choosing per step by the told context beats either
    drafter alone by far, at batch 1 and in a crowd, and no step gives one sequence two drafters."""
    rate = lambda d, c: 0.9 if (d == "a") == (c == 1) else 0.05
    for num_seqs, curve in ((1, FLAT), (8, MID)):
        both = simulate_choice(GoodputPolicy(8, 128), ("a", "b"), rate, curve, num_seqs=num_seqs)
        for single in ("a", "b"):
            alone = simulate_choice(GoodputPolicy(8, 128), (single,), rate, curve, num_seqs=num_seqs)
            assert both["rate"] >= 1.15 * alone["rate"], (num_seqs, single)

