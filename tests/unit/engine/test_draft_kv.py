"""PagedDraftKV, a drafter's own paged KV pool: sizing, grow/shrink/free per sequence, the
attention metadata of a forward, and committing an accepted path."""

from __future__ import annotations

import torch

from specserve.engine.kv_cache import PagedDraftKV


def test_sizing_and_per_sequence_blocks():
    kv = PagedDraftKV(2, 1, 4, torch.float32, "cpu", max_model_len=10, max_num_seqs=3, extra_tokens=2, block_size=4)
    assert kv.blocks.num_blocks == 3 * 3 and kv.cache.kv.shape == (2, 2, 36, 1, 4)   # ceil(12 / 4) per sequence
    assert kv.grow(7, 6) and kv.blocks.block_tables[7] == [0, 1]
    assert kv.grow(7, 9) and len(kv.blocks.block_tables[7]) == 3
    kv.shrink(7, 4)
    assert kv.blocks.block_tables[7] == [0] and kv.blocks.num_free_blocks == 8
    assert not kv.grow(8, 40) and 8 not in kv.blocks.block_tables     # all or nothing
    kv.free(7)
    assert kv.blocks.num_free_blocks == 9
    small = PagedDraftKV(1, 1, 4, torch.float32, "cpu", max_model_len=10, max_num_seqs=3, num_blocks=5)
    assert small.blocks.num_blocks == 5


def test_metadata_and_commit():
    kv = PagedDraftKV(1, 1, 2, torch.float32, "cpu", max_model_len=16, max_num_seqs=2, block_size=4)
    kv.grow(0, 8)
    kv.grow(1, 4)
    mask = torch.tensor([[True, False], [True, True]])
    positions, meta = kv.metadata([0, 1], [5, 0], [2, 3], [mask, None])
    assert positions.tolist() == [5, 6, 0, 1, 2]
    assert meta.cu_query_lens[-1] == 5
    # prefix 3, tree nodes at positions 3..7, accepted path [0, 2, 4] -> positions 3, 5, 7 move to 3, 4, 5
    for pos in range(8):
        kv.cache.kv[:, 0, kv.blocks.slot(0, pos)] = float(pos)
    assert kv.commit([0], [3], [[0, 2, 4]]) == [6]
    got = [kv.cache.kv[0, 0, kv.blocks.slot(0, p), 0, 0].item() for p in range(6)]
    assert got == [0, 1, 2, 3, 5, 7]
    assert len(kv.blocks.block_tables[0]) == 2
