"""Falcon drafter (Gao et al., AAAI 2025): a semi-autoregressive head drafts k = 2 tokens per
forward under a relaxed causal mask, and a static custom-designed decoding tree spends m forwards
per step (network, mask and the block alignment: drafters/nets/falcon.py; training with CSGD:
drafters/train/falcon.py).

Each step, per sequence whose committed tokens are x_0 .. x_{N-1} (x_{N-1} the tree root):

1. catch-up: the real features of every position that entered the target's KV since the last
   step (read from the engine's feature store, engine/features.py; `observe` only says which
   positions were rewritten) become rows of the drafter's own paged KV (`PagedDraftKV`), rows
   0 .. N-2 (row p reads f_p and x_{p+1}). The chunk's mask is causal except its last k rows, the **root block**
   N-1-k .. N-2, which see each other (`root_block_mask`); when fewer than k rows are new, the
   queries of the previous root block's rows are run again (their keys and values come out the
   same: they depend on the row's input alone). The root block's k outputs give the
   distributions of tree depths 1 .. k.
2. the tree: depth d belongs to block ⌈d/k⌉. **Within a block the tree is Cartesian**: a node at
   depth d with rank r carries the r-th most likely token of the block's distribution for d,
   whatever its ancestors inside the block (so `[0, 0]` and `[1, 0]` carry the same token).
   **Across blocks it is conditional**: every node at a depth that ends a block (k, 2k, ...) and
   has children in the tree is an *expansion*: one block of k rows at positions
   N-1-k + b·k .. (b = the block index), reading the k features its parent expansion predicted
   and the k tokens of its own path, attending to the real rows, to its ancestor expansions'
   rows and to its own block. All expansions of one block level, for all sequences, go through
   one batched forward; the tree rows are written after row N-2 and dropped after verification
   (`accept`), never kept.
3. tokens come from the target's frozen LM head (shared by reference), restricted by default to
   the checkpoint's 8192 most frequent target tokens (drafters.draft_vocab, FR-Spec style).

Drafts are deterministic (top-ranked children, one-hot q: `draft_probs=None`), which verification
accepts losslessly for greedy and sampling requests alike.

After h hypothetical tokens (a grammar's forced ones, `Drafter.drafts_after_uncommitted`) the step
plans the tree under a chain of h rank-0 nodes whose tokens are the hypothetical ones: the root
block's distributions give the depths after them that lie in its block (unconditioned on them, as
within any block), expansions read the hypothetical tokens of their path like drafted ones, and
the tree returned is the part under the last hypothetical token. Its rows are tree rows, dropped
like any tree's: nothing of them is kept.

The tree (`tree` option) is a set of rank paths plus a *preference order* of its nodes in which
every prefix is a tree: the scheduler's per-sequence budget takes the first `budget` nodes.
* a trees.json name (`falcon_kmask2_8layer_tree`, the paper's LLaMA2-Chat tree, the default, or
  `falcon_kmask2_4layer_tree`): the shared data folder's tree (duplicates such as `[0, 1, 0, 0]`
  dropped), ordered by the path probabilities the checkpoint measured on held-back data (its
  meta.json carries the tree and that order, so serving needs no data folder), else by a generic
  rank prior;
* `topk`: the plain tree of the ablation -- every node expanded to its `top_k` children down to
  `depth` levels, cut level-major (no measured order);
* `chain`: the top-1 path of `depth` tokens (the paper's "no tree attention" ablation);
* a JSON list of rank paths or a file holding one (taken as a preference order when every prefix
  is a tree, else ordered by the prior).

Options (`--drafter-option falcon.KEY=VALUE`):
  checkpoint=PATH   a trained checkpoint folder (`specserve train falcon ...`); default: the shipped
                    checkpoint in drafters/checkpoints/ whose target fingerprint matches
  tree=SPEC         see above (default "auto": the checkpoint's tree, else falcon_kmask2_8layer_tree)
  top_k, depth      the shape of tree=topk / tree=chain (2 and 8)
  draft_vocab=N     draft from the N tokens the target chose most often in training (default 8192
                    when the checkpoint has that ranking; 0 = the whole vocabulary)
  block_size, num_blocks   the drafter's KV pool
  random_init=true  FOR TESTS: an untrained head (`init`, `seed`, `k`); `head=` an in-memory FalconHead

Standardized walltime (`model_runs`): one run per sequence per block forward that serves it (the
root block of the catch-up, then each block level where it has expansions, all of that level's
expansions in one forward), at c = (the head's own parameters + the LM-head rows it multiplies,
the draft vocabulary's rows x hidden size) / the target's parameters.
"""

from __future__ import annotations

import heapq
import json
import logging
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.features import FeatureDrafter, FeatureState
from specserve.drafters.nets.falcon import (DEFAULT_K, FalconHead, head_for, load_head, root_block_mask,
                                            shipped_checkpoint)
from specserve.engine.data_dir import data_dir
from specserve.engine.model import rope_tables
from specserve.engine.tree import NO_PARENT, TokenTree, TreeTemplate, ancestor_mask, tree_depths

MAX_HYPOTHETICAL = 16   # hypothetical tokens (a grammar's forced ones) a draft may follow; more: no draft

logger = logging.getLogger("specserve")

DEFAULT_TREE = "falcon_kmask2_8layer_tree"
TREE_NAMES = ("falcon_kmask2_8layer_tree", "falcon_kmask2_4layer_tree")
Path_ = tuple[int, ...]


# ---- tree shapes -------------------------------------------------------------------------------------------------

def dedup_paths(paths: Seq[Seq[int]]) -> list[list[int]]:
    """`paths` without repeats (first occurrence kept, order kept): the official kmask2_8layer_tree
    lists `[0, 1, 0, 0]` twice."""
    seen: set[Path_] = set()
    out = []
    for p in paths:
        t = tuple(int(x) for x in p)
        if t and t not in seen:
            seen.add(t)
            out.append(list(t))
    return out


def closed_paths(paths: Seq[Seq[int]]) -> list[list[int]]:
    """Every path of `paths` and every prefix of one, level-major (depth, then lexicographic)."""
    out: set[Path_] = set()
    for p in paths:
        t = tuple(int(x) for x in p)
        for d in range(1, len(t) + 1):
            out.add(t[:d])
    return [list(p) for p in sorted(out, key=lambda p: (len(p), p))]


def load_tree(name: str) -> list[list[int]] | None:
    """A tree of the shared data folder's trees.json (`specserve.engine.data_dir.data_dir()`,
    $SPECSERVE_DATA), duplicates dropped; None when the file or the tree is not there."""
    try:
        trees = json.loads((data_dir() / "trees.json").read_text(encoding="utf-8"))
        return dedup_paths(trees[name]["paths"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def prior_probability(path: Seq[int]) -> float:
    """A generic prior of a node being accepted, before any measurement: the top-ranked draft is
    right 60 % of the time at depth 1, less deeper, rank r about half as likely as rank r-1."""
    p = 1.0
    for d, r in enumerate(path):
        p *= 0.6 * 0.85 ** d * 0.45 ** r
    return p


def empirical_probability(ranks: torch.Tensor) -> Callable[[Seq[int]], float]:
    """P(path) read off held-back data: `ranks[n, d]` is the rank of the right token among the
    depth-(d+1) drafts of position n (negative: not among them); a path's probability is the
    fraction of positions whose rank prefix is the path (the node is then on the accepted path)."""
    ranks = torch.as_tensor(ranks, dtype=torch.int64)
    n = max(1, ranks.shape[0])

    def prob(path: Seq[int]) -> float:
        d = len(path)
        if d > ranks.shape[1]:
            return 0.0
        want = torch.tensor(list(path), dtype=torch.int64)
        return float((ranks[:, :d] == want).all(1).sum()) / n
    return prob


def order_within(paths: Seq[Seq[int]], probability: Callable[[Seq[int]], float]) -> list[list[int]]:
    """The nodes of the tree `paths` (prefixes added) in the order a greedy expansion adds them:
    repeatedly the frontier node of highest `probability` (ties: shallower, then lexicographically
    smaller). Every prefix of the result is a tree, and -- when a child is never more probable than
    its parent -- the first n nodes are the n-node subtree of largest expected accepted length."""
    nodes = {tuple(p) for p in closed_paths(paths)}
    children: dict[Path_, list[Path_]] = {}
    for p in nodes:
        children.setdefault(p[:-1], []).append(p)
    frontier: list[tuple[float, int, Path_]] = []

    def push(parent: Path_) -> None:
        for c in children.get(parent, ()):
            heapq.heappush(frontier, (-probability(c), len(c), c))

    push(())
    order: list[list[int]] = []
    while frontier:
        _, _, p = heapq.heappop(frontier)
        order.append(list(p))
        push(p)
    return order


def is_prefix_closed(paths: Seq[Seq[int]]) -> bool:
    """Every prefix of every path comes before it (each prefix of the list is a tree)."""
    seen: set[Path_] = {()}
    for p in paths:
        t = tuple(p)
        if not t or t[:-1] not in seen:
            return False
        seen.add(t)
    return True


def topk_tree(top_k: int, depth: int) -> list[list[int]]:
    """Every node expanded to its `top_k` children down to `depth`, level-major (prefix-closed)."""
    return [list(p) for d in range(1, depth + 1) for p in product(range(top_k), repeat=d)]


def chain_tree(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


# ---- the step plan of a tree -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Expansion:
    """One k-row block a drafter forward computes. Expansion 0 is the root block (the catch-up's
    last k rows); expansion e >= 1 hangs under tree node `node` (at depth level·k), reads the k
    features its `parent` expansion predicted and the tokens of `input_nodes` (the k nodes of its
    path at depths (level-1)·k + 1 .. level·k), and sees the rows of `ancestors` (expansions,
    nearest last) besides the real rows and its own block."""

    level: int                       # 0 = root block; its rows sit at positions N-1-k + level·k + i
    node: int                        # the tree node it expands (0 for the root block)
    parent: int                      # parent expansion (-1 for the root block)
    input_nodes: tuple[int, ...]     # [k] nodes whose tokens the rows read (empty for the root block)
    ancestors: tuple[int, ...]       # expansions >= 1 on its path, itself excluded
    row: int                         # its first row among the step's tree rows (-1 for the root block)


@dataclass(frozen=True)
class SarPlan:
    """What a SAR drafter computes for one tree shape: the tree (level-major, `TreeTemplate`),
    for each node the expansion whose output gives its distribution and its row in that block,
    the expansions by level, and the top-r each (expansion, row) needs.

    Example, k = 2, paths [[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0]] (node ids level-major:
    1=[0] 2=[1] 3=[0,0] 4=[0,1] 5=[1,0] 6=[0,0,0]): nodes 1-5 take their tokens from the root
    block (depth 1: row 0, depth 2: row 1; nodes 3 and 5 carry the same token, the top-1 of
    depth 2); node 3 = [0, 0] ends block 1 and has a child, so it is expansion 1 (rows reading the
    tokens of nodes 1 and 3), whose row 0 gives node 6."""

    k: int
    template: TreeTemplate
    depths: tuple[int, ...]
    node_exp: tuple[int, ...]          # [n] expansion giving the node's distribution (-1 for the root)
    node_row: tuple[int, ...]          # [n] row of that expansion's block (0..k-1)
    expansions: tuple[Expansion, ...]
    need: tuple[tuple[int, ...], ...]  # [expansions][k] top-r needed at each row (0: not read)
    num_tree_rows: int                 # k x (expansions - 1)
    num_levels: int                    # forwards per step, the catch-up included
    level_exps: tuple[tuple[int, ...], ...] = field(repr=False, default=())    # [levels] expansions
    level_node_ids: tuple[tuple[int, ...], ...] = field(repr=False, default=())   # [levels] nodes they give
    level_masks: tuple = field(repr=False, compare=False, default=())   # [levels] bool masks (None at 0)

    @classmethod
    def build(cls, paths: Seq[Seq[int]], k: int) -> "SarPlan":
        template = TreeTemplate.from_choices(paths)
        parents, ranks = template.parents, template.ranks
        depths = tree_depths(parents)
        n = len(parents)
        has_child = [False] * n
        for p in parents[1:]:
            has_child[p] = True
        exp_of: dict[int, int] = {0: 0}            # node that ends a block (or the root) -> its expansion
        expansions = [Expansion(0, 0, -1, (), (), -1)]
        node_exp, node_row = [-1] * n, [0] * n
        for i in range(1, n):
            d = depths[i]
            anchor = i                              # the node at depth k * floor((d-1)/k): its block's expansion
            while depths[anchor] > (d - 1) // k * k:
                anchor = parents[anchor]
            node_exp[i], node_row[i] = exp_of[anchor], (d - 1) % k
            if d % k == 0 and has_child[i]:
                path = [i]
                while len(path) < k:
                    path.append(parents[path[-1]])
                parent_exp = exp_of[parents[path[-1]]]
                up = expansions[parent_exp]
                ancestors = up.ancestors + ((parent_exp,) if parent_exp else ())
                rows_before = k * (len(expansions) - 1)
                exp_of[i] = len(expansions)
                expansions.append(Expansion(d // k, i, parent_exp, tuple(reversed(path)), ancestors, rows_before))
        need = [[0] * k for _ in expansions]
        for i in range(1, n):
            e, r = node_exp[i], node_row[i]
            need[e][r] = max(need[e][r], ranks[i] + 1)
        levels = max((e.level for e in expansions), default=0) + 1
        by_level = tuple(tuple(e for e, x in enumerate(expansions) if x.level == b) for b in range(levels))
        nodes = tuple(tuple(i for i in range(1, n) if expansions[node_exp[i]].level == b) for b in range(levels))
        # the tree rows are the blocks of expansions 1.. in order (expansion e at rows k(e-1) ..):
        # an expansion's rows see its ancestors' blocks and its own, whole (the relaxed mask), i.e.
        # the ancestor mask over expansions, each entry widened to a k x k block
        exp_parents = [x.parent - 1 if x.parent > 0 else NO_PARENT for x in expansions[1:]]
        masks: list[torch.Tensor | None] = [None]
        for b in range(1, levels):
            exps = by_level[b]
            mask = ancestor_mask(exp_parents, [e - 1 for e in exps], exps[-1])
            masks.append(mask.repeat_interleave(k, 0).repeat_interleave(k, 1))
        return cls(k, template, tuple(depths), tuple(node_exp), tuple(node_row), tuple(expansions),
                   tuple(tuple(x) for x in need), k * (len(expansions) - 1), levels, by_level, nodes, tuple(masks))

    @property
    def num_nodes(self) -> int:
        return self.template.num_nodes

    def level(self, b: int) -> tuple[int, ...]:
        """The expansions whose rows one forward of block level b computes (0: the root block)."""
        return self.level_exps[b] if b < self.num_levels else ()

    def level_nodes(self, b: int) -> tuple[int, ...]:
        """The nodes whose distribution level b's forward gives."""
        return self.level_node_ids[b] if b < self.num_levels else ()

    def level_mask(self, b: int) -> torch.Tensor:
        """[rows of level b, tree rows up to its last] bool: what level b's rows see of the tree
        rows (their ancestors' blocks and their own; the real rows are all visible)."""
        return self.level_masks[b]

    def visible_rows(self, e: int) -> list[int]:
        """Tree rows expansion e's rows see: its ancestors' and its own."""
        rows = []
        for a in (*self.expansions[e].ancestors, e):
            start = self.expansions[a].row
            rows.extend(range(start, start + self.k))
        return rows


# ---- the drafter -------------------------------------------------------------------------------------------------

class _SeqState(FeatureState):
    __slots__ = ("root_out", "root_n")

    def __init__(self):
        super().__init__()                           # kv_len L: rows 0..L-1 (real features) are in the drafter's cache
        self.root_out: torch.Tensor | None = None    # [k, H] the root block's outputs, valid while N == root_n
        self.root_n = -1


@register("falcon")
class FalconDrafter(FeatureDrafter):
    """See the module docstring. The target's features are read from the engine's feature store
    (`ctx.features`, engine/features.py); built outside an engine, the drafter keeps its own store,
    fed by `observe`. Its rows live in a `PagedDraftKV` (one layer)."""

    name = "falcon"
    State = _SeqState
    drafts_after_uncommitted = True   # see Drafter and the module docstring; the chain's rows are tree rows

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, tree=None, top_k: int = 2,
                 depth: int = 8, draft_vocab: int | None = None, random_init: bool = False, init: str = "identity",
                 seed: int = 0, k: int = DEFAULT_K, head: FalconHead | None = None, block_size: int = 16,
                 num_blocks: int | None = None):
        super().__init__(ctx)
        target, model_config = ctx.target, ctx.model_config
        if min(int(top_k), int(depth)) < 1:
            raise ValueError(f"falcon: top_k and depth must be >= 1 (got {top_k}, {depth})")
        if head is None:
            if random_init:
                head = FalconHead.from_target(model_config, target, k=int(k), init=init, seed=int(seed))
            else:
                head = self.load_trained(checkpoint, model_config, shipped_checkpoint, load_head)
        self.head = head_for(head, self.device, self.dtype).eval()
        self.k = self.head.k
        self.vocab = DraftVocab(target.lm_head_weight, self.head.vocab_rank, draft_vocab, drafter="falcon",
                                full_logits=target.compute_logits)
        self.tree_name, self.order = self._tree(tree, int(top_k), int(depth))
        self._plans: dict[tuple[int, int], SarPlan] = {}
        full = self.plan(len(self.order), MAX_HYPOTHETICAL)
        self.max_tree_rows = full.num_tree_rows
        max_depth = max(full.depths)
        self.rope_cos, self.rope_sin = rope_tables(model_config, ctx.max_model_len + max_depth + self.k + 1,
                                                   self.device)
        self.paged_kv(ctx, self.max_tree_rows, block_size, num_blocks)
        self.count_cost(self.head)

    # ---- the tree -----------------------------------------------------------------------------------------------

    def _tree(self, spec, top_k: int, depth: int) -> tuple[str, list[list[int]]]:
        """(name, preference order) of the `tree` option (see the module docstring)."""
        stored = (self.checkpoint_meta.tree or {}) if self.checkpoint_meta is not None else {}
        trees = {stored["name"]: stored, **stored.get("alternatives", {})} if stored.get("name") else {}
        text = None if spec is None else spec if isinstance(spec, (list, tuple)) else str(spec).strip()
        if text is None or text in ("", "auto"):
            text = stored.get("name") or DEFAULT_TREE
        if isinstance(text, (list, tuple)):
            return "custom", self._as_order([list(map(int, p)) for p in text])
        if text == "topk":
            return f"topk{top_k}x{depth}", topk_tree(top_k, depth)
        if text == "chain":
            return f"chain{depth}", chain_tree(depth)
        if text.startswith("["):
            return "custom", self._as_order(json.loads(text))
        if text in trees and trees[text].get("order"):
            return text, [list(p) for p in trees[text]["order"]]
        paths = load_tree(text)
        if paths is None and text in trees:
            paths = trees[text].get("paths")
        if paths is None:
            file = Path(text).expanduser()
            if file.is_file():
                return file.name, self._as_order(json.loads(file.read_text(encoding="utf-8")))
            if text in TREE_NAMES:    # the shared data folder is not there: a built-in order of the prior
                logger.warning("falcon: tree %s not found (set SPECSERVE_DATA); using the prior's 64-node tree", text)
                return "prior", order_within(topk_tree(4, 4), prior_probability)[:64]
            raise ValueError(f"falcon tree {text!r}: not 'auto', 'topk', 'chain', a JSON path list, a file, or a "
                             f"tree of trees.json (set SPECSERVE_DATA to the folder holding it)")
        return text, order_within(paths, prior_probability)

    @staticmethod
    def _as_order(paths) -> list[list[int]]:
        paths = dedup_paths(paths)
        if not paths:
            raise ValueError("falcon: the tree has no path")
        return paths if is_prefix_closed(paths) else order_within(paths, prior_probability)

    def plan(self, budget: int, after: int = 0) -> SarPlan:
        """The step plan of the tree cut to `budget` nodes (cached), under a chain of `after` rank-0
        nodes (the hypothetical tokens': nodes 1 .. after)."""
        budget = min(int(budget), len(self.order))
        plan = self._plans.get((budget, after))
        if plan is None:
            chain = [[0] * d for d in range(1, after + 1)]
            plan = self._plans[(budget, after)] = SarPlan.build(chain + [[0] * after + list(p)
                                                                         for p in self.order[:budget]], self.k)
        return plan

    # ---- protocol -----------------------------------------------------------------------------------------------

    def rewind(self, seq_id: int, st: _SeqState, start: int) -> None:
        """Also: any new feature makes the root block's outputs stale."""
        super().rewind(seq_id, st, start)
        st.root_out, st.root_n = None, -1

    # ---- forwards -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def catch_up(self, seqs: Seq, extra_rows: Seq[int] | None = None) -> list[bool]:
        """Turn the real features of the positions without a row yet into rows up to row N-2, the
        root block's queries last (see the module docstring; the root block's rows that already
        have a row are run again from their features in the store); afterwards `state.root_out`
        holds the root block's k outputs. Returns, per sequence, whether it is ready to draft (False
        while the features right before the root are missing). `extra_rows` reserves room for tree
        rows."""
        k = self.k
        extra_rows = extra_rows or [0] * len(seqs)
        ready, todo = [], []
        for b, seq in enumerate(seqs):
            st = self.state.setdefault(seq.seq_id, self.State())
            n = seq.num_committed                                # hypothetical tokens have no features
            if st.root_n == n and st.root_out is not None:
                ok = self.kv.grow(seq.seq_id, n - 1 + extra_rows[b])
                ready.append(ok)
                continue
            first = min(st.kv_len, n - 1 - k)                   # the chunk: rows first .. N-2
            ok = first >= 0 and st.kv_len <= n - 1 and self.features.length(seq.seq_id) >= n - 1
            ok = ok and self.grow(seq.seq_id, n - 1 + extra_rows[b])
            ready.append(ok)
            if ok:
                todo.append((b, first))
        if not todo:
            return ready
        starts, qlens, masks, ids, feats = [], [], [], [], []
        for b, first in todo:
            seq = seqs[b]
            n = seq.num_committed
            starts.append(first)
            qlens.append(n - 1 - first)
            masks.append(root_block_mask(n - 1 - first, k, self.device))
            feats.append(self.features.view(seq.seq_id, first, n - 1))
            ids.extend(seq.token_ids[first + 1:n])
        positions, meta = self.kv.metadata([seqs[b].seq_id for b, _ in todo], starts, qlens, masks)
        out = self.head_rows(torch.tensor(ids, dtype=torch.int64, device=self.device),
                         torch.cat(feats).to(device=self.device, dtype=self.dtype), positions, meta)
        for (b, _), end in zip(todo, meta.cu_query_lens[1:]):
            seq = seqs[b]
            st = self.state[seq.seq_id]
            st.kv_len = seq.num_committed - 1
            st.root_out, st.root_n = out[end - k:end].clone(), seq.num_committed
        return ready

    def _topk(self, feats: torch.Tensor, r: int) -> list[list[int]]:
        """The r most likely draft tokens after each feature row (highest first)."""
        logits = self.vocab.logits(feats)
        return self.vocab.token_ids(logits.topk(r, dim=-1).indices).tolist()

    def draft(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        hyp = [tuple(s.hypothetical) for s in seqs]
        plans = [self.plan(b, min(len(h), MAX_HYPOTHETICAL)) for b, h in zip(budgets, hyp)]
        ready = self.catch_up(seqs, [p.num_tree_rows for p in plans])
        act = [b for b in range(len(seqs)) if ready[b] and len(hyp[b]) <= MAX_HYPOTHETICAL]
        if not act:
            return trees
        k = self.k
        states = [self.state[s.seq_id] for s in seqs]
        # the root (the last committed token), then the hypothetical tokens as nodes 1 .. h
        tokens = {b: [seqs[b].token_ids[seqs[b].num_committed - 1], *hyp[b]]
                  + [0] * (plans[b].num_nodes - 1 - len(hyp[b])) for b in act}
        outs: dict[tuple[int, int], torch.Tensor] = {(b, 0): states[b].root_out for b in act}   # (seq, exp) -> [k, H]
        self.num_runs += len(act)          # the root block's forward (in the catch-up)
        for level in range(max(plans[b].num_levels for b in act)):
            if level:   # one forward for every sequence's expansions of this level
                starts, qlens, masks, pos, ids, feats, order = [], [], [], [], [], [], []
                for b in act:
                    plan, exps = plans[b], plans[b].level(level)
                    if not exps:
                        continue
                    st = states[b]
                    row_pos = [st.kv_len - k + level * k + i for i in range(k)]
                    for e in exps:
                        x = plan.expansions[e]
                        ids.extend(tokens[b][i] for i in x.input_nodes)
                        feats.append(outs[(b, x.parent)])
                        pos.extend(row_pos)
                        order.append((b, e))
                    starts.append(st.kv_len + plan.expansions[exps[0]].row)
                    qlens.append(len(exps) * k)
                    masks.append(plan.level_mask(level))
                _, meta = self.kv.metadata([seqs[b].seq_id for b in act if plans[b].level(level)], starts, qlens,
                                           masks)
                out = self.head_rows(torch.tensor(ids, dtype=torch.int64, device=self.device), torch.cat(feats),
                                 torch.tensor(pos, dtype=torch.int64, device=self.device), meta)
                self.num_runs += len(starts)   # one block forward for each sequence with expansions here
                for j, key in enumerate(order):
                    outs[key] = out[j * k:(j + 1) * k]
            # this level's distributions -> the tokens of the nodes they give
            rows, where = [], []
            for b in act:
                plan = plans[b]
                for e in plan.level(level):
                    for r in range(k):
                        if plan.need[e][r]:
                            rows.append(outs[(b, e)][r])
                            where.append((b, e, r))
            if not rows:
                continue
            top = self._topk(torch.stack(rows), max(plans[b].need[e][r] for b, e, r in where))
            index = {key: j for j, key in enumerate(where)}
            for b in act:
                plan = plans[b]
                for i in plan.level_nodes(level):
                    if i > len(hyp[b]):   # nodes 1 .. h are the hypothetical tokens
                        tokens[b][i] = top[index[(b, plan.node_exp[i], plan.node_row[i])]][plan.template.ranks[i]]
        for b in act:
            h, parents = len(hyp[b]), plans[b].template.parents
            # the tree under the last hypothetical token (node h), which becomes its root
            trees[b] = TokenTree(tokens[b][h:], [NO_PARENT] + [p - h for p in parents[h + 1:]])
        return trees


__all__ = ["FalconDrafter", "SarPlan", "Expansion", "DEFAULT_TREE", "TREE_NAMES", "dedup_paths", "closed_paths",
           "load_tree", "order_within", "prior_probability", "empirical_probability", "topk_tree", "chain_tree",
           "is_prefix_closed"]
