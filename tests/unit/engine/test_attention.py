"""The torch reference attention: whole-block key gathering equals slot-by-slot gathering, and
both equal dense attention over each sequence's own keys."""

from dataclasses import replace

import torch

from specserve.engine.attention import build_attn_metadata, paged_attention_reference


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    block, num_blocks, kv_heads, heads, dim = 4, 32, 2, 6, 8
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g)
    # three decode rows of different lengths (padding needed), one chunked prefill, one tree
    starts, qlens = [9, 3, 14, 5, 6], [1, 1, 1, 4, 3]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for s, q in zip(starts, qlens):
        n = -(-(s + q) // block)
        tables.append(perm[used:used + n])
        used += n
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    masks = [None, None, None, None, tree]
    _, meta = build_attn_metadata(tables, block, starts, qlens, masks, torch.device("cpu"))
    q = torch.randn(sum(qlens), heads, dim, generator=g)
    return q, k_cache, v_cache, meta, tables, block, starts, qlens, masks


def test_block_gather_equals_slot_gather_and_dense():
    q, k_cache, v_cache, meta, tables, block, starts, qlens, masks = _setup()
    assert meta.block_size == block
    by_block = paged_attention_reference(q, k_cache, v_cache, meta, 0.5)
    by_slot = paged_attention_reference(q, k_cache, v_cache, replace(meta, block_size=0), 0.5)
    torch.testing.assert_close(by_block, by_slot, rtol=0, atol=0)

    group = q.shape[1] // k_cache.shape[1]
    row = 0
    for b, (s, n) in enumerate(zip(starts, qlens)):
        ctx = s + n
        slots = torch.tensor([tables[b][p // block] * block + p % block for p in range(ctx)])
        k = k_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)      # [H, ctx, D]
        v = v_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        visible = torch.ones(n, ctx, dtype=torch.bool)
        tail = masks[b] if masks[b] is not None else torch.ones(n, n, dtype=torch.bool).tril()
        visible[:, ctx - n:] = tail
        scores = (q[row:row + n].transpose(0, 1) @ k.transpose(1, 2)) * 0.5
        ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v      # [H, n, D]
        torch.testing.assert_close(by_block[row:row + n], ref.transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-5)
        row += n
