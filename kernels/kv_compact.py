"""KV compaction: move the accepted rows of draft trees to the slots right after each prefix.

Layout. The cache is one tensor `kv` [2, num_layers, num_slots, num_kv_heads, head_dim] (K and V
of every layer), so one "row" is `kv[c, l, slot]` ([num_kv_heads, head_dim]) and a move of a token
touches 2 * num_layers rows. Token position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Tree commit (`compact_tree_kv`). Tree sequence t, whose committed prefix has length
`prefix_lens[t]`, wrote its tree nodes at positions `prefix + 0 .. prefix + n - 1` and accepted
the path `paths[t, :path_lens[t]]` (node indices, strictly increasing; `paths[t, 0]` is the root,
0 for a tree, any root index for a forest; padded with -1). Pair i of sequence t moves
position `prefix + paths[t, i]` (its source) to position `prefix + i` (its destination), K and V,
all layers. Slots are computed on the device from the block tables: no host sync, no Python loop
over sequences.

Overlap argument. Within one sequence a destination can be the source of another pair: with path
[0, 2, 3], pair 1 reads node 2 and pair 2 writes node 2. Write s_i = paths[t, i]. Since the path
is strictly increasing with s_0 >= 0, s_i >= i for every i. Hence:

* no pair reads what an *earlier* pair wrote: pair k reads node s_k >= k > j, the node pair j < k
  writes (read-after-write never happens in increasing i, so loads may also be issued early);
* a pair may write what an earlier pair read (pair k writes node k = s_j for some j < k): this
  write-after-read is safe exactly when pair j's load happens before pair k's store, which
  processing the pairs in increasing i guarantees;
* no two pairs write the same destination (pair i writes node i), and pairs with s_i == i are
  no-ops: node i is nobody else's source (s_j == i with j != i would contradict strict monotony)
  and nobody else's destination.

Different sequences own disjoint blocks, so their pairs never touch the same slot.
The Triton kernel therefore gives each program one sequence and one (K/V, layer, column chunk),
and walks that sequence's pairs in increasing i: programs touch disjoint memory, and inside a
program the order above holds (a barrier between pairs makes it hold for every thread, whatever
layout the compiler picks). The torch reference instead gathers every source before it scatters.

Flat commit (`compact_kv`): `kv[:, :, dst] = kv[:, :, src]` for arbitrary pairs, gather before
scatter. Its Triton kernel gives each program one (K/V, layer, column chunk), loads all N source
rows, synchronises, then stores them, so any overlap is safe there too.

Dispatch: Triton on CUDA tensors when triton is importable; on CPU tensors the native kernel
(`kernels/cpu.py` `compact_tree_kv`: the pairs in increasing i, a copy per pair and plane, identity
pairs skipped — tens of microseconds where the reference's gather and scatter take most of a
millisecond) where the native library builds, else the torch reference;
`SPECSERVE_KV_COMPACT=reference|triton|native` forces one (the tests force `triton` on CPU tensors
under `TRITON_INTERPRET=1`, which triton reads when the kernels below are defined, i.e. at import).
The flat commit has no native kernel: it runs the reference on the CPU.
"""

from __future__ import annotations

import os

import torch

from specserve.kernels import cpu as native_cpu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without the dev extras: the reference serves
    triton = None

BACKEND_ENV = "SPECSERVE_KV_COMPACT"
MAX_FLAT_PAIRS = 1024   # the flat kernel holds all pairs' rows of a column chunk in registers


def _backend(kv: torch.Tensor) -> str:
    """The implementation to run: $SPECSERVE_KV_COMPACT when set, else triton on CUDA tensors and
    native on CPU caches whose layout it takes (`cpu.compact_layout_ok`, where the library builds).
    A cache the native kernel cannot take runs the reference, forced or not."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced in ("reference", "triton", "native"):
        if forced == "triton" and triton is None:
            raise RuntimeError(f"{BACKEND_ENV}=triton but triton is not installed")
        if forced == "native" and not native_cpu.available():
            raise RuntimeError(f"{BACKEND_ENV}=native but the native CPU kernels do not build here")
        if forced == "native" and not native_cpu.compact_layout_ok(kv):
            return "reference"
        return forced
    if forced:
        raise ValueError(f"{BACKEND_ENV} must be 'reference', 'triton' or 'native', not {forced!r}")
    if kv.is_cuda:
        return "triton" if triton is not None else "reference"
    return "native" if native_cpu.compact_layout_ok(kv) and native_cpu.available() else "reference"


# ---------------------------------------------------------------------------------------------
# flat pairs: kv[:, :, dst] = kv[:, :, src]
# ---------------------------------------------------------------------------------------------

def compact_kv_reference(
    kv: torch.Tensor,         # [2, num_layers, num_slots, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [N] int64 slots holding accepted entries
    dst_slots: torch.Tensor,  # [N] int64 slots they move to
) -> None:
    """kv[:, :, dst] = kv[:, :, src] for all layers at once.

    The gather copies before the scatter writes, so overlapping source and destination sets (a
    node moving onto a slot another accepted node is read from) are safe. Pairs with src == dst
    are no-ops and may be left in.
    """
    if src_slots.numel() == 0:
        return
    kv[:, :, dst_slots] = kv[:, :, src_slots]


def compact_kv_triton(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """`compact_kv_reference` in one Triton launch (at most MAX_FLAT_PAIRS pairs)."""
    n = src_slots.numel()
    if n == 0:
        return
    assert n <= MAX_FLAT_PAIRS, f"{n} pairs: use compact_kv_reference"
    row = kv.shape[3] * kv.shape[4]
    block_n = triton.next_power_of_2(n)
    block_c = max(16, min(triton.next_power_of_2(row), 8192 // block_n))
    grid = (2 * kv.shape[1], triton.cdiv(row, block_c))
    _compact_kv_kernel[grid](
        kv, src_slots, dst_slots, n, kv.shape[1], row, *kv.stride(), HEAD_DIM=kv.shape[4],
        BLOCK_N=block_n, BLOCK_C=block_c)


def compact_kv(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Dispatch (see the module docstring); more than MAX_FLAT_PAIRS pairs always take the reference."""
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1
    if _backend(kv) == "triton" and src_slots.numel() <= MAX_FLAT_PAIRS:
        compact_kv_triton(kv, src_slots, dst_slots)
    else:
        compact_kv_reference(kv, src_slots, dst_slots)


# ---------------------------------------------------------------------------------------------
# tree paths: slots from block tables, on the device
# ---------------------------------------------------------------------------------------------

def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of `positions` [T, P] in the rows of `block_tables` [T, max_blocks] (indices clamped
    into the table, so that padding positions stay addressable; callers mask them)."""
    blocks = (positions // block_size).clamp(0, block_tables.shape[1] - 1)
    return block_tables.gather(1, blocks).long() * block_size + positions % block_size


def tree_slot_pairs(
    block_tables: torch.Tensor, block_size: int, prefix_lens: torch.Tensor, paths: torch.Tensor,
    path_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, valid), each [T, P]: the slots pair (t, i) reads and writes, and whether it is
    one of the accepted path's pairs (i < path_lens[t])."""
    num_pairs = paths.shape[1]
    i = torch.arange(num_pairs, device=paths.device)
    valid = (i < path_lens[:, None]) & (paths >= 0)
    prefix = prefix_lens[:, None].long()
    src = _slots(block_tables, prefix + paths.long().clamp(min=0), block_size)
    dst = _slots(block_tables, prefix + i, block_size)
    return src, dst, valid


def _neutralise(src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (src, dst) where every invalid pair repeats the first valid pair of the batch (or,
    when there is none, is the no-op slot 0 -> slot 0).

    A repeated pair writes the same destination with the same gathered value, so the scatter's
    duplicate indices all agree; an invalid pair's own slots could instead collide with a valid
    pair's destination (padding positions past a sequence's blocks map to arbitrary slots) and
    race with it. Shape-only work: no host sync.
    """
    valid, src, dst = valid.reshape(-1), src.reshape(-1), dst.reshape(-1)
    src, dst = torch.where(valid, src, 0), torch.where(valid, dst, 0)
    first = valid.to(torch.uint8).argmax()   # 0 when nothing is valid: then (0, 0), a no-op
    return torch.where(valid, src, src[first]), torch.where(valid, dst, dst[first])


def compact_tree_kv_reference(
    kv: torch.Tensor, block_tables: torch.Tensor, block_size: int, prefix_lens: torch.Tensor,
    paths: torch.Tensor, path_lens: torch.Tensor,
) -> None:
    """`compact_tree_kv` in vectorised torch: slot pairs [T, P], then one gather-before-scatter copy."""
    if paths.numel() == 0:
        return
    src, dst = _neutralise(*tree_slot_pairs(block_tables, block_size, prefix_lens, paths, path_lens))
    compact_kv_reference(kv, src, dst)


def compact_tree_kv_triton(
    kv: torch.Tensor, block_tables: torch.Tensor, block_size: int, prefix_lens: torch.Tensor,
    paths: torch.Tensor, path_lens: torch.Tensor,
) -> None:
    """`compact_tree_kv` in one Triton launch: grid (T, 2 * num_layers, column chunks)."""
    num_seqs, num_pairs = paths.shape
    if num_seqs == 0 or num_pairs == 0:
        return
    row = kv.shape[3] * kv.shape[4]
    block_c = max(32, min(triton.next_power_of_2(row), 1024))
    grid = (num_seqs, 2 * kv.shape[1], triton.cdiv(row, block_c))
    _compact_tree_kv_kernel[grid](
        kv, block_tables, prefix_lens, paths, path_lens,
        num_pairs, kv.shape[1], row, block_size, *kv.stride(), *block_tables.stride(), *paths.stride(),
        HEAD_DIM=kv.shape[4], BLOCK_C=block_c, num_warps=max(1, min(4, block_c // 128)))


def compact_tree_kv(
    kv: torch.Tensor,            # [2, num_layers, num_slots, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [T, max_blocks] int32/int64: the tree sequences' block tables
    block_size: int,
    prefix_lens: torch.Tensor,   # [T] int64: committed length before the tree
    paths: torch.Tensor,         # [T, P] int64: accepted node indices, increasing, padded with -1
    path_lens: torch.Tensor,     # [T] int64: accepted nodes per sequence (root included)
) -> None:
    """Move each tree sequence's accepted nodes to the positions right after its prefix:
    position prefix_lens[t] + paths[t, i] -> prefix_lens[t] + i for i < path_lens[t], K and V of
    every layer, in place. Everything else in `kv` is left as it was. All inputs live on kv's
    device; nothing is read back to the host. Sequences must own disjoint blocks, paths must be
    strictly increasing, and the blocks of every accepted position must be in the table."""
    assert paths.dim() == 2 and block_tables.shape[0] == paths.shape[0] == prefix_lens.shape[0] == path_lens.shape[0]
    backend = _backend(kv)
    if backend == "triton":
        compact_tree_kv_triton(kv, block_tables, block_size, prefix_lens, paths, path_lens)
    elif backend == "native":
        native_cpu.compact_tree_kv(kv, block_tables, block_size, prefix_lens, paths, path_lens)
    else:
        compact_tree_kv_reference(kv, block_tables, block_size, prefix_lens, paths, path_lens)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _row_offsets(chunk, row, stride_h, stride_d, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr):
        """Offsets (and mask) of one column chunk of a [num_kv_heads, head_dim] row."""
        cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        return (cols // HEAD_DIM) * stride_h + (cols % HEAD_DIM) * stride_d, cols < row

    @triton.jit
    def _slot(table_ptr, stride_tb, position, block_size):
        block = tl.load(table_ptr + (position // block_size) * stride_tb).to(tl.int64)
        return block * block_size + position % block_size

    # the step's shapes (pairs per sequence, table widths) are not specialised on, nor the alignment
    # of its index tensors: one compiled variant serves every step, instead of a compile whenever a
    # value turns 1 or a multiple of 16
    @triton.jit(do_not_specialize=["num_pairs", "stride_tt", "stride_pt"],
                do_not_specialize_on_alignment=["tables_ptr", "prefix_ptr", "paths_ptr", "path_lens_ptr"])
    def _compact_tree_kv_kernel(
        kv_ptr, tables_ptr, prefix_ptr, paths_ptr, path_lens_ptr,
        num_pairs, num_layers, row, block_size,
        stride_c, stride_l, stride_s, stride_h, stride_d, stride_tt, stride_tb, stride_pt, stride_pi,
        HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """Program (t, c * num_layers + l, chunk): sequence t's pairs, in increasing i, for one
        column chunk of the K (c = 0) or V (c = 1) rows of layer l."""
        t = tl.program_id(0).to(tl.int64)
        cl = tl.program_id(1)
        cols, col_mask = _row_offsets(tl.program_id(2), row, stride_h, stride_d, HEAD_DIM, BLOCK_C)
        base = kv_ptr + (cl // num_layers).to(tl.int64) * stride_c + (cl % num_layers).to(tl.int64) * stride_l
        table = tables_ptr + t * stride_tt
        prefix = tl.load(prefix_ptr + t).to(tl.int64)
        n = tl.minimum(tl.load(path_lens_ptr + t).to(tl.int64), num_pairs)
        for i in range(0, n):
            node = tl.load(paths_ptr + t * stride_pt + i * stride_pi).to(tl.int64)
            if (node != i) & (node >= 0):   # identity pairs (and malformed -1s) move nothing
                src = _slot(table, stride_tb, prefix + node, block_size)
                dst = _slot(table, stride_tb, prefix + i, block_size)
                vals = tl.load(base + src * stride_s + cols, mask=col_mask)
                tl.store(base + dst * stride_s + cols, vals, mask=col_mask)
            tl.debug_barrier()   # pair i's loads before pair i+1's stores, for every thread

    @triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
    def _compact_kv_kernel(
        kv_ptr, src_ptr, dst_ptr, n, num_layers, row,
        stride_c, stride_l, stride_s, stride_h, stride_d,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """Program (c * num_layers + l, chunk): gather all N source rows of one column chunk,
        synchronise, scatter them."""
        cl = tl.program_id(0)
        cols, col_mask = _row_offsets(tl.program_id(1), row, stride_h, stride_d, HEAD_DIM, BLOCK_C)
        base = kv_ptr + (cl // num_layers).to(tl.int64) * stride_c + (cl % num_layers).to(tl.int64) * stride_l
        pairs = tl.arange(0, BLOCK_N)
        pair_mask = pairs < n
        src = tl.load(src_ptr + pairs, mask=pair_mask, other=0).to(tl.int64)
        dst = tl.load(dst_ptr + pairs, mask=pair_mask, other=0).to(tl.int64)
        mask = pair_mask[:, None] & col_mask[None, :]
        vals = tl.load(base + src[:, None] * stride_s + cols[None, :], mask=mask)
        tl.debug_barrier()   # every source read before any destination is written
        tl.store(base + dst[:, None] * stride_s + cols[None, :], vals, mask=mask)
