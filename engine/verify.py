"""Tree verification, greedy and lossless multi-candidate speculative sampling.

Tensors in, tensors out: no model calls, no KV work. Vocabulary (vLLM's): a draft token that
survives verification is **accepted**; the token the target adds where the walk stops is the
**bonus** token (after a rejection it is also called the recovered token). A step commits
`accepted + [bonus]`, between 1 and depth + 1 tokens.

Sampling walk (DESIGN §4), starting at the root with p = target distribution at the root:
at the current node try its children in order; child x with draft distribution q (one-hot for a
deterministic draft) is accepted with probability min(1, p(x) / q(x)). On rejection
p <- norm(max(0, p - q)) and x is removed from q for the following siblings (children drawn from
the same q without replacement). If a child is accepted, move into it with p = the target
distribution there. When no child is accepted, or at a leaf, the bonus token is drawn from the
current p. The committed tokens are then distributed exactly as sampling the target directly.

Target-initialised roots (MCSD, LOSSY opt-in): a forest's roots are the committed token's
alternatives, all sampled from the target at the previous step. Each root's subtree is walked as
above; the root whose walk accepts the most drafts wins (ties: the first-drawn root, so that with
one root, or when nothing is accepted anywhere, the result is the lossless one). Choosing the
longest walk biases the output towards easily drafted continuations — hence opt-in. With
`num_candidates = W > 1` the walk ends by drawing W distinct tokens from the final p (Gumbel
top-W, without replacement): the first is the bonus, exactly as lossless as the single draw; the
others are the next forest's extra roots.

Keyed verification (seeded requests, `sampler` module docstring): every node's target token is
the request's keyed sample there, argmax p / E with E the keyed Exp(1) draws of the node's output
position; the walk is the greedy one on those tokens (a child is accepted iff it equals its
parent's keyed sample, the bonus is the keyed sample at the end). The committed tokens are then
exactly those plain decoding with the same seed draws, whatever the tree. A deterministic draft x
is accepted with probability p(x) either way; a stochastic draft (q a distribution) is accepted
with probability sum_x q(x) p(x) instead of sum_x min(p(x), q(x)); drafting the most likely
tokens of q instead (what the draft model does for seeded requests) gives sum over the drafts of p(x).

Batched (the engine's path): `verify_batched` / `verify_greedy_batched` / `verify_sampling_batched`
verify all trees of a step at once on the device (`tree.pack_trees` layout) with no host sync and
return a `BatchVerifyResult` of device tensors, read back in one transfer. The Python functions
above are the reference they are tested against: greedy results are identical, sampling results
have the same distribution (not the same random stream).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specserve.engine.tree import NO_PARENT, num_roots


@dataclass
class VerifyResult:
    accepted_nodes: list[int]   # accepted draft nodes, root excluded, in path order
    accepted_tokens: list[int]  # their tokens
    bonus_token: int
    root: int = 0               # the root the path starts from (> 0 only for a forest)
    alternates: list[int] = field(default_factory=list)  # extra target samples for the bonus position

    @property
    def tokens(self) -> list[int]:
        """What the step commits."""
        return self.accepted_tokens + [self.bonus_token]


def _children(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p != NO_PARENT:
            children[p].append(i)
    return children


def verify_greedy(
    tokens: list[int],          # [n] node tokens, tokens[0] = root
    parents: list[int],         # [n]
    target_argmax: list[int],   # [n] argmax of the target's logits at every node
) -> VerifyResult:
    """Longest path of argmax matches; the bonus is the argmax at the last accepted node. Among
    siblings carrying the same token the first one is taken (and for a forest, the first root
    among equally long walks)."""
    children = _children(parents)
    best = None
    for root in range(num_roots(parents)):
        cur, nodes = root, []
        while True:
            want = target_argmax[cur]
            nxt = next((c for c in children[cur] if tokens[c] == want), None)
            if nxt is None:
                break
            nodes.append(nxt)
            cur = nxt
        if best is None or len(nodes) > len(best.accepted_nodes):
            best = VerifyResult(nodes, [tokens[c] for c in nodes], want, root)
    return best


def _sample(p: torch.Tensor, generator: torch.Generator | None, k: int = 1) -> list[int]:
    """k distinct draws from p without replacement (Gumbel top-k with exponential noise; the
    first is an exact draw from p). Fewer when p has fewer than k tokens with mass."""
    noise = torch.empty_like(p).exponential_(generator=generator)
    keys = p / noise.clamp_min(1e-20)
    k = max(1, min(k, int((p > 0).sum())))
    return keys.topk(k).indices.tolist() if k > 1 else [int(torch.argmax(keys))]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target distribution left after a draft drawn from q was rejected: norm(max(0, p - q)).
    When p <= q everywhere (no mass left) p is kept; the walk then can only stop and sample."""
    r = (p - q).clamp_min_(0.0)
    mass = r.sum()
    return r / mass if mass > 0 else p


def verify_sampling(
    tokens: list[int],                     # [n]
    parents: list[int],                    # [n]
    target_probs: torch.Tensor,            # [n, vocab] float32, after the request's logits processing
    draft_probs: torch.Tensor | None,      # [n, vocab] distribution each node was drawn from, or None (one-hot)
    generator: torch.Generator | None = None,
    num_candidates: int = 1,
) -> VerifyResult:
    """Multi-candidate speculative sampling over a tree or forest (see the module docstring)."""
    children = _children(parents)
    best = None
    for root in range(num_roots(parents)):
        nodes, p = _walk(root, tokens, children, target_probs, draft_probs, generator)
        if best is None or len(nodes) > len(best[0]):
            best = (nodes, p, root)
    nodes, p, root = best
    drawn = _sample(p, generator, num_candidates)
    return VerifyResult(nodes, [tokens[c] for c in nodes], drawn[0], root, drawn[1:])


def _walk(root, tokens, children, target_probs, draft_probs, generator) -> tuple[list[int], torch.Tensor]:
    """One root's walk: the accepted nodes and the distribution the bonus is drawn from."""
    cur, nodes = root, []
    p = target_probs[root].clone()
    while True:
        accepted = None
        removed: list[int] = []
        for c in children[cur]:
            x = tokens[c]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[c].clone()
                if removed:
                    q[removed] = 0.0
                total = q.sum()
                if total <= 0:
                    continue   # q has no mass left: this child cannot have been drawn from it
                q /= total
            qx, px = float(q[x]), float(p[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if qx > 0 and u * qx < px:        # accept with probability min(1, p(x)/q(x))
                accepted = c
                break
            p = residual(p, q)
            removed.append(x)
        if accepted is None:
            return nodes, p
        nodes.append(accepted)
        cur = accepted
        p = target_probs[cur].clone()


# --- The same verification for a whole batch of trees, on the device, without host syncs -------
#
# Everything below works on `PackedTrees` (T trees padded to N nodes) and returns device tensors;
# the caller moves the result to the host in one transfer (`BatchVerifyResult.stacked`). Loops run
# only over host bounds of the batch (depth, children per node, roots); nothing reads a device
# value on the host, so a step's verification is a fixed sequence of kernels whatever it decides.

from typing import Sequence  # noqa: E402

from specserve.engine.sampler import (SamplingTensors, argmax, exponential_noise, keyed_exponentials,  # noqa: E402
                                     processed_probs)
from specserve.engine.tree import PackedTrees  # noqa: E402
from specserve.kernels import cpu as native_cpu  # noqa: E402

PAD_TOKEN = -1   # pads `BatchVerifyResult.tokens` after the bonus token (and path / alternates)


@dataclass
class BatchVerifyResult:
    """Verification of T trees, device tensors. D = the batch's max depth, W = its max next_roots.

    Row t commits `tokens[t, :num_accepted[t] + 1]`: the accepted draft tokens, then the bonus."""

    path: torch.Tensor          # [T, D+1] int64 node indices: the chosen root, then the accepted nodes; pad -1
    num_accepted: torch.Tensor  # [T] int64 accepted draft tokens (0..D)
    tokens: torch.Tensor        # [T, D+1] int64 accepted tokens then the bonus token; pad PAD_TOKEN
    root: torch.Tensor          # [T] int64 the root the path starts from (> 0 only for a forest)
    alternates: torch.Tensor    # [T, W-1] int64 extra target samples (MCSD next roots); pad -1
    packed_rows: torch.Tensor | None = None   # `stacked()` already, when the fields are views of it

    def stacked(self) -> torch.Tensor:
        """[T, 2 (D+1) + 2 + W-1] int64, all fields side by side (path, tokens, num_accepted, root,
        alternates), for a single device-to-host copy; `to_verify_results` reads it back."""
        if self.packed_rows is not None:
            return self.packed_rows
        return torch.cat([self.path, self.tokens, self.num_accepted[:, None], self.root[:, None],
                          self.alternates], dim=1)

    @classmethod
    def from_stacked(cls, rows: torch.Tensor, max_depth: int) -> "BatchVerifyResult":
        """The fields as views of `stacked()`'s layout (what the greedy kernel writes)."""
        d1 = max_depth + 1
        return cls(rows[:, :d1], rows[:, 2 * d1], rows[:, d1:2 * d1], rows[:, 2 * d1 + 1], rows[:, 2 * d1 + 2:],
                   packed_rows=rows)


def to_verify_results(path: Sequence[Sequence[int]], num_accepted: Sequence[int],
                      tokens: Sequence[Sequence[int]], root: Sequence[int],
                      alternates: Sequence[Sequence[int]]) -> list[VerifyResult]:
    """Host lists (e.g. `BatchVerifyResult` fields after `.tolist()`) -> one VerifyResult per tree."""
    out = []
    for pa, n, tk, r, alt in zip(path, num_accepted, tokens, root, alternates):
        n = int(n)
        out.append(VerifyResult(list(pa[1:n + 1]), list(tk[:n]), int(tk[n]), int(r), [a for a in alt if a >= 0]))
    return out


def verify_results_from_stacked(rows: Sequence[Sequence[int]], max_depth: int) -> list[VerifyResult]:
    """VerifyResults from the host copy of `BatchVerifyResult.stacked()` (rows of `.tolist()`)."""
    d1 = max_depth + 1
    return to_verify_results([r[:d1] for r in rows], [r[2 * d1] for r in rows], [r[d1:2 * d1] for r in rows],
                             [r[2 * d1 + 1] for r in rows], [r[2 * d1 + 2:] for r in rows])


def _root_of(packed: PackedTrees) -> torch.Tensor:
    """[T, N] the root above each node: the lowest index in its ancestor-or-self set (roots lead)."""
    N = packed.max_nodes
    idx = torch.arange(N, device=packed.tokens.device)
    return torch.where(packed.mask, idx, N).amin(dim=-1)


def _ancestor_path(packed: PackedTrees, end: torch.Tensor) -> torch.Tensor:
    """[T, D+1] the nodes from the root down to `end` [T] (in depth order), pad -1."""
    T, N, D = packed.num_trees, packed.max_nodes, packed.max_depth
    dev = packed.tokens.device
    rows = torch.arange(T, device=dev)
    anc = packed.mask[rows, end]                                             # [T, N]
    col = torch.where(anc, packed.depths, D + 1)                             # non-ancestors -> a spill column
    path = torch.full((T, D + 2), -1, dtype=torch.int64, device=dev)
    path.scatter_(1, col, torch.arange(N, device=dev).expand(T, N).contiguous())
    path[:, D + 1] = -1
    return path[:, :D + 1]


def _commit_tokens(packed: PackedTrees, path: torch.Tensor, num_accepted: torch.Tensor,
                   bonus: torch.Tensor) -> torch.Tensor:
    """[T, D+1]: tokens of path[1 .. num_accepted], then bonus, then PAD_TOKEN."""
    T, D = packed.num_trees, packed.max_depth
    dev = packed.tokens.device
    nxt = torch.cat([path[:, 1:], torch.full((T, 1), -1, dtype=torch.int64, device=dev)], dim=1)   # [T, D+1]
    drafted = packed.tokens.gather(1, nxt.clamp_min(0))
    k = torch.arange(D + 1, device=dev)
    n = num_accepted[:, None]
    return torch.where(k < n, drafted, torch.where(k == n, bonus[:, None], PAD_TOKEN))


VERIFY_ENV = "SPECSERVE_VERIFY"   # reference | triton | native: force greedy verification's implementation


def _greedy_kernel(packed: PackedTrees) -> str:
    """Which implementation verifies greedily: 'triton' (kernels/verify_greedy.py) on CUDA when triton
    imports and the trees fit its registers; 'native' (the walk itself, `kernels/cpu.py`
    `verify_greedy_stacked`) on CPU tensors where the native library builds — there a host read costs
    nothing, and the walk takes microseconds where the reference's ~40 tensor operations take about a
    millisecond; else 'reference'. $SPECSERVE_VERIFY forces the choice (triton on CPU tensors needs
    TRITON_INTERPRET=1)."""
    forced = os.environ.get(VERIFY_ENV, "").strip().lower()
    if forced not in ("", "reference", "triton", "native"):
        raise ValueError(f"{VERIFY_ENV} must be 'reference', 'triton' or 'native', not {forced!r}")
    if forced == "reference":
        return "reference"
    device = packed.tokens.device.type
    if forced == "native" or (not forced and device == "cpu"):
        if device == "cpu" and native_cpu.available():
            return "native"
        if forced:
            raise RuntimeError(f"{VERIFY_ENV}=native needs CPU tensors and the native CPU kernels")
        return "reference"
    if not forced and device != "cuda":
        return "reference"
    from specserve.kernels import verify_greedy as kernel
    if kernel.triton is None:
        if forced:
            raise RuntimeError(f"{VERIFY_ENV}=triton but triton is not installed")
        return "reference"
    return "triton" if packed.max_nodes <= kernel.MAX_NODES else "reference"


def verify_greedy_batched(packed: PackedTrees, target_argmax: torch.Tensor) -> BatchVerifyResult:
    """`verify_greedy` for T trees at once (`verify_greedy_batched_reference`; on CUDA the same in one
    Triton launch, kernels/verify_greedy.py; on the CPU the walk in native code). target_argmax:
    [T, N] int64, argmax of the target's logits at every node (padding columns ignored)."""
    kernel = _greedy_kernel(packed)
    if kernel == "reference":
        return verify_greedy_batched_reference(packed, target_argmax)
    if kernel == "native":
        rows = native_cpu.verify_greedy_stacked(packed.tokens, packed.parents, packed.num_nodes, packed.num_roots,
                                                target_argmax, packed.max_depth, packed.max_next_roots)
        return BatchVerifyResult.from_stacked(rows, packed.max_depth)
    from specserve.kernels import verify_greedy as kernel
    rows = kernel.verify_greedy_stacked(packed.tokens, packed.parents, packed.depths, packed.mask, packed.num_nodes,
                                        packed.num_roots, target_argmax, packed.max_depth, packed.max_next_roots)
    return BatchVerifyResult.from_stacked(rows, packed.max_depth)


def verify_greedy_batched_reference(packed: PackedTrees, target_argmax: torch.Tensor) -> BatchVerifyResult:
    """`verify_greedy` for T trees at once, in torch. target_argmax: [T, N] int64, argmax of the
    target's logits at every node (padding columns ignored).

    A non-root node i **matches** iff tokens[i] == argmax[parent(i)] and no earlier sibling carries
    the same token (the reference takes the first such sibling). A node is on a walk iff every node
    of its ancestor-or-self set is a matching node or a root: one reduction over the ancestor mask.
    At most one child of a node matches, so the walk of each root is a chain; its end is its
    deepest node. The tree's result is the end with the largest depth, ties to the lowest root
    index (score = depth * (N+1) + N - root, one argmax). The accepted path is the end's ancestor
    set sorted by depth (a scatter by depth); the bonus token is argmax[end]."""
    T, N = packed.tokens.shape
    dev = packed.tokens.device
    tokens, parents = packed.tokens, packed.parents
    target_argmax = target_argmax.to(torch.int64)
    idx = torch.arange(N, device=dev)
    valid = idx < packed.num_nodes[:, None]                                   # [T, N]
    is_root = (idx < packed.num_roots[:, None]) & valid
    child = (parents != NO_PARENT) & valid
    want = target_argmax.gather(1, parents.clamp_min(0))                      # argmax at the parent
    earlier_twin = ((parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
                    & (idx[None, :, None] > idx[None, None, :]) & child[:, None, :]).any(dim=-1)
    ok = is_root | (child & (tokens == want) & ~earlier_twin)                 # [T, N]
    on_walk = valid & ~(packed.mask & ~ok[:, None, :]).any(dim=-1)            # all of ancestor-or-self ok
    root_of = _root_of(packed)
    score = torch.where(on_walk, packed.depths * (N + 1) + (N - root_of), -1)
    end = score.argmax(dim=1)                                                 # [T]
    rows = torch.arange(T, device=dev)
    num_accepted = packed.depths[rows, end]
    path = _ancestor_path(packed, end)
    bonus = target_argmax[rows, end]
    alternates = torch.full((T, packed.max_next_roots - 1), -1, dtype=torch.int64, device=dev)
    return BatchVerifyResult(path, num_accepted, _commit_tokens(packed, path, num_accepted, bonus),
                             root_of[rows, end], alternates)


def residual_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise `residual`: [T, V] p, q -> norm(max(0, p - q)) per row, p kept on rows where no
    mass is left. Looked up on the module at call time (tests replace it with wrong rules)."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1.0), p)


def _uniforms(T: int, N: int, sizes: Sequence[int], generators: Sequence[torch.Generator | None],
              device: torch.device) -> torch.Tensor:
    """[T, N] U(0, 1): u[t, c] decides the try of node c (each node is tried at most once, by its
    parent's walk). A tree with a generator draws its own num_nodes numbers from it (so a seeded
    request sees the same numbers whatever the batch); the rest come from one global draw."""
    u = torch.rand((T, N), device=device)
    for t, g in enumerate(generators):
        if g is not None:
            u[t, :sizes[t]] = torch.rand(sizes[t], generator=g, device=device)
    return u


def verify_sampling_batched(packed: PackedTrees, target_probs: torch.Tensor,
                            generators: Sequence[torch.Generator | None] | None = None,
                            compact: bool | None = None) -> BatchVerifyResult:
    """`verify_sampling` for T trees at once (its distribution, not its random stream).

    target_probs: [T, N, V] float32, the distribution plain sampling would draw from at every node
    (after temperature / top-k / top-p: `sampler.processed_probs`). generators: one per tree or None.

    For each root r (a loop over the batch's max roots) all trees walk in lockstep, one level per
    iteration (a loop over the max depth). At the current node `cur` with target distribution p,
    its children x_1, x_2, ... are tried in order (a loop over the max children): with q the
    distribution x_k was drawn from — the node's draft_probs row with the earlier rejected siblings'
    tokens removed and renormalised (children drawn without replacement), or one-hot(x_k) for a
    deterministic draft — x_k is accepted iff u * q(x_k) < p(x_k), i.e. with probability
    min(1, p(x_k)/q(x_k)); a child whose q has no mass left is skipped. On rejection
    p <- residual_rows(p, q) = norm(max(0, p - q)). This is the standard multi-draft rule (SpecInfer
    / MCSD): the token leaving a node is distributed as p whatever q is. An accepted child becomes
    `cur` with p = target_probs[cur]; a tree whose node has no accepted child stops, keeping p.

    The walk of the root with the most accepted drafts wins, ties to the first root (lossless with
    one root). The bonus token is drawn from the winner's final p by the exponential race
    argmax p / E, E ~ Exp(1); with next_roots W > 1 the W largest keys give W distinct tokens drawn
    without replacement (Gumbel top-W), the first being the bonus, the others `alternates` (fewer
    where p has less support).

    Random numbers: u[t, c] ~ U(0, 1) decides the try of node c (a node is tried at most once), and
    E[t] ~ Exp(1)^V; a tree with a generator draws its num_nodes uniforms and V exponentials from it,
    the others from the global RNG, so a seeded tree's result does not depend on the batch.

    compact: False (the default on CUDA) runs every (root, depth, child) iteration on all T rows,
    inactive ones frozen by masks — a fixed kernel sequence, no host sync. True (the default on
    CPU, where reading a count costs nothing) runs each iteration on the rows still trying a child
    (`nonzero`), so finished walks cost nothing; same random numbers, same results."""
    T = packed.num_trees
    dev = packed.tokens.device
    target_probs = target_probs.float()

    def probs_at(ix: torch.Tensor | None, nodes: torch.Tensor) -> torch.Tensor:
        return target_probs[torch.arange(T, device=dev) if ix is None else ix, nodes]

    return _sampling_walk(packed, probs_at, target_probs.shape[-1], generators, None,
                          dev.type == "cpu" if compact is None else compact)


def _sampling_walk(packed: PackedTrees, probs_at, V: int, generators, active: torch.Tensor | None,
                   compact: bool) -> BatchVerifyResult:
    """The walk of `verify_sampling_batched`. probs_at(ix, nodes) gives the target distribution at
    node nodes[i] of tree ix[i] (ix None: all trees, in order). active: [T] bool, the trees to walk
    (None: all); the others' results are unspecified (verify_batched overwrites them)."""
    T, N = packed.tokens.shape
    D, C, R, W = packed.max_depth, packed.max_children, packed.max_roots, packed.max_next_roots
    dev = packed.tokens.device
    generators = list(generators) if generators is not None else [None] * T
    assert len(generators) == T, (len(generators), T)
    rows = torch.arange(T, device=dev)
    u = _uniforms(T, N, packed.sizes, generators, dev)
    noise = exponential_noise((T, V), generators, dev)
    tokens, children, draft = packed.tokens, packed.children, packed.draft_probs
    stochastic = packed.stochastic

    def select(mask: torch.Tensor) -> torch.Tensor | None:
        """The rows an iteration works on: those in `mask` (compact) or all (None)."""
        return mask.nonzero().squeeze(1) if compact else None

    def take(x: torch.Tensor, ix: torch.Tensor | None) -> torch.Tensor:
        return x if ix is None else x[ix]

    def put(dst: torch.Tensor, ix: torch.Tensor | None, val: torch.Tensor) -> torch.Tensor:
        if ix is None:
            return val
        return dst.index_copy(0, ix, val)

    best_num = torch.full((T,), -1, dtype=torch.int64, device=dev)
    best_path = torch.full((T, D + 1), -1, dtype=torch.int64, device=dev)
    best_p = torch.zeros((T, V), dtype=torch.float32, device=dev)
    best_root = torch.zeros(T, dtype=torch.int64, device=dev)
    for r in range(R):
        alive = packed.num_roots > r                                           # [T]
        if active is not None:
            alive = alive & active
        started = alive
        cur = torch.full((T,), r, dtype=torch.int64, device=dev)
        ix = select(alive)
        p = put(torch.zeros((T, V), dtype=torch.float32, device=dev), ix, probs_at(ix, take(cur, ix)))
        path = torch.full((T, D + 1), -1, dtype=torch.int64, device=dev)
        path[:, 0] = r
        num = torch.zeros(T, dtype=torch.int64, device=dev)
        for depth in range(D):
            removed = torch.zeros((T, V), dtype=torch.bool, device=dev)
            chosen = torch.full((T,), -1, dtype=torch.int64, device=dev)
            for k in range(C):
                c_all = children[rows, cur, k]                                 # [T], -1: no such child
                trying_all = alive & (c_all >= 0) & (chosen < 0)
                ix = select(trying_all)
                rx = take(rows, ix)
                c, trying = take(c_all, ix), take(trying_all, ix)
                cs = c.clamp_min(0)
                x = torch.where(c >= 0, tokens[rx, cs], 0)                     # (0: no child here)
                p_ix = take(p, ix)
                onehot = torch.zeros_like(p_ix).scatter_(1, x[:, None], 1.0)
                if draft is not None:
                    qd = draft[rx, cs].masked_fill(take(removed, ix), 0.0)
                    total = qd.sum(dim=-1, keepdim=True)
                    has_mass = total > 0
                    qd = qd / torch.where(has_mass, total, 1.0)
                    st = take(stochastic, ix)
                    q = torch.where(st[:, None], qd, onehot)
                    trying = trying & (has_mass.squeeze(1) | ~st)               # no mass left: skip the child
                else:
                    q = onehot
                qx = q.gather(1, x[:, None]).squeeze(1)
                px = p_ix.gather(1, x[:, None]).squeeze(1)
                accept = trying & (qx > 0) & (u[rx, cs] * qx < px)             # w.p. min(1, p(x) / q(x))
                reject = trying & ~accept
                chosen = put(chosen, ix, torch.where(accept, c, take(chosen, ix)))
                p = put(p, ix, torch.where(reject[:, None], _residual(p_ix, q), p_ix))
                removed[rx, x] = removed[rx, x] | reject                       # x leaves q for the next siblings
            moved = chosen >= 0
            cur = torch.where(moved, chosen, cur)
            ix = select(moved)
            p_next = probs_at(ix, take(cur, ix))
            p = put(p, ix, p_next if compact else torch.where(moved[:, None], p_next, p))
            num = num + moved.to(torch.int64)
            path[:, depth + 1] = torch.where(moved, chosen, -1)
            alive = alive & moved
        better = started & (num > best_num)
        best_num = torch.where(better, num, best_num)
        best_path = torch.where(better[:, None], path, best_path)
        ix = select(better)
        best_p = put(best_p, ix, take(p, ix) if compact else torch.where(better[:, None], p, best_p))
        best_root = torch.where(better, r, best_root)
    best_num = best_num.clamp_min(0)

    keys = best_p / noise
    if W > 1:
        top = keys.topk(min(W, V), dim=-1).indices                            # [T, W]
        bonus = top[:, 0]
        support = (best_p > 0).sum(dim=-1)
        k_t = torch.minimum(packed.next_roots, support).clamp_min(1)           # draws each tree gets
        j = torch.arange(1, top.shape[1], device=dev)
        alternates = torch.where(j[None, :] < k_t[:, None], top[:, 1:], -1)
        if alternates.shape[1] < W - 1:
            alternates = torch.cat([alternates, torch.full((T, W - 1 - alternates.shape[1]), -1,
                                                           dtype=torch.int64, device=dev)], dim=1)
    else:
        bonus = argmax(keys)
        alternates = torch.full((T, 0), -1, dtype=torch.int64, device=dev)
    return BatchVerifyResult(best_path, best_num, _commit_tokens(packed, best_path, best_num, bonus),
                             best_root, alternates)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Calls the module's current `residual_rows` (so a monkeypatched rule takes effect)."""
    return globals()["residual_rows"](p, q)


def _rows_of(st: SamplingTensors, ix: torch.Tensor) -> SamplingTensors:
    """The settings of rows ix (host flags kept: they stay valid bounds for a subset)."""
    return SamplingTensors(st.temperature[ix], st.top_k[ix], st.top_p[ix], st.all_greedy, st.any_top_k,
                           st.any_top_p, None, st.max_top_k, min_p=None if st.min_p is None else st.min_p[ix])


def _keyed_index(sampling: SamplingTensors, device: torch.device) -> torch.Tensor:
    """`sampling.keyed_rows` as a device tensor: the one `SamplingTensors.from_params` made, else made here."""
    if sampling.keyed_index is not None:
        return sampling.keyed_index
    return torch.tensor(sampling.keyed_rows, dtype=torch.int64, device=device)


def keyed_choices(packed: PackedTrees, target_logits: torch.Tensor, sampling: SamplingTensors,
                  positions: Sequence[int] | torch.Tensor, compact: bool) -> torch.Tensor:
    """[K, N] for the K keyed trees (`sampling.keyed_rows`): the target's keyed sample at every node
    of its match walk, -1 elsewhere. The walk starts at the root; at a node of depth d the keyed
    sample is argmax over v of processed_p(node)[v] / E[v], E the keyed Exp(1) draws of (the tree's
    key, positions[t] + d); the walk moves into the first child carrying that token, and stops when
    none does. `verify_greedy_batched` on these choices then accepts exactly that walk (a node whose
    choice is -1 has no matching child), so only the (accepted + 1) nodes of each walk are sampled.
    compact: work on the walks still going only (a host read of their count: the CPU's path), or on
    all K rows with finished ones frozen (no host sync: the CUDA path)."""
    dev = target_logits.device
    K, (N, V), D = len(sampling.keyed_rows), target_logits.shape[1:], packed.max_depth
    rows = _keyed_index(sampling, dev)
    st = _rows_of(sampling, rows)
    if isinstance(positions, torch.Tensor):   # on the device already (the runner stages them): no copy here
        base = positions.to(torch.int64).index_select(0, rows)
    else:
        base = torch.tensor([int(positions[t]) for t in sampling.keyed_rows], dtype=torch.int64, device=dev)
    keys = sampling.keys
    cur = torch.zeros(K, dtype=torch.int64, device=dev)
    alive = torch.ones(K, dtype=torch.bool, device=dev)
    choice = torch.full((K, N), -1, dtype=torch.int64, device=dev)
    k_all = torch.arange(K, device=dev)
    for depth in range(D + 1):
        ix = alive.nonzero().squeeze(1) if compact else k_all
        if compact and ix.numel() == 0:
            break
        node = cur[ix]
        probs = processed_probs(target_logits[rows[ix], node], _rows_of(st, ix))
        sampled = argmax(probs / keyed_exponentials(keys[ix], base[ix] + depth, V))
        live = alive[ix]
        choice[ix, node] = torch.where(live, sampled, choice[ix, node])
        if depth == D:                   # no node has children (a batch of roots alone: none at all)
            break
        kids = packed.children[rows[ix], node]                                  # [k, C], -1: none
        match = (kids >= 0) & (packed.tokens[rows[ix, None], kids.clamp_min(0)] == sampled[:, None])
        found = match.any(dim=-1) & live
        nxt = kids.gather(1, match.to(torch.int64).argmax(dim=-1, keepdim=True)).squeeze(1)
        cur[ix] = torch.where(found, nxt, node)
        alive[ix] = found
    return choice


def verify_batched(packed: PackedTrees, target_logits: torch.Tensor, sampling: SamplingTensors,
                   generators: Sequence[torch.Generator | None] | None = None,
                   any_greedy: bool | None = None, compact: bool | None = None,
                   positions: Sequence[int] | torch.Tensor | None = None) -> BatchVerifyResult:
    """Verify T trees from the target's raw logits [T, N, V] (any float dtype), sampling settings
    one row per tree (`SamplingTensors.from_params`), generators one per tree (unkeyed rows' random
    stream; None: the global RNG). positions: per tree the output position of the token drawn at
    its root (needed when `sampling` has keyed rows): host ints, or an int64 tensor [T] already on
    the device (then nothing is copied to the device inside verification).

    Keyed trees (seeded random rows) are verified by matching their keyed samples
    (`keyed_choices`, the module docstring) on the greedy walk.

    Greedy trees (temperature 0) take `verify_greedy_batched` on the argmax of the raw logits, the
    others the walk of `verify_sampling_batched` on `processed_probs` of the logits (temperature,
    top-k, top-p) — computed only at the nodes a walk visits (roots and accepted nodes), not at all
    T * N nodes; rows are merged with torch.where. The sampling work is skipped when
    `sampling.all_greedy`; the greedy work when the caller says no row is greedy (`any_greedy=False`,
    or a host `any_greedy` attribute on `sampling`) — otherwise it is done, being cheap. `compact`
    as in `verify_sampling_batched`."""
    T, N, V = target_logits.shape
    dev = target_logits.device
    if any_greedy is None:
        any_greedy = getattr(sampling, "any_greedy", None)
    greedy_res = None
    keyed = sampling.keyed_rows
    if sampling.all_greedy or any_greedy is not False or keyed:
        matched = argmax(target_logits)                               # [T, N]
        if keyed:
            assert positions is not None, "keyed rows need the positions of their roots"
            ix = _keyed_index(sampling, dev)
            matched = matched.index_copy(0, ix, keyed_choices(packed, target_logits, sampling, positions,
                                                              dev.type == "cpu" if compact is None else compact))
        greedy_res = verify_greedy_batched(packed, matched)
        if sampling.all_greedy or sampling.all_matched:
            return greedy_res
    rows = torch.arange(T, device=dev)

    def probs_at(ix: torch.Tensor | None, nodes: torch.Tensor) -> torch.Tensor:
        if ix is None:
            return processed_probs(target_logits[rows, nodes], sampling)
        return processed_probs(target_logits[ix, nodes], _rows_of(sampling, ix))

    g = sampling.temperature == 0                                              # [T] rows decided by the match walk
    if keyed:
        g = g.index_fill(0, _keyed_index(sampling, dev), True)
    sampled = _sampling_walk(packed, probs_at, V, generators, ~g if greedy_res is not None else None,
                             dev.type == "cpu" if compact is None else compact)
    if greedy_res is None:
        return sampled
    col = g[:, None]
    return BatchVerifyResult(
        torch.where(col, greedy_res.path, sampled.path),
        torch.where(g, greedy_res.num_accepted, sampled.num_accepted),
        torch.where(col, greedy_res.tokens, sampled.tokens),
        torch.where(g, greedy_res.root, sampled.root),
        torch.where(col, greedy_res.alternates, sampled.alternates),
    )
