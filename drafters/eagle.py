"""EAGLE-style drafter: one decoder layer predicts the target's next feature, the target's own LM
head turns features into draft tokens, and a dynamic token tree grows level by level.

The head (`specserve.drafters.nets.eagle.EagleHead`): row p reads fc([f_p ‖ e(x_{p+1})]) (f = the
target's post-norm last-layer feature, e = the target's frozen embedding) and outputs f̂_{p+1};
the draft distribution after x_{p+1} is softmax(LMHead(f̂_{p+1})) with the target's frozen LM
head applied directly (post-norm features in, post-norm features out). The embedding and LM head
are the target's tensors, shared by reference.

Per sequence the drafter keeps its own paged KV cache (one layer) holding **only rows computed
from the target's real features**: rows 0 .. L-1, row p = (f_p, x_{p+1}). Each step:

1. catch up: the engine's feature store (engine/features.py) holds the real features of every
   token in the target's KV (prefill chunks, plain decodes, the verified root and accepted path;
   `observe` only says which positions were rewritten). Rows L .. N-2 are computed from them
   (N = len(token_ids); the root
   x_{N-1} has no feature yet, it is the token half of the last row). The last row's output
   f̂_{N-1} gives the root's children. This is also where the previous step's tree rows --
   computed from *predicted* features -- are overwritten: they are never kept.
2. grow the tree level by level, one batched forward per level for all sequences: every node
   chosen for expansion gets a row (f̂ of its parent's row, its own token) at position
   N-2+depth, attending to the real rows and its expanded ancestors (tree mask); its output f̂
   gives its top-k children. Expansion is dynamic (EAGLE-2 style): a child's score is its
   cumulative draft log-probability; each level expands the `width` best nodes of that level
   (nodes that cannot reach the budget's best are skipped), and the tree sent for verification
   is the `budget` best nodes overall (an ancestor scores at least as high as its descendants,
   so the set is a tree), in level-major order, children of a node in rank order.
3. `accept` only releases the blocks past L: the accepted path's features enter the store and
   are caught up at the next step (recomputed from the real features).

Drafts are deterministic (top-k children, one-hot q: `draft_probs=None`), which verification
accepts losslessly for greedy and sampling requests alike.

On CUDA (`device_tree=auto`) step 2 runs on the device instead (drafters/device_tree.py): the
same trees, grown in the fixed shape of the step's largest budget with the level metadata built on
the device, one transfer a step and one CUDA graph per (batch size, shape), captured with the
target's at start-up. The host loop stays for the CPU, where the fixed shape computes the rows the
host's pruning skips, and for drafts after a grammar's forced tokens.

Cost on a CPU: every tree level reads the LM head. Measured single-threaded (SmolLM2-135M,
budget 8): a propose takes 39 ms with the whole head (49152 x 576) against 86 ms for the target's
verification step, 10.5 ms with the default draft vocabulary (the 8192 tokens the target chose
most often in training, 92 % of held-back labels; see drafters.draft_vocab; `draft_vocab=0` for
the whole vocabulary).

Standardized walltime (`model_runs`): one run per sequence per draft-distribution read (the
root's after the catch-up forward, then each expanded level's: the head's forward and the LM
head's GEMM), at c = (the head's own parameters + the LM-head rows it multiplies, i.e. the
draft vocabulary's rows x hidden size) / the target's parameters. The embedding lookup is not a
GEMM and is not counted.
"""

from __future__ import annotations

import logging
from typing import Sequence as Seq

import torch

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.device_tree import DeviceTree, usable_on
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.features import FeatureDrafter, FeatureState
from specserve.drafters.nets.eagle import EagleHead, load_head, shipped_checkpoint
from specserve.engine.model import rope_tables
from specserve.engine.tree import NO_PARENT, TokenTree, ancestor_mask

logger = logging.getLogger("specserve")

MAX_HYPOTHETICAL = 16   # hypothetical tokens (a grammar's forced ones) a draft may follow; more: no draft


class _SeqState(FeatureState):
    __slots__ = ("root_feat",)

    def __init__(self):
        super().__init__()                           # kv_len L: rows 0..L-1 (real features) are in the drafter's cache
        self.root_feat: torch.Tensor | None = None   # output of row L-1 (f̂ at the root), valid while L == N-1


class _Node:
    __slots__ = ("token", "parent", "depth", "score", "rank", "feat", "row")

    def __init__(self, token: int, parent: int, depth: int, score: float, rank: int):
        self.token, self.parent, self.depth, self.score, self.rank = token, parent, depth, score, rank
        self.feat: torch.Tensor | None = None   # output f̂ of this node's row (when expanded)
        self.row = -1                           # its row among this step's tree rows (when expanded)


@register("eagle")
class EagleDrafter(FeatureDrafter):
    """Options: `checkpoint=PATH` (an eagle checkpoint folder; default: the shipped one for this
    target), `depth` (max tree depth, 6), `top_k` (children per expanded node, 4), `width` (nodes
    expanded per level, 4), `draft_vocab` (N > 0: draft from the N most frequent target tokens
    of the checkpoint's ranking, default 8192; 0 = the whole vocabulary), `block_size`/`num_blocks` (its KV
    pool), `device_tree` (auto | true | false: grow the tree on the device in a fixed shape, one
    transfer a step and CUDA graphs, drafters/device_tree.py; auto = on CUDA). For tests:
    `random_init=true` (an untrained head, `init=random` or `init=last`: its decoder layer copied
    from the target's last one) or `head=` an in-memory EagleHead."""

    name = "eagle"
    State = _SeqState
    drafts_after_uncommitted = True   # see Drafter; hypothetical tokens become tree rows, never kept

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, random_init: bool = False,
                 init: str = "random", head: EagleHead | None = None, depth: int = 6, top_k: int = 4, width: int = 4,
                 draft_vocab: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 device_tree: bool | str = "auto"):
        super().__init__(ctx)
        target, model_config = ctx.target, ctx.model_config
        if min(depth, top_k, width) < 1:
            raise ValueError(f"eagle: depth, top_k and width must be >= 1 (got {depth}, {top_k}, {width})")
        self.depth, self.top_k, self.width = int(depth), int(top_k), int(width)
        head = self.in_memory(head) if head is not None else self.build_head(ctx, checkpoint, random_init, init)
        self.head = head.to(device=self.device, dtype=self.dtype).eval()
        # draft tokens come from the checkpoint's most frequent target tokens (see drafters.draft_vocab)
        self.vocab = DraftVocab(target.lm_head_weight, self.head.vocab_rank, draft_vocab, drafter="eagle",
                                full_logits=target.compute_logits)
        self.max_rows = ctx.max_model_len + self.depth + MAX_HYPOTHETICAL + 1
        self.rope_cos, self.rope_sin = rope_tables(model_config, self.max_rows, self.device)
        self.max_tree_rows = self.width * max(0, self.depth - 1) + MAX_HYPOTHETICAL
        self.paged_kv(ctx, self.max_tree_rows, block_size, num_blocks)
        self.count_cost(self.head)
        self.device_tree = self._device_tree(device_tree, ctx.max_num_seqs)

    def _device_tree(self, option: bool | str, max_batch: int) -> DeviceTree | None:
        choice = str(option).lower()
        if choice not in ("auto", "true", "false"):
            raise ValueError(f"{self.name}: device_tree must be auto, true or false, got {option!r}")
        usable = usable_on(self.device, self.dtype, self.cache.kv.dtype)
        if choice == "true" and not usable:
            raise ValueError(f"{self.name}: device_tree=true needs the Triton attention (CUDA) or the CPU's native "
                             "kernels with fp32 rows")
        on = usable and (choice == "true" or (choice == "auto" and self.device.type == "cuda"))
        return DeviceTree(self, max_batch) if on else None

    def capture_graphs(self, backend, budgets) -> int:
        """Capture the device tree of every batch bucket for the shapes of `budgets` (the node
        budgets the draft policy grants); 0 without a device tree."""
        if self.device_tree is None:
            return 0
        try:
            return self.device_tree.capture(backend, self.depth, self.width, self.top_k, list(budgets))
        except Exception:   # noqa: BLE001 -- drafting goes on eagerly; the target's graphs are not at stake
            logger.exception("%s: capturing the draft graphs failed; its trees grow eagerly", self.name)
            self.device_tree.replays.clear()
            return 0

    def build_head(self, ctx: DrafterContext, checkpoint: str | None, random_init: bool, init: str) -> EagleHead:
        """The head of `checkpoint` (default: the shipped one), or an untrained one (tests)."""
        if random_init:
            return EagleHead.from_target(ctx.model_config, ctx.target, init=init)
        return self.load_trained(checkpoint, ctx.model_config, shipped_checkpoint, load_head)

    def real_features(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        """The engine's features of positions lo..hi-1 that the head's real rows read (through
        `head.lift_features`): the last-layer ones."""
        return self.features.view(seq_id, lo, hi)

    def rewind(self, seq_id: int, st: _SeqState, start: int) -> None:
        super().rewind(seq_id, st, start)
        st.root_feat = None

    # ---- catch-up -----------------------------------------------------------------------------

    @torch.inference_mode()
    def catch_up(self, seqs: Seq, extra_rows: Seq[int] | None = None) -> list[bool]:
        """Turn every sequence's pending real features into rows, up to row N-2 (the root's row);
        afterwards `state.root_feat` = f̂ at the root. Returns, per sequence, whether it is ready to
        draft (False when its features are missing). `extra_rows` reserves room for tree rows."""
        extra_rows = extra_rows or [0] * len(seqs)
        ready, todo = [], []
        for b, seq in enumerate(seqs):
            st = self.state.setdefault(seq.seq_id, self.State())
            n = seq.num_committed                            # N: hypothetical tokens have no features
            n_rows = n - 1 - st.kv_len                       # rows L .. N-2
            ok = n_rows >= 0 and self.features.length(seq.seq_id) >= n - 1
            ok = ok and (n_rows > 0 or st.root_feat is not None) and n - 1 > 0
            ok = ok and self.grow(seq.seq_id, n - 1 + extra_rows[b])
            ready.append(ok)
            if ok and n_rows > 0:
                todo.append((b, n_rows))
        if not todo:
            return ready
        starts, qlens, ids, feats = [], [], [], []
        for b, n_rows in todo:
            seq, st = seqs[b], self.state[seqs[b].seq_id]
            starts.append(st.kv_len)
            qlens.append(n_rows)
            feats.append(self.real_features(seq.seq_id, st.kv_len, st.kv_len + n_rows))
            ids.extend(seq.token_ids[st.kv_len + 1:st.kv_len + 1 + n_rows])
        positions, meta = self.kv.metadata([seqs[b].seq_id for b, _ in todo], starts, qlens)
        out = self.head_rows(torch.tensor(ids, dtype=torch.int64, device=self.device),
                             self.head.lift_features(torch.cat(feats)), positions, meta)
        for (b, n_rows), end in zip(todo, meta.cu_query_lens[1:]):
            st = self.state[seqs[b].seq_id]
            st.kv_len += n_rows
            st.root_feat = out[end - 1].clone()
        return ready

    # ---- drafting -----------------------------------------------------------------------------

    def children_of(self, feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (log-probabilities [N, k] fp32, token ids [N, k]) of the draft distribution after
        each feature row, on the device."""
        top = self.vocab.logits(feats).log_softmax(-1).topk(k, dim=-1)
        return top.values.float(), self.vocab.token_ids(top.indices)

    def _children(self, feats: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """`children_of` on the host."""
        values, ids = self.children_of(feats, k)
        both = torch.cat([values, ids.float()], dim=1).tolist()   # one transfer; ids < 2^24 are exact
        return [r[:k] for r in both], [[int(t) for t in r[k:]] for r in both]

    def draft(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        """Trees on the device where there is one (drafters/device_tree.py), but for sequences
        that draft after a grammar's forced tokens: those grow on the host."""
        on_host = [b for b, s in enumerate(seqs) if self.device_tree is None or s.hypothetical]
        if not on_host:
            return self._draft_on_device(seqs, budgets)
        if len(on_host) == len(seqs):
            return self._draft_on_host(seqs, budgets)
        trees: list[TokenTree | None] = [None] * len(seqs)
        on_device = sorted(set(range(len(seqs))) - set(on_host))
        for part, draft in ((on_device, self._draft_on_device), (on_host, self._draft_on_host)):
            for b, tree in zip(part, draft([seqs[b] for b in part], [budgets[b] for b in part])):
                trees[b] = tree
        return trees

    def _draft_on_host(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        depth = [min(self.depth, b) for b in budgets]
        width = [min(self.width, b) for b in budgets]
        top_k = [min(self.top_k, b) for b in budgets]
        hyp = [list(s.hypothetical) for s in seqs]
        ready = self.catch_up(seqs, [w * max(0, d - 1) + len(h) for w, d, h in zip(width, depth, hyp)])
        act = [b for b in range(len(seqs)) if ready[b] and len(hyp[b]) <= MAX_HYPOTHETICAL]
        if not act:
            return trees
        states = [self.state[s.seq_id] for s in seqs]
        fed: list[list[_Node]] = [[] for _ in seqs]         # expanded nodes = this step's tree rows
        row_parents: list[list[int]] = [[] for _ in seqs]   # per tree row: its parent's row
        # the hypothetical tokens (a grammar's forced ones) first, as a chain of tree rows from the
        # root's f̂: the draft grows under the last of them (`Drafter.drafts_after_uncommitted`)
        top = {b: states[b].root_feat for b in act}         # f̂ the tree's root children come from
        for i in range(max(len(hyp[b]) for b in act)):
            chain = [b for b in act if i < len(hyp[b])]
            if not chain:
                break
            starts, pos, masks = [], [], []
            for b in chain:
                node = _Node(hyp[b][i], -1, 0, 0.0, 0)
                node.row = len(fed[b])
                fed[b].append(node)
                row_parents[b].append(node.row - 1 if node.row else NO_PARENT)
                starts.append(states[b].kv_len + node.row)
                pos.append(states[b].kv_len + node.row)
                masks.append(ancestor_mask(row_parents[b], [node.row], len(fed[b])))
            _, meta = self.kv.metadata([seqs[b].seq_id for b in chain], starts, [1] * len(chain), masks)
            out = self.head_rows(torch.tensor([hyp[b][i] for b in chain], dtype=torch.int64, device=self.device),
                                 torch.stack([top[b] for b in chain]),
                                 torch.tensor(pos, dtype=torch.int64, device=self.device), meta)
            self.num_runs += len(chain)
            for r, b in enumerate(chain):
                top[b] = out[r]
        tail = {b: len(fed[b]) - 1 if fed[b] else NO_PARENT for b in act}   # the row the tree hangs from
        nodes: list[list[_Node]] = [[] for _ in seqs]       # candidates, in creation order
        kmax = max(top_k[b] for b in act)
        scores, toks = self._children(torch.stack([top[b] for b in act]), kmax)
        self.num_runs += len(act)
        for r, b in enumerate(act):
            for rank in range(top_k[b]):
                nodes[b].append(_Node(toks[r][rank], -1, 1, scores[r][rank], rank))
        for d in range(1, max(depth[b] for b in act)):
            expand: dict[int, list[int]] = {}
            for b in act:
                if d >= depth[b]:
                    continue
                level = [i for i, n in enumerate(nodes[b]) if n.depth == d]
                level.sort(key=lambda i: -nodes[b][i].score)
                bar = sorted((n.score for n in nodes[b]), reverse=True)
                cut = bar[budgets[b] - 1] if len(bar) >= budgets[b] else float("-inf")
                pick = [i for i in level[:width[b]] if nodes[b][i].score >= cut]
                if pick:
                    expand[b] = sorted(pick)
            if not expand:
                break
            # one forward over every sequence's nodes of this level
            starts, qlens, masks, pos, ids, feats = [], [], [], [], [], []
            order = sorted(expand)
            for b in order:
                st, n_old = states[b], len(fed[b])
                new = [nodes[b][i] for i in expand[b]]
                for node in new:
                    node.row = len(fed[b])
                    fed[b].append(node)
                    # rows hang under the real rows; a depth-1 node's row has no parent row
                    row_parents[b].append(tail[b] if node.parent < 0 else nodes[b][node.parent].row)
                starts.append(st.kv_len + n_old)
                qlens.append(len(new))
                masks.append(ancestor_mask(row_parents[b], [n.row for n in new], len(fed[b])))
                pos.extend(st.kv_len - 1 + len(hyp[b]) + d for _ in new)
                ids.extend(node.token for node in new)
                feats.extend(top[b] if node.parent < 0 else nodes[b][node.parent].feat for node in new)
            _, meta = self.kv.metadata([seqs[b].seq_id for b in order], starts, qlens, masks)
            out = self.head_rows(torch.tensor(ids, dtype=torch.int64, device=self.device), torch.stack(feats),
                             torch.tensor(pos, dtype=torch.int64, device=self.device), meta)
            kmax = max(top_k[b] for b in order)
            scores, toks = self._children(out, kmax)
            self.num_runs += len(order)
            r = 0
            for b in order:
                for i in expand[b]:
                    parent = nodes[b][i]
                    parent.feat = out[r]
                    for rank in range(top_k[b]):
                        nodes[b].append(_Node(toks[r][rank], i, d + 1, parent.score + scores[r][rank], rank))
                    r += 1
        for b in act:
            trees[b] = self._select(seqs[b].token_ids[-1], nodes[b], budgets[b])
        return trees

    def _draft_on_device(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        """`draft` through the device tree (drafters/device_tree.py): the same trees, in the
        fixed shape of the largest budget."""
        trees: list[TokenTree | None] = [None] * len(seqs)
        m = max(budgets)
        shape = self.device_tree.shape_of(self.depth, self.width, self.top_k, m)
        ready = self.catch_up(seqs, [shape.tree_rows] * len(seqs))
        act = [b for b in range(len(seqs)) if ready[b]]
        if not act:
            return trees
        states = [self.state[seqs[b].seq_id] for b in act]
        picks = self.device_tree.run([st.root_feat for st in states], [st.kv_len for st in states],
                                     [self.kv.blocks.block_tables[seqs[b].seq_id] for b in act], shape,
                                     min(m, shape.num_candidates))
        self.num_runs += len(act) * (1 + len(shape.frontier))
        depths = shape.depths()
        for r, b in enumerate(act):
            chosen = sorted(picks[r][:budgets[b]], key=lambda p: (depths[p[0]], p[0]))   # level-major
            trees[b] = _level_major_tree(seqs[b].token_ids[-1], chosen)
        return trees

    @staticmethod
    def _select(root: int, nodes: list[_Node], budget: int) -> TokenTree:
        """The `budget` best-scoring candidates (ties: shallower, then older first, so a node never
        comes before its ancestors), as a level-major tree with children in rank order."""
        best = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:budget]
        return _level_major_tree(root, [(i, nodes[i].token, nodes[i].parent)
                                        for i in sorted(best, key=lambda i: (nodes[i].depth, i))])


def _level_major_tree(root: int, chosen: list[tuple[int, int, int]]) -> TokenTree:
    """The tree of `chosen` candidates (index, token, parent index or -1 under the root), given in
    level-major order; a candidate whose parent is not among them is left out (its ancestor fell
    out: only a numerical tie can do that)."""
    out_index = {-1: 0}
    tokens, parents = [root], [NO_PARENT]
    for i, token, parent in chosen:
        if parent not in out_index:
            continue
        out_index[i] = len(tokens)
        tokens.append(token)
        parents.append(out_index[parent])
    return TokenTree(tokens, parents)
