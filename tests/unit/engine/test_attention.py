"""The torch reference attention: whole-block key gathering equals slot-by-slot gathering, and
both equal dense attention over each sequence's own keys; the batched reference (two SDPA calls
per layer) equals the per-sequence loop on random ragged batches of decode rows, prefill chunks,
chains, trees, forests and wide masks; the metadata packed for kernels; the backend dispatch.
The Triton kernel is compared with this reference in tests/unit/kernels/test_tree_attention.py."""

import random
from dataclasses import replace

import pytest
import torch

from specserve.engine.attention import (SDPA_MAX_SEQS, _paged_attention_loop, attention_backend, build_attn_metadata,
                                        paged_attention, paged_attention_reference)


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
    width = max(s + n for s, n in zip(starts, qlens))
    grid = torch.tensor([[t[p // block] * block + p % block if p < (s + n) else 0 for p in range(width)]
                         for t, s, n in zip(tables, starts, qlens)])       # each key position's slot
    by_slot = paged_attention_reference(q, k_cache, v_cache, replace(meta, block_size=0, context_slots=grid), 0.5)
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


# ---- the batched reference against the per-sequence loop, on random ragged batches ----

def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a forest given by parent indices (-1: a root)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def random_batch(seed: int, block: int, kv_heads: int, group: int, dim: int = 8, dtype=torch.float32):
    """A ragged batch mixing decode rows, prefill chunks (with and without a prefix), chains, trees,
    forests and masks wider than q (a tree grown level by level: the last q of m nodes are new)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    starts, qlens, masks = [], [], []
    for kind in rng.sample(["decode", "decode", "prefill", "chain", "tree", "forest", "wide", "wide1"], 6):
        start = rng.randint(0, 30)
        if kind == "decode":
            q, m = 1, None
        elif kind == "prefill":
            q, m = rng.randint(2, 12), None
        else:
            n = rng.randint(2, 9)
            parents = [i - 1 for i in range(n)] if kind == "chain" else \
                [-1] + [rng.randrange(-1 if kind == "forest" else 0, i) for i in range(1, n)]
            q = {"wide": rng.randint(1, n - 1), "wide1": 1}.get(kind, n)
            m = ancestor_mask(parents)[n - q:]                     # [q, n]: the last q nodes are new
            start = max(start, n - q)
        starts.append(start)
        qlens.append(q)
        masks.append(m)
    num_blocks = sum(-(-(s + q) // block) for s, q in zip(starts, qlens)) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for s, q in zip(starts, qlens):
        n = -(-(s + q) // block)
        tables.append(perm[used:used + n])
        used += n
    _, meta = build_attn_metadata(tables, block, starts, qlens, masks, torch.device("cpu"))
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(sum(qlens), kv_heads * group, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,kv_heads,group", [(1, 2, 1), (4, 3, 3), (16, 1, 4), (4, 2, 4)])
def test_batched_reference_equals_per_sequence_loop(block, kv_heads, group, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for seed in range(8):
        q, k_cache, v_cache, meta = random_batch(seed, block, kv_heads, group, dtype=dtype)
        got = paged_attention_reference(q, k_cache, v_cache, meta, 0.4)
        want = _paged_attention_loop(q, k_cache, v_cache, meta, 0.4)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_contiguous_starts_follow_the_block_tables():
    """A sequence's context is read in place only when the blocks covering it are consecutive."""
    _, meta = build_attn_metadata([[3, 4, 5], [3, 5], [3, 4, 9], [7], [2, 1]], 4, [9, 3, 6, 0, 5], [1, 2, 2, 3, 1],
                                  None, torch.device("cpu"))
    # [3, 4, 9] over 8 keys: only blocks 3 and 4 hold its context; [2, 1] is descending
    assert meta.contiguous_starts == [12, None, 12, 28, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "chain", "tree", "forest", "wide", "wide1"])
def test_one_sequence_in_place_equals_gathered_and_loop(kind, dtype):
    """A step of one sequence in consecutive blocks attends over views of the cache; the same step
    with its blocks scattered (or the start unknown) gathers them: all equal the per-sequence loop."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for seed in range(4):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        block, kv_heads, group, dim = rng.choice([1, 4, 16]), 3, 3, 8
        if kind in ("decode", "prefill"):
            q_len, mask = (1 if kind == "decode" else rng.randint(2, 12)), None
            start = rng.randint(0 if kind == "prefill" else 1, 40)
        else:
            n = rng.randint(2, 9)
            parents = [i - 1 for i in range(n)] if kind == "chain" else \
                [-1] + [rng.randrange(-1 if kind == "forest" else 0, i) for i in range(1, n)]
            q_len = {"wide": rng.randint(1, n - 1), "wide1": 1}.get(kind, n)
            mask = ancestor_mask(parents)[n - q_len:]
            start = rng.randint(n - q_len, 40)
        num = -(-(start + q_len) // block)
        num_blocks = num + 8
        k_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(dtype)
        q = torch.randn(q_len, kv_heads * group, dim, generator=g).to(dtype)
        first = rng.randint(0, 8)
        _, in_place = build_attn_metadata([list(range(first, first + num))], block, [start], [q_len], [mask],
                                          torch.device("cpu"))
        assert in_place.contiguous_starts == [first * block]
        scattered_table = list(range(first, first + num))[::-1]
        _, scattered = build_attn_metadata([scattered_table], block, [start], [q_len], [mask], torch.device("cpu"))
        assert num == 1 or scattered.contiguous_starts == [None]
        got = paged_attention_reference(q, k_cache, v_cache, in_place, 0.4)
        torch.testing.assert_close(got, _paged_attention_loop(q, k_cache, v_cache, in_place, 0.4), rtol=tol, atol=tol)
        gathered = paged_attention_reference(q, k_cache, v_cache, replace(in_place, contiguous_starts=None), 0.4)
        torch.testing.assert_close(got, gathered, rtol=tol, atol=tol)
        torch.testing.assert_close(paged_attention_reference(q, k_cache, v_cache, scattered, 0.4),
                                   _paged_attention_loop(q, k_cache, v_cache, scattered, 0.4), rtol=tol, atol=tol)


def test_batched_reference_shapes_of_batch():
    """The special layouts: one sequence, equal-length sequences (no padding), decode rows only,
    and a one-token row with a mask (batched with the trees: its mask is honoured)."""
    cases = [([[0, 1, 2]], [5], [4], [None]),
             ([[0, 1], [2, 3]], [2, 3], [3, 3], [None, None]),
             ([[0, 1], [2, 3], [4]], [5, 2, 0], [1, 1, 1], [None, None, None]),
             ([[0, 1], [2, 3]], [5, 3], [1, 1], [None, torch.tensor([[True, False, True]])])]
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(24, 2, 8, generator=g), torch.randn(24, 2, 8, generator=g)
    for tables, starts, qlens, masks in cases:
        _, meta = build_attn_metadata(tables, 4, starts, qlens, masks, torch.device("cpu"))
        q = torch.randn(sum(qlens), 4, 8, generator=g)
        torch.testing.assert_close(paged_attention_reference(q, k_cache, v_cache, meta, 0.3),
                                   _paged_attention_loop(q, k_cache, v_cache, meta, 0.3), rtol=1e-5, atol=1e-5)
    # the masked one-token row goes with the trees (the loop honours its mask, and so does the batch)
    assert meta.other_idx == [1] and meta.decode_idx == [0]


def test_ragged_steps_split_into_few_padded_batches():
    """Sequences of similar size share one SDPA call (at most SDPA_MAX_SEQS of them); a very ragged
    step gets a few calls, and still equals the loop."""
    def meta_for(starts, qlens):
        tables = [list(range(100 * b, 100 * b + -(-(s + q) // 4))) for b, (s, q) in enumerate(zip(starts, qlens))]
        return build_attn_metadata(tables, 4, starts, qlens, None, torch.device("cpu"))[1]

    assert meta_for([40] * 6, [8] * 6).other_groups() == [list(range(6))]
    assert len(meta_for([40] * 20, [8] * 20).other_groups()) == -(-20 // SDPA_MAX_SEQS)
    ragged = meta_for([300, 5, 296, 8, 6], [30, 2, 28, 3, 2])
    assert sorted(map(sorted, ragged.other_groups())) == [[0, 2], [1, 3, 4]]

    rng = random.Random(0)
    starts, qlens = [rng.randint(0, 120) for _ in range(20)], [rng.randint(1, 20) for _ in range(20)]
    meta = meta_for(starts, qlens)
    assert len(meta.other_groups()) > 2
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2000 * 4, 3, 8, generator=g), torch.randn(2000 * 4, 3, 8, generator=g)
    q = torch.randn(sum(qlens), 9, 8, generator=g)
    torch.testing.assert_close(paged_attention_reference(q, k_cache, v_cache, meta, 0.3),
                               _paged_attention_loop(q, k_cache, v_cache, meta, 0.3), rtol=1e-5, atol=1e-5)


def test_packed_kernel_fields():
    q, k_cache, v_cache, meta = random_batch(3, 4, 2, 2)
    assert meta.cu_query_lens_t.tolist() == meta.cu_query_lens
    assert meta.context_lens_t.tolist() == meta.context_lens
    assert meta.block_tables.dtype == torch.int32 and meta.cu_query_lens_t.dtype == torch.int32
    widths = [0 if m is None else m.shape[1] for m in meta.masks]
    assert meta.mask_widths.tolist() == widths
    flat = meta.mask_data
    for b, m in enumerate(meta.masks):
        if m is not None:
            off = meta.mask_offsets[b].item()
            assert torch.equal(flat[off:off + m.numel()].view(m.shape).bool(), m)
    # a hand-built metadata gets the same fields on first use
    bare = replace(meta, cu_query_lens_t=None, context_lens_t=None, mask_offsets=None, mask_widths=None,
                   mask_data=None).packed()
    for name in ("cu_query_lens_t", "context_lens_t", "mask_offsets", "mask_widths"):
        assert torch.equal(getattr(bare, name), getattr(meta, name)), name
    assert torch.equal(bare.mask_data, meta.mask_data)


def test_positions_and_slots_follow_the_block_tables():
    tables, starts, qlens = [[7, 2, 5], [0, 3]], [6, 0], [5, 6]
    positions, meta = build_attn_metadata(tables, 4, starts, qlens, None, torch.device("cpu"))
    assert positions.tolist() == [6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5]
    want = [tables[b][p // 4] * 4 + p % 4 for b, (s, q) in enumerate(zip(starts, qlens)) for p in range(s, s + q)]
    assert meta.slot_mapping.tolist() == want and meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables[0].tolist() == tables[0] and meta.block_tables[1, :2].tolist() == tables[1]


def test_backend_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("SPECSERVE_ATTENTION", raising=False)
    assert attention_backend(cpu) == "reference"
    monkeypatch.setenv("SPECSERVE_ATTENTION", "reference")
    assert attention_backend(torch.device("cuda")) == "reference"
    monkeypatch.setenv("SPECSERVE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SPECSERVE_ATTENTION"):
        attention_backend(cpu)
    monkeypatch.setenv("SPECSERVE_ATTENTION", "reference")
    q, k_cache, v_cache, meta = random_batch(1, 4, 2, 2)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.5),
                               paged_attention_reference(q, k_cache, v_cache, meta, 0.5), rtol=0, atol=0)
