"""The goodput draft budget: how many draft-tree nodes each decoding sequence gets this step.

Pure Python (no torch), deterministic given the same observations (no randomness, ties go to the
earlier sequence). Every step the scheduler asks `GoodputBudget.allocate` for the budgets b_i of
the decoding sequences that have a drafter, maximising the expected committed tokens per second of
the whole batch:

    G(b) = (C0 + sum_i E_i(b_i)) / (E[T_step] + sum_d T_draft_d(seqs_d, nodes_d))

C0: tokens the batch commits anyway (one per decoding sequence or finishing prompt), E_i(b): expected
accepted draft tokens of sequence i for a budget of b nodes, T_step: seconds of a target step
(forward + verification + commit) as a function of its tokens and of the draft trees it verifies (a
fixed cost for having any, one per tree), T_draft_d: seconds of drafter d's `propose` call for its
sequences and node budgets (0 when it has none). The expectation is over whether trees come back
at all (a drafter may return none: an n-gram drafter without a match): with probability
prod_i (1 - P_i(tree)) the step is a plain one of n0 tokens (decode tokens and prefill chunks),
else it holds n0 plus the expected draft nodes given that some tree came; averaging token counts
instead would overcharge the jump a CPU forward makes from 1 token to 2.

Budgets come from a small fixed set of sizes (`budget_sizes`: 0, 1, 2, 4, 8, 16, 32 up to
`num_speculative_tokens`, which is a size too), so a later step can capture one CUDA graph per
size. Allocation is greedy: starting from 0 everywhere, among the moves (one sequence raised to
any larger size) that raise the batch goodput even when only GAIN_TRUST of their expected gain is
counted and that promise at least MIN_GAIN more accepted tokens, take the one with the largest
goodput gain per draft node, until none is left; the per-step node cap and each sequence's cap
(its num_speculative_tokens, tokens left, context room) bound it.

The models, all learnt online from what the engine observes:

* Step cost (`StepCostModel`): piecewise linear over knots at powers of two; calibrated at start-up
  from a few timed forwards (`ModelRunner.profile_forward`), then corrected by an exponentially
  weighted ridge fit of (tokens, seconds) of real steps: an offset per knot with a smoothness prior
  (neighbouring offsets alike), so the overhead real steps have and the calibration forward has not
  carries over to token counts not seen yet, while regions that are observed keep their own shape.
* Draft cost (`_DrafterModel.cost`): per drafter, seconds ~ a + b * sequences + c * node budget
  + e[the call's largest budget size], the same kind of weighted ridge fit over its `propose` calls
  (0 before the first: optimistic). A drafter that drafts level by level (EAGLE, a draft model's
  chain) runs one pass of its network per depth for all its sequences at once, so its cost follows
  the deepest tree it is asked for, and a tree of 8 nodes 4 deep costs it far less than 8 times a
  1-node tree; e has one offset per budget size, neighbouring offsets held alike, so a size not
  measured yet costs what the nearest measured one does (optimistic, as the acceptance prior is:
  measured once it is tried), and c is held near 0 unless calls with the same largest size but
  different node totals (a batch) show it.
* Acceptance, per drafter: for each budget size, the mean accepted draft tokens, nodes and depth of
  the trees it returned at that size (blended with an optimistic prior worth PRIOR_WEIGHT
  observations: a geometric chain accepting each token with PRIOR_ACCEPT_RATE while no smaller
  size is measured, else the largest measured smaller size's estimate scaled by the node ratio),
  and its per-depth acceptance rate (accepted depths over depths tested: verification stops at the
  first rejected depth; depths past a tree's end are not counted, so trees cut short by the budget
  do not read as rejections). A size's evidence fades by STALE_DECAY for every tree its drafter
  has at other sizes, so a size the allocator stopped picking on text where it did not pay (one
  dataset or user) returns towards its prior, which the sizes in use set, and is tried again once
  they say it could pay on the text of now, instead of keeping its old mean for good.
* Acceptance, per sequence: its chance that the drafter returns a tree at all (an n-gram drafter
  finds no match in many contexts), a multiplier (its recent accepted tokens over what the
  drafter's per-size means predicted for it), and its own per-depth rate (the drafter's as prior).
  E_i(b) = P(tree) * max(multiplier * drafter mean(b), chain(own rate, drafter depth(b))): the
  second term sees that a sequence whose drafts are accepted whole would gain from larger ones
  even where the drafter's mean for those sizes was measured on other sequences.
* Persistence, per drafter: how much of a sequence's own deviation from its drafter (in its
  multiplier and its own rate) carries over to its next tree, k in [0, 1], fitted on the drafter's
  trees (what the sequence's own record predicted against what its drafter's did, before each
  tree was verified). Where acceptance runs in streaks (n-grams inside a repeated passage) k stays
  near 1; where a learnt drafter's trees are accepted 0 to 4 tokens from one tree to the next on
  every sequence alike, k falls, and a sequence is neither left at 0 after two unlucky trees nor
  drafted deeper after one lucky tree (the winner's curse of picking sequences by noisy records).
* Streaks, per drafter: the per-depth rate of its trees drafted on the step right after their
  sequence's previous tree was accepted whole (`streak_rate`). Right after a whole tree a sequence
  expects at least a path accepting at that rate: an n-gram drafter inside a repeated passage has
  its next tree accepted whole most of the time, where neither its average tree nor a sequence's
  recent record (rejections just before the passage began) says so. A sequence that stops drafting
  for a step, or gets no tree, leaves its streak. Only a tree at least STREAK_MIN_DEPTH deep starts
  one: a learnt drafter's one-node trees are accepted whole half the time or more, which says
  little of the next tree, and counted as streaks they drew its sequences into larger trees that
  did not pay (eagle on the batch-1 grid, 3-7 % slower on each dataset).
* Misses, per drafter: the mirror of streaks, the per-depth rate of its trees drafted after their
  sequence's previous tree accepted nothing (`miss_rate`; steps without a tree in between do not
  end the miss, the next verified tree does). Until then the sequence expects only a path
  accepting at that rate: an n-gram drafter that left the passage it was copying has its next
  trees rejected too (0.33 accepted tokens per tree after a rejected one on HumanEval against 1.01
  over all, batch 1), so it is asked for a one-node tree, cheap to verify, whose acceptance ends
  the miss, where its per-size means and the sequence's decayed record would still promise a
  large one; a drafter whose trees after a miss accept as its others do (a learnt drafter on
  varied text) keeps its sizes.
* Contexts, per (drafter, context): a drafter may tell, before drafting, what kind of tree a
  sequence will get (`Drafter.context_of`: a small integer, e.g. the length of the suffix an n-gram
  drafter matched; `allocate`'s `contexts`). Then everything learnt of acceptance above (per-size
  means, depth, streak and miss rates, persistence, and the chance that a tree comes back at all,
  a mean over the context's calls instead of the sequence's own slow average) is learnt per
  context, from all the drafter's sequences, and a sequence is sized by its context of this step:
  an n-gram drafter's 4-token matches accept 2-5 tokens deep where its 1-token matches accept
  0.3-0.6 (the shared benchmark prompts, SmolLM2-135M, greedy), so the first get 8 nodes and the
  second one or none, where one record for both gave every tree a size between. The draft cost
  stays the drafter's; a sequence's own record (multiplier, own rate) spans its contexts.
* Realized share, per drafter (and context), in crowds: the tokens the trees the allocator picked
  among several sequences accepted over what it expected of them (`_DrafterModel.realized`),
  which scales every expectation in a step with more than one candidate. Picking the sequences
  whose estimates are highest reads noise as promise (the winner's curse), so the picked trees
  accept less than expected (an n-gram drafter at 16 streams on a CPU: 262 tokens where 402 were
  expected); the share takes that out, whatever its source, and rises above 1 where the estimates
  are pessimistic. A lone sequence is not picked from others, and there it is not applied.
* Exploration: sizes never tried get the optimistic prior; a sequence left at 0 is given a probe
  on its first decoding step, then after 16, 32, ... MAX_PROBE_PAUSE steps at 0 (the pause
  doubles with every probe; once the allocator picks the sequence by itself it starts over at
  FIRST_PROBE_PAUSE), so
  its estimates do not freeze -- a new sequence of a drafter whose acceptance was learnt on other
  text (another dataset, another user) gets measured at once. A probe has the size the allocator
  would pick were the sequence to accept as well as it may hope (its drafter's depth for the
  size): a 1-node probe tests one depth and could never show that a sequence accepts deep drafts,
  while a probe at the hopeful size feeds the sequence's own per-depth rate at every depth it
  reaches, and that rate (the chain term of E_i) is what lifts the larger sizes. A probe is made
  only where it could pay: were the sequence to accept that well, drafting it would raise the
  goodput (otherwise, as for a crowd on a CPU, it waits). The hope: PROBE_OPTIMISM per depth at
  first; once PROBE_POPULATION_MIN sequences of the drafter finished, at most the PROBE_QUANTILE of
  their own rates plus PROBE_MARGIN (a request unlike all before it is still found where drafting
  is cheap, as at batch 1, while a crowded step stops paying for probes no earlier sequence would
  have repaid); where the drafter tells a context, at most the per-depth rate of the earlier probes
  in that context (`probe_rate`, the optimism as its prior) plus PROBE_MARGIN: the finished
  sequences' rates span all contexts, and the context's trees come from sequences the allocator
  picked for their record, while its probes are what a probe there gets (an n-gram drafter's
  8-node probes at 16 streams on a CPU, hoping for the best sequences' rates, were mostly rejected
  whole and cost the step 3-5 %: GSM8K, SmolLM2-135M, greedy); and pulled towards the sequence's
  own rate as it gets measured (a sequence whose probe was rejected hopes for less the next time).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

BUDGET_SIZES = (0, 1, 2, 4, 8, 16, 32)
# allocation
GAIN_TRUST = 0.85           # a move is judged on this share of its expected gain (estimates are noisy;
                            # a move that only just pays on paper is more often a loss than a win)
MIN_GAIN = 0.05             # a move must promise this many more accepted tokens (cost-model noise margin)
# exploration
FIRST_PROBE_PAUSE = 8       # steps at 0 before a probe, after the allocator last drafted the sequence
MAX_PROBE_PAUSE = 128       # the pause doubles with every probe, up to this
PROBE_OPTIMISM = 0.9        # a probe is sized and made as if the sequence accepted at most this share per depth
PROBE_POPULATION = 32       # a drafter remembers the per-depth rates of this many finished sequences
PROBE_POPULATION_MIN = 8    # ... and bounds its probes' optimism by them once it has this many
PROBE_QUANTILE = 0.9        # the bound: this quantile of those rates ...
PROBE_MARGIN = 0.1          # ... plus this (text differs between requests: leave room above what was seen)
PROBE_SEQ_WEIGHT = 2.0      # depths tested of a sequence's own that weigh as much as that optimism
PROBE_PRIOR_WEIGHT = 2.0    # depths tested that the optimism counts for in a context's probe rate
MIN_RATE_TRIALS = 1.0       # a finished sequence's rate is remembered once it had a depth tested
# acceptance
PRIOR_ACCEPT_RATE = 0.7     # optimistic prior: a chain accepting each next token with this probability
PRIOR_WEIGHT = 0.25         # the prior counts as this many observations
MAX_EVIDENCE = 8.0          # a size's mean moves as an EMA of rate 1/MAX_EVIDENCE once it has that many
                            # (it must follow a change of the requests' text -- learnt on chat, then code --
                            # within the few trees a drafter gets to draft once its means say it does not pay)
STALE_DECAY = 0.98          # a size's evidence fades by this per tree of its drafter at other sizes
SEQ_DECAY = 0.7             # per-sequence sums decay by this per observation (about the last 3 steps)
SEQ_PRIOR = 1.0             # pseudo accepted tokens shrinking the per-sequence multiplier towards 1
MAX_MULTIPLIER = 4.0
TREE_RATE_SEQ = 0.3         # EMA rate of a sequence's chance of getting a tree
DEPTH_DECAY_SEQ = 0.8       # a sequence's per-depth acceptance counts decay by this per observation
DEPTH_DECAY_DRAFTER = 0.99  # its drafter's (the prior of the sequence's rate)
DEPTH_PRIOR_WEIGHT = 2.0    # trials the drafter's rate counts for in a sequence's
STREAK_PRIOR_WEIGHT = 2.0   # depths tested that the drafter's overall rate counts for in its rate after a whole tree
STREAK_MIN_DEPTH = 2        # a tree accepted whole starts a streak when it was at least this deep
MISS_PRIOR_WEIGHT = 2.0     # depths tested that the drafter's overall rate counts for in its rate after a rejected tree
TREE_RATE_DRAFTER = 0.05    # EMA rate of a drafter's chance of returning a tree (its new sequences' prior)
REALIZED_PRIOR = 4.0        # expected tokens the prior share 1 of what picked trees realize counts for
REALIZED_MIN = 0.25         # the share's bounds
REALIZED_MAX = 2.0
PERSISTENCE_PRIOR = 1.0     # how much of a sequence's own deviation from its drafter carries to its next tree
PERSISTENCE_WEIGHT = 2.0    # ... before evidence (all of it), worth this many squared tokens of deviation,
PERSISTENCE_DECAY = 0.995   # ... learnt per drafter from its trees (about the last 200), decaying by this per tree
# costs
STEP_FORGET = 0.98          # step cost fit: weight of an observation decays by this per step
STEP_SCALE_PRECISION = 0.05 # ... its scale of the calibrated curve held as weakly as one knot's offset
DRAFT_FORGET = 0.95         # draft cost fit: the same per `propose` call
DRAFT_NODE_PRECISION = 100.0 # ... its cost per node budget held near 0 this firmly (see `_draft_cost_prior`)
MAX_STEP_RATIO = 4.0        # a step slower than this times the estimate counts as this much (GC, noise)
CALIBRATION_SECONDS = 1.5   # start-up timing stops once it spent this long
UNCALIBRATED_FLAT = 32      # without calibration: T(n) ~ UNCALIBRATED_FLAT + n, scaled by the first step


def budget_sizes(max_per_seq: int) -> list[int]:
    """The budget sizes for a per-sequence maximum of `max_per_seq` nodes: BUDGET_SIZES up to it,
    and the maximum itself."""
    if max_per_seq <= 0:
        return [0]
    return sorted({s for s in BUDGET_SIZES if s < max_per_seq} | {max_per_seq})


def prior_accepted(size: int, rate: float = PRIOR_ACCEPT_RATE) -> float:
    """Expected accepted tokens of a `size`-node chain accepting each token with probability `rate`."""
    return rate * (1 - rate ** size) / (1 - rate) if size > 0 else 0.0


# ---- small weighted ridge regression -----------------------------------------------------------


class _Ridge:
    """Exponentially weighted ridge regression y ~ theta . phi with a Gaussian prior (mean 0,
    precision matrix `prior`, or its diagonal) forgotten towards itself:
    A = rho A + phi phi^T + (1 - rho) A0, b = rho b + phi y, theta = A^-1 b."""

    def __init__(self, prior: list[float] | list[list[float]], forget: float):
        k = len(prior)
        if prior and not isinstance(prior[0], list):
            prior = [[prior[i] if i == j else 0.0 for j in range(k)] for i in range(k)]
        self.prior = [list(row) for row in prior]
        self.forget = forget
        self.A = [list(row) for row in prior]
        self.b = [0.0] * k
        self.num_observations = 0
        self._theta: list[float] | None = [0.0] * k

    def update(self, phi: dict[int, float], y: float) -> None:
        rho, A, b = self.forget, self.A, self.b
        for i, (row, prior_row) in enumerate(zip(A, self.prior)):
            for j in range(len(row)):
                row[j] = rho * row[j] + (1 - rho) * prior_row[j]
            b[i] *= rho
        for i, x in phi.items():
            b[i] += x * y
            for j, z in phi.items():
                A[i][j] += x * z
        self.num_observations += 1
        self._theta = None

    @property
    def theta(self) -> list[float]:
        if self._theta is None:
            self._theta = _solve(self.A, self.b)
        return self._theta

    def theta_nonnegative(self, indices: Iterable[int]) -> list[float]:
        """The fit with theta[i] >= 0 for each i in `indices`: a coordinate the unconstrained fit
        puts below 0 is pinned at 0 and the rest refitted without it (active set, repeated until
        none is negative). Pinning after the fit instead would drop what that coordinate explained:
        where two terms are confounded (a tree's verification cost and the curve's slope, at batch
        1), the curve's share of it is left in the other."""
        indices, theta, pinned = tuple(indices), self.theta, set()
        while True:
            negative = [i for i in indices if i not in pinned and theta[i] < 0]
            if not negative:
                return theta
            pinned.update(negative)
            free = [i for i in range(len(self.b)) if i not in pinned]
            sub = _solve([[self.A[i][j] for j in free] for i in free], [self.b[i] for i in free])
            theta = [0.0] * len(self.b)
            for i, x in zip(free, sub):
                theta[i] = x


def _solve(A: list[list[float]], b: list[float]) -> list[float]:
    """x with A x = b (Gaussian elimination, partial pivoting; A is small and positive definite)."""
    n = len(b)
    m = [list(row) + [bi] for row, bi in zip(A, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        if abs(piv) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / piv
            if f:
                row, top = m[r], m[c]
                for k in range(c, n + 1):
                    row[k] -= f * top[k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        piv = m[c][c]
        x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / piv if abs(piv) >= 1e-300 else 0.0
    return x


def _hold_offsets_alike(prior: list[list[float]], first: int, end: int) -> None:
    """Add to the precision matrix `prior` a smoothness prior on the offsets first .. end - 1:
    precision 1 on each neighbouring difference (as much as one observation), 0.05 on each offset
    (held weakly near 0)."""
    for i in range(first, end):
        prior[i][i] += 0.05
        if i + 1 < end:
            prior[i][i] += 1.0
            prior[i + 1][i + 1] += 1.0
            prior[i][i + 1] -= 1.0
            prior[i + 1][i] -= 1.0


# ---- step cost -----------------------------------------------------------------------------------


class StepCostModel:
    """Seconds of one engine step (target forward, verification, commit) as a function of its
    tokens and of the draft trees it verifies: F(n) + any_tree * [a tree in it] + per_tree * trees.
    F is piecewise linear between knots 1, 2, 4, ... (the first power of two >= `max_tokens`),
    linear beyond the last; `calibrate` sets its base curve B, `observe` corrects all of it online:
    F(n) = B(n) * (1 + s) + offset(n), a scale s (the machine running slower or faster than when it
    was calibrated: most of a CPU's drift is memory bandwidth, which scales every step alike) and
    offsets at the knots (work the calibration forward does not do). The tree terms are the
    verification work a tree costs beyond its tokens (0 until observed), fitted non-negative
    (`_Ridge.theta_nonnegative`): clipped after an unconstrained fit instead, a negative share
    (tree steps below a curve whose scale prefill steps had raised) was dropped from the
    prediction, and trees were charged 25-50 % more than they cost."""

    def __init__(self, max_tokens: int):
        top = 1
        while top < max(1, max_tokens):
            top *= 2
        self.knots = [2 ** i for i in range(top.bit_length())]
        self.base: list[float] | None = None       # the calibrated (or scaled prior) curve at the knots
        self.calibrated = False
        k = len(self.knots)
        # offsets at the knots: neighbours alike (precision 1 on each difference), each held near 0
        # (precision 0.05: an offset seen at one knot carries over to knots a few doublings away,
        # fading, so neither a per-step overhead nor a calibration outlier is all of the answer);
        # then the two tree terms, held at 0 as firmly as neighbouring offsets are held alike: where
        # every step with a tree also has more tokens (batch 1) the data cannot tell them from the
        # curve, and the curve (calibrated) should explain it; where the number of trees varies at
        # similar token counts (larger batches) the data shows them
        # then the scale, held as weakly as one offset: a step slower than B(n) at one n is as
        # likely a slower machine (all of the curve, in proportion) as work B(n) misses (nearby);
        # without it a calibration made while the machine ran fast left the offsets to rise with n
        # against their smoothness, and the tree terms took the rest: small trees were charged
        # what large ones showed
        prior = [[0.0] * (k + 3) for _ in range(k + 3)]
        _hold_offsets_alike(prior, 0, k)
        prior[k][k] = 0.2          # a step-level cost (a CPU forward's path for non-decode rows) is
        prior[k + 1][k + 1] = 2.0  # likelier than one per tree where the data cannot tell them apart
        prior[k + 2][k + 2] = STEP_SCALE_PRECISION
        self._fit = _Ridge(prior, STEP_FORGET)
        self._values: list[float] | None = None
        self._tree_terms = (0.0, 0.0)

    # -- base curve --

    def calibrate(self, points: dict[int, float]) -> None:
        """Base curve from measured (tokens -> seconds) points: interpolated between them,
        extrapolated with the slope of the last two beyond, made non-decreasing."""
        pts = sorted((n, s) for n, s in points.items() if n > 0 and s > 0 and math.isfinite(s))
        if not pts:
            return
        self.base = _monotone([_interp(pts, k) for k in self.knots])
        self.calibrated = True
        self._values = None

    def calibration_order(self, max_tokens: int) -> list[int]:
        """Knots to time, most useful first: 1, the first covering `max_tokens`, then the middles
        (log scale), so a calibration cut short by its time limit still spans the decode range."""
        top = next((i for i, k in enumerate(self.knots) if k >= max_tokens), len(self.knots) - 1)
        order, spans = [0, top] if top else [0], [(0, top)]
        while spans:
            lo, hi = spans.pop(0)
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                spans += [(lo, mid), (mid, hi)]
        return [self.knots[i] for i in order]

    def _prior_base(self, n: float, seconds: float) -> list[float]:
        scale = seconds / (UNCALIBRATED_FLAT + n)
        return [scale * (UNCALIBRATED_FLAT + k) for k in self.knots]

    # -- online --

    def observe(self, num_tokens: int, seconds: float, num_trees: int = 0) -> None:
        if num_tokens <= 0 or not (seconds > 0) or not math.isfinite(seconds):
            return
        if self.base is None:   # no calibration: the prior shape, scaled to the first step seen
            self.base = self._prior_base(num_tokens, seconds)
            self._values = None
            return
        base = _interp_knots(self.knots, self.base, num_tokens)
        seconds = min(seconds, MAX_STEP_RATIO * max(self.predict(num_tokens, num_trees), base))
        k = len(self.knots)
        phi: dict[int, float] = {}
        for i, w in self._hat(num_tokens):
            phi[i] = phi.get(i, 0.0) + w
        if num_trees > 0:
            phi[k], phi[k + 1] = 1.0, float(num_trees)
        phi[k + 2] = base / self.base[0]      # the scale, in units of B(1): as one offset at 1 token
        self._fit.update(phi, seconds - base)
        self._values = None

    # -- prediction --

    def _hat(self, n: float) -> list[tuple[int, float]]:
        knots = self.knots
        if n <= knots[0]:
            return [(0, 1.0)]
        if n >= knots[-1]:
            return [(len(knots) - 1, 1.0)]
        j = max(0, int(math.floor(math.log2(n))))
        j = min(j, len(knots) - 2)
        w = (n - knots[j]) / (knots[j + 1] - knots[j])
        return [(j, 1.0 - w), (j + 1, w)]

    def _solve(self) -> None:
        base = self.base if self.base is not None else [UNCALIBRATED_FLAT + k for k in self.knots]
        k = len(self.knots)
        theta = self._fit.theta_nonnegative((k, k + 1))
        scale = theta[k + 2] / base[0]
        self._values = _monotone([max(1e-6, b * (1.0 + scale) + theta[i]) for i, b in enumerate(base)])
        self._tree_terms = (theta[k], theta[k + 1])

    @property
    def values(self) -> list[float]:
        """Current estimate of F at each knot (seconds)."""
        if self._values is None:
            self._solve()
        return self._values

    @property
    def tree_terms(self) -> tuple[float, float]:
        """(seconds a step with any draft tree costs extra, seconds each tree costs extra)."""
        if self._values is None:
            self._solve()
        return self._tree_terms

    def predict(self, num_tokens: float, num_trees: float = 0) -> float:
        t = _interp_knots(self.knots, self.values, num_tokens)
        if num_trees > 0:
            any_tree, per_tree = self._tree_terms
            t += any_tree + per_tree * num_trees
        return t

    def estimates(self) -> list[tuple[int, float]]:
        return list(zip(self.knots, self.values))


def _monotone(values: list[float]) -> list[float]:
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted `pts`; flat below the first, the last slope (>= 0) beyond
    (one point: proportional beyond it)."""
    if x <= pts[0][0]:
        return pts[0][1]
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


def _interp_knots(knots: list[int], values: list[float], x: float) -> float:
    if x <= knots[0]:
        return values[0]
    if x >= knots[-1]:
        if len(knots) == 1:
            return values[0]
        slope = max(0.0, (values[-1] - values[-2]) / (knots[-1] - knots[-2]))
        return values[-1] + slope * (x - knots[-1])
    j = min(int(math.floor(math.log2(x))), len(knots) - 2)
    w = (x - knots[j]) / (knots[j + 1] - knots[j])
    return values[j] + (values[j + 1] - values[j]) * w


# ---- per drafter and per sequence ------------------------------------------------------------------


@dataclass
class _SizeStats:
    accepted: float = 0.0      # mean accepted draft tokens when a tree came back (EMA once MAX_EVIDENCE seen)
    nodes: float = 0.0         # mean draft nodes of such trees
    depth: float = 0.0         # mean depth of such trees
    weight: float = 0.0        # observations (the prior's share fades as 1 / weight), at tree `last`
    last: int = 0              # its drafter's tree count at its last observation


def _size_curve(sizes: list[int], expected: list[float]) -> list[float]:
    """Expected accepted tokens per budget size from raw estimates: each at most its size, and
    never below a smaller size's (a larger budget can always draft the smaller tree)."""
    out, best = [], 0.0
    for s, e in zip(sizes, expected):
        best = max(best, min(float(s), e))
        out.append(best)
    return out


def _depth_trials(accepted: int, depth: int) -> int:
    """Depths a verification tested: each up to the first rejected one (or the tree's last)."""
    return max(1, min(accepted + 1, depth))


def chain_accepted(rate: float, depth: float) -> float:
    """Expected accepted tokens of a path `depth` deep accepting each next token with `rate`."""
    rate = min(max(rate, 0.0), 0.999)
    return rate * (1 - rate ** depth) / (1 - rate) if depth > 0 else 0.0


def _draft_cost_prior(num_sizes: int) -> list[list[float]]:
    """Prior precision of the draft cost fit's parameters (a, b, c, e_1 .. e_num_sizes): a, b
    nearly free; c held near 0 (DRAFT_NODE_PRECISION) so that where node totals and the largest
    size move together (one sequence) the per-size offsets explain the cost; the offsets near each
    other (precision 1 on each neighbouring difference, as one observation) and weakly near 0."""
    k = 3 + num_sizes
    prior = [[0.0] * k for _ in range(k)]
    prior[0][0] = prior[1][1] = 1e-3
    prior[2][2] = DRAFT_NODE_PRECISION
    _hold_offsets_alike(prior, 3, k)
    return prior


class _DrafterModel:
    def __init__(self, budget_sizes: Iterable[int]):
        self.sizes: dict[int, _SizeStats] = {}
        self.tree_rate = 1.0                                  # P(a tree comes back), the prior of new sequences
        self.cost_sizes = sorted({s for s in budget_sizes if s > 0}) or [1]
        # seconds ~ a + b * seqs + c * nodes + e[the call's largest budget size]
        self.cost = _Ridge(_draft_cost_prior(len(self.cost_sizes)), DRAFT_FORGET)
        self.depth_hits = 0.0                                 # accepted depths (decayed)
        self.depth_trials = 0.0                               # depths tested (decayed)
        self.seq_rates: deque[float] = deque(maxlen=PROBE_POPULATION)   # finished sequences' own rates
        self.streak_hits = 0.0                                # accepted depths of trees drafted right after
        self.streak_trials = 0.0                              # a wholly accepted one, and depths tested (decayed)
        self.miss_hits = 0.0                                  # the same for the first trees after
        self.miss_trials = 0.0                                # one that accepted nothing
        self.persist_xy = 0.0                                 # see `persistence` (decayed sums)
        self.persist_xx = 0.0
        self.tree_hits = 0.0                                  # a context's calls that returned a tree,
        self.tree_calls = 0.0                                 # and its calls (decayed; see `context_tree_rate`)
        self.trees = 0                                        # trees observed (see `_weight`)
        self.probe_hits = 0.0                                 # accepted depths of its probes' trees,
        self.probe_trials = 0.0                               # and their depths tested (decayed)
        self.realized_accepted = 0.0                          # accepted tokens of the trees the allocator
        self.realized_expected = 0.0                          # picked in a crowd, and what it expected of them

    @property
    def persistence(self) -> float:
        """k in [0, 1]: the share of a sequence's own deviation from its drafter's expectation that
        carries over to its next tree. A least-squares fit through the origin of (accepted - the
        drafter's expectation) on (the sequence's own expectation - the drafter's), both made before
        the tree was verified, over this drafter's recent trees, with a prior of PERSISTENCE_PRIOR
        worth PERSISTENCE_WEIGHT. Where acceptance runs in streaks (an n-gram drafter inside a
        repeated passage) k is near 1; where one tree's luck says little about the next (a learnt
        drafter on varied text) k is near 0, and a sequence is not starved of drafts by one miss nor
        overdrafted after one lucky tree. Selecting which sequences draft by their own expectation
        does not bias the fit: it conditions on the regressor, not on the outcome."""
        k = (self.persist_xy + PERSISTENCE_WEIGHT * PERSISTENCE_PRIOR) / (self.persist_xx + PERSISTENCE_WEIGHT)
        return min(1.0, max(0.0, k))

    def observe_persistence(self, own: float, drafter: float, accepted: float) -> None:
        x = own - drafter
        self.persist_xy = PERSISTENCE_DECAY * self.persist_xy + x * (accepted - drafter)
        self.persist_xx = PERSISTENCE_DECAY * self.persist_xx + x * x

    def probe_optimism(self) -> float:
        """The per-depth rate a probe of a sequence without evidence of its own hopes for:
        PROBE_OPTIMISM, bounded once PROBE_POPULATION_MIN sequences finished by the
        PROBE_QUANTILE of their own rates plus PROBE_MARGIN (where no sequence of this drafter
        came near the rate that would make drafting pay, probing another one is a known loss)."""
        if len(self.seq_rates) < PROBE_POPULATION_MIN:
            return PROBE_OPTIMISM
        rates = sorted(self.seq_rates)
        q = rates[min(len(rates) - 1, int(PROBE_QUANTILE * len(rates)))]
        return min(PROBE_OPTIMISM, q + PROBE_MARGIN)

    @property
    def depth_rate(self) -> float:
        """P(the next depth is accepted | the ones above were): over its trees, depths past a
        tree's end not counted (so a cap that cut the trees short does not read as rejection)."""
        return (self.depth_hits + PRIOR_ACCEPT_RATE) / (self.depth_trials + 1.0)

    @property
    def streak_rate(self) -> float:
        """The per-depth rate of this drafter's trees drafted on the step right after their
        sequence's previous tree was accepted whole, its overall rate as the prior (worth
        STREAK_PRIOR_WEIGHT depths). Inside a passage the text repeats (code, a quoted document)
        an n-gram drafter's trees come in streaks: one accepted whole says the next will mostly be
        too (0.86-0.89 per depth on HumanEval against 0.3-0.6 after a rejection, both n-gram
        drafters, batch 1), while the drafter's average over every tree, and a sequence's own rate
        over its last few, are far lower. A drafter whose trees are alike whatever came before
        learns a streak rate near its overall one, which adds nothing."""
        return (self.streak_hits + STREAK_PRIOR_WEIGHT * self.depth_rate) / (self.streak_trials + STREAK_PRIOR_WEIGHT)

    def observe_streak(self, accepted: int, depth: int) -> None:
        """A tree drafted right after its sequence's previous one was accepted whole."""
        self.streak_hits = DEPTH_DECAY_DRAFTER * self.streak_hits + accepted
        self.streak_trials = DEPTH_DECAY_DRAFTER * self.streak_trials + _depth_trials(accepted, depth)

    @property
    def miss_rate(self) -> float:
        """The per-depth rate of this drafter's trees drafted after their sequence's previous tree
        accepted nothing (the first tree verified after it, steps without one between or not), its
        overall rate as the prior (worth MISS_PRIOR_WEIGHT depths). The mirror of `streak_rate`: where acceptance comes
        in passages (an n-gram drafter in code) a rejected tree says the next one will mostly be
        rejected too, while the drafter's per-size means and the sequence's decayed record still
        promise what its trees accept inside a passage."""
        return (self.miss_hits + MISS_PRIOR_WEIGHT * self.depth_rate) / (self.miss_trials + MISS_PRIOR_WEIGHT)

    def observe_miss(self, accepted: int, depth: int) -> None:
        """The first tree verified after its sequence's previous one accepted nothing."""
        self.miss_hits = DEPTH_DECAY_DRAFTER * self.miss_hits + accepted
        self.miss_trials = DEPTH_DECAY_DRAFTER * self.miss_trials + _depth_trials(accepted, depth)

    def probe_rate(self, prior: float) -> float:
        """The per-depth rate of the probes' trees, `prior` worth PROBE_PRIOR_WEIGHT depths."""
        return (self.probe_hits + PROBE_PRIOR_WEIGHT * prior) / (self.probe_trials + PROBE_PRIOR_WEIGHT)

    def observe_probe(self, accepted: int, depth: int) -> None:
        self.probe_hits = DEPTH_DECAY_DRAFTER * self.probe_hits + accepted
        self.probe_trials = DEPTH_DECAY_DRAFTER * self.probe_trials + _depth_trials(accepted, depth)

    @property
    def realized(self) -> float:
        """The share of its expected accepted tokens that the trees the allocator picked among
        several sequences got: the tokens they accepted over what `_expected` promised for them
        before verification, with a prior of 1 worth REALIZED_PRIOR expected tokens, within
        [REALIZED_MIN, REALIZED_MAX]. Picking the sequences whose estimates are highest reads their
        noise as promise (the winner's curse), the more so the more sequences there are to pick
        from, and the picked trees accept less than expected: an n-gram drafter's at 16 streams
        on a CPU got 262 tokens where 402 were expected, and trees that paid on paper lost in the
        step. Measured and applied per drafter and context, in crowds only (a lone sequence is not
        picked from others: applied at batch 1 too, the share cut eagle's and medusa's speedups
        on MT-Bench and HumanEval from 1.12-1.30x to 1.00-1.12x)."""
        share = (self.realized_accepted + REALIZED_PRIOR) / (self.realized_expected + REALIZED_PRIOR)
        return min(REALIZED_MAX, max(REALIZED_MIN, share))

    def observe_realized(self, expected: float, accepted: int) -> None:
        self.realized_accepted = DEPTH_DECAY_DRAFTER * self.realized_accepted + accepted
        self.realized_expected = DEPTH_DECAY_DRAFTER * self.realized_expected + expected

    @property
    def context_tree_rate(self) -> float:
        """P(a tree comes back) for the sequences of a drafter's context (see `GoodputBudget`):
        its calls' share that returned one, with an optimistic prior worth one call. The context
        says it for every sequence alike (an n-gram drafter with no recurring suffix returns none),
        so it is a mean over the context's calls, not a sequence's slow average over its own."""
        return (self.tree_hits + 1.0) / (self.tree_calls + 1.0)

    def observe_tree(self, got: bool) -> None:
        self.tree_hits = DEPTH_DECAY_DRAFTER * self.tree_hits + got
        self.tree_calls = DEPTH_DECAY_DRAFTER * self.tree_calls + 1.0

    def _weight(self, st: _SizeStats) -> float:
        """A size's evidence now: its observations, faded by STALE_DECAY for every tree its drafter
        had at other sizes since the last one. Acceptance moves with the text (one dataset, user or
        task after another); the sizes in use follow it, while a size the allocator stopped picking
        would keep the mean it had when it stopped -- measured on other text -- and never be tried
        again. Faded, its estimate returns towards the prior, which the sizes in use set (a smaller
        size's current estimate scaled by the node ratio), so it is tried again once they say it
        could pay, and measured anew."""
        return st.weight * STALE_DECAY ** (self.trees - st.last)

    def observe(self, size: int, accepted: int, nodes: int, depth: int | None = None) -> None:
        st = self.sizes.setdefault(size, _SizeStats())
        self.trees += 1
        st.weight = min(1e6, self._weight(st) + 1.0)
        st.last = self.trees
        rate = max(1.0 / st.weight, 1.0 / MAX_EVIDENCE)
        depth = depth if depth is not None else nodes
        st.accepted += rate * (accepted - st.accepted)
        st.nodes += rate * (nodes - st.nodes)
        st.depth += rate * (depth - st.depth)
        self.depth_hits = DEPTH_DECAY_DRAFTER * self.depth_hits + accepted
        self.depth_trials = DEPTH_DECAY_DRAFTER * self.depth_trials + _depth_trials(accepted, depth)

    def _toward_size(self, size: int, value: Callable[[_SizeStats], float]) -> float:
        """`value` of a size's trees (their mean depth or nodes) blended with the size itself (a chain
        of that many nodes, the prior, worth PRIOR_WEIGHT observations) by the size's evidence now."""
        st = self.sizes.get(size)
        if st is None:
            return float(size)
        w = self._weight(st)
        return (PRIOR_WEIGHT * size + w * value(st)) / (PRIOR_WEIGHT + w)

    def depths(self, sizes: list[int]) -> list[float]:
        """Expected tree depth for each budget size (the size itself until measured: a chain)."""
        return [self._toward_size(s, lambda st: st.depth) for s in sizes]

    def accepted(self, sizes: list[int]) -> list[float]:
        """Expected accepted tokens given a tree, for each of `sizes` (all budget sizes up to some
        cap, ascending): the measured mean blended with a prior, never below what a smaller size gets
        (a larger budget never hurts). The prior is optimistic but consistent with what smaller
        sizes measured: a geometric chain while none did, else the largest measured smaller size's
        estimate scaled by the node ratio (each extra node at most as useful as the average one)."""
        out, best = [], 0.0
        ref: tuple[int, float] | None = None   # the largest measured size so far and its estimate
        for s in sizes:
            if s == 0:
                out.append(0.0)
                continue
            prior = prior_accepted(s) if ref is None else ref[1] * s / ref[0]
            prior = min(prior, float(s))
            st = self.sizes.get(s)
            if st is None:
                est = prior
            else:
                w = self._weight(st)
                est = (PRIOR_WEIGHT * prior + w * st.accepted) / (PRIOR_WEIGHT + w)
                if w >= 1:
                    ref = (s, est)
            best = max(best, min(est, float(s)))
            out.append(best)
        return out

    def nodes(self, sizes: list[int]) -> list[float]:
        """Expected draft nodes of a tree for each budget size (the size itself until measured)."""
        return [self._toward_size(s, lambda st: st.nodes) for s in sizes]

    def _cost_phi(self, num_seqs: int, num_nodes: int, largest: int) -> dict[int, float]:
        # the offset of the smallest budget size holding `largest` (the last one beyond them all)
        j = next((i for i, s in enumerate(self.cost_sizes) if s >= largest), len(self.cost_sizes) - 1)
        return {0: 1.0, 1: float(num_seqs), 2: float(num_nodes), 3 + j: 1.0}

    def draft_seconds(self, num_seqs: int, num_nodes: int, largest: int) -> float:
        """Seconds of one `propose` call for `num_seqs` sequences with `num_nodes` node budget in
        all, the largest of them `largest`."""
        if num_seqs <= 0:
            return 0.0
        theta = self.cost.theta
        return max(0.0, sum(theta[i] * x for i, x in self._cost_phi(num_seqs, num_nodes, largest).items()))

    def observe_cost(self, num_seqs: int, num_nodes: int, largest: int, seconds: float) -> None:
        self.cost.update(self._cost_phi(num_seqs, num_nodes, largest), seconds)


@dataclass
class _SeqState:
    tree_rate: float = 1.0     # P(its drafter proposes a tree)
    acc_sum: float = 0.0       # decayed sum of its accepted tokens (steps with a tree)
    size_weights: dict = field(default_factory=dict)   # budget size -> decayed count of those steps
    idle: int = 0              # consecutive steps at 0 while it could have drafted
    pause: int = FIRST_PROBE_PAUSE
    probing: bool = False      # this step's budget is a probe
    pending: int = 0           # the size granted this step, until its outcome is known
    pending_nodes: int = 0
    pending_probe: bool = False   # ... and whether it was a probe
    expected: dict = field(default_factory=dict)   # budget size -> accepted tokens expected this step in a
                                                   # crowd (before the drafter's `realized` share)
    pending_expected: float | None = None          # ... for the size granted, the allocator's own pick
    depth_hits: float = 0.0    # its accepted depths (decayed)
    depth_trials: float = 0.0  # its depths tested (decayed)
    streak: bool = False       # its tree of the step just before was accepted whole (and deep enough)
    missed: bool = False       # its last tree accepted nothing (until its next tree is verified)
    context: int | None = None          # its drafter's context this step (`allocate`'s `contexts`)
    pending_context: int | None = None  # ... of the tree granted this step, until its outcome is known

    def multiplier(self, estimates: dict[int, float]) -> float:
        """Its recent accepted tokens over what its drafter's current per-size `estimates` predict
        for the same steps (recomputed each time: no stale predictions from the drafter's first,
        optimistic, steps), shrunk towards 1 by SEQ_PRIOR tokens."""
        pred = sum(w * estimates.get(size, 0.0) for size, w in self.size_weights.items())
        return min(MAX_MULTIPLIER, (self.acc_sum + SEQ_PRIOR) / (pred + SEQ_PRIOR))

    def depth_rate(self, prior: float) -> float:
        return (self.depth_hits + DEPTH_PRIOR_WEIGHT * prior) / (self.depth_trials + DEPTH_PRIOR_WEIGHT)

    def hopeful_rate(self, optimism: float) -> float:
        """The rate a probe of this sequence hopes for: its drafter's probe optimism, pulled towards
        its own measured rate as its own evidence grows (a sequence whose last probe was rejected
        hopes for less the next time, and a crowded step stops paying for its probes)."""
        return (self.depth_hits + PROBE_SEQ_WEIGHT * optimism) / (self.depth_trials + PROBE_SEQ_WEIGHT)


@dataclass
class BudgetDecision:
    """What `allocate` chose, for tests and debugging."""

    budgets: dict[int, int] = field(default_factory=dict)    # seq_id -> nodes
    goodput: float = 0.0                                     # expected committed tokens per second
    step_seconds: float = 0.0                                # the cost model's estimate of the step
    probes: list[int] = field(default_factory=list)          # seq_ids given a probe budget


class GoodputBudget:
    """See the module docstring. `max_per_seq`: num_speculative_tokens; `max_step_tokens`: the
    most tokens a step can hold (the cost model's range)."""

    def __init__(self, max_per_seq: int, max_step_tokens: int):
        self.sizes = budget_sizes(max_per_seq)
        self.cost = StepCostModel(max(max_step_tokens, 1))
        self.drafters: dict[str, _DrafterModel] = {}
        self.contexts: dict[tuple[str, int], _DrafterModel] = {}   # (drafter, context) -> its acceptance
        self.seqs: dict[int, _SeqState] = {}
        self.last: BudgetDecision | None = None

    # ---- calibration ----

    def calibrate(self, profile_forward: Callable[[int], float], max_tokens: int,
                  time_limit: float = CALIBRATION_SECONDS, clock: Callable[[], float] | None = None) -> dict[int, float]:
        """Time forwards of 1 token and of the first knot covering `max_tokens` (the largest decode
        step), then of the knots between, while under `time_limit` seconds, with
        `profile_forward(n) -> seconds`, and set the base cost curve from them. Returns the points."""
        import time

        clock = clock or time.perf_counter
        start = clock()
        profile_forward(1)                   # warm-up, discarded
        points: dict[int, float] = {}
        for n in self.cost.calibration_order(max(1, max_tokens)):
            points[n] = float(profile_forward(n))
            if len(points) >= 2 and clock() - start > time_limit:
                break
        self.cost.calibrate(points)
        return dict(sorted(points.items()))

    # ---- models ----

    def _drafter(self, name: str) -> _DrafterModel:
        model = self.drafters.get(name)
        if model is None:
            model = self.drafters[name] = _DrafterModel(self.sizes)
        return model

    def _acceptance(self, name: str, context: int | None) -> _DrafterModel:
        """The model whose acceptance estimates hold for a sequence of drafter `name` in `context`:
        the drafter's own without one, else one per (drafter, context) (their draft costs stay the
        drafter's)."""
        if context is None:
            return self._drafter(name)
        model = self.contexts.get((name, context))
        if model is None:
            model = self.contexts[(name, context)] = _DrafterModel(self.sizes)
        return model

    def _seq(self, seq) -> _SeqState:
        st = self.seqs.get(seq.seq_id)
        if st is None:
            # idle == pause: a new sequence may be probed on its first decoding step
            st = self.seqs[seq.seq_id] = _SeqState(tree_rate=self._drafter(seq.drafter).tree_rate,
                                                   idle=FIRST_PROBE_PAUSE)
        return st

    def forget(self, seq) -> None:
        """`seq` finished (or left): its own per-depth rate joins its drafter's population."""
        st = self.seqs.pop(seq.seq_id, None)
        drafter = getattr(seq, "drafter", None)
        if st is not None and drafter is not None and st.depth_trials >= MIN_RATE_TRIALS:
            self._drafter(drafter).seq_rates.append(st.depth_hits / st.depth_trials)

    def _expected(self, st: _SeqState, dm: _DrafterModel, sizes: list[int], *ks: float,
                  streaks: bool = True, misses: bool = True) -> list[list[float]]:
        """Expected accepted tokens of a sequence, given a tree, for each budget size: the better of
        two estimates, its drafter's per-size curve times the sequence's multiplier, and a path as
        deep as its drafter's trees of that size accepting each depth at the sequence's own
        per-depth rate (which sees that a sequence whose drafts are accepted whole would gain from
        larger ones); and right after a tree accepted whole, a path accepting each depth at its
        drafter's `streak_rate` (what its trees after a whole one measured). After a tree that
        accepted nothing, until its next tree is verified, only a path accepting each depth at its
        drafter's `miss_rate`, for every k: a drafter whose trees after a miss are rejected too
        (an n-gram drafter that left the passage it was copying) is then asked for a one-node
        tree, cheap to verify, whose acceptance ends the miss, instead of the large tree its
        per-size means and the sequence's decayed record would still promise; a drafter whose
        trees after a miss accept as the others (a learnt drafter) keeps its sizes. One curve for
        each of `ks`: the share k of the sequence's own deviation from its drafter that counts (the
        drafter's `persistence`; 0: the drafter's expectation, 1: the sequence's own). Without
        `streaks`, no streak term (the persistence fit measures what a sequence's own record adds
        to its drafter's average, streak or not); without `misses`, no miss term (the same)."""
        depths = dm.depths(sizes)
        if st.missed and misses:
            after_miss = _size_curve(sizes, [chain_accepted(dm.miss_rate, d) for d in depths])
            return [list(after_miss) for _ in ks]
        estimates = dict(zip(self.sizes, dm.accepted(self.sizes)))
        curve = [estimates[s] for s in sizes]
        own_m, own_rate = st.multiplier(estimates), st.depth_rate(dm.depth_rate)
        streak = [chain_accepted(dm.streak_rate, d) for d in depths] if st.streak and streaks else [0.0] * len(sizes)
        curves = []
        for k in ks:
            m = 1.0 + k * (own_m - 1.0)
            rate = dm.depth_rate + k * (own_rate - dm.depth_rate)
            curves.append(_size_curve(sizes, [max(m * a, chain_accepted(rate, d), after_whole)
                                              for a, d, after_whole in zip(curve, depths, streak)]))
        return curves

    def _gains(self, st: _SeqState, dm: _DrafterModel, sizes: list[int], p_tree: float,
               crowd: bool) -> list[float]:
        """Expected accepted tokens of a sequence for each budget size (`_expected` with its
        drafter's persistence) times its chance `p_tree` of getting a tree at all; in a `crowd`
        (more than one sequence to pick from) times the drafter's `realized` share, at most the
        size, and the estimates before that share are kept for the sequence
        (`_SeqState.expected`), so that the tree it gets is measured against them."""
        (expected,) = self._expected(st, dm, sizes, dm.persistence)
        if not crowd:
            return [p_tree * g for g in expected]
        st.expected = dict(zip(sizes, expected))
        share = dm.realized
        return [p_tree * min(float(size), share * g) for size, g in zip(sizes, expected)]

    # ---- the allocation ----

    def allocate(self, candidates: Iterable[tuple[object, int]], base_tokens: int, base_commits: int,
                 max_total: int, contexts: dict[int, int] | None = None,
                 decode_rows: int | None = None) -> BudgetDecision:
        """Budgets for `candidates` ((sequence, its cap) for each decoding sequence with a drafter)
        in a step of `base_tokens` tokens committing `base_commits` tokens without drafts, with at
        most `max_total` draft nodes in all; `contexts`: seq_id -> its drafter's context this step
        (`Drafter.context`), for the sequences whose drafter gives one; `decode_rows`: the sequences
        that decode in the steps after this one (this step's prefill done), when it holds prefill.

        A move must earn its seconds at the better of two rates: this step's goodput, and the
        tokens per second of a plain decode step of `decode_rows` sequences. The first alone is
        right for a step of decode rows, whose rate is what the engine's time earns; a step that
        also holds a prefill chunk commits a few tokens in many seconds, and against its own rate
        any draft looks worth its cost, while the seconds it adds are taken from decode steps
        that earn the second rate.

        Greedy: among the moves that raise the batch goodput (one sequence to any larger size), take
        the one with the largest gain per draft node (so a binding node cap is spread where it
        helps most, and a size worth drafting only as a whole, past a drafter's fixed cost, is still
        reached), until none raises it. Then sequences left at 0 long enough get their probe."""
        predict = self.cost.predict
        t_cache: dict[float, float] = {}

        def step_seconds(tokens: float) -> float:
            t = t_cache.get(tokens)
            if t is None:
                t = t_cache[tokens] = predict(tokens)
            return t

        d_cache: dict[tuple[str, int, int, int], float] = {}

        def draft_seconds(name: str, num_seqs: int, num_nodes: int, largest: int) -> float:
            key = (name, num_seqs, num_nodes, largest)
            d = d_cache.get(key)
            if d is None:
                d = d_cache[key] = self.drafters[name].draft_seconds(num_seqs, num_nodes, largest)
            return d

        any_tree, per_tree = self.cost.tree_terms
        candidates = list(candidates)
        crowd = max_total > 0 and sum(1 for _, cap in candidates if cap > 0) > 1
        cands = []   # [seq, sizes, gains, nodes, index of the current size, P(tree)]
        for seq, cap in candidates:
            sizes = [s for s in self.sizes if s <= cap] if max_total > 0 else [0]
            st = self._seq(seq)
            st.context = contexts.get(seq.seq_id) if contexts else None
            st.expected = {}
            if len(sizes) < 2:
                cands.append([seq, [0], [0.0], [0.0], 0, 0.0])
                continue
            am = self._acceptance(seq.drafter, st.context)
            p_tree = st.tree_rate if st.context is None else am.context_tree_rate
            gains = self._gains(st, am, sizes, p_tree, crowd)
            nodes = [p_tree * x for x in am.nodes(sizes)]   # expected: P(tree) * its nodes
            cands.append([seq, sizes, gains, nodes, 0, p_tree])
        n0 = float(base_tokens)
        t0 = step_seconds(n0)

        def seconds(no_tree: float, extra: float, trees: float) -> float:
            """Expected step seconds: with probability `no_tree` no tree comes back at all (the step
            is a plain one), else `extra` expected nodes among the trees that do, plus the trees'
            own verification costs (an n-gram drafter often returns none: averaging the token
            count instead would overcharge the jump a CPU forward makes from 1 token to 2)."""
            if no_tree >= 1.0:
                return t0
            some = 1.0 - no_tree
            return no_tree * t0 + some * (step_seconds(n0 + extra / some) + any_tree) + per_tree * trees

        commits, total = float(base_commits), 0
        group: dict[str, tuple[int, int, int]] = {}   # drafter -> (sequences drafting, nodes granted, largest)
        draft_s = 0.0
        no_tree, extra, trees = 1.0, 0.0, 0.0      # P(no tree at all), expected nodes, expected trees
        goodput = commits / t0 if t0 > 0 else 0.0
        decode_rate = 0.0                          # tokens per second of a plain decode step after this one
        if decode_rows and base_tokens > decode_rows:
            decode_rate = decode_rows / step_seconds(float(decode_rows))
        now_s = t0                                 # expected seconds of the step as allocated so far

        def earns(gain: float, denom: float) -> bool:
            """`gain` more committed tokens for a step of `denom` seconds instead of `now_s` raise
            the goodput and earn at least the decode rate."""
            return commits + gain > goodput * denom * (1 + 1e-9) and gain >= decode_rate * (denom - now_s)
        while True:
            best, best_score, best_g = None, 0.0, goodput
            for ci, (seq, sizes, gains, nodes, cur, p_tree) in enumerate(cands):
                if cur + 1 >= len(sizes):
                    continue
                name = seq.drafter
                g_seqs, g_nodes, g_top = group.get(name, (0, 0, 0))
                d_now = draft_seconds(name, g_seqs, g_nodes, g_top)
                if cur == 0:
                    no_tree2, trees2 = no_tree * (1.0 - p_tree), trees + p_tree
                else:
                    no_tree2, trees2 = no_tree, trees
                for j in range(cur + 1, len(sizes)):
                    size_extra = sizes[j] - sizes[cur]
                    if total + size_extra > max_total:
                        break
                    d_commit = gains[j] - gains[cur]
                    if d_commit < MIN_GAIN:
                        continue
                    extra2 = extra + nodes[j] - nodes[cur]
                    d_new = draft_seconds(name, g_seqs + (cur == 0), g_nodes + size_extra, max(g_top, sizes[j]))
                    denom = seconds(no_tree2, extra2, trees2) + draft_s - d_now + d_new
                    if denom <= 0:
                        continue
                    if not earns(GAIN_TRUST * d_commit, denom):
                        continue
                    g_sure = (commits + GAIN_TRUST * d_commit) / denom
                    g = (commits + d_commit) / denom
                    score = (g_sure - goodput) / size_extra
                    if score > best_score:
                        best, best_score, best_g = (ci, j, d_new - d_now, no_tree2, extra2, trees2), score, g
            if best is None:
                break
            ci, j, d_delta, no_tree, extra, trees = best
            c = cands[ci]
            seq, sizes, gains, cur = c[0], c[1], c[2], c[4]
            g_seqs, g_nodes, g_top = group.get(seq.drafter, (0, 0, 0))
            group[seq.drafter] = (g_seqs + (cur == 0), g_nodes + sizes[j] - sizes[cur], max(g_top, sizes[j]))
            commits += gains[j] - gains[cur]
            total += sizes[j] - sizes[cur]
            draft_s += d_delta
            goodput = best_g
            now_s = seconds(no_tree, extra, trees) + draft_s
            c[4] = j
        decision = BudgetDecision(goodput=goodput, step_seconds=seconds(no_tree, extra, trees))
        # probes, for sequences at 0 long enough, where a probe could pay: were the sequence to accept
        # as well as it may hope (`hopeful_rate` per depth), drafting it at the probe's size would raise
        # the goodput (else a good outcome would change nothing -- a crowd on a CPU -- and the probe
        # waits); the size is the one that would raise it most under that hope
        for seq, sizes, gains, nodes, cur, p_tree in cands:
            st = self.seqs[seq.seq_id]
            size = sizes[cur]
            st.probing = False
            if size == 0 and len(sizes) > 1 and st.idle >= st.pause:
                dm = self.drafters[seq.drafter]
                am = self._acceptance(seq.drafter, st.context)
                optimism = dm.probe_optimism()
                if am is not dm:   # what earlier probes in its context got bounds what it may hope
                    optimism = min(optimism, am.probe_rate(optimism) + PROBE_MARGIN)
                hope = st.hopeful_rate(optimism)
                g_seqs, g_nodes, g_top = group.get(seq.drafter, (0, 0, 0))
                d_now = draft_seconds(seq.drafter, g_seqs, g_nodes, g_top)
                best_j, best_d, best_g = 0, 0.0, goodput
                for j, depth in enumerate(am.depths(sizes)):
                    if j == 0:
                        continue
                    if total + sizes[j] > max_total:
                        break
                    d_delta = draft_seconds(seq.drafter, g_seqs + 1, g_nodes + sizes[j], max(g_top, sizes[j])) - d_now
                    hopeful = p_tree * chain_accepted(hope, depth)
                    denom = seconds(0.0, extra + sizes[j], trees + 1) + draft_s + d_delta
                    if denom > 0 and earns(hopeful, denom) and (commits + hopeful) / denom > best_g * (1 + 1e-9):
                        best_j, best_d, best_g = j, d_delta, (commits + hopeful) / denom
                if best_j:
                    j = best_j
                    size = sizes[j]
                    total += size
                    group[seq.drafter] = (g_seqs + 1, g_nodes + size, max(g_top, size))
                    draft_s += best_d
                    no_tree, extra, trees = no_tree * (1.0 - p_tree), extra + nodes[j], trees + p_tree
                    commits += gains[j]
                    st.probing = True
                    decision.probes.append(seq.seq_id)
            decision.budgets[seq.seq_id] = size
        self.last = decision
        return decision

    def record(self, seq, granted: int) -> None:
        """The budget `seq` finally got this step (0 when the pool could not hold its draft)."""
        st = self._seq(seq)
        st.pending, st.pending_nodes = 0, 0
        if granted > 0:
            st.pending, st.pending_context, st.pending_probe = granted, st.context, st.probing
            st.pending_expected = None if st.probing else st.expected.get(granted)
            st.idle = 0
            st.pause = min(MAX_PROBE_PAUSE, 2 * st.pause) if st.probing else FIRST_PROBE_PAUSE
        else:
            st.idle += 1
            st.streak = False   # the next tree, if any, will not follow the whole one directly
        st.probing = False

    # ---- observations ----

    def observe_step(self, num_tokens: int, seconds: float, num_trees: int = 0) -> None:
        self.cost.observe(num_tokens, seconds, num_trees)

    def observe_draft(self, drafter: str, seqs: list, budgets: list[int], nodes: list[int], seconds: float) -> None:
        """Drafter `drafter` proposed for `seqs` with these budgets in `seconds`; `nodes[i]` draft
        nodes came back for seqs[i] (0: no tree)."""
        dm = self._drafter(drafter)
        if seqs:
            dm.observe_cost(len(seqs), sum(budgets), max(budgets), seconds)
        for seq, budget, n in zip(seqs, budgets, nodes):
            st = self.seqs.get(seq.seq_id)
            if st is None or not st.pending:
                continue
            got = 1.0 if n > 0 else 0.0
            st.tree_rate += TREE_RATE_SEQ * (got - st.tree_rate)
            dm.tree_rate += TREE_RATE_DRAFTER * (got - dm.tree_rate)
            if st.pending_context is not None:
                self._acceptance(drafter, st.pending_context).observe_tree(n > 0)
            if n > 0:
                st.pending_nodes = n
            else:
                st.pending = 0
                st.streak = False

    def observe_acceptance(self, seq, num_accepted: int, depth: int | None = None) -> None:
        """`seq`'s tree (`depth` deep) got `num_accepted` draft tokens accepted."""
        st = self.seqs.get(seq.seq_id)
        if st is None or not st.pending or seq.drafter is None:
            return
        nodes = st.pending_nodes or st.pending
        depth = depth if depth is not None else nodes
        dm = self._acceptance(seq.drafter, st.pending_context)
        sizes = [s for s in self.sizes if s <= st.pending]
        own, drafter = self._expected(st, dm, sizes, 1.0, 0.0, streaks=False, misses=False)
        dm.observe_persistence(own[-1], drafter[-1], num_accepted)
        dm.observe(st.pending, num_accepted, nodes, depth)
        if st.streak:
            dm.observe_streak(num_accepted, depth)
        if st.missed:
            dm.observe_miss(num_accepted, depth)
        if st.pending_probe:
            dm.observe_probe(num_accepted, depth)
        if st.pending_expected is not None:
            dm.observe_realized(st.pending_expected, num_accepted)
        st.streak = depth >= STREAK_MIN_DEPTH and num_accepted >= depth
        st.missed = num_accepted == 0
        st.acc_sum = SEQ_DECAY * st.acc_sum + num_accepted
        for size in st.size_weights:
            st.size_weights[size] *= SEQ_DECAY
        st.size_weights[st.pending] = st.size_weights.get(st.pending, 0.0) + 1.0
        st.depth_hits = DEPTH_DECAY_SEQ * st.depth_hits + num_accepted
        st.depth_trials = DEPTH_DECAY_SEQ * st.depth_trials + _depth_trials(num_accepted, depth)
        st.pending, st.pending_nodes = 0, 0
