"""Draft token trees: the one representation (parent pointers) and the one place that derives
masks, positions and root-to-leaf paths from it.

A tree hangs under the sequence's last committed token, the **root** (node 0, whose KV is not yet
in the cache: the verification forward computes it together with the drafts). Nodes are in
topological order (`parents[i] < i`); trees built from templates are also **level-major** (all
depth-1 nodes, then all depth-2 nodes, ...), so the first `k` levels form a valid smaller tree
(MCSD's sliced mask: the top-left square of the full mask).

Example — the template `[[0], [1], [0, 0]]` (paths of child ranks) is

    node:    0(root)  1  2  3
    parent:   -1      0  0  1
    depth:     0      1  1  2
    mask row 3 = {0, 1, 3}     (itself and its ancestors)

**Forests** (MCSD's target-initialised roots, an explicitly lossy opt-in): the first `num_roots`
nodes may all be roots (parent -1). Node 0 is the last committed token; roots 1.. are other
samples of the target for that same position, drawn at the previous verification. Every root
sits at the same position (depth 0) and sees only the prefix and itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

import torch

NO_PARENT = -1


@dataclass(frozen=True)
class TreeTemplate:
    """A tree topology without tokens: `parents` plus each node's rank among its siblings (the
    rank-th most likely child, 0-based), as static templates and k-configurations describe it."""

    parents: tuple[int, ...]     # [n] parents[0] = NO_PARENT
    ranks: tuple[int, ...]       # [n] ranks[0] = 0

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @classmethod
    def from_choices(cls, paths: Sequence[Sequence[int]]) -> "TreeTemplate":
        """From "choices" path lists (Medusa/EAGLE/Falcon templates): `[0, 1]` is the 2nd-ranked
        child of the 1st-ranked child of the root. Duplicates are dropped; every prefix of a path
        must be present (it is added if missing). Nodes come out level-major, ranks ascending."""
        seen: set[tuple[int, ...]] = set()
        for p in paths:
            p = tuple(int(x) for x in p)
            for k in range(1, len(p) + 1):
                seen.add(p[:k])
        ordered = sorted(seen, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks = [NO_PARENT], [0]
        for p in ordered:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_branching(cls, ks: Sequence[int]) -> "TreeTemplate":
        """MCSD k-configuration: every node at depth d-1 gets ks[d-1] children, e.g. (4, 2, 2, 1)
        gives 4 + 8 + 16 + 16 = 44 draft nodes and 16 leaves."""
        if any(k < 1 for k in ks):
            raise ValueError(f"branching factors must be >= 1, got {tuple(ks)}")
        paths = [p for d in range(1, len(ks) + 1) for p in product(*(range(k) for k in ks[:d]))]
        return cls.from_choices(paths)

    @classmethod
    def forest(cls, num_roots: int, ks: Sequence[int]) -> "TreeTemplate":
        """`num_roots` roots, each with the k-configuration `ks` below it, level-major (all roots,
        then all depth-1 nodes, ...). MCSD's target-initialised (2, 4, 3, 1, 1) is forest(2, (4, 3, 1, 1))."""
        if num_roots < 1:
            raise ValueError(f"num_roots must be >= 1, got {num_roots}")
        if num_roots == 1:
            return cls.from_branching(ks)
        full = cls.from_branching((num_roots, *ks))   # a virtual root above the roots, then dropped
        parents = tuple(NO_PARENT if p <= 0 else p - 1 for p in full.parents[1:])
        return cls(parents, full.ranks[1:])

    @classmethod
    def chain(cls, length: int) -> "TreeTemplate":
        return cls.from_choices([[0] * d for d in range(1, length + 1)])

    def truncate(self, max_nodes: int) -> "TreeTemplate":
        """The first `max_nodes` nodes (a valid tree because parents come first)."""
        return TreeTemplate(self.parents[:max_nodes], self.ranks[:max_nodes])


@dataclass
class TokenTree:
    """A draft tree with tokens. `draft_probs[i]` is the distribution node i was drawn from
    (stochastic drafters; row 0 unused), or None for deterministic drafts (one-hot q)."""

    tokens: list[int]                         # [n] tokens[0] = root = last committed token
    parents: list[int]                        # [n] parents[0] = NO_PARENT, parents[i] < i
    draft_probs: torch.Tensor | None = None   # [n, vocab] float32 or None
    # target samples to draw at the end of this tree's verification: 1 = the bonus token (lossless);
    # W > 1 = MCSD target-initialised roots for the next tree (LOSSY, opt-in): the first sample is
    # held back from the client until the next verification picks one of the W as the token
    next_roots: int = 1

    def __post_init__(self) -> None:
        validate_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} nodes")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_roots(self) -> int:
        """1, or the number of target-initialised roots of a forest."""
        return num_roots(self.parents)

    @property
    def num_draft_tokens(self) -> int:
        """Drafted nodes (roots are the target's own tokens, not drafts)."""
        return len(self.tokens) - self.num_roots

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int], draft_probs: torch.Tensor | None = None) -> "TokenTree":
        return cls([root, *drafts], [NO_PARENT, *range(len(drafts))], draft_probs)

    @classmethod
    def root_only(cls, root: int) -> "TokenTree":
        """No draft: plain decoding in the same code path."""
        return cls([root], [NO_PARENT])


def num_roots(parents: Sequence[int]) -> int:
    n = 0
    while n < len(parents) and parents[n] == NO_PARENT:
        n += 1
    return n


def validate_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless `parents` is a topologically ordered tree rooted at node 0 (or a
    forest whose roots are the leading nodes)."""
    if not parents or parents[0] != NO_PARENT:
        raise ValueError("node 0 must be the root (parent -1)")
    for i in range(num_roots(parents), len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children "
                             f"(only the leading nodes may be roots)")


def tree_depths(parents: Sequence[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        if parents[i] != NO_PARENT:
            depth[i] = depth[parents[i]] + 1
    return depth


@dataclass
class TreeBuffers:
    mask: torch.Tensor        # [n, n] bool: mask[i, j] = node j is node i or an ancestor of it
    depths: torch.Tensor      # [n] int64 (RoPE position = committed length + depth)
    paths: list[list[int]]    # root-to-leaf node paths, one per leaf, in leaf order


def build_tree_buffers(parents: Sequence[int], device: torch.device | str = "cpu") -> TreeBuffers:
    """The only place tree masks, depths and paths are made (row i = row parent(i) OR self)."""
    validate_parents(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] != NO_PARENT:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    depths = tree_depths(parents)
    has_child = [False] * n
    for p in parents[1:]:
        if p != NO_PARENT:
            has_child[p] = True
    paths = []
    for leaf in (i for i in range(n) if not has_child[i]):
        path = [leaf]
        while parents[path[-1]] != NO_PARENT:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return TreeBuffers(mask.to(device), torch.tensor(depths, dtype=torch.int64, device=device), paths)
