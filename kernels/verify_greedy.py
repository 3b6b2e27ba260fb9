"""Greedy tree verification in one Triton launch: `engine.verify.verify_greedy_batched`'s result,
its fields side by side as `BatchVerifyResult.stacked()` lays them out.

The torch reference (engine/verify.py) takes some forty small operations per batch of trees; on a
GPU each is a launch of a few microseconds of host time, so greedy verification costs more host
time than the step's whole forward replayed as a CUDA graph. Here one program verifies one tree,
every [N, N] relation of it held in registers (N ≤ 64 nodes, as the verification graphs allow):

* node i **matches** when it is a root, or when its token is the target's argmax at its parent and
  no earlier sibling carries the same token;
* it is **on a walk** when every node of its ancestor-or-self set (the packed mask row) matches;
* the walk's **end** is the node on a walk of the largest score depth * (N+1) + N - root (the
  deepest, ties to the lowest root, then to the lowest index, as torch's argmax);
* the path is the end's ancestor set ordered by depth (one node per depth), its tokens those of
  the path after the root, then the bonus token (the argmax at the end), then PAD.

Output row t: [path (D+1) | tokens (D+1) | accepted | root | alternates (W-1, all -1)], int64.
Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without the dev extras: the torch reference serves
    triton = None

MAX_NODES = 64     # the most nodes per tree the kernel holds in registers (the caller falls back above)


if triton is not None:

    @triton.jit(do_not_specialize=["num_nodes_max", "d1", "width"])
    def _verify_greedy_kernel(
        tokens_ptr, parents_ptr, depths_ptr, mask_ptr, num_nodes_ptr, num_roots_ptr, argmax_ptr, out_ptr,
        num_nodes_max, d1, width,
        stride_tok, stride_par, stride_dep, stride_mt, stride_mr, stride_am, stride_out,
        NP: tl.constexpr, DP: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, NP)                       # nodes as rows
        j = tl.arange(0, NP)                       # nodes as columns
        n_t = tl.load(num_nodes_ptr + t)
        r_t = tl.load(num_roots_ptr + t)
        inside = i < num_nodes_max
        valid = i < n_t
        tok = tl.load(tokens_ptr + t * stride_tok + i, mask=inside, other=0)
        par = tl.load(parents_ptr + t * stride_par + i, mask=inside, other=-1)
        dep = tl.load(depths_ptr + t * stride_dep + i, mask=inside, other=0)
        child = (par >= 0) & valid
        want = tl.load(argmax_ptr + t * stride_am + tl.maximum(par, 0), mask=child, other=-1)
        # an earlier sibling with the same token takes the match (the reference walk's first child)
        twin = ((par[:, None] == par[None, :]) & (tok[:, None] == tok[None, :]) & (j[None, :] < i[:, None])
                & child[None, :])
        earlier = tl.max(twin.to(tl.int32), axis=1) > 0
        ok = ((i < r_t) & valid) | (child & (tok == want) & ~earlier)
        grid_ok = (i[:, None] < num_nodes_max) & (j[None, :] < num_nodes_max)
        anc = tl.load(mask_ptr + t * stride_mt + i[:, None] * stride_mr + j[None, :], mask=grid_ok, other=0) != 0
        broken = tl.max((anc & ~ok[None, :]).to(tl.int32), axis=1) > 0
        on_walk = valid & ~broken
        root_of = tl.min(tl.where(anc, j[None, :], NP), axis=1)
        n_pad = num_nodes_max.to(tl.int64)
        score = tl.where(on_walk, dep * (n_pad + 1) + (n_pad - root_of), -1)
        best = tl.max(score, axis=0)
        end = tl.min(tl.where(score == best, i, NP), axis=0)          # the first node of the best score
        at_end = i == end
        accepted = tl.sum(tl.where(at_end, dep, 0), axis=0)
        root = tl.sum(tl.where(at_end, root_of, 0), axis=0)
        bonus = tl.load(argmax_ptr + t * stride_am + end)
        on_path = tl.load(mask_ptr + t * stride_mt + end * stride_mr + j, mask=j < num_nodes_max, other=0) != 0
        k = tl.arange(0, DP)                       # depths
        at_depth = on_path[None, :] & (dep[None, :] == k[:, None])    # [DP, NP]: the path's node at depth k
        path = tl.max(tl.where(at_depth, j[None, :], -1), axis=1)
        at_next = on_path[None, :] & (dep[None, :] == k[:, None] + 1)
        drafted = tl.max(tl.where(at_next, tok[None, :], -1), axis=1)
        tokens = tl.where(k < accepted, drafted, tl.where(k == accepted, bonus, -1))   # -1: engine.verify.PAD_TOKEN
        row = out_ptr + t * stride_out
        keep = k < d1
        tl.store(row + k, path, mask=keep)
        tl.store(row + d1 + k, tokens, mask=keep)
        tl.store(row + 2 * d1, accepted)
        tl.store(row + 2 * d1 + 1, root)
        w = tl.arange(0, NP)
        tl.store(row + 2 * d1 + 2 + w, tl.full([NP], -1, tl.int64), mask=w < width - 2 * d1 - 2)


def verify_greedy_stacked(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
                          num_nodes: torch.Tensor, num_roots: torch.Tensor, argmax: torch.Tensor, max_depth: int,
                          max_next_roots: int) -> torch.Tensor:
    """PackedTrees' fields and the target's argmax [T, N] -> the stacked greedy result
    [T, 2 (max_depth + 1) + 2 + max_next_roots - 1] int64, one launch. N ≤ MAX_NODES."""
    T, N = tokens.shape
    assert N <= MAX_NODES, f"{N} nodes per tree: verify with the torch reference"
    d1 = max_depth + 1
    width = 2 * d1 + 2 + max_next_roots - 1
    np_ = max(16, triton.next_power_of_2(N))          # nodes held in registers (and alternates written)
    assert max_next_roots - 1 <= np_, "more alternates than the kernel writes"
    out = torch.empty(T, width, dtype=torch.int64, device=tokens.device)
    if T == 0:
        return out
    argmax = argmax.to(torch.int64).contiguous()    # the kernel reads rows as contiguous
    mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    _verify_greedy_kernel[(T,)](
        tokens, parents, depths, mask_u8, num_nodes, num_roots, argmax, out,
        N, d1, width,
        tokens.stride(0), parents.stride(0), depths.stride(0), mask_u8.stride(0), mask_u8.stride(1),
        argmax.stride(0), out.stride(0),
        NP=np_, DP=max(16, triton.next_power_of_2(d1)),
        num_warps=1 if np_ <= 16 else 4,
    )
    return out
