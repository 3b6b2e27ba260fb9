"""The goodput draft policy: each decoding sequence's node budget, to maximise the batch's
expected committed tokens per second.

Pure Python, deterministic given the same observations (ties go to the earlier sequence). Every
step, the budgets b_i of the candidates come from a small set of sizes (0, 1, 2, 4, 8, ... up to
num_speculative_tokens, so that a later step can capture one CUDA graph per size) and maximise

    G(b) = (C0 + sum_i E_i(b_i)) / (T_step(n0 + nodes, trees) + sum_d T_draft_d(calls of drafter d))

C0: the tokens the step commits anyway (one per decode or finishing prompt), n0 its tokens without
drafts. Three ideas make it:

1. One acceptance model. Verification stops at the first rejected depth, so a verified tree says,
   for each depth it reached, whether that depth was accepted given the ones above it were: the
   per-depth acceptance r_d. It is kept per key = (drafter, the drafter's context, the last
   outcome), where the context is what the drafter tells of its next tree (`Drafter.context_of`,
   e.g. the length of the suffix an n-gram drafter matched) and the last outcome is how the
   sequence's previous tree fared: accepted whole, partially, not at all, or no tree yet (first).
   A sequence's rate is its key's, moved by its own deviation from it, shrunk by W trials:

       r_d = r_key_d + sum(hit - r_key_d) / (trials_d + W),   r_key_d = (hits + P * r_key_{d-1}) / (trials + P)

   (sums over the sequence's own tested depths, the key's mean at each; r_key_0 = 1/2, one hit and
   one miss: a depth not measured yet is expected to accept as the one above it). A sequence that drafts in several
   contexts is judged against each context's rate, not against its average.

   and E_i(b) = P(tree | key) * sum_{d <= D(b)} prod_{j <= d} r_j, with D(b) the mean depth of the
   drafter's b-node trees (a chain, b, until measured) and P(tree | key) the share of its calls in
   that key that returned a tree (an n-gram drafter without a match returns none).

2. Two cost models, as measured (`cost.py`): a target step by its tokens and trees, calibrated at
   start-up and corrected online; each drafter's `propose` call by sequences, nodes and its largest
   size. The expected step time averages over whether any tree comes back (with probability
   prod_i (1 - P_i(tree)) the step is a plain one): averaging token counts instead would
   overcharge the jump a CPU forward makes from 1 token to 2.

3. Exploration by optimism. Each r_key_d is read at its upper confidence bound, its mean plus
   one standard deviation of its evidence (a Beta posterior's, about sqrt(r (1 - r) / (n + 1))),
   by one candidate of each drafter in a step, the one whose key has the least evidence (its
   first depth's trials); the others read their keys' means. One tree a step is enough to learn
   from, and in a crowd optimism for every key alike drafts where the means say it does not pay
   (an n-gram drafter has 5 contexts x 4 outcomes = 20 keys: at 16 streams nearly every sequence
   was the first of its key, and ngram read 0.92x plain under continuous admission). Evidence
   fades with time: a key's by KEY_DECAY per step its drafter serves in (a step with a candidate
   of that drafter: a drafter idle while others serve keeps what it learnt), a sequence's own by
   SEQ_DECAY per step it could draft. A depth, context or drafter not
   tried lately becomes uncertain again and is tried once optimism says it could pay, and a
   sequence left at 0 returns to its key's estimate, so nothing freezes on old text.

4. A sequence that may draft with several drafters (`--drafter auto`) comes as one candidate per
   drafter, each with its own key, evidence and cost; before the greedy moves it is given the one
   whose best tree alone would raise the step's goodput most (none, if no tree would), so the
   choice among drafters and the choice of K = 0 are one decision, renewed every step.

Allocation is greedy: from 0 everywhere, among the moves (one sequence raised to any larger size)
that raise G and earn at least the rate of a plain decode step of the sequences that decode after
this one (a step holding a prefill chunk commits few tokens in many seconds, and against its own
rate any draft would look worth its cost), take the one with the largest gain per draft node,
until none is left; the step's node cap and each sequence's cap bound it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from specserve.engine.draft_policy.base import Candidate, StepCaps, StepReport, budget_sizes
from specserve.engine.draft_policy.cost import DraftCostModel, StepCostModel, calibrate_step_cost

PRIOR_WEIGHT = 2.0   # P: trials a depth's prior counts for (the first depth's: one hit, one miss);
                     # P(tree) starts at 1 with the same weight
SEQ_WEIGHT = 4.0     # W: trials its key's rate counts for against a sequence's own deviation
SEQ_DECAY = 0.8      # a sequence's own evidence fades by this per step
SEQ_NEGLIGIBLE = 1e-4  # below this a sequence's own deviation moves no rate: it reads its key's
KEY_DECAY = 0.99     # a key's evidence fades by this per step of its drafter, a drafter's tree shapes per tree

FIRST, WHOLE, PARTIAL, NONE = "first", "whole", "partial", "none"


class _Evidence:
    """Per-depth acceptance counts (hits[d], trials[d] for depth d + 1) and trees per call, faded
    by `decay` per step up to the step asked for."""

    __slots__ = ("hits", "trials", "calls", "trees", "step", "decay")

    def __init__(self, depth: int, decay: float, step: int):
        self.hits, self.trials = [0.0] * depth, [0.0] * depth
        self.calls = self.trees = 0.0
        self.step, self.decay = step, decay

    def fade(self, step: int) -> "_Evidence":
        if step > self.step:
            f = self.decay ** (step - self.step)
            self.hits = [h * f for h in self.hits]
            self.trials = [t * f for t in self.trials]
            self.calls, self.trees, self.step = self.calls * f, self.trees * f, step
        return self

    def add(self, accepted: int, depth: int, less: list[float] | None = None) -> None:
        """A tree `depth` deep that accepted `accepted`: each depth it tested (up to the first
        rejection) is a trial, a hit when accepted; `less`: per-depth values to count hits against
        (a sequence's deviation from its key's means)."""
        for d in range(min(accepted + 1, depth, len(self.trials))):
            self.trials[d] += 1.0
            self.hits[d] += (d < accepted) - (less[d] if less is not None else 0.0)

    def p_tree(self) -> float:
        return (self.trees + PRIOR_WEIGHT) / (self.calls + PRIOR_WEIGHT)


@dataclass
class _Shape:
    """A drafter's trees per budget size: decayed sums of their depths and nodes, and their count."""

    depth: dict[int, float] = field(default_factory=dict)
    nodes: dict[int, float] = field(default_factory=dict)
    count: dict[int, float] = field(default_factory=dict)

    def mean(self, sums: dict[int, float], size: int) -> float:
        """The size itself (a chain of that many nodes) counts as one tree."""
        return (sums.get(size, 0.0) + size) / (self.count.get(size, 0.0) + 1.0)

    def add(self, size: int, depth: int, nodes: int) -> None:
        for sums, x in ((self.depth, depth), (self.nodes, nodes), (self.count, 1)):
            sums[size] = KEY_DECAY * sums.get(size, 0.0) + x


@dataclass
class _Seq:
    own: _Evidence
    outcome: str = FIRST
    key: tuple = ()      # its key at the last allocation
    pending: int = 0     # nodes granted and not yet verified


def expected_accepted(rates: list[float], depth: float) -> float:
    """Accepted draft tokens of a path `depth` deep (fractional: the last depth in part) that
    accepts depth d + 1 with probability rates[d] given the ones above it."""
    e, p, full = 0.0, 1.0, int(depth)
    for d in range(min(full, len(rates))):
        p *= rates[d]
        e += p
    if depth > full and full < len(rates):
        e += (depth - full) * p * rates[full]
    return e


class GoodputPolicy:
    """See the module docstring. `max_per_seq`: num_speculative_tokens; `max_step_tokens`: the
    most tokens a step can hold (the step cost model's range)."""

    reads_contexts = True    # the scheduler asks each drafter's context (`Drafter.context_of`)
    chooses_drafters = True  # a sequence with several drafters comes as one candidate per drafter

    def __init__(self, max_per_seq: int, max_step_tokens: int):
        self.sizes = budget_sizes(max_per_seq)
        self.depth = max(1, max_per_seq)
        self.step_cost = StepCostModel(max(max_step_tokens, 1))
        self.draft_cost: dict[str, DraftCostModel] = {}
        self.shapes: dict[str, _Shape] = {}
        self.keys: dict[tuple, _Evidence] = {}
        self.seqs: dict[tuple[int, str], _Seq] = {}   # (seq_id, drafter) -> its own evidence
        self.drafting: dict[int, str] = {}             # seq_id -> the drafter its last budget went to
        self.step = 0
        self.clock: dict[str, float] = {}   # drafter -> the steps it had candidates in (its keys' time)

    def calibrate(self, profile_forward: Callable[[int], float], max_tokens: int, **kwargs) -> dict[int, float]:
        """Set the step cost curve from timed forwards (`cost.calibrate_step_cost`)."""
        return calibrate_step_cost(self.step_cost, profile_forward, max_tokens, **kwargs)

    # ---- the acceptance model ----

    def _key(self, key: tuple) -> _Evidence:
        now = self.clock.get(key[0], 0)
        ev = self.keys.get(key)
        if ev is None:
            ev = self.keys[key] = _Evidence(self.depth, KEY_DECAY, now)
        return ev.fade(now)

    def _drafter_cost(self, name: str) -> DraftCostModel:
        model = self.draft_cost.get(name)
        if model is None:
            model = self.draft_cost[name] = DraftCostModel(self.sizes)
        return model

    @staticmethod
    def key_rates(key: _Evidence) -> tuple[list[float], list[float]]:
        """A key's per-depth acceptance: (means, upper confidence bounds)."""
        means, uppers, prior = [], [], 0.5
        for hits, trials in zip(key.hits, key.trials):
            n = trials + PRIOR_WEIGHT
            mean = (hits + PRIOR_WEIGHT * prior) / n
            means.append(mean)
            uppers.append(min(1.0, mean + math.sqrt(mean * (1.0 - mean) / (n + 1.0))))   # one sd above
            prior = mean   # a depth not measured yet is expected to accept as the one above it
        return means, uppers

    def rates(self, own: _Evidence, key: _Evidence, optimist: bool = True,
              key_rates: tuple[list[float], list[float]] | None = None) -> list[float]:
        """A sequence's per-depth acceptance: its key's upper bound (its mean, when not `optimist`)
        plus its own deviation from its key's means (`own.hits` holds hits less those means),
        shrunk by SEQ_WEIGHT trials. `key_rates`: `key_rates(key)` when already computed."""
        means, uppers = key_rates or self.key_rates(key)
        return [min(1.0, max(0.0, u + dev / (t + SEQ_WEIGHT)))
                for u, dev, t in zip(uppers if optimist else means, own.hits, own.trials)]

    def _seq_key(self, cand: Candidate) -> tuple[_Seq, _Evidence]:
        """The candidate's sequence state (its own evidence faded to now) and its key's evidence."""
        st = self.seqs.get((cand.seq_id, cand.drafter))
        if st is None:
            st = self.seqs[(cand.seq_id, cand.drafter)] = _Seq(_Evidence(self.depth, SEQ_DECAY, self.step))
        st.own.fade(self.step)
        st.key = (cand.drafter, cand.context, st.outcome)
        return st, self._key(st.key)

    def gains(self, cand: Candidate, st: _Seq, key: _Evidence, sizes: list[int], optimist: bool,
              memo: dict) -> tuple[list[float], list[float], float]:
        """(expected accepted tokens, expected draft nodes) for each of `sizes`, and P(tree), of
        `cand` (its state and key's evidence: `_seq_key`); the key read at its upper bound when
        `optimist`, else at its mean."""
        # within a step a key's rates and a drafter's tree shapes are the same for every sequence
        # reading them: computed once per step (`memo`, the allocation's)
        # and so are the gains of the sequences whose own evidence has faded to nothing (a crowd
        # that has not drafted for a while: their deviation moves no rate by 1e-4)
        alike = all(abs(dev) < SEQ_NEGLIGIBLE * (t + SEQ_WEIGHT) for dev, t in zip(st.own.hits, st.own.trials))
        shared = (id(key), optimist, tuple(sizes)) if alike else None
        if shared is not None and shared in memo:
            return memo[shared]
        key_rates = memo.get(id(key))
        if key_rates is None:
            key_rates = memo[id(key)] = self.key_rates(key)
        p = key.p_tree()
        rates = (key_rates[1] if optimist else key_rates[0]) if alike else self.rates(st.own, key, optimist, key_rates)
        shape = self.shapes.setdefault(cand.drafter, _Shape())
        means = memo.get((cand.drafter, tuple(sizes)))
        if means is None:
            means = memo[(cand.drafter, tuple(sizes))] = (
                [shape.mean(shape.depth, s) for s in sizes], [shape.mean(shape.nodes, s) for s in sizes])
        gains, best = [], 0.0
        for s, depth in zip(sizes, means[0]):
            best = max(best, min(float(s), p * expected_accepted(rates, depth)))
            gains.append(best)
        out = gains, [p * n for n in means[1]], p
        if shared is not None:
            memo[shared] = out
        return out

    # ---- the allocation ----

    @staticmethod
    def optimists(candidates: list[Candidate], keys: list[_Evidence]) -> set[int]:
        """The candidates (indices) that read their key (`keys`, in order) at its upper bound this
        step: one per drafter, the one whose key has the least evidence at its first depth (the
        earliest on a tie), and one per sequence: a sequence with several drafters lends its
        optimism to the least tried of them, the other drafters taking their next least tried
        candidate of another sequence, if any (the best of several upper bounds would favour
        drafting far more than any one of them)."""
        ranked: dict[str, list[tuple[float, int]]] = {}
        for i, (c, key) in enumerate(zip(candidates, keys)):
            ranked.setdefault(c.drafter, []).append((key.trials[0], i))
        for order in ranked.values():
            order.sort()
        chosen, taken = set(), set()
        for order in sorted(ranked.values()):   # the least tried drafter first
            for _, i in order:
                if candidates[i].seq_id not in taken:
                    chosen.add(i)
                    taken.add(candidates[i].seq_id)
                    break
        return chosen

    def allocate(self, candidates: list[Candidate], caps: StepCaps) -> list[int]:
        self.step += 1
        # a drafter's keys age by one step per step it serves in; a sequence's k drafters share its
        # step (1/k each), so that offering k of them explores no more than offering one
        alternatives: dict[int, int] = {}
        for c in candidates:
            alternatives[c.seq_id] = alternatives.get(c.seq_id, 0) + 1
        ticks: dict[str, float] = {}
        for c in candidates:
            ticks[c.drafter] = max(ticks.get(c.drafter, 0.0), 1.0 / alternatives[c.seq_id])
        for name, tick in ticks.items():
            self.clock[name] = self.clock.get(name, 0) + tick
        predict, memo, draft_memo = self.step_cost.predict, {}, {}

        def step_seconds(tokens: float) -> float:
            if tokens not in memo:
                memo[tokens] = predict(tokens)
            return memo[tokens]

        def draft_seconds(name: str, group: tuple[int, int, int]) -> float:
            key = (name, group)
            if key not in draft_memo:
                draft_memo[key] = self._drafter_cost(name).predict(*group)
            return draft_memo[key]

        any_tree, per_tree = self.step_cost.tree_terms
        cands = []   # [candidate, sizes, gains, nodes, index of its size now, P(tree)]
        keyed = [self._seq_key(c) for c in candidates]
        optimists = self.optimists(candidates, [key for _, key in keyed])
        shared: dict = {}   # what every candidate reads alike (`gains`)
        for i, (c, (st, key)) in enumerate(zip(candidates, keyed)):
            sizes = [s for s in self.sizes if s <= c.cap] if caps.max_total > 0 else [0]
            gains, nodes, p = (self.gains(c, st, key, sizes, i in optimists, shared) if len(sizes) > 1
                               else ([0.0], [0.0], 0.0))
            cands.append([c, sizes, gains, nodes, 0, p])
        n0 = float(caps.base_tokens)
        t0 = step_seconds(n0)

        def seconds(no_tree: float, extra: float, trees: float) -> float:
            """Expected step seconds: with probability `no_tree` no tree comes back (a plain step),
            else `extra` expected nodes among the trees that do, plus the trees' verification."""
            if no_tree >= 1.0:
                return t0
            some = 1.0 - no_tree
            return no_tree * t0 + some * (step_seconds(n0 + extra / some) + any_tree) + per_tree * trees

        commits, total, draft_s = float(caps.base_commits), 0, 0.0
        groups: dict[str, tuple[int, int, int]] = {}   # drafter -> (sequences, nodes, largest size)
        no_tree, extra, trees = 1.0, 0.0, 0.0
        goodput = commits / t0 if t0 > 0 else 0.0
        decode_rate = 0.0
        if caps.decode_rows and caps.base_tokens > caps.decode_rows:
            decode_rate = caps.decode_rows / step_seconds(float(caps.decode_rows))
        now_s = t0

        alone_memo: dict = {}

        def alone(entry: list, j: int) -> float | None:
            """The step's goodput with only this candidate's tree at sizes[j] (the greedy's first
            move), or None where that move is not taken (alike for candidates sharing their gains)."""
            c, sizes, gains, nodes, _, p = entry
            memo_key = (id(gains), j)
            if memo_key not in alone_memo:
                denom = seconds(1.0 - p, nodes[j], p) + draft_seconds(c.drafter, (1, sizes[j], sizes[j]))
                alone_memo[memo_key] = (None if denom <= 0 or gains[j] < decode_rate * (denom - t0)
                                        else (commits + gains[j]) / denom)
            return alone_memo[memo_key]

        self._choose(cands, alone, goodput)
        while True:
            best, best_score = None, 0.0
            for ci, (c, sizes, gains, nodes, cur, p) in enumerate(cands):
                g_seqs, g_nodes, g_top = groups.get(c.drafter, (0, 0, 0))
                d_now = draft_seconds(c.drafter, (g_seqs, g_nodes, g_top))
                no_tree2, trees2 = (no_tree * (1.0 - p), trees + p) if cur == 0 else (no_tree, trees)
                for j in range(cur + 1, len(sizes)):
                    more = sizes[j] - sizes[cur]
                    if total + more > caps.max_total:
                        break
                    gain = gains[j] - gains[cur]
                    extra2 = extra + nodes[j] - nodes[cur]
                    group = (g_seqs + (cur == 0), g_nodes + more, max(g_top, sizes[j]))
                    d_delta = draft_seconds(c.drafter, group) - d_now
                    denom = seconds(no_tree2, extra2, trees2) + draft_s + d_delta
                    if denom <= 0 or gain < decode_rate * (denom - now_s):
                        continue
                    g = (commits + gain) / denom
                    score = (g - goodput) / more
                    if score > best_score:
                        best, best_score = (ci, j, group, d_delta, no_tree2, extra2, trees2, g), score
            if best is None:
                break
            ci, j, group, d_delta, no_tree, extra, trees, goodput = best
            c = cands[ci]
            groups[c[0].drafter] = group
            commits += c[2][j] - c[2][c[4]]
            total += c[1][j] - c[1][c[4]]
            draft_s += d_delta
            now_s = seconds(no_tree, extra, trees) + draft_s
            c[4] = j
        out = [sizes[cur] for _, sizes, _, _, cur, _ in cands]
        for c, size in zip(candidates, out):
            if size or c.seq_id not in self.drafting:
                self.drafting[c.seq_id] = c.drafter
        return out

    @staticmethod
    def _choose(cands: list, alone, goodput: float) -> None:
        """One drafter for each sequence that comes with several (one candidate per drafter): the
        one whose best tree alone (`alone(entry, size index)`: the step's goodput with it) raises
        the step's goodput (`goodput`) most; the others are left at size 0. On a tie, or where none
        would raise it, the earlier candidate."""
        by_seq: dict[int, list[list]] = {}
        for entry in cands:
            by_seq.setdefault(entry[0].seq_id, []).append(entry)
        for group in by_seq.values():
            if len(group) < 2:
                continue
            best, best_g = group[0], goodput
            for entry in group:
                for j in range(1, len(entry[1])):
                    g = alone(entry, j)
                    if g is not None and g > best_g:
                        best, best_g = entry, g
            for entry in group:
                if entry is not best:
                    entry[1:4] = [[0], [0.0], [0.0]]

    # ---- observations ----

    def observe(self, report: StepReport) -> None:
        for seq_id, granted in report.granted.items():
            st = self.seqs.get((seq_id, self.drafting.get(seq_id)))
            if st is not None:
                st.pending = granted
        if report.seconds > 0:
            self.step_cost.observe(report.num_tokens, report.seconds, report.num_trees)
        for call in report.drafts:
            if call.seq_ids:
                self._drafter_cost(call.drafter).observe(len(call.seq_ids), sum(call.budgets),
                                                         max(call.budgets), call.seconds)
            for seq_id, nodes in zip(call.seq_ids, call.nodes):
                st = self.seqs.get((seq_id, call.drafter))
                if st is None or not st.pending:
                    continue
                key = self._key(st.key)
                key.calls += 1.0
                key.trees += nodes > 0
                if nodes == 0:
                    st.pending = 0
        for out in report.outcomes:
            st = self.seqs.get((out.seq_id, self.drafting.get(out.seq_id)))
            if st is None or not st.pending:
                continue
            key = self._key(st.key)
            st.own.add(out.accepted, out.depth, less=self.key_rates(key)[0])
            key.add(out.accepted, out.depth)
            self.shapes.setdefault(st.key[0], _Shape()).add(st.pending, out.depth, out.nodes)
            st.outcome = WHOLE if out.accepted >= out.depth else PARTIAL if out.accepted else NONE
            st.pending = 0
        for seq_id in report.finished:
            self.drafting.pop(seq_id, None)
            for name in self.clock:
                self.seqs.pop((seq_id, name), None)
