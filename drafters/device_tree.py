"""EAGLE's dynamic tree grown on the device in a fixed shape: one host transfer per step, and one
CUDA graph per (batch, shape) bucket.

`EagleDrafter.draft` (drafters/eagle.py) grows its tree on the host: every level sorts its nodes in
Python, builds the level's attention metadata on the host, and reads the children's scores back
(a transfer and a sync per level, some 250 kernel launches per step on a GPU). Here the same tree
is grown as a fixed-shape computation over the device tensors alone:

* level 1: the root's top-K children (K = top_k), scores = their draft log-probabilities;
* the frontier of level l is the W best nodes of that level (W = width; fewer where the level
  has fewer), taken in creation order as the host tree takes them (`sorted(pick)`); each gets a
  tree row (the f̂ of its parent's row, its own token) at position L - 1 + l, written to the
  drafter's KV right after the real rows, attending to the real rows and to its ancestors' rows
  (an ancestor-or-self mask over the tree rows, carried from parent to child by a gather);
* its output's top-K children are the next level's candidates, score = parent's + own, summed
  in float64 as the host tree does.

After D - 1 levels (D = depth) the candidates (K + Σ frontier_l · K of them, level-major in
creation order) are sorted by score, stable, so ties fall to the shallower and older node, as in
`EagleDrafter._select`; the best `m` (the batch's largest budget) with their tokens and parents
come back in one transfer, and each sequence keeps its own budget's best.

**The same tree as the host's.** The host prunes: it expands at most min(width, budget) nodes
of a level, skips those below the budget's best score so far, gives a node min(top_k, budget)
children and stops at min(depth, budget) levels. None of that changes the best `budget` nodes:
a node's score bounds its descendants', so the best `budget` nodes are ancestor-closed, hold
at most `budget` nodes per level, each among the best of its level, and no child ranked past
`budget` among its siblings or deeper than `budget`. So the fixed shape of the batch's largest
budget (depth, width, top_k each capped by it) gives every sequence the host's tree, up to
floating-point ties (the rows run in other batch shapes, so logits may differ in the last bit).

The level's metadata is built on the device (cache slots from the block tables, context lengths
= real rows + tree rows so far, the masks' bytes): the attention kernels read only those packed
tensors (Triton on CUDA, the native kernels on the CPU), never host lists, so a level is the same
kernels for every step of a bucket and the whole tree is captured once per (batch size, shape)
through the engine's `GraphBackend` (engine/cuda_graphs.py; `EagerReplay` stands in on the CPU).
Inputs live in static buffers: the roots' f̂, the real row counts and the block tables; a
batch is padded to its bucket by repeating its last sequence (the copies write the same rows to
the same slots).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.attention import AttnMetadata, attention_backend
from specserve.engine.cuda_graphs import batch_buckets


@dataclass(frozen=True)
class TreeShape:
    """depth D, width W, top_k K of one fixed-shape tree; `frontier[l - 1]` = nodes expanded at
    level l (1 .. D - 1)."""

    depth: int
    width: int
    top_k: int

    @property
    def frontier(self) -> list[int]:
        sizes, level = [], self.top_k
        for _ in range(1, self.depth):
            f = min(self.width, level)
            sizes.append(f)
            level = f * self.top_k
        return sizes

    @property
    def tree_rows(self) -> int:
        return sum(self.frontier)

    @property
    def num_candidates(self) -> int:
        return self.top_k * (1 + sum(self.frontier))

    @functools.cache
    def depths(self) -> list[int]:
        """The depth of each candidate, in the level-major candidate order (computed once per shape)."""
        out = [1] * self.top_k
        for lvl, f in enumerate(self.frontier, start=2):
            out += [lvl] * (f * self.top_k)
        return out


def shape_for(depth: int, width: int, top_k: int, budget: int) -> TreeShape:
    """The fixed shape that gives every tree of at most `budget` nodes (see the module docstring)."""
    return TreeShape(min(depth, budget), min(width, budget), min(top_k, budget))


def usable_on(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the head's attention here reads the packed metadata alone: Triton (CUDA), or the
    CPU's native kernels (fp32 rows over an fp32 or fp16 cache). The torch reference reads host
    lists, which a device-built level does not have."""
    if device.type == "cuda":
        return attention_backend(device) == "triton"
    from specserve.kernels import cpu as native
    return (device.type == "cpu" and native.available() and dtype == torch.float32
            and kv_dtype in (torch.float32, torch.float16))


class DeviceTree:
    """Fixed-shape trees for one eagle drafter (`drafter`: its head, KV, vocabulary and rope)
    over static buffers for at most `max_batch` sequences; `capture` records a graph per bucket."""

    def __init__(self, drafter, max_batch: int):
        self.d = drafter
        dev = drafter.device
        self.max_batch = max_batch
        self.table_width = drafter.kv.blocks_per_seq
        self.roots = torch.zeros(max_batch, drafter.hidden_size, dtype=drafter.dtype, device=dev)
        self.ints = torch.zeros(max_batch, 1 + self.table_width, dtype=torch.int32, device=dev)
        self.replays: dict[tuple[int, TreeShape], Callable[[], torch.Tensor]] = {}
        self.budgets: list[int] = []       # the budgets whose shapes were captured
        self.num_replays = 0
        self.batch_sizes = batch_buckets(max_batch)

    # ---- one step -----------------------------------------------------------------------------

    def run(self, roots: list[torch.Tensor], kv_lens: list[int], tables: list[list[int]], shape: TreeShape,
            m: int) -> list[list[tuple[int, int, int]]]:
        """Per sequence (`roots[b]`: f̂ at its root, `kv_lens[b]` its real rows, `tables[b]` its
        block table), its best `m` candidates as (candidate index, token, parent candidate index or
        -1), best first: through the bucket's graph when one was captured, else eagerly; one transfer."""
        n = len(roots)
        bucket = next((b for b in self.batch_sizes if b >= n), None)
        graph = self.replays.get((bucket, shape))
        rows = bucket if graph is not None else n
        pad = [min(i, n - 1) for i in range(rows)]
        tw = self.table_width
        ints = [[kv_lens[b], *tables[b][:tw], *[0] * (tw - len(tables[b]))] for b in pad]
        self.ints[:rows].copy_(torch.tensor(ints, dtype=torch.int32), non_blocking=True)
        torch.stack([roots[b] for b in pad], out=self.roots[:rows])
        if graph is not None:
            self.num_replays += 1
            out = graph()
        else:
            out = self.levels(rows, shape)
        picked = out[:n, :3 * m].tolist()      # the one transfer
        return [[(int(r[3 * j]), int(r[3 * j + 1]), int(r[3 * j + 2])) for j in range(m)] for r in picked]

    def levels(self, B: int, shape: TreeShape) -> torch.Tensor:
        """The tree of the first B static inputs: [B, 3 * C] float64 rows of (candidate index, token,
        parent index or -1) for the candidates sorted best first (C = shape.num_candidates)."""
        d, dev = self.d, self.d.device
        K, H, bs = shape.top_k, d.hidden_size, d.kv.block_size
        roots, L = self.roots[:B], self.ints[:B, 0].long()
        tables = self.ints[:B, 1:]
        lp, tok = d.children_of(roots, K)                                  # [B, K]
        scores, tokens = [lp.double()], [tok]
        parents = [torch.full((B, K), -1, dtype=torch.long, device=dev)]
        f1 = shape.frontier[0] if shape.frontier else 0
        fr_idx = torch.arange(f1, device=dev).expand(B, f1)
        fr_score, fr_tok = scores[0][:, :f1], tok[:, :f1]
        fr_feat = roots[:, None, :].expand(B, f1, H)
        R = shape.tree_rows
        anc = torch.zeros(B, f1, R, dtype=torch.bool, device=dev)
        lo, base = 0, K                                                    # tree rows / candidates so far
        for lvl, f in enumerate(shape.frontier, start=1):
            anc[:, :, lo:lo + f] |= torch.eye(f, dtype=torch.bool, device=dev)
            width = lo + f
            pos = L[:, None] + lo + torch.arange(f, device=dev)               # cache positions of the rows
            slots = tables.gather(1, pos // bs).long() * bs + pos % bs
            meta = AttnMetadata(
                query_lens=[f] * B, context_lens=[width] * B, cu_query_lens=list(range(0, B * f + 1, f)),
                slot_mapping=slots.reshape(-1), context_slots=None, block_tables=tables,
                masks=[torch.ones(f, width, dtype=torch.bool)] * B,   # host lists: shapes only
                block_size=bs,
                cu_query_lens_t=torch.arange(0, B * f + 1, f, dtype=torch.int32, device=dev),
                context_lens_t=(L + width).int(),
                mask_offsets=torch.arange(0, B * f * width, f * width, dtype=torch.int32, device=dev),
                mask_widths=torch.full((B,), width, dtype=torch.int32, device=dev),
                mask_data=anc[:, :, :width].to(torch.uint8).reshape(-1))
            positions = (L - 1 + lvl)[:, None].expand(B, f).reshape(-1)
            out = d.head_rows(fr_tok.reshape(-1), fr_feat.reshape(B * f, H), positions, meta)   # [B * f, H]
            lp, tok = d.children_of(out, K)                                # [B * f, K]
            child = fr_score[:, :, None] + lp.double().view(B, f, K)
            scores.append(child.reshape(B, f * K))
            tokens.append(tok.view(B, f * K))
            parents.append(fr_idx[:, :, None].expand(B, f, K).reshape(B, f * K))
            if lvl < len(shape.frontier):
                nf = shape.frontier[lvl]
                j = child.reshape(B, f * K).topk(nf, dim=1).indices.sort(dim=1).values   # creation order
                prow = j // K
                fr_idx, fr_score = base + j, child.reshape(B, f * K).gather(1, j)
                fr_tok = tokens[-1].gather(1, j)
                fr_feat = out.view(B, f, H).gather(1, prow[..., None].expand(B, nf, H))
                anc = anc.gather(1, prow[..., None].expand(B, nf, R))
            lo, base = lo + f, base + f * K
        allscores = torch.cat(scores, dim=1)
        order = torch.sort(allscores, dim=1, descending=True, stable=True).indices
        picked_tok = torch.cat(tokens, dim=1).gather(1, order)
        picked_par = torch.cat(parents, dim=1).gather(1, order)
        return torch.stack([order, picked_tok, picked_par], dim=2).reshape(B, -1).double()

    # ---- graphs ---------------------------------------------------------------------------------

    def shape_of(self, depth: int, width: int, top_k: int, budget: int) -> TreeShape:
        """The shape a step whose largest budget is `budget` runs in: that of the smallest captured
        budget at least as large (the same trees, see the module docstring), else its own."""
        return shape_for(depth, width, top_k, next((b for b in self.budgets if b >= budget), budget))

    @torch.inference_mode()
    def capture(self, backend, depth: int, width: int, top_k: int, budgets: list[int]) -> int:
        """Record `levels` for every batch bucket and the shape of each budget, largest first;
        returns how many graphs. Only at start-up: the runs write tree rows into block 0 of the
        drafter's KV."""
        self.budgets = sorted({b for b in budgets if b > 0})
        shapes = {shape_for(depth, width, top_k, b) for b in self.budgets}
        self.ints.zero_()
        self.ints[:, 0] = 1                       # one real row: the capture's positions are valid
        for shape in sorted(shapes, key=lambda s: -s.num_candidates):
            for B in sorted(self.batch_sizes, reverse=True):
                self.replays[(B, shape)] = backend.capture(lambda B=B, shape=shape: self.levels(B, shape))
        return len(self.replays)
