"""Choose a draft-tree shape from measured acceptance (Medusa-style "sparse tree" tuning).

For a drafter whose depth-d candidates are the rank-ordered top tokens of one distribution per
depth (Medusa heads, ParallelSpec slots), a tree is a set of *paths* of ranks: `[0, 2]` is the
3rd-ranked token of depth 2 under the top token of depth 1 (the "choices" format of
`TreeTemplate.from_choices`). A node is on the accepted path exactly when, at every depth along
its path, the right token is the candidate of that rank; so the expected number of accepted
drafts of a tree is the sum over its nodes of P(the node's path is right).

* Independence model (`greedy_tree_order`): `acc[d][r]` = P(the rank-r candidate of depth d+1 is
  the right token); a path's probability is the product along it.
* Empirical model (`greedy_tree_order_empirical`): from the rank of the right token at every
  depth for held-back positions, a path's probability is the fraction of positions whose rank
  prefix equals the path (no independence assumption: errors of the heads are correlated).

Both grow the tree greedily: start from the root, repeatedly add the frontier node (a child of a
node already in the tree) with the highest path probability. Because a child's probability never
exceeds its parent's, the first n nodes added are the n most probable nodes that form a tree,
i.e. the tree of n nodes with the largest expected accepted length. The returned *order* has the
useful property that every prefix is itself a tree (parents are added before children), so one
list serves every budget: `TreeTemplate.from_choices(order[:budget])`.

Ties are broken towards shorter paths, then lexicographically smaller paths (deterministic).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

Path = tuple[int, ...]


def path_probability(acc: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """Product of acc[d][path[d]] along the path (independence model)."""
    p = 1.0
    for d, r in enumerate(path):
        if d >= len(acc) or r >= len(acc[d]):
            return 0.0
        p *= float(acc[d][r])
    return p


def expected_accepted_length(acc: Sequence[Sequence[float]], paths: Sequence[Sequence[int]]) -> float:
    """Expected accepted drafts (bonus excluded) of the tree `paths` under the independence model;
    prefixes missing from `paths` are added (they are in the tree built from them)."""
    return sum(path_probability(acc, p) for p in _closed(paths))


def greedy_tree_order(acc: Sequence[Sequence[float]], budget: int, max_depth: int | None = None) -> list[list[int]]:
    """The `budget` most probable paths, in the order the greedy expansion adds them.

    `acc[d][r]`: probability that the rank-r candidate at depth d+1 is right (d = 0 is the first
    draft level). Nodes of probability 0 are never added, so fewer than `budget` paths may come
    back."""
    depth_limit = len(acc) if max_depth is None else min(max_depth, len(acc))
    frontier: list[tuple[float, int, Path]] = []

    def push_children(parent: Path, p_parent: float) -> None:
        d = len(parent)
        if d >= depth_limit:
            return
        for r, a in enumerate(acc[d]):
            p = p_parent * float(a)
            if p > 0.0:
                heapq.heappush(frontier, _key(p, parent + (r,)))

    push_children((), 1.0)
    order: list[list[int]] = []
    while frontier and len(order) < budget:
        neg_p, _, path = heapq.heappop(frontier)
        order.append(list(path))
        push_children(path, -neg_p)
    return order


def greedy_tree_order_empirical(ranks: torch.Tensor, budget: int, max_rank: int = 10,
                                max_depth: int | None = None) -> list[list[int]]:
    """Like `greedy_tree_order` with path probabilities read off the data: `ranks[n, d]` is the
    rank of the right token among the depth-(d+1) candidates at held-back position n (negative
    or >= max_rank: not among the candidates; the walk stops there)."""
    ranks = torch.as_tensor(ranks, dtype=torch.int64)
    n, depth = ranks.shape
    if max_depth is not None:
        depth = min(depth, max_depth)
    if n == 0 or depth == 0:
        return []
    frontier: list[tuple[float, int, Path]] = []
    members: dict[Path, torch.Tensor] = {(): torch.arange(n)}   # positions whose rank prefix is the path

    def push_children(parent: Path) -> None:
        d = len(parent)
        if d >= depth:
            return
        rows = members[parent]
        r = ranks[rows, d]
        ok = (r >= 0) & (r < max_rank)
        counts = torch.bincount(r[ok], minlength=max_rank)
        for rank, c in enumerate(counts.tolist()):
            if c > 0:
                heapq.heappush(frontier, _key(c / n, parent + (rank,)))

    push_children(())
    order: list[list[int]] = []
    while frontier and len(order) < budget:
        _, _, path = heapq.heappop(frontier)
        parent_rows = members[path[:-1]]
        members[path] = parent_rows[ranks[parent_rows, len(path) - 1] == path[-1]]
        order.append(list(path))
        push_children(path)
    return order


def accepted_lengths(ranks: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per position, the drafts a Cartesian tree `paths` gets accepted: the longest path of the
    tree that equals the position's rank prefix. `ranks[n, d]` as in `greedy_tree_order_empirical`."""
    ranks = torch.as_tensor(ranks, dtype=torch.int64)
    tree = _closed(paths)
    n = ranks.shape[0]
    out = torch.zeros(n, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    max_len = max((len(p) for p in tree), default=0)
    for d in range(min(max_len, ranks.shape[1])):
        # a position survives depth d+1 if its prefix of length d+1 is a path of the tree
        prefixes = {p[:d + 1] for p in tree if len(p) > d}
        hit = torch.zeros(n, dtype=torch.bool)
        for p in prefixes:
            m = alive.clone()
            for j, r in enumerate(p):
                m &= ranks[:, j] == r
            hit |= m
        alive &= hit
        if not alive.any():
            break
        out += alive.long()
    return out


def empirical_accepted_length(ranks: torch.Tensor, paths: Sequence[Sequence[int]]) -> float:
    """Mean accepted drafts (bonus excluded) of the tree `paths` over the positions of `ranks`."""
    ranks = torch.as_tensor(ranks)
    if ranks.shape[0] == 0:
        return 0.0
    return float(accepted_lengths(ranks, paths).double().mean())


def acceptance_table(ranks: torch.Tensor, max_rank: int = 10) -> list[list[float]]:
    """acc[d][r] = fraction of positions whose right token is the rank-r candidate at depth d+1
    (marginal over positions, whatever happened at the other depths)."""
    ranks = torch.as_tensor(ranks, dtype=torch.int64)
    n, depth = ranks.shape
    table = []
    for d in range(depth):
        r = ranks[:, d]
        r = r[(r >= 0) & (r < max_rank)]
        counts = torch.bincount(r, minlength=max_rank)[:max_rank].double()
        table.append((counts / max(n, 1)).tolist())
    return table


def is_prefix_closed(paths: Sequence[Sequence[int]]) -> bool:
    """Every prefix of every path is in the list before it (so each prefix of the list is a tree)."""
    seen: set[Path] = {()}
    for p in paths:
        p = tuple(p)
        if not p or p[:-1] not in seen:
            return False
        seen.add(p)
    return True


def _closed(paths: Sequence[Sequence[int]]) -> set[Path]:
    out: set[Path] = set()
    for p in paths:
        p = tuple(int(x) for x in p)
        for k in range(1, len(p) + 1):
            out.add(p[:k])
    return out


def _key(p: float, path: Path) -> tuple[float, int, Path]:
    """Heap key: highest probability first, then shorter, then lexicographically smaller paths."""
    return (-p, len(path), path)
