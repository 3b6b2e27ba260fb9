"""The goodput draft budget (engine/budget.py): the allocator on synthetic cost and acceptance models,
the step cost model, exploration, determinism; the configuration switches; the engine stays lossless
with it; its budgets and cost estimates reach /metrics."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from helpers import make_llm_engine, run_requests

from specserve.drafters.base import Drafter, register
from specserve.engine.budget import (BUDGET_SIZES, FIRST_PROBE_PAUSE, MAX_PROBE_PAUSE, PROBE_OPTIMISM, GoodputBudget,
                                     StepCostModel, budget_sizes, chain_accepted, prior_accepted)
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import TokenTree

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def cpu_cost(n: float) -> float:
    """Steep: every token costs (a CPU running a small model: compute bound from a few tokens on)."""
    return 0.02 + 0.0025 * n


def gpu_cost(n: float) -> float:
    """Nearly flat up to hundreds of tokens (memory bound)."""
    return 0.01 + 0.00001 * n


def make_budget(cost=cpu_cost, cap: int = 8, max_step_tokens: int = 512) -> GoodputBudget:
    b = GoodputBudget(cap, max_step_tokens)
    b.cost.calibrate({n: cost(n) for n in KNOTS})
    return b


def seqs_of(n: int, drafter: str = "d", start: int = 0) -> list:
    return [SimpleNamespace(seq_id=start + i, drafter=drafter) for i in range(n)]


def teach_drafter(b: GoodputBudget, drafter: str, rate: float, times: int = 20) -> None:
    """The drafter accepts like a chain with per-token acceptance `rate`, at every size."""
    dm = b._drafter(drafter)
    for s in b.sizes[1:]:
        for _ in range(times):
            dm.observe(s, prior_accepted(s, rate), s)


def run_step(b: GoodputBudget, seqs, cap: int = 8, max_total: int = 64, accept=None, nodes=None,
             prefill_tokens: int = 0):
    """One step as the engine drives the budget: allocate, record, draft, verify. `accept(seq, budget)`
    gives the accepted tokens (default: none), `nodes(seq, budget)` the nodes drafted (default: all)."""
    decision = b.allocate([(s, cap) for s in seqs], len(seqs) + prefill_tokens, len(seqs), max_total)
    for s in seqs:
        b.record(s, decision.budgets[s.seq_id])
    by_drafter: dict[str, list] = {}
    for s in seqs:
        if decision.budgets[s.seq_id]:
            by_drafter.setdefault(s.drafter, []).append(s)
    for name, group in by_drafter.items():
        budgets = [decision.budgets[s.seq_id] for s in group]
        got = [nodes(s, bud) if nodes else bud for s, bud in zip(group, budgets)]
        b.observe_draft(name, group, budgets, got, 0.0001 * len(group))
        for s, bud, n in zip(group, budgets, got):
            if n:
                b.observe_acceptance(s, min(n, accept(s, bud) if accept else 0), n)
    return decision


# ---- sizes --------------------------------------------------------------------------------------


def test_budget_sizes():
    assert budget_sizes(8) == [0, 1, 2, 4, 8]
    assert budget_sizes(10) == [0, 1, 2, 4, 8, 10]
    assert budget_sizes(1) == [0, 1] and budget_sizes(0) == [0]
    assert budget_sizes(64) == [*BUDGET_SIZES, 64]


# ---- the allocator ------------------------------------------------------------------------------


def test_batch_one_with_good_acceptance_drafts_the_most():
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.9)
    d = b.allocate([(s, 8) for s in seqs_of(1)], 1, 1, 64)
    assert d.budgets == {0: 8}
    # the same on a flat (GPU-like) cost curve
    b = make_budget(gpu_cost)
    teach_drafter(b, "d", 0.9)
    assert b.allocate([(s, 8) for s in seqs_of(1)], 1, 1, 64).budgets == {0: 8}


def test_many_sequences_on_a_steep_cost_curve_do_not_draft():
    """16 sequences on a CPU: a forward of 16 + 16 * 8 tokens costs far more than the tokens accepted."""
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.6)
    seqs = seqs_of(16)
    d = b.allocate([(s, 8) for s in seqs], 16, 16, 64)
    assert {v for i, v in d.budgets.items() if i not in d.probes} == {0}   # new sequences: probes only
    # a flat curve with the same acceptance: everyone drafts, the node cap spread evenly
    b = make_budget(gpu_cost)
    teach_drafter(b, "d", 0.6)
    d = b.allocate([(s, 8) for s in seqs], 16, 16, 64)
    assert all(v > 0 for v in d.budgets.values()) and sum(d.budgets.values()) <= 64
    assert max(d.budgets.values()) - min(d.budgets.values()) <= 2


def test_it_learns_to_stop_drafting_from_acceptance_and_costs():
    """Untried sizes start optimistic; once the (poor) acceptance is measured, 16 sequences on a steep
    curve stop drafting and only occasional probes remain."""
    b = make_budget(cpu_cost)
    seqs = seqs_of(16)
    drafted = []
    for _ in range(60):
        d = run_step(b, seqs, accept=lambda s, bud: 0)
        drafted.append(sum(v > 0 for v in d.budgets.values()))
    assert sum(drafted[-30:]) <= 16      # probes only: each sequence at most once in the last 30 steps
    assert sum(drafted) < 60 * 16 * 0.2


def test_mixed_acceptance_drafts_only_for_the_good_sequences():
    b = make_budget(lambda n: 0.02 + 0.0004 * n)
    teach_drafter(b, "d", 0.5)
    seqs = seqs_of(8)
    good = {0, 2, 4, 6}
    for _ in range(30):
        d = run_step(b, seqs, accept=lambda s, bud: bud if s.seq_id in good else 0)
    d = b.allocate([(s, 8) for s in seqs], 8, 8, 64)
    assert all(d.budgets[i] > 0 for i in good)
    assert all(d.budgets[i] == 0 or i in d.probes for i in set(range(8)) - good)
    assert min(d.budgets[i] for i in good) > max(d.budgets[i] for i in set(range(8)) - good - set(d.probes))


def test_a_sequence_without_trees_stops_costing_nodes():
    """A sequence its drafter finds nothing for (n-gram without a match): its chance of a tree falls, so
    its expected gain does, and the allocator stops asking (a steep curve, a costly drafter)."""
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.8)
    seqs = seqs_of(4)
    for _ in range(40):
        run_step(b, seqs, accept=lambda s, bud: bud, nodes=lambda s, bud: 0 if s.seq_id == 3 else bud)
    assert b.seqs[3].tree_rate < 0.25 and b.seqs[0].tree_rate > 0.9
    d = b.allocate([(s, 8) for s in seqs], 4, 4, 64)
    assert d.budgets[3] < d.budgets[0]


def test_probes_after_doubling_pauses():
    """A sequence left at 0 gets a probe on its first step, then after 16, 32, ... MAX_PROBE_PAUSE
    steps at 0 (its own evidence cleared after each step, so that every probe has the same hope)."""
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.3)
    seqs = seqs_of(16)
    zeros_before_probe, run = [], 0
    for _ in range(400):
        d = run_step(b, seqs)
        for st in b.seqs.values():
            st.depth_hits = st.depth_trials = 0.0
        if d.budgets[0]:
            assert 0 in d.probes
            zeros_before_probe.append(run)
            run = 0
        else:
            run += 1
    expected = [0, 2 * FIRST_PROBE_PAUSE]
    while len(expected) < len(zeros_before_probe):
        expected.append(min(MAX_PROBE_PAUSE, 2 * expected[-1]))
    assert zeros_before_probe == expected and expected[-1] == MAX_PROBE_PAUSE


def test_a_probe_has_the_size_optimism_would_pick():
    """Batch 1 on a CPU-like curve, a drafter whose acceptance was learnt poor on other text: a new
    sequence is probed at once with a draft deep enough to show good acceptance (not a single node),
    and one that accepts everything is drafted at full size after its probe; the control, the same
    start with a sequence that accepts nothing, is left at 0 after its probe."""
    def fresh():
        b = make_budget(lambda n: 0.02 + 0.002 * n)
        teach_drafter(b, "d", 0.05)
        return b

    b, seq = fresh(), seqs_of(1)
    assert b.allocate([(seq[0], 8)], 1, 1, 64).budgets[0] > 1   # untouched: the probe, deep
    b = fresh()
    d = run_step(b, seq, accept=lambda s, bud: bud)
    assert d.probes == [0] and d.budgets[0] >= 4
    assert [run_step(b, seq, accept=lambda s, bud: bud).budgets[0] for _ in range(4)] == [8] * 4
    b = fresh()
    d = run_step(b, seq, accept=lambda s, bud: 0)
    assert d.probes == [0]
    assert [run_step(b, seq).budgets[0] for _ in range(8)] == [0] * 8


def finish_population(b: GoodputBudget, rate: float, n: int = 16, depth: int = 8, trees: int = 4,
                      start: int = 1000) -> None:
    """`n` sequences of drafter "d", each with `trees` `depth`-deep trees verified accepting each
    depth with probability `rate`, finish: their rates join the drafter's population."""
    rng = random.Random(0)
    for s in seqs_of(n, start=start):
        for _ in range(trees):
            b.record(s, depth)
            b.observe_draft("d", [s], [depth], [depth], 0.0)
            accepted = 0
            while accepted < depth and rng.random() < rate:
                accepted += 1
            b.observe_acceptance(s, accepted, depth)
        b.forget(s)


def probed(b: GoodputBudget, n: int, start: int = 0) -> int:
    """How many of `n` new sequences a first step probes."""
    return len(b.allocate([(s, 8) for s in seqs_of(n, start=start)], n, n, 64).probes)


def test_probes_hope_for_what_earlier_sequences_showed():
    """In a crowded CPU step, a new sequence of a drafter whose finished sequences all accepted
    poorly is not probed (no earlier sequence would have repaid it); the control, the same step
    after sequences that accepted well, probes. At batch 1, where a draft costs little beside the
    step, the poor population still leaves room for a probe (a request unlike the earlier ones is
    found), and before any sequence finished the probe hopes for PROBE_OPTIMISM."""
    def fresh(rate=None):
        b = make_budget(cpu_cost)
        teach_drafter(b, "d", 0.05)
        if rate is not None:
            finish_population(b, rate)
        return b

    assert fresh().drafters["d"].probe_optimism() == PROBE_OPTIMISM
    assert probed(fresh(), 16) > 0
    assert probed(fresh(0.9), 16) > 0
    poor = fresh(0.15)
    assert poor.drafters["d"].probe_optimism() < 0.5
    assert probed(poor, 16) == 0
    # at batch 1 it drafts on its first step: as a probe, or by itself where the sizes the
    # population's trees did not use have faded back towards their prior (`STALE_DECAY`)
    assert fresh(0.15).allocate([(s, 8) for s in seqs_of(1)], 1, 1, 64).budgets[0] > 0


def test_a_rejected_probe_lowers_the_next_ones_hope():
    """A sequence whose probe was rejected hopes for less the next time: in a crowded step it is not
    probed again, while one whose own evidence was cleared is (the control)."""
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.2)
    seqs = seqs_of(16)
    first = run_step(b, seqs).probes           # the first step: probes, all rejected
    assert first
    seqs = [s for s in seqs if s.seq_id in first]
    for s in seqs:
        b.seqs[s.seq_id].idle = b.seqs[s.seq_id].pause   # due again
    assert not b.allocate([(s, 8) for s in seqs], 16, 16, 64).probes
    for s in seqs:
        b.seqs[s.seq_id].depth_hits = b.seqs[s.seq_id].depth_trials = 0.0
    assert b.allocate([(s, 8) for s in seqs], 16, 16, 64).probes


def test_probes_in_a_context_hope_for_what_its_earlier_probes_got():
    """A drafter that tells contexts (an n-gram drafter's match length), in a crowded step where a
    probe pays only if its sequence accepts well: the first sequences in context 3 are probed and
    their probes (8 nodes) rejected whole; a few crowds later new sequences in context 3 get a
    quarter of those nodes or less (a one-node probe, cheap on this curve, can still pay), while new
    ones in context 2 (the same acceptance, no probe of its own yet: the control) get at least half."""
    b = make_budget(lambda n: 0.06 + 0.001 * n)
    for context in (2, 3):   # the trees drafted there accepted little: the allocator drafts neither
        am = b._acceptance("d", context)
        for s in b.sizes[1:]:
            for _ in range(20):
                am.observe(s, prior_accepted(s, 0.05), s)

    def crowd(context: int, start: int) -> list:
        seqs = seqs_of(16, start=start)
        decision = b.allocate([(s, 8) for s in seqs], 16, 16, 64, {s.seq_id: context for s in seqs})
        assert not set(decision.budgets) - {s.seq_id for s in seqs}
        assert all(decision.budgets[s.seq_id] == 0 for s in seqs if s.seq_id not in decision.probes)
        for s in seqs:
            b.record(s, decision.budgets[s.seq_id])
        probes = [s for s in seqs if s.seq_id in decision.probes]
        for s in probes:
            budget = decision.budgets[s.seq_id]
            b.observe_draft("d", [s], [budget], [budget], 1e-4)
            b.observe_acceptance(s, 0, budget)
        return sum(decision.budgets[s.seq_id] for s in probes)

    nodes = [crowd(3, 100 * i) for i in range(4)]       # draft nodes spent on probes, crowd by crowd
    assert nodes[0] >= 16 and nodes[-1] <= nodes[0] / 4, nodes
    assert b._acceptance("d", 3).probe_rate(PROBE_OPTIMISM) < PROBE_OPTIMISM / 2
    assert crowd(2, 1000) >= nodes[0] / 2


def test_the_share_the_picked_trees_realized_scales_the_expectations_in_a_crowd():
    """The allocator's picks among 16 sequences are measured against what it expected of them: trees
    that accept a third of that lower the drafter's realized share towards a third, and the crowd
    then gets fewer nodes than the same budget whose picks accepted what it expected (the control,
    share near 1). A probe's outcome does not move the share, and neither does a lone sequence's
    tree (batch 1: nothing was picked from others), whose expectations it leaves alone."""
    def world(fraction: float, n: int = 16):
        b = make_budget(lambda n: 0.06 + 0.001 * n)
        teach_drafter(b, "d", 0.6)
        seqs = seqs_of(n)
        for s in seqs:
            b._seq(s).idle = 0   # not due for a probe
        for step in range(12):
            d = b.allocate([(s, 8) for s in seqs], n, n, 64)
            for s in seqs:
                b.record(s, d.budgets[s.seq_id])
            for s in seqs:
                budget = d.budgets[s.seq_id]
                if budget:
                    expected = b.seqs[s.seq_id].pending_expected
                    assert (expected is None) == (s.seq_id in d.probes or n == 1)
                    accepted = round(fraction * (expected if expected is not None else prior_accepted(budget, 0.6)))
                    b.observe_draft("d", [s], [budget], [budget], 1e-4)
                    b.observe_acceptance(s, min(budget, accepted), budget)
            teach_drafter(b, "d", 0.6, times=2)   # the drafter's trees elsewhere keep its means
        nodes = sum(b.allocate([(s, 8) for s in seqs], n, n, 64).budgets.values())
        return b.drafters["d"].realized, nodes

    share, nodes = world(1 / 3)
    full_share, full_nodes = world(1.0)
    assert share < 0.5 and 0.8 < full_share < 1.25, (share, full_share)
    assert nodes < full_nodes, (nodes, full_nodes)
    assert world(1 / 3, n=1)[0] == 1.0
    # a probe is not the allocator's pick: its outcome leaves the share alone
    b = make_budget(cpu_cost)
    teach_drafter(b, "d", 0.05)
    seqs = seqs_of(16)
    d = b.allocate([(s, 8) for s in seqs], 16, 16, 64)
    assert d.probes and all(d.budgets[i] == 0 for i in d.budgets if i not in d.probes)
    for s in seqs:
        b.record(s, d.budgets[s.seq_id])
    for i in d.probes:
        assert b.seqs[i].pending_expected is None
        b.observe_draft("d", [seqs[i]], [d.budgets[i]], [d.budgets[i]], 1e-4)
        b.observe_acceptance(seqs[i], 0, d.budgets[i])
    assert b.drafters["d"].realized == 1.0


def test_a_step_holding_prefill_drafts_only_what_earns_the_decode_rate():
    """16 decoding sequences and a 200-token prefill chunk in one step, on a steep (CPU) curve: a
    node costs 2.5 ms, and one accepted 30 % of the time earns 120 tokens a second -- more than the
    step's own goodput (16 tokens in 0.56 s), less than a plain decode step of the 16 (267 a
    second). Told that 16 sequences decode after this step, the budget drafts none of them; not
    told (the control), it drafts them all. A step without prefill is the same either way."""
    def decide(decode_rows, base_tokens=16 + 200):
        b = make_budget(cpu_cost)
        teach_drafter(b, "d", 0.3)
        seqs = seqs_of(16)
        for s in seqs:
            b._seq(s).idle = 0   # not due for a probe
        return b.allocate([(s, 8) for s in seqs], base_tokens, 16, 64, decode_rows=decode_rows).budgets

    assert all(decide(None).values())
    assert not any(decide(16).values())
    assert decide(16, base_tokens=16) == decide(None, base_tokens=16)


def test_a_good_probe_brings_a_sequence_back():
    """A sequence whose acceptance turns good is found by its probes and drafts again."""
    b = make_budget(lambda n: 0.02 + 0.0005 * n)
    teach_drafter(b, "d", 0.4)
    seqs = seqs_of(4)
    for _ in range(30):
        run_step(b, seqs, accept=lambda s, bud: 0)
    d = b.allocate([(s, 8) for s in seqs], 4, 4, 64)
    assert d.budgets[0] == 0 or 0 in d.probes
    for s in seqs:
        b.record(s, 0)
    budgets = [run_step(b, seqs, accept=lambda s, bud: bud).budgets[0] for _ in range(40)]
    assert budgets[-1] > 1 and sum(x > 0 for x in budgets[-8:]) == 8


def run_population(b: GoodputBudget, rate, n: int = 24, steps: int = 24, start: int = 0) -> None:
    """`n` sequences of drafter "d" decode one after another at batch 1 for `steps` steps each; a
    tree of sequence i accepts each next depth with probability `rate(i)`."""
    rng = random.Random(3)

    def accept(s, bud):
        k = 0
        while k < bud and rng.random() < rate(s.seq_id):
            k += 1
        return k

    for s in seqs_of(n, start=start):
        for _ in range(steps):
            run_step(b, [s], accept=accept)
        b.forget(s)


def streaks(i: int) -> float:
    """Every other sequence accepts well, for good."""
    return 0.95 if i % 2 == 0 else 0.05


def luck(i: int) -> float:
    """Every sequence alike: one tree's luck says nothing of the next."""
    return 0.6


def flat_cost(n: float) -> float:
    """Between `gpu_cost` and `cpu_cost`: an extra draft node costs a hundredth of the step."""
    return 0.02 + 0.0002 * n


@pytest.mark.parametrize("cost", [flat_cost, cpu_cost])
def test_persistence_is_learnt_from_streaks_and_from_luck(cost):
    """How much of a sequence's own record carries to its next tree is measured: high where each
    sequence accepts well or badly for good (streaks), low where every sequence accepts alike and
    one tree's luck says nothing of the next; the prior, before any tree, is all of it. (On the
    steep cost curve the bad sequences, after their misses, draft one-node trees, whose records
    differ little from their drafter's: the fit sees mostly the good ones, against a drafter
    mean learnt mostly on them, and settles lower than on the flat curve: 0.57, and 0.45 since
    sizes left unused fade back towards their prior and are tried again.)"""
    assert make_budget(cost)._drafter("d").persistence == 1.0
    persistence = {}
    for rate in (streaks, luck):
        b = make_budget(cost)
        run_population(b, rate)
        persistence[rate] = b.drafters["d"].persistence
    assert persistence[streaks] > 0.4 and persistence[luck] < 0.2


@pytest.mark.parametrize("cost", [flat_cost, cpu_cost])
def test_rejected_trees_do_not_shrink_a_sequence_where_luck_does_not_last(cost):
    """Batch 1, a drafter accepting 0.6 per depth on every sequence alike: a new sequence whose trees
    are all rejected keeps the size its drafter's record earns after its first rejected tree (with
    its own record counted in full it would shrink after the first), and stays within half of it
    over ten (its rejected trees do lower its drafter's per-size means, which follow new evidence
    at 1/MAX_EVIDENCE: on some populations the size halves after a few). The control, a drafter
    whose sequences accept 0.95 or 0.05 for good: one rejected tree and the next is smaller."""
    budgets = {}
    for rate in (luck, streaks):
        b = make_budget(cost)
        run_population(b, rate)
        s = seqs_of(1, start=500)
        budgets[rate] = [run_step(b, s).budgets[500] for _ in range(10)]
    assert budgets[luck][0] > 0 and budgets[luck][1] == budgets[luck][0]
    assert min(budgets[luck]) >= budgets[luck][0] // 2
    assert budgets[streaks][1] < budgets[streaks][0]


def passages(stay: float, inside: float = 0.95, outside: float = 0.25):
    """A sequence whose text goes in and out of passages an n-gram drafter knows (code, a quoted
    document): each step it stays where it is with probability `stay`; per-depth acceptance is
    `inside` within a passage and `outside` elsewhere."""
    def rates(rng: random.Random, steps: int) -> list[float]:
        out, within = [], False
        for _ in range(steps):
            within = within if rng.random() < stay else not within
            out.append(inside if within else outside)
        return out
    return rates


def simulated_step(b: GoodputBudget, s, rate: float, u: list[float], cost, depth_of: dict | None = None):
    """One batch-1 step of `s`: its tree (`depth_of[size]` deep, else as deep as its size) accepts
    each next depth while that depth's uniform draw in `u` is below `rate`. (Committed tokens,
    the step's `cost` of its tokens.)"""
    got = 0

    def accept(_s, bud):
        nonlocal got
        depth = depth_of[bud] if depth_of else bud
        while got < depth and u[got] < rate:
            got += 1
        return got

    nodes = run_step(b, [s], accept=accept).budgets[s.seq_id]
    return 1 + got, cost(1 + nodes)


def simulate_goodput(cost, rates_of, seeds=(5, 6, 7), n: int = 24, steps: int = 40) -> tuple[float, object]:
    """`n` sequences one after another at batch 1, `steps` steps each, per-depth acceptance of each
    step from `rates_of`; the same uniform draws whatever the budgets. Committed tokens per
    simulated second (`cost` of each step's tokens), and the drafter's model at the end."""
    tokens = seconds = 0.0
    for seed in seeds:
        b, rng = make_budget(cost), random.Random(seed)
        for s in seqs_of(n):
            rates = rates_of(rng, steps)
            draws = [[rng.random() for _ in range(8)] for _ in range(steps)]
            for rate, u in zip(rates, draws):
                t, sec = simulated_step(b, s, rate, u, cost)
                tokens += t
                seconds += sec
            b.forget(s)
    return tokens / seconds, b.drafters["d"]


def test_trees_after_a_whole_one_are_sized_by_the_streak_rate(monkeypatch):
    """Sequences going in and out of passages where the drafter is accepted 0.95 per depth (0.25
    elsewhere) on a steep cost curve: the drafter learns that its trees after a tree accepted whole
    accept far more than its average, and sizing them so commits more tokens per second than
    without the streak term (the control, its streak rate replaced by the overall one). Where
    acceptance is alike on every step (luck), the streak rate is the overall one and changes
    nothing."""
    from specserve.engine.budget import _DrafterModel
    with_streaks = {}
    for name, rates_of in (("passages", passages(0.8)), ("luck", lambda rng, steps: [0.6] * steps)):
        with_streaks[name], dm = simulate_goodput(cpu_cost, rates_of)
        if name == "passages":
            assert dm.streak_rate > dm.depth_rate + 0.05
        else:
            assert abs(dm.streak_rate - dm.depth_rate) < 0.08
    with monkeypatch.context() as m:
        m.setattr(_DrafterModel, "streak_rate", property(lambda self: self.depth_rate))
        without = {"passages": simulate_goodput(cpu_cost, passages(0.8))[0],
                   "luck": simulate_goodput(cpu_cost, lambda rng, steps: [0.6] * steps)[0]}
    assert with_streaks["passages"] > 1.05 * without["passages"]
    assert with_streaks["luck"] > 0.98 * without["luck"]


def measured_cpu_cost(n: float) -> float:
    """Shaped like this project's 2-core CPU running SmolLM2-135M (the step cost tables of `bench
    replay`): 41 ms for one token, 44.5 for two, 60 for nine, then 1.5 ms a token."""
    ms = (41.0, 44.5, 49.0, 52.5, 54.0, 54.5, 57.5, 59.0, 60.0)
    if n >= 9:
        return (ms[-1] + (n - 9) * 1.5) / 1e3
    lo = max(1, int(n))
    f = n - lo
    return (ms[lo - 1] * (1 - f) + ms[min(8, lo)] * f) / 1e3


def tree_of(b: GoodputBudget, s, nodes: int, accepted: int) -> None:
    """`s` got a chain of `nodes` nodes, `accepted` of them accepted."""
    b.record(s, nodes)
    b.observe_draft(s.drafter, [s], [nodes], [nodes], 0.0001)
    b.observe_acceptance(s, accepted, nodes)


def without_misses(monkeypatch) -> None:
    """The control: no miss term, whatever came before a tree."""
    orig = GoodputBudget._expected
    monkeypatch.setattr(GoodputBudget, "_expected",
                        lambda self, st, dm, sizes, *ks, streaks=True, misses=True:
                        orig(self, st, dm, sizes, *ks, streaks=streaks, misses=False))


def test_after_a_miss_a_drafter_whose_next_trees_fail_is_asked_for_one_node(monkeypatch):
    """A drafter accepting 0.8 per depth over all, whose trees after a rejected one were rejected
    too (an n-gram drafter leaving a passage): after a miss its sequence gets a one-node tree
    where, without the miss term, its per-size means give it 4 nodes or more; steps without a tree
    keep the miss, an accepted token ends it and the size comes back. A drafter whose trees after
    a miss accept as the others do (its miss rate is its overall rate) keeps its size."""
    b = make_budget(measured_cpu_cost)
    teach_drafter(b, "d", 0.8)
    for seq in seqs_of(16, start=100):     # each: a miss, then the next tree mostly rejected too
        tree_of(b, seq, 8, 0)
        tree_of(b, seq, 8, 1 if seq.seq_id % 3 == 0 else 0)
        b.forget(seq)
    dm = b.drafters["d"]
    assert 0.15 < dm.miss_rate < 0.4 < 0.6 < dm.depth_rate
    s = seqs_of(1)[0]
    tree_of(b, s, 8, 8)
    assert run_step(b, [s]).budgets[0] == 8            # (no tree accepts: run_step's default)
    assert b._seq(s).missed
    assert b.allocate([(s, 8)], 1, 1, 64).budgets[0] == 1
    b.record(s, 0)                                     # a step without a tree: still missed
    assert b._seq(s).missed and b.allocate([(s, 8)], 1, 1, 64).budgets[0] == 1
    tree_of(b, s, 1, 1)
    assert not b._seq(s).missed and b.allocate([(s, 8)], 1, 1, 64).budgets[0] > 1
    tree_of(b, s, 8, 0)
    with monkeypatch.context() as m:
        without_misses(m)
        assert b.allocate([(s, 8)], 1, 1, 64).budgets[0] >= 4
    alike = make_budget(measured_cpu_cost)
    teach_drafter(alike, "d", 0.8)
    tree_of(alike, s, 8, 0)
    assert alike.drafters["d"].miss_rate == alike.drafters["d"].depth_rate
    assert alike.allocate([(s, 8)], 1, 1, 64).budgets[0] == 8


def test_the_miss_term_pays_where_acceptance_comes_in_passages(monkeypatch):
    """Sequences going in and out of passages (0.95 per depth inside, 0.05 outside, a passage
    lasting ten steps on average) on this machine's cost curve: the miss term commits more tokens
    per second than the control without it; where every step accepts alike (luck) it costs
    little."""
    worlds = {"passages": passages(0.9, outside=0.05), "luck": lambda rng, steps: [0.6] * steps}
    with_misses = {name: simulate_goodput(measured_cpu_cost, w)[0] for name, w in worlds.items()}
    with monkeypatch.context() as m:
        without_misses(m)
        without = {name: simulate_goodput(measured_cpu_cost, w)[0] for name, w in worlds.items()}
    assert with_misses["passages"] > 1.02 * without["passages"]
    assert with_misses["luck"] > 0.98 * without["luck"]


def test_only_a_deep_tree_accepted_whole_starts_a_streak():
    """A one-node tree accepted is no streak (a learnt drafter's first token is accepted half the
    time or more); a deeper tree accepted whole is, the tree after it is what the drafter's streak
    rate learns from, and a tree accepted in part, or a step without a tree, ends it."""
    b = make_budget(cpu_cost)
    s = seqs_of(1)[0]
    dm = b._drafter("d")

    def tree(nodes: int, accepted: int) -> None:
        b.record(s, nodes)
        b.observe_draft("d", [s], [nodes], [nodes], 0.0001)
        b.observe_acceptance(s, accepted, nodes)   # a chain: as deep as its nodes

    tree(1, 1)
    tree(1, 1)
    assert not b._seq(s).streak and dm.streak_trials == 0
    tree(4, 4)
    assert b._seq(s).streak and dm.streak_trials == 0
    tree(4, 4)
    assert b._seq(s).streak and dm.streak_hits == 4
    tree(4, 1)
    assert not b._seq(s).streak and dm.streak_hits > 4
    tree(2, 2)
    b.record(s, 0)
    assert not b._seq(s).streak


def test_untried_sizes_get_an_optimistic_prior():
    b = make_budget(gpu_cost)
    dm = b._drafter("d")
    for _ in range(20):
        dm.observe(1, 1, 1)    # only size 1 ever tried: always accepted
    est = dm.accepted(b.sizes)
    assert est[0] == 0 and est[1] == pytest.approx(1, abs=0.05)
    assert est[2] > est[1] and est[4] > est[3] > est[2] >= prior_accepted(2)
    assert b.allocate([(s, 8) for s in seqs_of(1)], 1, 1, 64).budgets == {0: 8}


def simulate_phases(phases: list[float], seed: int, n: int = 6, steps: int = 60) -> list[float]:
    """One budget, batch 1, on this machine's step costs: `n` sequences of `steps` steps per phase,
    phase after phase (one dataset after another through one engine); a tree of 1 or 2 nodes is
    one deep, 4 nodes two, 8 nodes three (a learnt drafter's trees), each depth accepted with the
    phase's rate. Committed tokens per simulated second of each phase."""
    depth_of = {1: 1, 2: 1, 4: 2, 8: 3}
    b, rng = make_budget(measured_cpu_cost), random.Random(seed)
    out = []
    for k, rate in enumerate(phases):
        tokens = seconds = 0.0
        for s in seqs_of(n, start=1000 * k):
            for _ in range(steps):
                t, sec = simulated_step(b, s, rate, [rng.random() for _ in range(8)], measured_cpu_cost, depth_of)
                tokens += t
                seconds += sec
            b.forget(s)
        out.append(tokens / seconds)
    return out


def test_a_size_left_unused_is_tried_again_when_acceptance_rises(monkeypatch):
    """A drafter accepting 0.4 per depth, then 0.8 (one dataset, then another where its drafts fit):
    in the first phase deep trees do not pay and the allocator stops picking them; in the second
    they do (8 nodes: 2.95 tokens per 60 ms step against 1.8 per 44.5 ms for one node). With the
    stale sizes' evidence fading (`STALE_DECAY`) the second phase commits more than 5 % more tokens
    per second than the control, whose unused sizes keep the means of the first phase; where
    acceptance does not move, the fading costs at most 1 %."""
    from specserve.engine import budget as budget_mod
    seeds = (5, 6, 7)

    def run(phases):
        return [simulate_phases(phases, seed) for seed in seeds]

    shifted, flat = run([0.4, 0.8]), run([0.4])
    with monkeypatch.context() as m:
        m.setattr(budget_mod, "STALE_DECAY", 1.0)
        shifted_control, flat_control = run([0.4, 0.8]), run([0.4])
    assert sum(r[1] for r in shifted) > 1.05 * sum(r[1] for r in shifted_control)
    assert sum(r[0] for r in flat) > 0.99 * sum(r[0] for r in flat_control)


def test_sizes_stay_in_the_set_and_within_every_cap():
    rng = random.Random(1)
    b = make_budget(lambda n: 0.01 + 0.0001 * n, cap=10)
    seqs = seqs_of(12, "a") + seqs_of(12, "b", start=100)
    for step in range(120):
        live = [s for s in seqs if rng.random() < 0.8]
        caps = {s.seq_id: rng.choice([0, 1, 3, 5, 10, 10]) for s in live}
        max_total = rng.choice([0, 5, 16, 64])
        d = b.allocate([(s, caps[s.seq_id]) for s in live], len(live), len(live), max_total)
        assert set(d.budgets) == {s.seq_id for s in live}
        assert sum(d.budgets.values()) <= max_total
        for s in live:
            bud = d.budgets[s.seq_id]
            assert bud in budget_sizes(10) and bud <= caps[s.seq_id]
            b.record(s, bud)
            if bud:
                b.observe_draft(s.drafter, [s], [bud], [bud], 0.0002)
                b.observe_acceptance(s, rng.randint(0, bud) if s.drafter == "a" else 0)
        b.observe_step(len(live) + sum(d.budgets.values()), 0.01 + 0.0001 * (len(live) + sum(d.budgets.values())))


def test_deterministic_given_the_same_observations():
    def run() -> list[dict[int, int]]:
        rng = random.Random(7)
        b = GoodputBudget(8, 512)
        b.cost.calibrate({n: cpu_cost(n) * 0.2 for n in KNOTS})
        seqs = seqs_of(6)
        out = []
        for _ in range(50):
            d = run_step(b, seqs, accept=lambda s, bud: rng.randint(0, bud))
            b.observe_step(6 + sum(d.budgets.values()), rng.uniform(0.004, 0.02))
            out.append(dict(d.budgets))
        return out

    assert run() == run()


def test_drafter_cost_counts():
    """A drafter whose calls are expensive is not worth calling for one token; a cheap one is."""
    budgets = {}
    for name, seconds in (("cheap", 0.0001), ("costly", 0.05)):
        b = make_budget(lambda n: 0.02 + 0.0002 * n)
        teach_drafter(b, name, 0.5)
        seqs = seqs_of(4, name)
        for k in range(1, 30):
            b.observe_draft(name, seqs[:1 + k % 4], [2] * (1 + k % 4), [2] * (1 + k % 4), seconds)
        budgets[name] = b.allocate([(s, 8) for s in seqs], 4, 4, 64).budgets
    assert all(v > 0 for v in budgets["cheap"].values())
    assert all(v == 0 for v in budgets["costly"].values())


def level_cost(largest: int) -> float:
    """A drafter that drafts level by level over all its sequences (EAGLE): a fixed part, then one
    pass per level of the deepest tree asked for (a tree of n nodes log2(n) + 1 deep)."""
    return 0.001 + 0.002 * (largest.bit_length())


def free_node_slope(monkeypatch) -> None:
    """The control of the draft cost tests: the per-node slope as free as the other parameters (the
    cost model before it had per-size offsets: linear in nodes)."""
    import specserve.engine.budget as budget_mod

    monkeypatch.setattr(budget_mod, "DRAFT_NODE_PRECISION", 1e-3)


def check_level_cost_learnt(b: GoodputBudget) -> None:
    s = seqs_of(1)
    dm = b._drafter("d")
    for k in range(40):
        size = 1 + k % 2
        b.observe_draft("d", s, [size], [size], level_cost(size))
    assert dm.draft_seconds(1, 2, 2) == pytest.approx(level_cost(2), rel=0.05)
    unmeasured = dm.draft_seconds(1, 8, 8)
    assert level_cost(1) <= unmeasured <= level_cost(2) * 1.1 < level_cost(8)
    for _ in range(10):
        b.observe_draft("d", s, [8], [8], level_cost(8))
    assert dm.draft_seconds(1, 8, 8) == pytest.approx(level_cost(8), rel=0.05)
    assert dm.draft_seconds(1, 2, 2) == pytest.approx(level_cost(2), rel=0.05)


def test_draft_cost_follows_the_deepest_tree_asked_for(monkeypatch):
    """Measured at budgets 1 and 2 only (one sequence: node totals and tree sizes move together), a
    level-by-level drafter's cost at 8 is not extrapolated along nodes (8 x a 1-node call): it costs
    at most what the nearest measured size does until measured, then what it measured. With the
    per-node slope left free (the control), the same data extrapolates along nodes and fails."""
    check_level_cost_learnt(make_budget())
    free_node_slope(monkeypatch)
    with pytest.raises(AssertionError):
        check_level_cost_learnt(make_budget())


def test_draft_cost_per_node_is_learnt_from_batches():
    """A drafter whose calls cost per node (a model run over every draft row) is measured on batches
    of 1-16 sequences at budget 4: the cost of 16 sequences, and of 3, is predicted."""
    b = make_budget()
    seqs = seqs_of(16)

    def cost(n_seqs):
        return 0.001 + 0.0001 * n_seqs + 0.0005 * 4 * n_seqs

    for k in range(60):
        n = 1 + (k * 7) % 16
        b.observe_draft("d", seqs[:n], [4] * n, [4] * n, cost(n))
    dm = b._drafter("d")
    for n in (3, 16):
        assert dm.draft_seconds(n, 4 * n, 4) == pytest.approx(cost(n), rel=0.05)


# ---- the step cost model ---------------------------------------------------------------------------


def test_step_cost_calibration_and_online_correction():
    m = StepCostModel(512)
    m.calibrate({1: 0.02, 16: 0.05, 128: 0.3})
    assert m.predict(16) == pytest.approx(0.05) and m.predict(64) == pytest.approx(0.05 + 48 * 0.25 / 112)
    assert m.predict(512) > m.predict(256) > m.predict(128)              # extrapolated with the last slope
    for _ in range(200):     # real steps of 16 tokens carry 10 ms the calibration forward does not
        m.observe(16, 0.06)
    assert m.predict(16) == pytest.approx(0.06, abs=0.002)
    # moved elsewhere too, between a shared offset (0.31) and a slower machine (0.3 * 0.06 / 0.05)
    assert 0.31 < m.predict(128) < 0.36
    for _ in range(200):     # and a region that is really different keeps its own shape
        m.observe(128, 0.5)
        m.observe(16, 0.06)
    assert m.predict(128) == pytest.approx(0.5, abs=0.01) and m.predict(16) == pytest.approx(0.06, abs=0.003)
    values = [s for _, s in m.estimates()]
    assert values == sorted(values)


def check_scaled_machine(scale: float, tree_tokens: int) -> None:
    """Calibrated while the machine ran `scale` times as fast as it does now; then a batch of one:
    plain steps, and one step in ten verifying a tree of `tree_tokens` - 1 nodes."""
    def cost(n, trees=0):
        return 0.042 + 0.003 * (n - 1) + (0.003 if trees else 0.0)

    rng = random.Random(0)
    m = StepCostModel(16)
    m.calibrate({n: cost(n) * scale for n in (1, 2, 4, 8, 16)})
    for i in range(400):
        n, trees = (tree_tokens, 1) if i % 10 == 5 else (1, 0)
        m.observe(n, cost(n, trees) * rng.uniform(0.9, 1.1), trees)
    assert m.predict(1) == pytest.approx(cost(1), abs=0.001)
    assert m.predict(tree_tokens, 1) == pytest.approx(cost(tree_tokens, 1), abs=0.0015)
    for n in (2, 3, 5, 9, 17):    # every tree size the budget weighs, from the one size seen: never
        # charged much more than it costs (a size charged too much is not tried, so never measured);
        # somewhat less is corrected by the first trees of that size
        assert -0.15 < m.predict(n, 1) / cost(n, 1) - 1 < 0.05, n


@pytest.mark.parametrize("scale,tree_tokens", [(0.5, 9), (0.5, 2), (1.3, 9), (1.3, 2), (1.0, 9)])
def test_step_cost_follows_a_machine_slower_or_faster_than_at_calibration(scale, tree_tokens):
    """Most of a CPU's drift is memory bandwidth: every step slower alike. Seen at one size of tree,
    the step cost of the others follows (a small tree is not charged what a large one showed)."""
    check_scaled_machine(scale, tree_tokens)


def test_without_the_scale_a_slower_machine_mischarges_trees(monkeypatch):
    """The control: the step cost model with its scale pinned at 1 (as before it had one)."""
    import specserve.engine.budget as budget_mod

    monkeypatch.setattr(budget_mod, "STEP_SCALE_PRECISION", 1e9)
    with pytest.raises(AssertionError):
        check_scaled_machine(0.5, 9)


# a start-up calibration and the steps that followed it, batch 1, ngram on HumanEval (this CPU,
# 2026-11-24): prefill steps of ~150 tokens ran ~40 % above the calibrated curve, which the scale
# took up, so the 1-token and tree steps sat below the scaled curve and the tree terms' share of
# the difference came out negative
STARTUP_CALIBRATION = {1: 0.0499, 2: 0.0607, 4: 0.0705, 8: 0.0732, 16: 0.0835, 32: 0.1041, 64: 0.1453,
                       128: 0.2278, 256: 0.3928}
MEASURED_STEP = {1: 0.0514, 3: 0.0565, 5: 0.0660, 9: 0.0690, 150: 0.35}   # seconds; 2-9 verify one tree


def check_prefill_above_calibration() -> StepCostModel:
    rng = random.Random(0)
    m = StepCostModel(256)
    m.calibrate(STARTUP_CALIBRATION)
    for i in range(300):
        n = 150 if i % 64 == 0 else {3: 5, 6: 5, 9: 9}.get(i % 10, 1)   # a new request every 64 steps
        m.observe(n, MEASURED_STEP[n] * rng.uniform(0.95, 1.05), 1 if 1 < n < 150 else 0)
    assert min(m.tree_terms) >= 0.0
    assert m.predict(1) == pytest.approx(MEASURED_STEP[1], rel=0.05)
    assert m.predict(150) == pytest.approx(MEASURED_STEP[150], rel=0.1)
    for n in (5, 9):    # the tree sizes seen
        assert m.predict(n, 1) == pytest.approx(MEASURED_STEP[n], rel=0.08), n
    assert m.predict(3, 1) < 1.15 * MEASURED_STEP[3]    # and a size between, not seen
    return m


def test_tree_terms_are_fitted_non_negative_not_clipped():
    """Where tree steps come out below the fitted curve (prefill steps above the calibration raised
    its scale), the unconstrained fit gives the tree terms a negative share. They are held at 0 or
    above by refitting without them (the offsets take what they explained): every size seen is
    predicted within 8 %. The control clips them after the fit (as before): trees of 2-8 nodes
    predicted 15-20 ms (25-50 %) above what they cost, so the budget drafted too little."""
    check_prefill_above_calibration()


def test_clipping_the_tree_terms_after_the_fit_overcharges_trees(monkeypatch):
    from specserve.engine.budget import _Ridge

    def clipped(self, indices):
        return [max(0.0, x) if i in indices else x for i, x in enumerate(self.theta)]

    monkeypatch.setattr(_Ridge, "theta_nonnegative", clipped)
    with pytest.raises(AssertionError):
        check_prefill_above_calibration()


def test_step_cost_without_calibration_learns_from_steps():
    m = StepCostModel(256)
    for k in range(400):
        n = (1, 16, 48, 144)[k % 4]
        m.observe(n, cpu_cost(n))
    for n in (1, 16, 48, 144):
        assert m.predict(n) == pytest.approx(cpu_cost(n), rel=0.08)


def test_step_cost_learns_what_verifying_trees_costs():
    """Verification work per step with trees (beyond their tokens) is its own term, learnt from steps,
    and the allocator pays it: drafting stops where one tree's fixed cost exceeds what it gains."""
    m = StepCostModel(256)
    m.calibrate({n: cpu_cost(n) for n in KNOTS})
    for k in range(300):
        trees = k % 3
        n = 16 + 2 * trees
        m.observe(n, cpu_cost(n) + (0.02 + 0.001 * trees if trees else 0.0), trees)
    any_tree, per_tree = m.tree_terms
    assert any_tree + per_tree > 0.015
    for trees in (1, 2):
        n = 16 + 2 * trees
        assert m.predict(n, trees) == pytest.approx(cpu_cost(n) + 0.02 + 0.001 * trees, rel=0.05)
    assert m.predict(16) == pytest.approx(cpu_cost(16), rel=0.05)
    b = make_budget(gpu_cost)
    teach_drafter(b, "d", 0.5)
    seqs = seqs_of(4)
    assert all(b.allocate([(s, 8) for s in seqs], 4, 4, 64).budgets.values())
    for _ in range(300):
        b.observe_step(4, gpu_cost(4))
        b.observe_step(12, gpu_cost(12) + 0.02, 4)     # any tree: twice a plain step
    d = b.allocate([(s, 8) for s in seqs], 4, 4, 64)
    assert not any(v for i, v in d.budgets.items() if i not in d.probes)


def test_an_outlier_step_moves_the_estimate_little():
    m = StepCostModel(64)
    m.calibrate({1: 0.01, 64: 0.02})
    for _ in range(50):
        m.observe(8, m.predict(8))
    before = m.predict(8)
    m.observe(8, 100.0)       # a stall
    assert m.predict(8) < 2 * before


def test_calibration_is_short_and_stops_on_time():
    b = GoodputBudget(8, 512)
    calls = []
    now = [0.0]

    def profile(n):
        calls.append(n)
        now[0] += 0.001 * n
        return 0.001 * n

    points = b.calibrate(profile, 144, time_limit=1.0, clock=lambda: now[0])
    assert calls[:3] == [1, 1, 256]       # warm-up, then both ends of the decode range first
    assert list(points) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert b.cost.calibrated and b.cost.predict(64) == pytest.approx(0.064)
    calls.clear()
    now[0] = 0.0
    points = GoodputBudget(8, 512).calibrate(profile, 100, time_limit=0.135, clock=lambda: now[0])
    assert list(points) == [1, 8, 128]    # cut short by the time limit, still spanning the range
    assert GoodputBudget(8, 512).cost.calibration_order(100) == [1, 128, 8, 2, 32, 4, 16, 64]


# ---- configuration ---------------------------------------------------------------------------------


def test_config_draft_budget_and_the_older_switch():
    from specserve.engine.config import DRAFT_BUDGETS, EngineConfig
    from specserve.server import cli

    assert EngineConfig().draft_budget == "goodput"
    assert EngineConfig(adaptive_draft_length=True).draft_budget == "adaptive"
    assert EngineConfig(adaptive_draft_length=False).draft_budget == "fixed"
    assert EngineConfig(draft_budget="fixed", adaptive_draft_length=False).draft_budget == "fixed"
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(draft_budget="adaptive", adaptive_draft_length=False)
    with pytest.raises(ValueError, match="draft_budget"):
        EngineConfig(draft_budget="greedy")
    assert cli.DRAFT_BUDGETS == DRAFT_BUDGETS


def test_cli_flag_and_env(monkeypatch):
    from specserve.server import cli

    config = cli._engine_config(cli.build_parser().parse_args(["serve"]))
    assert config.draft_budget == "goodput"
    monkeypatch.setenv("SPECSERVE_DRAFT_BUDGET", "adaptive")
    assert cli._engine_config(cli.build_parser().parse_args(["serve"])).draft_budget == "adaptive"
    args = cli.build_parser().parse_args(["serve", "--draft-budget", "fixed"])
    assert cli._engine_config(args).draft_budget == "fixed"
    monkeypatch.delenv("SPECSERVE_DRAFT_BUDGET")
    args = cli.build_parser().parse_args(["serve", "--no-adaptive-draft-length"])
    assert cli._engine_config(args).draft_budget == "fixed"
    monkeypatch.setenv("SPECSERVE_DRAFT_BUDGET", "sometimes")
    with pytest.raises(SystemExit):
        cli.build_parser()


def test_bench_option():
    from specserve.bench import spec_decode

    args = spec_decode.build_parser().parse_args(["--draft-budget", "fixed"])
    assert args.draft_budget == ["fixed"] and args.adaptive_draft_length is None
    assert spec_decode.build_parser().parse_args([]).draft_budget == ["goodput"]


# ---- the engine ------------------------------------------------------------------------------------

def contexts_world(rng: random.Random) -> int:
    """An n-gram drafter's contexts, drawn afresh every step: its 4-token matches (accepted whole),
    its 1-token matches (rejected), no match (no tree)."""
    return rng.choice((4, 4, 1, 1, 0))


def simulate_contexts(told: bool, seed: int = 5, n: int = 4, steps: int = 80) -> tuple[float, GoodputBudget]:
    """Tokens committed per second of `n` sequences in `contexts_world` on this machine's cost curve,
    with the budget told each step's contexts or not."""
    rng, b = random.Random(seed), make_budget(measured_cpu_cost)
    seqs, tokens, seconds = seqs_of(n), 0.0, 0.0
    for _ in range(steps):
        contexts = {s.seq_id: contexts_world(rng) for s in seqs}
        decision = b.allocate([(s, 8) for s in seqs], n, n, 64, contexts if told else None)
        drafted = 0
        for s in seqs:
            budget = decision.budgets[s.seq_id]
            b.record(s, budget)
            if not budget:
                continue
            nodes = budget if contexts[s.seq_id] else 0
            b.observe_draft(s.drafter, [s], [budget], [nodes], 0.0001)
            if nodes:
                accepted = nodes if contexts[s.seq_id] == 4 else 0
                b.observe_acceptance(s, accepted, nodes)
                tokens, drafted = tokens + accepted, drafted + nodes
        step = measured_cpu_cost(n + drafted)
        b.observe_step(n + drafted, step, sum(1 for s in seqs if decision.budgets[s.seq_id]))
        tokens, seconds = tokens + n, seconds + step
    return tokens / seconds, b


def test_a_drafters_context_sizes_each_tree_by_its_own_record():
    """One drafter whose trees are accepted whole in one context and rejected in another (an n-gram
    drafter's long and short matches), the contexts mixed on every sequence from step to step. Told
    the context, the budget drafts 8 nodes in the good one, nothing in the bad one, and nothing
    where the drafter will return no tree, and commits more per second than the control that is not
    told (which sees one drafter accepting 40 % of its trees on average)."""
    told, b = simulate_contexts(True)
    blind, _ = simulate_contexts(False)
    assert told > 1.1 * blind
    assert {key[1] for key in b.contexts} == {0, 1, 4} and all(key[0] == "d" for key in b.contexts)
    assert b.contexts[("d", 4)].depth_rate > 0.9 > 0.2 > b.contexts[("d", 1)].depth_rate
    assert b.contexts[("d", 0)].context_tree_rate < 0.2 < 0.9 < b.contexts[("d", 4)].context_tree_rate
    s = seqs_of(1, start=50)[0]
    tree_of(b, s, 8, 3)               # not new (a new sequence is probed whatever its context)
    # (in context 1 one node can still pay: 3.5 ms for what the prior leaves of its rate, ~0.12 a token)
    assert b.allocate([(s, 8)], 1, 1, 64, {s.seq_id: 4}).budgets[s.seq_id] == 8
    assert b.allocate([(s, 8)], 1, 1, 64, {s.seq_id: 1}).budgets[s.seq_id] <= 1
    # a sequence's context and its own record: a tree rejected in context 1 leaves it a miss, but in
    # context 4 (whose trees after a miss were accepted whole) it still gets 8 nodes
    tree_of(b, s, 8, 0)
    assert b._seq(s).missed and b.allocate([(s, 8)], 1, 1, 64, {s.seq_id: 4}).budgets[s.seq_id] == 8


PLAIN: dict[tuple[int, ...], list[int]] = {}    # prompt -> plain greedy continuation


@register("test_budget_oracle")
class OracleChainDrafter(Drafter):
    """Drafts the plain greedy continuation as a chain, wrong at every fifth position."""

    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:]
            drafts = [(t + 1) % self.vocab if (seq.num_output_tokens + k) % 5 == 4 else t
                      for k, t in enumerate(truth[:budget])]
            trees.append(TokenTree.chain(seq.token_ids[-1], drafts) if drafts else None)
        return trees


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    import torch

    engine = make_llm_engine(tiny_llama_dir, [])
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (7, 21, 12, 30, 5)]
    plain = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for i, p in enumerate(prompts):
        PLAIN[tuple(p)] = plain[f"r{i}"]
    return prompts, plain


def cheap_steps(engine) -> None:
    """Make the engine's goodput budget see steps as nearly free whatever their tokens and trees (the
    tiny model's forward is so cheap that the verification of a tree costs more than it, so that
    drafting rarely pays there; these tests want drafts), and stop it learning from real timings."""
    budget = engine.scheduler.budget
    budget.cost.calibrate({1: 0.010, 512: 0.011})
    engine.scheduler.observe_step = lambda *args, **kwargs: None


def test_goodput_budget_is_lossless_and_drafts(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # with the real timings: lossless whatever it decides
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], draft_budget="goodput", num_speculative_tokens=8)
    assert engine.scheduler.draft_budget == "goodput" and engine.scheduler.budget.cost.calibrated
    assert run_requests(engine, prompts, params) == plain
    assert sum(engine.get_stats().drafters["test_budget_oracle"].budget_counts) > 0
    # where drafting pays, it drafts, and stays lossless
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle", "ngram"], draft_budget="goodput",
                             num_speculative_tokens=8)
    cheap_steps(engine)
    assert run_requests(engine, prompts, params) == plain
    assert run_requests(engine, prompts, params, prefix="r") == plain   # again, with learnt models
    for i, p in enumerate(prompts):     # the n-gram drafter through the same engine
        engine.add_request(f"n{i}", p, params, drafter="ngram")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
    assert got == {f"n{i}": plain[f"r{i}"] for i in range(len(prompts))}
    stats = engine.get_stats()
    oracle = stats.drafters["test_budget_oracle"]
    # it drafted, and well (how much depends on the timings the cost model sees: a loose bound)
    assert oracle.num_accepted_tokens > 0.3 * sum(map(len, plain.values()))
    counts = oracle.budget_counts
    assert sum(counts) > 0 and all(c == 0 for b, c in enumerate(counts) if b not in budget_sizes(8))
    assert stats.step_cost_tokens[:4] == [1, 2, 4, 8] and all(s > 0 for s in stats.step_cost_seconds)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@register("test_budget_always_wrong")
class AlwaysWrong(Drafter):
    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size

    def propose(self, seqs, budgets):
        return [TokenTree.chain(seq.token_ids[-1], [(PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])]
                                                     [seq.num_output_tokens] + 1) % self.vocab] * b)
                for seq, b in zip(seqs, budgets)]


def test_goodput_budget_stops_drafting_what_is_never_accepted(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_always_wrong"], num_speculative_tokens=8,
                             draft_budget="goodput")
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    st = engine.get_stats().drafters["test_budget_always_wrong"]
    assert st.num_accepted_tokens == 0
    decode_steps = sum(st.budget_counts)
    assert st.num_steps < 0.35 * decode_steps     # mostly no draft at all


@register("test_budget_context")
class ContextOracle(Drafter):
    """Tells context 1 at even output positions, where it drafts the plain continuation, and 2 at
    odd ones, where it drafts a wrong chain."""

    def __init__(self, ctx):
        self.vocab, self.told = ctx.model_config.vocab_size, 0

    def context_of(self, seq):
        self.told += 1
        return 1 + seq.num_output_tokens % 2

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:][:budget]
            drafts = truth if seq.num_output_tokens % 2 == 0 else [(t + 1) % self.vocab for t in truth]
            trees.append(TokenTree.chain(seq.token_ids[-1], drafts) if drafts else None)
        return trees


@register("test_budget_context_raises")
class ContextRaises(OracleChainDrafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.told = 0

    def context_of(self, seq):
        self.told += 1
        raise RuntimeError("no context today")


def test_the_engine_hands_drafter_contexts_to_the_budget(tiny_llama_dir, prompts_and_plain, caplog):
    """A drafter's contexts reach the budget, which learns acceptance per context, losslessly; a
    drafter whose `context_of` raises is asked once (logged), and goes on drafting from its record."""
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_context", "test_budget_context_raises"],
                             draft_budget="goodput", num_speculative_tokens=8)
    cheap_steps(engine)
    budget = engine.scheduler.budget
    assert run_requests(engine, prompts, params, drafter="test_budget_context") == plain
    assert engine.drafters["test_budget_context"].told > 0
    good, bad = budget.contexts[("test_budget_context", 1)], budget.contexts[("test_budget_context", 2)]
    assert good.depth_rate > 0.8 > 0.2 > bad.depth_rate
    assert engine.get_stats().drafters["test_budget_context"].num_accepted_tokens > 0
    with caplog.at_level("ERROR", logger="specserve"):
        assert run_requests(engine, prompts, params, drafter="test_budget_context_raises", prefix="x") == \
            {f"x{i}": plain[f"r{i}"] for i in range(len(prompts))}
    assert engine.drafters["test_budget_context_raises"].told == 1
    assert sum("failed to tell a context" in r.getMessage() for r in caplog.records) == 1
    assert engine.get_stats().drafters["test_budget_context_raises"].num_accepted_tokens > 0
    assert not any(key[0] == "test_budget_context_raises" for key in budget.contexts)


def test_fixed_and_adaptive_budgets_still_work(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for mode in ("fixed", "adaptive"):
        engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], draft_budget=mode)
        assert engine.scheduler.budget is None and engine.get_stats().step_cost_tokens == []
        assert run_requests(engine, prompts[:2], params) == {k: plain[k] for k in ("r0", "r1")}
        assert sum(engine.get_stats().drafters["test_budget_oracle"].budget_counts) > 0


def test_metrics_export_the_budgets_and_the_cost_model(tiny_llama_dir, prompts_and_plain):
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.server.metrics import ServerMetrics

    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], num_speculative_tokens=8, draft_budget="goodput")
    cheap_steps(engine)
    run_requests(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    front = SimpleNamespace(engine=engine, get_stats=engine.get_stats, drafter_names=engine.drafter_names,
                            max_model_len=engine.max_model_len)
    text = ServerMetrics(front, "tiny").exposition().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    name = "specserve_spec_decode_draft_budget_tokens"
    buckets = {float(dict(k)["le"]): v for (n, k), v in samples.items() if n == name + "_bucket"}
    assert sorted(buckets) == [0.0, 1.0, 2.0, 4.0, 8.0, float("inf")]
    counts = engine.get_stats().drafters["test_budget_oracle"].budget_counts
    count = samples[(name + "_count", (("drafter", "test_budget_oracle"),))]
    assert count == sum(counts) == buckets[float("inf")] > 0
    assert list(buckets.values()) == sorted(buckets.values())       # cumulative
    total = samples[(name + "_sum", (("drafter", "test_budget_oracle"),))]
    assert 0 < total <= 8 * count
    cost = {int(dict(k)["tokens"]): v for (n, k), v in samples.items() if n == "specserve_step_cost_estimate_seconds"}
    assert min(cost) == 1 and all(0 < v < 10 for v in cost.values())
    assert [cost[k] for k in sorted(cost)] == sorted(cost.values())
    assert "# HELP specserve_spec_decode_draft_budget_tokens" in text
