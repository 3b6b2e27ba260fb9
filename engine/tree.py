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

**Provenance** (composite drafters, e.g. a cascade of sub-drafters): a tree may say which part
proposed each node, `sources[i]` indexing `source_names` (the root's entry is ignored: the root is
the target's token). `sources=None` means the whole tree is the drafter's own (one part, no
per-part figures). The engine credits each draft node to its part, and each accepted token to the
part of the accepted node (`TokenTree.part_tally`). Helpers that build a tree from other trees
keep the sources (`TokenTree.prefix`, `merge_trees`); `trie_from_candidates` takes one source per
candidate; `tagged` marks a whole tree as one part. A node proposed by several parts (the same
token under the same parent) is credited to the **first** part that proposed it, in the order the
parts are given: the merged tree cannot tell which part "really" proposed it, and the first is the
one whose draft is used in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

import numpy as np
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
    # provenance (composite drafters): the part that proposed each node, as an index into
    # `source_names` (root entries ignored); None = the whole tree is the drafter's own
    sources: list[int] | None = None
    source_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} nodes")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")
        self.source_names = tuple(str(n) for n in self.source_names)
        if self.sources is not None:
            self.sources = [int(s) for s in self.sources]
        problem = sources_problem(len(self.tokens), self.sources, self.source_names)
        if problem:
            raise ValueError(problem)

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

    def part_of(self, node: int) -> str | None:
        """The name of the part that proposed `node` (None without sources, and for roots)."""
        if self.sources is None or self.parents[node] == NO_PARENT:
            return None
        return self.source_names[self.sources[node]]

    def part_tally(self, accepted_nodes: Sequence[int] = ()) -> dict[str, tuple[int, int]]:
        """Per part: (draft nodes it proposed in this tree, nodes of `accepted_nodes` it proposed),
        every name of `source_names` present (zeros included); {} for a tree without sources.

        Example: tokens `[5, a, b, c]`, parents `[-1, 0, 1, 0]`, sources `[0, 0, 0, 1]`, names
        `("x", "y")`, accepted `[1, 2]` -> `{"x": (2, 2), "y": (1, 0)}`."""
        if self.sources is None:
            return {}
        drafted = [0] * len(self.source_names)
        accepted = [0] * len(self.source_names)
        for i in range(self.num_roots, len(self.tokens)):
            drafted[self.sources[i]] += 1
        for node in accepted_nodes:
            accepted[self.sources[node]] += 1
        return {name: (drafted[k], accepted[k]) for k, name in enumerate(self.source_names)}

    def prefix(self, num_nodes: int) -> "TokenTree":
        """The first `num_nodes` nodes (root included): a valid tree, since parents come first; what
        cutting a tree to a budget of `num_nodes - 1` draft nodes gives. Draft distributions and
        sources come along."""
        n = max(1, min(num_nodes, len(self.tokens)))
        return TokenTree(self.tokens[:n], self.parents[:n],
                         None if self.draft_probs is None else self.draft_probs[:n], self.next_roots,
                         None if self.sources is None else self.sources[:n], self.source_names)

    def subtree(self, keep: Sequence[int]) -> "TokenTree":
        """The nodes `keep` (increasing, each node's parent kept with it, the roots among them), with
        their parents renumbered; draft distributions and sources come along. Example: tokens
        `[5, a, b, c]`, parents `[-1, 0, 1, 0]`, keep `[0, 3]` -> tokens `[5, c]`, parents `[-1, 0]`."""
        index = {node: i for i, node in enumerate(keep)}
        parents = [NO_PARENT if self.parents[n] == NO_PARENT else index[self.parents[n]] for n in keep]
        return TokenTree([self.tokens[n] for n in keep], parents,
                         None if self.draft_probs is None else self.draft_probs[list(keep)], self.next_roots,
                         None if self.sources is None else [self.sources[n] for n in keep], self.source_names)

    def tagged(self, name: str) -> "TokenTree":
        """The same tree with every node credited to the part `name` (replacing any sources)."""
        return TokenTree(list(self.tokens), list(self.parents), self.draft_probs, self.next_roots,
                         [0] * len(self.tokens), (name,))

    def then(self, after: "TokenTree", name: str) -> "TokenTree":
        """This chain (a single path from its root, e.g. a grammar's forced tokens) with `after` (a
        one-root tree rooted at this chain's last token, proposed by `name`) hung from its last
        node. Sources keep both: this tree's parts first (its own name for a tree without sources),
        then `after`'s (`name` for a tree without). Deterministic nodes on one side and sampled ones
        on the other: the deterministic ones get one-hot rows (q(x) = 1). Example: chain tokens
        `[5, a]`, after `[a, b, c]` with parents `[-1, 0, 0]` -> tokens `[5, a, b, c]`, parents
        `[-1, 0, 1, 1]`."""
        last = self.num_nodes - 1
        if self.parents != [NO_PARENT, *range(last)] or after.num_roots != 1 or after.tokens[0] != self.tokens[-1]:
            raise ValueError("then: a chain, and a one-root tree rooted at its last token")
        tokens = self.tokens + after.tokens[1:]
        parents = self.parents + [last + p for p in after.parents[1:]]
        probs = None
        if self.draft_probs is not None or after.draft_probs is not None:
            vocab = (after.draft_probs if after.draft_probs is not None else self.draft_probs).shape[1]
            rows = []
            for tree in (self, after):
                if tree.draft_probs is not None:
                    rows.append(tree.draft_probs if tree is self else tree.draft_probs[1:])
                else:
                    picks = torch.tensor(tree.tokens if tree is self else tree.tokens[1:], dtype=torch.int64)
                    one_hot = torch.zeros(len(picks), vocab, dtype=torch.float32)
                    one_hot[torch.arange(len(picks)), picks] = 1.0
                    rows.append(one_hot.to(self.draft_probs.device if self.draft_probs is not None
                                           else after.draft_probs.device))
            probs = torch.cat(rows)
        mine = self.source_names if self.sources is not None else ("",)
        theirs = after.source_names if after.sources is not None else (name,)
        own = self.sources if self.sources is not None else [0] * self.num_nodes
        sources = own + [len(mine) + p for p in (after.sources[1:] if after.sources is not None
                                                 else [0] * (after.num_nodes - 1))]
        return TokenTree(tokens, parents, probs, after.next_roots, sources, (*mine, *theirs))

    @classmethod
    def root_only(cls, root: int) -> "TokenTree":
        """No draft: plain decoding in the same code path."""
        return cls([root], [NO_PARENT])


def sources_problem(num_nodes: int, sources: Sequence[int] | None, source_names: Sequence[str]) -> str | None:
    """Why `sources`/`source_names` do not describe a tree of `num_nodes` nodes, or None."""
    if len(set(source_names)) != len(source_names):
        return f"source_names must be distinct, got {tuple(source_names)}"
    if sources is None:
        return None
    if len(sources) != num_nodes:
        return f"{len(sources)} sources for {num_nodes} nodes"
    bad = next((s for s in sources if not 0 <= s < len(source_names)), None)
    if bad is not None:
        return f"source {bad} is not an index into {len(source_names)} source_names"
    return None


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


# --- A whole batch of trees as padded tensors (device verification, batched attention) ----------

from collections import OrderedDict  # noqa: E402

@dataclass(frozen=True)
class TreeTopology:
    """What a tree's shape alone determines, on the host: built once per distinct `parents` and
    cached (static templates — medusa, parallelspec, draft_model k-configs, chains — then cost a
    dictionary look-up per step)."""

    mask: torch.Tensor       # [n, n] bool, ancestor-or-self (as build_tree_buffers)
    depths: torch.Tensor     # [n] int64
    children: torch.Tensor   # [n, c] int64: the children of each node in node order, pad -1 (c >= 0)
    num_roots: int
    max_depth: int

    @property
    def max_children(self) -> int:
        return self.children.shape[1]


TOPOLOGY_CACHE_SIZE = 1024
_TOPOLOGY_CACHE: "OrderedDict[tuple[int, ...], TreeTopology]" = OrderedDict()


def _build_topology(parents: tuple[int, ...]) -> TreeTopology:
    buf = build_tree_buffers(parents)   # also validates
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p != NO_PARENT:
            kids[p].append(i)
    c = max(len(k) for k in kids)
    children = torch.tensor([k + [-1] * (c - len(k)) for k in kids], dtype=torch.int64).reshape(n, c)
    return TreeTopology(buf.mask, buf.depths, children, num_roots(parents), max(tree_depths(parents)))


def tree_topology(parents: Sequence[int]) -> TreeTopology:
    """The cached host topology of `parents` (LRU, TOPOLOGY_CACHE_SIZE entries). Host tensors
    only: device copies are made per step for the whole batch at once by `pack_trees`."""
    key = tuple(parents)
    topo = _TOPOLOGY_CACHE.get(key)
    if topo is not None:
        _TOPOLOGY_CACHE.move_to_end(key)
        return topo
    topo = _build_topology(key)
    _TOPOLOGY_CACHE[key] = topo
    while len(_TOPOLOGY_CACHE) > TOPOLOGY_CACHE_SIZE:
        _TOPOLOGY_CACHE.popitem(last=False)
    return topo


@dataclass
class PackedTrees:
    """T draft trees padded to N = the largest tree's node count, on one device.

    Padding nodes (index >= num_nodes[t]) have token 0, parent NO_PARENT, depth 0, no children
    and a mask row that sees only themselves; they are never roots of a walk (walks start at the
    first num_roots[t] nodes). Host copies of the batch maxima are kept so that device code can
    loop over them without a sync."""

    tokens: torch.Tensor               # [T, N] int64, pad 0
    parents: torch.Tensor              # [T, N] int64, NO_PARENT for roots and padding
    num_nodes: torch.Tensor            # [T] int64
    sizes: list[int]                   # host copy of num_nodes
    depths: torch.Tensor               # [T, N] int64 (roots 0)
    mask: torch.Tensor                 # [T, N, N] bool ancestor-or-self (padding rows: self only)
    children: torch.Tensor             # [T, N, C] int64, children in node order, pad -1
    num_roots: torch.Tensor            # [T] int64
    max_depth: int                     # host: max depth over the batch (0 for root-only trees)
    draft_probs: torch.Tensor | None   # [T, N, V] float32, zeros for deterministic trees; None if no tree has any
    stochastic: torch.Tensor           # [T] bool: tree t has draft_probs (else its drafts use one-hot q)
    next_roots: torch.Tensor           # [T] int64 (TokenTree.next_roots)
    max_next_roots: int                # host
    max_roots: int = 1                 # host: max num_roots over the batch

    @property
    def num_trees(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_children(self) -> int:
        return self.children.shape[2]



def pack_trees(trees: Sequence[TokenTree], device: torch.device | str = "cpu") -> PackedTrees:
    """Pad and stack `trees` for batched verification. Topologies come from the `tree_topology`
    cache; the batch is assembled on the host and sent with one copy of an int64 buffer and one
    of a bool buffer (pinned, non-blocking on CUDA), plus the draft distributions when any tree
    has them (stacked where they already live)."""
    if not trees:
        raise ValueError("pack_trees needs at least one tree")
    device = torch.device(device)
    T = len(trees)
    topos = [tree_topology(t.parents) for t in trees]
    sizes = [t.num_nodes for t in trees]
    N = max(sizes)
    C = max(tp.max_children for tp in topos)
    fields = (("tokens", N), ("parents", N), ("depths", N), ("children", N * C), ("num_nodes", 1),
              ("num_roots", 1), ("next_roots", 1), ("stochastic", 1))
    width = sum(w for _, w in fields)
    pin = device.type == "cuda"
    host = torch.empty(T * width, dtype=torch.int64, pin_memory=pin)
    mask = torch.empty(T, N, N, dtype=torch.bool, pin_memory=pin)
    # filled through numpy views of the (pinned) host buffers: a few times faster than torch's
    # indexing for these small rows
    flat, views, off = host.numpy(), {}, 0
    for name, w in fields:
        views[name] = flat[off:off + T * w].reshape(T, w)
        off += T * w
    tokens, parents, depths = views["tokens"], views["parents"], views["depths"]
    children = views["children"].reshape(T, N, C)
    tokens.fill(0)
    parents.fill(NO_PARENT)
    depths.fill(0)
    children.fill(-1)
    m = mask.numpy()
    m.fill(False)
    m[:, np.arange(N), np.arange(N)] = True
    for t, (tree, tp, n) in enumerate(zip(trees, topos, sizes)):
        tokens[t, :n] = tree.tokens
        parents[t, :n] = tree.parents
        depths[t, :n] = tp.depths.numpy()
        children[t, :n, :tp.max_children] = tp.children.numpy()
        m[t, :n, :n] = tp.mask.numpy()
    stochastic = [t.draft_probs is not None for t in trees]
    views["num_nodes"][:, 0] = sizes
    views["num_roots"][:, 0] = [tp.num_roots for tp in topos]
    views["next_roots"][:, 0] = [max(1, int(t.next_roots)) for t in trees]
    views["stochastic"][:, 0] = stochastic

    dev = host.to(device, non_blocking=True) if device != host.device else host
    mask = mask.to(device, non_blocking=True) if device != mask.device else mask
    out, off = {}, 0
    for name, w in fields:
        out[name] = dev[off:off + T * w].view(T, w)
        off += T * w

    draft_probs = None
    if any(stochastic):
        V = next(t.draft_probs.shape[1] for t in trees if t.draft_probs is not None)
        draft_probs = torch.zeros(T, N, V, dtype=torch.float32, device=device)
        for t, tree in enumerate(trees):
            if tree.draft_probs is not None:
                draft_probs[t, :sizes[t]].copy_(tree.draft_probs, non_blocking=True)

    return PackedTrees(
        tokens=out["tokens"], parents=out["parents"], num_nodes=out["num_nodes"].view(T), sizes=sizes,
        depths=out["depths"], mask=mask, children=out["children"].view(T, N, C),
        num_roots=out["num_roots"].view(T), max_depth=max(tp.max_depth for tp in topos),
        draft_probs=draft_probs, stochastic=out["stochastic"].view(T).bool(),
        next_roots=out["next_roots"].view(T), max_next_roots=max(max(1, int(t.next_roots)) for t in trees),
        max_roots=max(tp.num_roots for tp in topos),
    )


# --- Helpers for drafters: building trees, and a drafter's own tree forwards --------------------


def preference_prefix(order: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """The first `budget` nodes of a tree given as rank paths in *preference order* (Medusa-style
    tuned orders): the first `budget` paths when every path's parent comes before it, else the
    level-major truncation of the whole set (as `TreeTemplate.truncate` would cut it).

    Example: `[[0], [0, 0], [1], [0, 1]]` with budget 3 -> `[[0], [0, 0], [1]]`; the order
    `[[0, 0], [1], [0]]` is not prefix-closed, so budget 2 gives level-major `[[0], [1]]`."""
    seen: set[tuple[int, ...]] = {()}
    closed = True
    for p in order:
        if tuple(p[:-1]) not in seen:
            closed = False
            break
        seen.add(tuple(p))
    if closed:
        return [list(p) for p in order[:budget]]
    level_major = sorted({tuple(p[:j]) for p in order for j in range(1, len(p) + 1)}, key=lambda p: (len(p), p))
    return [list(p) for p in level_major[:budget]]


def cartesian_fill(template: TreeTemplate, root: int, topk: Sequence[Sequence[int]]) -> TokenTree:
    """Medusa's Cartesian tree: node i at depth d with sibling rank r carries `topk[d-1][r]`, the
    r-th most likely token of the depth-d distribution, whatever its parent (all depths are
    predicted from the same position). The tree is cut before the first node whose depth or rank
    has no candidate (a topological prefix, so still a tree).

    Example: template `[[0], [1], [0, 0]]` (parents -1 0 0 1, ranks 0 0 1 0), topk
    `[[11, 12], [21]]`, root 5 -> tokens `[5, 11, 12, 21]`."""
    tokens = [root]
    depth = [0] * template.num_nodes
    for node in range(1, template.num_nodes):
        parent = template.parents[node]
        if parent == NO_PARENT:
            raise ValueError("cartesian_fill takes single-root templates")
        depth[node] = depth[parent] + 1
        d, rank = depth[node], template.ranks[node]
        if d > len(topk) or rank >= len(topk[d - 1]):
            break
        tokens.append(int(topk[d - 1][rank]))
    return TokenTree(tokens, list(template.parents[:len(tokens)]))


def trie_from_candidates(root: int, candidates: Sequence[Sequence[int]], budget: int,
                         scores: Sequence[float] | None = None, sources: Sequence[int] | None = None,
                         source_names: Sequence[str] = ()) -> TokenTree | None:
    """Merge candidate continuations of `root` into a trie (shared prefixes become shared nodes,
    duplicates vanish) of at most `budget` draft nodes; None when no node fits.

    Without `scores`, nodes are taken in the order the candidates give them (candidate by candidate,
    each down its path) until the budget is spent: earlier candidates win. With `scores` (one per
    candidate, higher is better), a node scores the best candidate through it, the `budget` best
    nodes are kept (an ancestor scores at least as high as its descendants and wins ties, so they
    form a tree), laid out level-major with siblings best first.

    `sources` (one per candidate, indices into `source_names`) give the tree provenance: a node
    is credited to the first candidate (in candidate order) that passes through it.

    Example: candidates `[a b c], [a d], [e]`, budget 4 -> root -> a -> (b -> c, d) cut to a b c d;
    with scores `[0.1, 0.5, 0.3]` and budget 3 -> a (0.5), e (0.3), d (0.5) level-major: a e d.
    With sources `[0, 1, 1]`: a b c are part 0's, d and e part 1's."""
    if budget <= 0:
        return None
    if sources is not None and len(sources) != len(candidates):
        raise ValueError(f"{len(sources)} sources for {len(candidates)} candidates")
    names = tuple(source_names)
    src = [0] * len(candidates) if sources is None else [int(x) for x in sources]
    if scores is None:
        tokens, parents, node_src = [root], [NO_PARENT], [0]
        child: dict[tuple[int, int], int] = {}
        for cand, cs in zip(candidates, src):
            node = 0
            for tok in cand:
                nxt = child.get((node, tok))
                if nxt is None:
                    if len(tokens) - 1 >= budget:
                        break
                    nxt = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    node_src.append(cs)
                    child[(node, tok)] = nxt
                node = nxt
        if len(tokens) <= 1:
            return None
        return TokenTree(tokens, parents, sources=None if sources is None else node_src, source_names=names)
    if len(scores) != len(candidates):
        raise ValueError(f"{len(scores)} scores for {len(candidates)} candidates")
    # the full trie: node -> (token, parent, depth, best score, first seen)
    tok_of, par_of, dep_of, best, src_of = [root], [NO_PARENT], [0], [float("inf")], [0]
    index: dict[tuple[int, int], int] = {}
    for cand, score, cs in zip(candidates, scores, src):
        node = 0
        for tok in cand:
            nxt = index.get((node, tok))
            if nxt is None:
                nxt = len(tok_of)
                index[(node, tok)] = nxt
                tok_of.append(int(tok))
                par_of.append(node)
                dep_of.append(dep_of[node] + 1)
                best.append(float(score))
                src_of.append(cs)
            else:
                best[nxt] = max(best[nxt], float(score))
            node = nxt
    kept = sorted(range(1, len(tok_of)), key=lambda i: (-best[i], dep_of[i], i))[:budget]
    if not kept:
        return None
    out = {0: 0}
    tokens, parents, node_src = [root], [NO_PARENT], [0]
    # level-major; within a level, grouped by the parent's output order, siblings best first
    for d in sorted({dep_of[i] for i in kept}):
        level = [i for i in kept if dep_of[i] == d]
        level.sort(key=lambda i: (out[par_of[i]], -best[i], i))
        for i in level:
            out[i] = len(tokens)
            tokens.append(tok_of[i])
            parents.append(out[par_of[i]])
            node_src.append(src_of[i])
    return TokenTree(tokens, parents, sources=None if sources is None else node_src, source_names=names)


def merge_trees(root: int, trees: Sequence[TokenTree | None], names: Sequence[str] | None = None,
                budget: int | None = None) -> TokenTree | None:
    """The draft trees of several parts (sub-drafters) under one root, with provenance; None when
    no draft node is left.

    Every tree must hang under `root` (its node 0's token) with a single root, and be
    deterministic (`draft_probs` None: siblings drawn from different parts' distributions are not
    one draw that verification could correct for). Trees are taken in order, each in its node
    order; a node whose path of tokens from the root is already in the merged tree is not added
    again (identical paths are deduplicated) and keeps the source of the **first** part that
    proposed it. A tree without sources is credited whole to its name in `names` (required
    then); a tree with sources keeps its own part names (so merges nest). With `budget`, nodes
    are added until `budget` draft nodes are in: a node past the budget and its descendants are
    dropped, later parts' nodes already present still merge. The result's nodes are in
    topological order (parents first), not level-major.

    Example: trees `5 -> a -> b` ("x") and `5 -> (a -> c, d)` ("y") -> tokens `[5, a, b, c, d]`,
    parents `[-1, 0, 1, 1, 0]`, sources `[0, 0, 0, 1, 1]` over `("x", "y")`; with budget 3 the
    last node (d) is dropped."""
    if names is not None and len(names) != len(trees):
        raise ValueError(f"{len(names)} names for {len(trees)} trees")
    out_names: list[str] = []
    tokens, parents, sources = [root], [NO_PARENT], [0]
    child: dict[tuple[int, int], int] = {}
    limit = float("inf") if budget is None else budget
    for k, tree in enumerate(trees):
        if tree is None:
            continue
        if tree.tokens[0] != root or tree.num_roots != 1:
            raise ValueError(f"tree {k} does not hang under the single root {root}")
        if tree.draft_probs is not None:
            raise ValueError(f"tree {k} is stochastic; merge_trees takes deterministic trees")
        if tree.sources is None:
            if names is None:
                raise ValueError(f"tree {k} has no sources and no name")
            part_names, part_src = (names[k],), [0] * tree.num_nodes
        else:
            part_names, part_src = tree.source_names, tree.sources
        ids = []
        for name in part_names:
            if name not in out_names:
                out_names.append(name)
            ids.append(out_names.index(name))
        where = [0] + [-1] * (tree.num_nodes - 1)   # tree node -> merged node (-1: dropped)
        for i in range(1, tree.num_nodes):
            p = where[tree.parents[i]]
            if p < 0:
                continue
            key = (p, tree.tokens[i])
            node = child.get(key)
            if node is None:
                if len(tokens) - 1 >= limit:
                    continue
                node = child[key] = len(tokens)
                tokens.append(int(tree.tokens[i]))
                parents.append(p)
                sources.append(ids[part_src[i]])
            where[i] = node
    if len(tokens) == 1:
        return None
    return TokenTree(tokens, parents, sources=sources, source_names=tuple(out_names))


def ancestor_mask(parents: Sequence[int], rows: Sequence[int], width: int | None = None) -> torch.Tensor:
    """The "prefix + ancestors" visibility of new nodes in a drafter's own tree forward, over the
    tree nodes only (the committed prefix is visible to every row and is not part of the mask).

    `parents` indexes the nodes whose KV sits, in node order, right after the prefix (NO_PARENT
    marks a node hanging directly under the prefix: a root, or in a forest of depth-1 rows any of
    them); `rows` the nodes fed in this forward. Row r is True at `rows[r]` and every ancestor of
    it; `width` (default `max(rows) + 1`) is the number of node columns. A bool [len(rows), width]
    CPU tensor, as `build_attn_metadata` takes it.

    Example: parents `[-1, 0, 0, 1]`, rows `[3]` -> `[[True, True, False, True]]`."""
    width = (max(rows) + 1) if width is None else width
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, node in enumerate(rows):
        a = node
        while a != NO_PARENT:
            mask[r, a] = True
            a = parents[a]
    return mask
