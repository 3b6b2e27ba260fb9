"""Tree attention over the paged KV cache: one Triton launch per layer for a whole ragged batch of
prefill chunks, decode rows, chains, draft trees and forests.

Inputs (the layout `engine/attention.py` documents): q [num_tokens, H, D], the new tokens of
sequence b in rows cu_query_lens[b] : cu_query_lens[b+1]; k_cache / v_cache [num_slots, Hkv, D]
with key position j of sequence b in slot block_tables[b, j // block_size] * block_size
+ j % block_size (the new tokens' K/V are already written there). With q = query length, ctx =
context length and m = mask width of sequence b, row i (context position ctx - q + i) sees key j < ctx
when

    m == 0 (causal: prefill chunk, decode row, chain):  j <= ctx - q + i
    m > 0  (tree, forest, a tree grown level by level): j < ctx - m  or  mask[b][i, j - (ctx - m)]

where mask[b] is the row-major [q, m] byte matrix at mask_data[mask_offsets[b]:].

Grid: (query block, kv head). A query block holds BLOCK_Q consecutive tokens of one sequence times
the GROUP = H / Hkv query heads sharing kv head `pid(1)`, BLOCK_M = BLOCK_Q * GROUP_PAD rows in all
(row r = token r // GROUP_PAD, head r % GROUP_PAD; heads >= GROUP are padding), so each K/V tile is
loaded once for the whole group and K/V are never repeated. Sequence b owns the query blocks
cu_query_lens[b] // BLOCK_Q + b + (0, 1, ...), an upper bound on ceil(q / BLOCK_Q) that needs no
host-side table: a program finds its sequence by binary search over those starts and exits when its
block lies past the sequence's end; the grid is num_tokens // BLOCK_Q + B blocks long.

Each program walks its sequence's keys in tiles of BLOCK_N positions (gathering block-table entries
per position, so any block size works, 1 included), up to the last key its rows can see, with the
online softmax: running row max m, normaliser l and fp32 accumulator acc,

    s = q k^T * scale * log2(e);  m' = max(m, rowmax(s));  p = 2^(s - m')
    l = l * 2^(m - m') + rowsum(p);  acc = acc * 2^(m - m') + p v;  out = acc / l.

m starts at a finite -1e30 so a tile a row cannot see at all (a forest's later root, whose
visible keys start further on) adds exact zeros instead of NaNs. head_dim is padded to a power of
two with masked loads. fp32 inputs use exact ("ieee") dot products; bf16/fp16 feed the tensor cores
and cast p to the value dtype for p v, as flash attention does (under TRITON_INTERPRET=1, bf16 dot
operands are upcast to fp32 after that rounding: the interpreter cannot multiply bf16 tiles).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


# the batch's shapes (sequences, block-table width) are not specialised on, nor the alignment of the
# metadata (views into one staging buffer, at offsets that follow the batch): one compiled variant per
# (dtype, block configuration) serves every eager step, instead of a compile whenever a value turns 1
# or a multiple of 16 mid-serving
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_q_ptr", "context_lens_ptr", "mask_offsets_ptr",
                                            "mask_widths_ptr", "mask_ptr"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    block_tables_ptr, cu_q_ptr, context_lens_ptr, mask_offsets_ptr, mask_widths_ptr, mask_ptr,
    qk_scale,                          # softmax scale * log2(e)
    num_seqs, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # the sequence owning query block `pid`: the last b with cu_q[b] // BLOCK_Q + b <= pid
    lo = tl.zeros([], tl.int32)                # (tensors, not constants: they are loop-carried)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        owns = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    first_token = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_token >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    width = tl.load(mask_widths_ptr + seq)
    mask_base = tl.load(mask_offsets_ptr + seq).to(tl.int64)
    prefix = ctx - q_len                       # context position of the sequence's first new token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = first_token + rows // GROUP_PAD    # index among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM

    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # keys this block can see: all of the context with a mask, up to its last token's position causally
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    kv_end = tl.where(width > 0, ctx, prefix + last_token + 1)
    tail = ctx - width                         # first key position the mask governs

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_end
        block = tl.load(bt_row + j // block_size, mask=j_ok, other=0)
        slot = block.to(tl.int64) * block_size + j % block_size
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0)

        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale      # [BLOCK_M, BLOCK_N] fp32
        if width > 0:
            col = j - tail
            in_tail = col >= 0
            bits = tl.load(mask_ptr + mask_base + token[:, None] * width + col[None, :],
                           mask=row_ok[:, None] & (in_tail & j_ok)[None, :], other=0)
            visible = (~in_tail)[None, :] | (bits != 0)
        else:
            visible = j[None, :] <= prefix + token[:, None]
        visible = visible & j_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# Triton's CPU interpreter multiplies bf16 tiles as raw integers (triton 3.9): there the dot
# operands are upcast to fp32 after the same roundings (p to bf16) the GPU path makes.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_config(group: int, max_query_len: int) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q): at least 16 rows per program (tl.dot's minimum) and at most 64, with
    no more token slots than the longest sequence needs."""
    group_pad = _next_pow2(group)
    rows = max(16, min(64, group_pad * _next_pow2(max_query_len)))
    return group_pad, max(1, rows // group_pad)


def tree_attention(
    q: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta,                   # engine.attention.AttnMetadata with its packed kernel fields
    scale: float,
    block_n: int = 64,
) -> torch.Tensor:          # [num_tokens, num_heads * head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    if num_heads % num_kv or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    if q.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError("tree_attention runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 "
                           "(set before triton is imported)")
    if meta.block_size <= 0:
        raise ValueError("tree_attention needs the cache block size (AttnMetadata.block_size)")
    group = num_heads // num_kv
    group_pad, block_q = block_config(group, meta.max_query_len)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    bt = meta.block_tables
    grid = (num_tokens // block_q + meta.num_seqs, num_kv)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out,
        bt, meta.cu_query_lens_t, meta.context_lens_t, meta.mask_offsets, meta.mask_widths, meta.mask_data,
        scale * math.log2(math.e),
        meta.num_seqs, meta.block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), bt.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, _next_pow2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=_INTERPRETED and q.dtype == torch.bfloat16,
    )
    return out.view(num_tokens, num_heads * head_dim)
