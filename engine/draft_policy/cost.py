"""The two cost models of the goodput policy: seconds of a target step, and of a drafter's call.

* Step cost (`StepCostModel`): piecewise linear over knots at powers of two; calibrated at start-up
  from a few timed forwards (`calibrate_step_cost`), then corrected by an exponentially weighted
  ridge fit of (tokens, seconds) of real steps: an offset per knot with a smoothness prior
  (neighbouring offsets alike), so the overhead real steps have and the calibration forward has not
  carries over to token counts not seen yet, while regions that are observed keep their own shape.
* Draft cost (`DraftCostModel`): per drafter, seconds ~ a + b * sequences + c * node budget
  + e[the call's largest budget size], the same kind of weighted ridge fit over its `propose` calls
  (0 before the first: optimistic). A drafter that drafts level by level (EAGLE, a draft model's
  chain) runs one pass of its network per depth for all its sequences at once, so its cost follows
  the deepest tree it is asked for; e has one offset per budget size, neighbouring offsets held
  alike, so a size not measured yet costs what the nearest measured one does, and c is held near 0
  unless calls with the same largest size but different node totals (a batch) show it.

Outliers. A fit that keeps what it learnt where nothing new is observed (`_Ridge`) must not learn
from a one-off: the first step that verifies a tree on a GPU compiles kernels (hundreds of ms
against 2 ms), a drafter's first call initialises its libraries, a pause can land anywhere. Once
learnt, "trees are slow" would never be tested again, since the policy stops drafting. So a
drafter's first call is not observed, and an observation more than MAX_STEP_RATIO times the
current estimate (and OUTLIER_SECONDS above it: an extrapolation to a shape not seen yet is rough)
is held back (`_Outliers`): it is fitted, clamped at that bound, only when the
next observation of its kind (a step with or without trees; a drafter's call) is an outlier too.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import numpy as np

STEP_FORGET = 0.98          # step cost fit: weight of an observation decays by this per step
STEP_SCALE_PRECISION = 0.05 # ... its scale of the calibrated curve held as weakly as one knot's offset
DRAFT_FORGET = 0.95         # draft cost fit: the same per `propose` call
DRAFT_NODE_PRECISION = 100.0 # ... its cost per node budget held near 0 this firmly
MAX_STEP_RATIO = 4.0        # a step or call slower than this times the estimate ...
OUTLIER_SECONDS = 0.005     # ... and by this much is an outlier (module docstring)
UNCALIBRATED_FLAT = 32      # without calibration: T(n) ~ UNCALIBRATED_FLAT + n, scaled by the first step


class _Outliers:
    """Per kind, the last observation held back as an outlier (module docstring)."""

    def __init__(self):
        self.held: dict = {}

    def admit(self, kind, obs: tuple, seconds: float, expected: float) -> list[tuple[tuple, float]]:
        """The (observation, seconds) pairs to fit now: none while `seconds` is the first outlier of
        its kind in a row; the held one and this one, each clamped at the ceiling of its estimate,
        when it is the second; this one alone when it is no outlier."""
        ceiling = max(MAX_STEP_RATIO * expected, expected + OUTLIER_SECONDS)
        if not (expected > 0) or seconds <= ceiling:
            self.held.pop(kind, None)
            return [(obs, seconds)]
        held = self.held.pop(kind, None)
        if held is None:
            self.held[kind] = (obs, ceiling)
            return []
        return [held, (obs, ceiling)]


# ---- small weighted ridge regression -----------------------------------------------------------


class _Ridge:
    """Exponentially weighted ridge regression y ~ theta . phi with a Gaussian prior (mean 0,
    precision matrix `prior`, or its diagonal). Old evidence fades towards what it said:
    A = rho A + (1 - rho) A0 + phi phi^T, b = rho b + (1 - rho) A0 theta + phi y, theta = A^-1 b.
    Without new observations in some direction theta keeps its value there (A theta = b stays a
    fixed point), while its certainty falls back to the prior's; forgetting towards the prior mean
    instead would walk a term that is rarely observed (the extra cost of a step with a draft tree,
    in a crowd that seldom drafts) back to 0 and make it look cheap again."""

    def __init__(self, prior: list[float] | list[list[float]], forget: float):
        prior = np.asarray(prior, dtype=np.float64)
        self.prior = prior if prior.ndim == 2 else np.diag(prior)
        self.forget = forget
        self.A = self.prior.copy()
        self.b = np.zeros(len(self.prior))
        self.num_observations = 0
        self._theta: list[float] | None = [0.0] * len(self.b)

    def update(self, phi: dict[int, float], y: float) -> None:
        rho, theta = self.forget, np.asarray(self.theta)
        self.A = rho * self.A + (1 - rho) * self.prior
        self.b = rho * self.b + (1 - rho) * (self.prior @ theta)
        idx = np.fromiter(phi.keys(), dtype=np.intp, count=len(phi))
        x = np.fromiter(phi.values(), dtype=np.float64, count=len(phi))
        self.b[idx] += x * y
        self.A[np.ix_(idx, idx)] += np.outer(x, x)
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
            free = np.array([i for i in range(len(self.b)) if i not in pinned], dtype=np.intp)
            sub = _solve(self.A[np.ix_(free, free)], self.b[free])
            theta = [0.0] * len(self.b)
            for i, x in zip(free.tolist(), sub):
                theta[i] = x


def _solve(A: np.ndarray, b: np.ndarray) -> list[float]:
    """x with A x = b (A is small and positive definite; a singular one, which the priors rule out,
    gets its least-squares solution)."""
    try:
        return np.linalg.solve(A, b).tolist()
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(A, b, rcond=None)[0].tolist()


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
    (`_Ridge.theta_nonnegative`)."""

    def __init__(self, max_tokens: int):
        top = 1
        while top < max(1, max_tokens):
            top *= 2
        self.knots = [2 ** i for i in range(top.bit_length())]
        self.base: list[float] | None = None       # the calibrated (or scaled prior) curve at the knots
        self.calibrated = False
        k = len(self.knots)
        # priors: offsets at the knots alike (one step's precision on each difference) and weakly
        # near 0; the tree terms held at 0 where the data cannot tell them from the curve (batch 1);
        # the scale as weakly as one offset (a step slower at one n is as likely a slower machine)
        prior = [[0.0] * (k + 3) for _ in range(k + 3)]
        _hold_offsets_alike(prior, 0, k)
        prior[k][k] = 0.2          # a step-level cost (a CPU forward's path for non-decode rows) is
        prior[k + 1][k + 1] = 2.0  # likelier than one per tree where the data cannot tell them apart
        prior[k + 2][k + 2] = STEP_SCALE_PRECISION
        self._fit = _Ridge(prior, STEP_FORGET)
        self._outliers = _Outliers()
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
        """Knots to time: 1, 2, 4, ... up to the first covering `max_tokens`, smallest first. The
        small ones are cheap and decide batch 1, where a step of 1 token and one of 9 cost nearly
        the same; a calibration cut short by its time limit extrapolates the largest ones, which
        the crowd's steps then correct online."""
        top = next((i for i, k in enumerate(self.knots) if k >= max_tokens), len(self.knots) - 1)
        return self.knots[:top + 1]

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
        for (n, trees), s in self._outliers.admit(num_trees > 0, (num_tokens, num_trees), seconds,
                                                  self.predict(num_tokens, num_trees)):
            self._update(n, s, trees)

    def _update(self, num_tokens: int, seconds: float, num_trees: int) -> None:
        base = _interp_knots(self.knots, self.base, num_tokens)
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
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent violators):
    a knot timed high by noise is averaged with the lower ones after it, not carried to all of them
    as a running maximum would."""
    blocks: list[tuple[float, int]] = []   # (mean, count) of pooled runs
    for v in values:
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = ((m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2)
    return [m for m, c in blocks for _ in range(c)]


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


def calibrate_step_cost(cost: StepCostModel, profile_forward: Callable[[int], float], max_tokens: int,
                        time_limit: float = 3.0, clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Time forwards of the knots 1, 2, 4, ... up to the first covering `max_tokens` (the largest
    decode step), while under `time_limit` seconds, with `profile_forward(n) -> seconds`, and set
    `cost`'s base curve from them. Returns the points."""
    start = clock()
    profile_forward(1)                   # warm-up, discarded
    points: dict[int, float] = {}
    for n in cost.calibration_order(max(1, max_tokens)):
        points[n] = float(profile_forward(n))
        if len(points) >= 2 and clock() - start > time_limit:
            break
    cost.calibrate(points)
    return dict(sorted(points.items()))


class DraftCostModel:
    """Seconds of one drafter's `propose` call (module docstring), over the budget sizes `sizes`."""

    def __init__(self, sizes: list[int]):
        self.sizes = [s for s in sizes if s > 0] or [1]
        k = 3 + len(self.sizes)
        prior = [[0.0] * k for _ in range(k)]
        prior[0][0] = prior[1][1] = 1e-3
        prior[2][2] = DRAFT_NODE_PRECISION
        _hold_offsets_alike(prior, 3, k)
        self._fit = _Ridge(prior, DRAFT_FORGET)
        self._outliers = _Outliers()
        self.num_calls = 0

    def _phi(self, num_seqs: int, num_nodes: int, largest: int) -> dict[int, float]:
        # the offset of the smallest budget size holding `largest` (the last one beyond them all)
        j = next((i for i, s in enumerate(self.sizes) if s >= largest), len(self.sizes) - 1)
        return {0: 1.0, 1: float(num_seqs), 2: float(num_nodes), 3 + j: 1.0}

    def predict(self, num_seqs: int, num_nodes: int, largest: int) -> float:
        """Seconds of a call for `num_seqs` sequences, `num_nodes` node budget in all, the largest `largest`."""
        if num_seqs <= 0:
            return 0.0
        theta = self._fit.theta
        return max(0.0, sum(theta[i] * x for i, x in self._phi(num_seqs, num_nodes, largest).items()))

    def observe(self, num_seqs: int, num_nodes: int, largest: int, seconds: float) -> None:
        if num_seqs <= 0 or not math.isfinite(seconds):
            return
        self.num_calls += 1
        if self.num_calls == 1:      # the first call: libraries initialised, kernels compiled
            return
        for obs, s in self._outliers.admit(0, (num_seqs, num_nodes, largest), seconds,
                                           self.predict(num_seqs, num_nodes, largest)):
            self._fit.update(self._phi(*obs), s)
