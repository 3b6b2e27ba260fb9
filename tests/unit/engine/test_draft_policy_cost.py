"""The goodput policy's step cost model through its public surface: calibration from timed forwards
(`calibrate_step_cost`, `StepCostModel.calibrate`) and prediction after real steps (`observe`)."""

from __future__ import annotations

from specserve.engine.draft_policy.cost import DraftCostModel, StepCostModel, calibrate_step_cost


def test_a_knot_timed_high_by_noise_does_not_raise_the_ones_after_it():
    # batch 1 on a CPU: 1 to 8 tokens cost about the same; the 2-token forward was timed high
    cost = StepCostModel(16)
    cost.calibrate({1: 0.034, 2: 0.041, 4: 0.032, 8: 0.034, 16: 0.045})
    values = dict(cost.estimates())
    assert all(a <= b for a, b in zip(list(values.values()), list(values.values())[1:]))   # non-decreasing
    assert values[8] < 0.036      # a running maximum would hold 41 ms from 2 tokens to 8
    assert values[16] == 0.045


def test_a_calibration_cut_short_keeps_the_small_knots():
    """The time limit stops the calibration; what it timed first are the small steps (batch 1)."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    def profile_forward(n: int) -> float:
        seconds = 0.030 + 0.002 * n
        now[0] += 3 * seconds           # a few repeats
        return seconds

    cost = StepCostModel(256)
    points = calibrate_step_cost(cost, profile_forward, 256, time_limit=1.0, clock=clock)
    assert [1, 2, 4, 8, 16, 32] == sorted(points)[:6]
    assert 256 not in points           # cut short before the largest
    # beyond the last knot timed, the curve goes on with the last slope
    last = max(points)
    assert abs(cost.predict(256) - (0.030 + 0.002 * 256)) < 1e-3
    assert cost.predict(256) > cost.predict(last)


def test_a_tree_term_seen_a_few_times_is_kept_over_many_plain_steps():
    """A crowd that drafts rarely: the few steps with trees show their extra cost, then hundreds of
    plain steps follow; the model still charges a tree what those steps showed."""
    cost = StepCostModel(64)
    curve = lambda n: 0.020 + 0.0025 * n
    cost.calibrate({n: curve(n) for n in (1, 2, 4, 8, 16, 32, 64)})
    for _ in range(5):
        cost.observe(16, curve(16))
        cost.observe(20, curve(20) + 0.015, num_trees=1)
    learnt = cost.predict(20, 1) - cost.predict(20)
    assert learnt > 0.010
    for _ in range(500):
        cost.observe(16, curve(16))
    assert cost.predict(20, 1) - cost.predict(20) > 0.8 * learnt


def test_a_one_off_slow_tree_step_is_not_learnt_and_a_repeated_one_is():
    """The first step verifying a tree on a GPU compiles kernels: 1 s against 2 ms. Learnt, it would
    say trees cost half a second, and since the policy then never drafts, it would never be tested
    again. Held back, it is forgotten when the next tree step is normal, and learnt (clamped) when
    the next one is slow too."""
    def fresh() -> StepCostModel:
        cost = StepCostModel(64)
        cost.calibrate({n: 0.010 for n in (1, 2, 4, 8, 16, 32, 64)})   # eager forwards; steps replay graphs
        for _ in range(60):
            cost.observe(1, 0.002)
        return cost

    cost = fresh()
    before = cost.predict(9, 1)
    assert before < 0.004
    cost.observe(9, 1.0, num_trees=1)
    assert cost.predict(9, 1) == before
    cost.observe(9, 0.003, num_trees=1)     # the next tree step is normal: the outlier is dropped
    cost.observe(9, 0.9, num_trees=1)       # a new one-off
    assert cost.predict(9, 1) < 0.004

    slow = fresh()
    slow.observe(9, 1.0, num_trees=1)
    slow.observe(9, 1.0, num_trees=1)       # twice in a row: trees really cost more
    assert 0.004 < slow.predict(9, 1) <= 4 * 0.0035
    assert slow.predict(1) < 0.0025         # plain steps keep their own estimate


def test_a_drafters_first_call_and_one_off_slow_calls_are_not_learnt():
    cost = DraftCostModel([1, 2, 4, 8])
    cost.observe(1, 8, 8, 0.5)                       # the first call: libraries initialised
    assert cost.predict(1, 8, 8) == 0.0
    for _ in range(30):
        cost.observe(1, 8, 8, 0.001)
    assert abs(cost.predict(1, 8, 8) - 0.001) < 2e-4
    cost.observe(1, 8, 8, 0.3)                       # a pause
    cost.observe(1, 8, 8, 0.001)
    assert abs(cost.predict(1, 8, 8) - 0.001) < 2e-4
    cost.observe(1, 8, 8, 0.010)
    cost.observe(1, 8, 8, 0.010)                     # the drafter got slower: learnt
    assert cost.predict(1, 8, 8) > 0.0012
