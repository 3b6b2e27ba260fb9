"""Paged KV cache: block accounting and the commit (accepted-path compaction) operation."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.kv_cache import BlockManager, KVCache, commit_accepted, kv_pool_bytes
from specserve.kernels.kv_compact import compact_kv_reference


def test_grow_shrink_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.grow(1, 9) and len(bm.block_tables[1]) == 3
    assert bm.grow(2, 16) and bm.num_free_blocks == 3
    assert not bm.can_grow(3, 13) and not bm.grow(3, 13)
    assert 3 not in bm.block_tables or bm.block_tables[3] == []  # all-or-nothing
    assert bm.grow(1, 12) and len(bm.block_tables[1]) == 3  # still fits its blocks
    assert bm.grow(1, 13) and len(bm.block_tables[1]) == 4
    assert bm.usage == pytest.approx(8 / 10)
    bm.shrink(1, 5)
    assert len(bm.block_tables[1]) == 2
    bm.free(1)
    bm.free(2)
    bm.free(3)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert sorted(bm._free) == list(range(10))


def test_slots_follow_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.grow(0, 4)
    bm.grow(1, 4)
    bm.grow(0, 8)   # seq 0's second block is not adjacent to its first
    table = bm.block_tables[0]
    assert bm.slots(0, 0, 8) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4 + i for i in range(4)]
    assert bm.slot(0, 6) == table[1] * 4 + 2


def naive_commit(rows: dict[int, list[torch.Tensor]], prefix: dict[int, int], accepted: dict[int, list[int]]):
    """Per-sequence list model of the cache: keep prefix rows, then the accepted nodes in order."""
    return {sid: r[:prefix[sid]] + [r[prefix[sid] + n] for n in accepted[sid]] for sid, r in rows.items()}


@pytest.mark.parametrize("seed", range(5))
def test_commit_matches_naive_compaction(seed):
    rng = random.Random(seed)
    layers, heads, dim, bs = 3, 2, 4, 4
    bm = BlockManager(num_blocks=64, block_size=bs)
    cache = KVCache(layers, 64, bs, heads, dim, torch.float32, torch.device("cpu"))
    cache.kv.copy_(torch.randn_like(cache.kv))
    seqs, prefix, accepted, rows = [], {}, {}, {}
    for sid in range(4):
        prefix[sid] = rng.randint(0, 13)
        tree = rng.randint(1, 12)
        assert bm.grow(sid, prefix[sid] + tree)
        # a random root-to-node path: increasing node indices, starting at the root (node 0)
        path = [0] + sorted(rng.sample(range(1, tree), rng.randint(0, tree - 1)))
        accepted[sid] = path[:rng.randint(1, len(path))]
        seqs.append(sid)
        slots = bm.slots(sid, 0, prefix[sid] + tree)
        rows[sid] = [cache.kv[:, :, s].clone() for s in slots]
    expected = naive_commit(rows, prefix, accepted)
    free_before = bm.num_free_blocks
    new_lens = commit_accepted(bm, cache, seqs, [prefix[s] for s in seqs], [accepted[s] for s in seqs])
    for sid, n in zip(seqs, new_lens):
        assert n == prefix[sid] + len(accepted[sid])
        assert len(bm.block_tables[sid]) == bm.blocks_for(n)
        got = [cache.kv[:, :, s] for s in bm.slots(sid, 0, n)]
        for a, b in zip(got, expected[sid]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert bm.num_free_blocks >= free_before


def test_compact_reference_overlapping_moves():
    kv = torch.arange(2 * 1 * 6, dtype=torch.float32).view(2, 1, 6, 1, 1)
    before = kv.clone()
    # slot 3 -> 1 while slot 1 -> 0: the read of slot 1 must see its old value
    compact_kv_reference(kv, torch.tensor([1, 3]), torch.tensor([0, 1]))
    assert kv[0, 0, :, 0, 0].tolist() == [before[0, 0, 1, 0, 0].item(), before[0, 0, 3, 0, 0].item(), 2, 3, 4, 5]


def test_gpu_memory_utilization_leaves_the_pool_what_weights_and_activations_do_not_take():
    gib = 2**30
    assert kv_pool_bytes(80 * gib, 0.9, 2 * gib, 1 * gib) == int(0.9 * 80 * gib) - 3 * gib
    with pytest.raises(ValueError, match="nothing is left for the KV cache; raise it, or lower --max-num-batched"):
        kv_pool_bytes(8 * gib, 0.25, 1 * gib, 1 * gib)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)


def test_gpu_memory_utilization_on_the_cpu_keeps_the_memory_cap(tiny_llama_dir, caplog):
    from specserve.engine.core import LLMEngine

    cfg = dict(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64,
               kv_cache_memory_gib=0.001)
    plain = LLMEngine(EngineConfig(**cfg))
    with caplog.at_level("WARNING", logger="specserve"):
        util = LLMEngine(EngineConfig(**cfg, gpu_memory_utilization=0.5))
    assert util.blocks.num_blocks == plain.blocks.num_blocks
    assert "applies on CUDA only" in caplog.text
