"""Cascade Speculative Drafting (Chen et al. 2024, "CS Drafting"): neural drafters that *review*
the drafts of smaller ones instead of drafting autoregressively (vertical cascade), larger
drafters for the early draft positions and smaller ones for the later (horizontal cascade), with
Max-Gram (`mag`) at the bottom.

Levels: `levels=a,b,...,mag`, largest first, ending in `mag`. Every level above `mag` is a draft
model (`draft_model`, `student`, or a subclass) and reviews through `DraftModelDrafter.review`:
one forward over the proposed chain in its own paged KV, rows past the committed prefix dropped
afterwards. Sub-drafters are built with `make_drafter` from the cascade's own `DrafterContext`.

The recursion (the paper's Algorithm 1, its prose rather than its listing; decisions below).
`draft(r, prefix)` uses the levels `L_r, ..., L_n = mag` and the row `K[r]` of cumulative
thresholds `k_r, ..., k_n` (one per level, counted from `prefix`). Starting from an empty draft g:

* for j = r, ..., n-1 (the neural levels), **horizontal**: while `len(g) < k_j`, one round of
  level j: `d = draft(j + 1, prefix + g)` (**vertical**: the smaller levels' draft), then L_j
  reviews d in one forward from `prefix + g` and g is extended by d's accepted tokens plus L_j's
  own token at the stop (the correction, or the bonus after an accepted chain);
* for j = n (`mag`): while `len(g) < k_n`, Max-Gram drafts the missing tokens directly (at most
  its `max_tokens` a call; it stops early when it finds none).
* The call for the bottom row (`mag` alone, r = n) is the paper's base case: Max-Gram drafts its
  own `max_tokens` (10 by default, as in the paper).

The top call (r = 0) is reviewed by the target: its chain goes to the engine's verification,
cut to the scheduler's budget.

Decisions on the paper's ambiguities (digest §5.3):

* **K.** `k` is the matrix K as rows separated by ";", each row's cumulative thresholds separated
  by ",": row r (r = 0 for the call the target reviews, r >= 1 for the call level r-1 reviews) has
  one threshold per level L_r..L_n; its last (mag's) entry may be left out, meaning "mag drafts no
  positions of its own in this row" (the paper's rows, e.g. its (base, small, mag) GSM8K setting
  `k=7,10;1`). Thresholds must not decrease. Rows not given default to one round of each neural
  level and no mag positions (`1,...,1`). The default top row gives level 0 the first 4 positions,
  each further neural level 2 more, and mag 2 more (`4,6` for two levels, `4,6,8` for three).
* **Thresholds are loop conditions**, as in the listing: a round's tokens are all kept, so level
  j's segment can run past k_j (a reviewed token is never thrown away); only the top call is cut,
  to the budget. A level whose threshold is already reached drafts nothing.
* **Provenance.** Each node of the final chain is credited (`TokenTree.sources`) to the top-level
  horizontal segment it lies in: the level whose rounds (its review included) produced that
  position, or `mag` for the raw Max-Gram tail. Per-part acceptance then is the per-segment
  acceptance alpha_i of the paper's EWIF analysis. Part names are the level names, suffixed
  `@i` (the level index) where a name repeats.
* **Reviews are deterministic** (the digest's defects 1-3 do not arise): a proposed token x is
  accepted iff `leniency * q(x) >= max q` for the reviewing model's softmax q (its logits at
  temperature 1) and the reviewer adds its argmax. With leniency l = 1 this is the greedy review
  (accept the argmax only); the paper's stochastic rule, accept x with probability
  min(1, l q(x) / d(x)) with d(x) the probability recorded for the drafted token, is
  min(1, l q(x)) for a one-hot d (MaG, or an earlier deterministic review); ours accepts exactly
  the tokens with `l q(x) >= max q`, the same monotone loosening in l without randomness (and at
  temperature 0, where the reviewer's distribution is one-hot on its argmax, the paper's rule would
  make leniency do nothing). `leniency` is one value for every inner review, or
  one per neural level (the reviews that level makes), e.g. `leniency=1.5,1` for the paper's
  "leniency between base and small, none between small and MaG". The target's review is the
  engine's verification, always with l = 1.
* **Lossless for any leniency, greedy and sampled.** The draft is a deterministic function of the
  committed tokens (made before, and independently of, verification's random draws), so the chain
  goes out with `draft_probs=None`: q is one-hot on each drafted token. engine/verify.py then accepts a drafted x with probability min(1, p(x)/1) = p(x), and on
  rejection samples from residual(p, onehot(x)) = p with x removed, renormalised; the committed
  token is y with probability p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y), the
  target's law, whatever x was. (The digest's worry, a lenient review's tokens not following the
  reviewer's distribution, concerns passing the reviewer's p' upward as q; nothing but one-hot q
  is passed here, so leniency never reaches the target's review.) Greedy requests: the engine
  accepts drafted tokens equal to the target's argmax, exact by construction.
* **Chains only**, as in the paper; sampling requests are drafted the same way (greedy drafts).

Per-level options: `level_options` (JSON text, or a list / dict when built in Python): a list
with one object per level, or an object keyed by level part name; each object holds that level's
own options (`{"draft_layers": 1}`, `{"max_tokens": 6}`, ...), validated by `make_drafter`.

Standardized walltime (`model_runs`, the paper's SWI with MS costs): per level part, the runs
counted once per sequence served (a review forward over B sequences counts B; at batch 1 the
runs are the `calls`), with the level's cost ratio c (its draft model's parameters over the
target's, as `draft_model` computes it) and c = 0 for `mag`.
"""

from __future__ import annotations

import json
import math
from typing import Sequence as Seq

from specserve.drafters.base import Drafter, DrafterContext, drafter_class, make_drafter, register
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.engine.tree import TokenTree

BOTTOM = "mag"


def parse_levels(value) -> tuple[str, ...]:
    """"student,mag" / ["student", "mag"] -> ("student", "mag"); at least two levels, the last `mag`,
    `mag` nowhere else, no nested cascade."""
    names = [x.strip() for x in value.split(",")] if isinstance(value, str) else [str(x).strip() for x in value]
    names = [x for x in names if x]
    if len(names) < 2 or names[-1] != BOTTOM:
        raise ValueError(f"cascade levels must be two or more drafter names, largest first, ending in "
                         f"{BOTTOM!r}; got {value!r}")
    if BOTTOM in names[:-1] or "cascade" in names:
        raise ValueError(f"cascade levels: {BOTTOM!r} only as the last level and no nested cascade; got {value!r}")
    return tuple(names)


def default_k(num_levels: int) -> tuple[tuple[int, ...], ...]:
    """The default K (see the module docstring): top row 4, 6, ... (level 0 to 4, +2 per further
    level, mag included); inner rows: one round of each neural level, no mag positions."""
    neural = num_levels - 1
    top = tuple(4 + 2 * j for j in range(num_levels))
    return (top,) + tuple(tuple([1] * (neural - r) + [1]) for r in range(1, neural))


def parse_k(value, num_levels: int) -> tuple[tuple[int, ...], ...]:
    """K as full rows: row r (r = 0 .. num_levels - 2) has num_levels - r cumulative thresholds,
    the last one mag's. `"7,10;1"` for 3 levels -> ((7, 10, 10), (1, 1)). A row may leave out mag's
    entry (it then equals the last neural one); rows not given are one round per neural level."""
    rows_in: list[list[int]]
    if value is None:
        return default_k(num_levels)
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"cascade k must be integers, rows separated by ';', entries by ','; got {value!r}")
    if isinstance(value, (int, float)):
        rows_in = [[int(value)]]
    elif isinstance(value, str):
        try:
            rows_in = [[int(x) for x in row.split(",") if x.strip()] for row in value.replace(" ", "").split(";")]
        except ValueError:
            raise ValueError(f"cascade k must be integers, rows separated by ';', entries by ','; got {value!r}")
    else:
        rows_in = [[int(x) for x in row] for row in value]
    neural = num_levels - 1
    if len(rows_in) > neural:
        raise ValueError(f"cascade k has {len(rows_in)} rows; {num_levels} levels take at most {neural}")
    rows = []
    for r in range(neural):
        if r < len(rows_in):
            row = rows_in[r]
        else:
            row = [1] * (neural - r)
        want = num_levels - r
        if len(row) == want - 1:
            row = row + row[-1:]
        if len(row) != want:
            raise ValueError(f"cascade k row {r} needs {want - 1} or {want} thresholds (levels {r}..{num_levels - 1}), "
                             f"got {row}")
        if any(x < 0 for x in row) or any(b < a for a, b in zip(row, row[1:])) or row[-1] < 1:
            raise ValueError(f"cascade k row {r} must be non-negative, non-decreasing cumulative thresholds "
                             f"ending >= 1, got {row}")
        rows.append(tuple(row))
    return tuple(rows)


def parse_leniency(value, num_neural: int) -> tuple[float, ...]:
    """One leniency l >= 1 for every neural level's reviews, or one per neural level."""
    if isinstance(value, str):
        vals = [float(x) for x in value.split(",") if x.strip()]
    elif isinstance(value, (int, float)):
        vals = [float(value)]
    else:
        vals = [float(x) for x in value]
    if len(vals) == 1:
        vals = vals * num_neural
    if len(vals) != num_neural or any(not (v >= 1 and math.isfinite(v)) for v in vals):
        raise ValueError(f"cascade leniency must be one finite value >= 1 or one per neural level "
                         f"({num_neural}); got {value!r}")
    return tuple(vals)


def part_names_of(levels: Seq[str]) -> tuple[str, ...]:
    """Level names, `name@i` where a name repeats."""
    return tuple(n if levels.count(n) == 1 else f"{n}@{i}" for i, n in enumerate(levels))


def parse_level_options(value, parts: Seq[str]) -> list[dict]:
    if value is None:
        return [{} for _ in parts]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"cascade level_options is not JSON: {e}")
    if isinstance(value, dict):
        unknown = [k for k in value if k not in parts]
        if unknown:
            raise ValueError(f"cascade level_options names no level {unknown[0]!r}; levels: {', '.join(parts)}")
        value = [value.get(p, {}) for p in parts]
    if not isinstance(value, list) or len(value) != len(parts) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"cascade level_options must be a list of {len(parts)} objects (one per level) "
                         f"or an object keyed by level ({', '.join(parts)})")
    return [dict(v) for v in value]


@register("cascade")
class CascadeDrafter(Drafter):
    name = "cascade"

    def __init__(self, ctx: DrafterContext, *, levels="student,mag", k=None, leniency=1.0, level_options=None):
        self.level_names = parse_levels(levels)
        self.part_names = part_names_of(self.level_names)
        n = len(self.level_names)
        self.k = parse_k(k, n)
        self.leniency = parse_leniency(leniency, n - 1)
        opts = parse_level_options(level_options, self.part_names)
        for part, name in zip(self.part_names[:-1], self.level_names[:-1]):
            factory = drafter_class(name)
            if not (isinstance(factory, type) and issubclass(factory, DraftModelDrafter)):
                raise ValueError(f"cascade level {part!r} cannot review drafts: the levels above mag must be "
                                 f"draft models (draft_model, student)")
        self.levels: list[Drafter] = []
        for name, part, o in zip(self.level_names, self.part_names, opts):
            try:
                self.levels.append(make_drafter(name, ctx, **o))
            except ValueError as e:
                raise type(e)(f"cascade level {part!r}: {e}") from e
        for part, d in zip(self.part_names[:-1], self.levels[:-1]):
            if getattr(d, "target_init_width", 1) != 1:
                raise ValueError(f"cascade level {part!r}: target_init_width does not apply to a reviewing level")
        # a draft after tokens not yet committed (a grammar's forced ones): each level drafts and
        # reviews from the extended prefix and keeps none of it (`Drafter.drafts_after_uncommitted`)
        self.drafts_after_uncommitted = all(getattr(d, "drafts_after_uncommitted", False) for d in self.levels)
        self.max_model_len = ctx.max_model_len
        # batched calls per level since start (reviews: one forward each; mag: one propose each), for
        # the paper's standardized walltime (SWI = tokens / sum of calls x cost coefficient)
        self.calls = dict.fromkeys(self.part_names, 0)
        self.runs = dict.fromkeys(self.part_names, 0)   # the same, once per sequence served

    def model_runs(self) -> dict[str, tuple[int, float]]:
        costs = [float(getattr(d, "cost", 0.0)) for d in self.levels[:-1]] + [0.0]
        return {part: (self.runs[part], c) for part, c in zip(self.part_names, costs)}

    # ---- protocol: forwarded to every level ---------------------------------------------------

    def start(self, seq) -> None:
        for d in self.levels:
            d.start(seq)

    def accept(self, seqs, results) -> None:
        for d in self.levels:
            d.accept(seqs, results)

    def finish(self, seq) -> None:
        for d in self.levels:
            d.finish(seq)

    def propose(self, seqs, budgets) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        live = [i for i, b in enumerate(budgets) if b > 0]
        if not live:
            return trees
        limits = [min(budgets[i], self._room(seqs[i])) for i in live]
        drafts, sources = self._draft(0, [seqs[i] for i in live], limits)
        for i, toks, src in zip(live, drafts, sources):
            if toks:
                trees[i] = TokenTree([seqs[i].token_ids[-1], *toks], [-1, *range(len(toks))],
                                     sources=[0, *src], source_names=self.part_names)
        return trees

    # ---- the cascade ----------------------------------------------------------------------------

    def _room(self, seq) -> int:
        """Draft tokens that still fit in the context after `seq.token_ids` (one kept for the token
        the reviewer or the target adds)."""
        return max(0, self.max_model_len - len(seq.token_ids) - 1)

    def _draft(self, r: int, reqs: list, limits: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Row r's call for every request: drafts after `reqs[b].token_ids` (at most `limits[b]`
        tokens) and, per token, the level whose horizontal segment of this call produced it."""
        n = len(self.levels)
        gen: list[list[int]] = [[] for _ in reqs]
        src: list[list[int]] = [[] for _ in reqs]
        if r == n - 1:                      # the base case: Max-Gram alone, its own draft length
            self.calls[self.part_names[-1]] += 1
            self.runs[self.part_names[-1]] += len(reqs)
            trees = self.levels[-1].propose(reqs, limits)
            for b, t in enumerate(trees):
                if t is not None:
                    gen[b] = [int(x) for x in t.tokens[1:limits[b] + 1]]
                    src[b] = [r] * len(gen[b])
            return gen, src
        row = self.k[r]
        for j in range(r, n):
            goal = [min(row[j - r], lim) for lim in limits]
            if j == n - 1:                  # mag's own tail: calls for the missing tokens until it has none
                done: set[int] = set()
                while True:
                    active = [b for b in range(len(reqs)) if len(gen[b]) < goal[b] and b not in done]
                    if not active:
                        break
                    ext = [reqs[b].extend(gen[b]) for b in active]
                    self.calls[self.part_names[j]] += 1
                    self.runs[self.part_names[j]] += len(active)
                    trees = self.levels[j].propose(ext, [goal[b] - len(gen[b]) for b in active])
                    for b, t in zip(active, trees):
                        toks = [] if t is None else [int(x) for x in t.tokens[1:goal[b] - len(gen[b]) + 1]]
                        if not toks:
                            done.add(b)
                        gen[b] += toks
                        src[b] += [j] * len(toks)
                break
            while True:
                active = [b for b in range(len(reqs)) if len(gen[b]) < goal[b]]
                if not active:
                    break
                ext = [reqs[b].extend(gen[b]) for b in active]
                inner, _ = self._draft(j + 1, ext, [self._room(e) for e in ext])
                self.calls[self.part_names[j]] += 1
                self.runs[self.part_names[j]] += len(active)
                reviewed = self.levels[j].review(ext, inner, self.leniency[j])
                for b, prop, (a, token) in zip(active, inner, reviewed):
                    toks = [*prop[:a], token][:limits[b] - len(gen[b])]
                    gen[b] += toks
                    src[b] += [j] * len(toks)
        return gen, src
